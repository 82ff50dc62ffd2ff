"""GPU benchmark and profiling scripts of nsa-flex, each run from the repository root as `python -m bench.<name>`."""
