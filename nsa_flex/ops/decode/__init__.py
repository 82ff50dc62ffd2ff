"""One decode step's ops: cache update (cache_step, phi_step), fused attention (attend, kernels), both (step_attend)."""
