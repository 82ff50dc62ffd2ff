"""The parts of `nsa_flex.training.train.train()`: settings, checkpoints, parallelism, optimizer, metrics,
watchdog and text tokenisation. Each is small; `train()` calls them in a fixed order."""
