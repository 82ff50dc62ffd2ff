"""A fused AdamW for training tests on the CPU: with it (and train's `_fused` saying so) a step's
update is queued on the device and the step read back ahead, as on CUDA."""

from __future__ import annotations


def fused_builder(build):
    """build_optimizer's stand-in: the optimizer `build` makes, every group fused."""

    def fused(model, **kw):
        optimizer = build(model, **kw)
        for group in optimizer.param_groups:
            group["fused"], group["foreach"] = True, False
        return optimizer

    return fused
