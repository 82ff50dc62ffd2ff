"""NSAFlexChoices: Inductor's choices plus one backward flex config that fits 16-row query blocks.

Its own module (imported only by nsa_flex.flex.tuning.install_flex_tuning) so that importing
nsa_flex does not import Inductor, and so the class pickles by reference: Inductor puts the
installed choices class into its cache keys. See nsa_flex/flex/tuning.py for why it exists.
"""

from __future__ import annotations

import functools

from torch._inductor.choices import InductorChoices


def _fallback_bwd_config():
    try:
        from torch._inductor.template_heuristics.triton import FlexBwDConfig
    except ImportError:  # older layouts keep it one level up
        from torch._inductor.template_heuristics import FlexBwDConfig
    # 16-wide tiles divide every block size FlexAttention accepts.
    return FlexBwDConfig(16, 16, 16, 16, 1, 4)


def with_fallback(get_configs):
    """A get_flex_attention_bwd_configs that appends the 16x16 config to what get_configs returns."""

    @functools.wraps(get_configs)
    def configs(self, *args, **kwargs):
        found = list(get_configs(self, *args, **kwargs))
        fallback = _fallback_bwd_config()
        return found if fallback in found else found + [fallback]

    return configs


class NSAFlexChoices(InductorChoices):
    """Appends the 16x16 backward config to Inductor's own list (see nsa_flex.flex.tuning)."""

    get_flex_attention_bwd_configs = with_fallback(InductorChoices.get_flex_attention_bwd_configs)

    def uuid(self) -> str:
        # Part of Inductor's cache key (torch >= 2.13): change it when the configs change.
        return "nsa_flex.NSAFlexChoices.v1"
