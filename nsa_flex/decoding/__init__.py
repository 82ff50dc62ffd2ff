"""Decoding: the per-layer cache, one layer's prefill and decode step, and batched generation."""
