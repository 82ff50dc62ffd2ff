"""NSAFlexChoices: Inductor's choices plus one backward flex config that fits 16-row query blocks.

Its own module (imported only by nsa_flex.flex.tuning.install_flex_tuning) so that importing
nsa_flex does not import Inductor, and so the class pickles by reference: Inductor puts the
installed choices class into its cache keys. See nsa_flex/flex/tuning.py for why it exists.
"""

from __future__ import annotations

from torch._inductor.choices import InductorChoices


def _fallback_bwd_config():
    try:
        from torch._inductor.template_heuristics.triton import FlexBwDConfig
    except ImportError:  # older layouts keep it one level up
        from torch._inductor.template_heuristics import FlexBwDConfig
    # 16-wide tiles divide every block size FlexAttention accepts.
    return FlexBwDConfig(16, 16, 16, 16, 1, 4)


def with_fallback(configs) -> list:
    """Inductor's backward configs plus the 16x16 one (once)."""
    configs = list(configs)
    fallback = _fallback_bwd_config()
    return configs if fallback in configs else configs + [fallback]


class NSAFlexChoices(InductorChoices):
    """Appends the 16x16 backward config to Inductor's own list (see nsa_flex.flex.tuning)."""

    def get_flex_attention_bwd_configs(self, *args, **kwargs):
        return with_fallback(super().get_flex_attention_bwd_configs(*args, **kwargs))

    def uuid(self) -> str:
        # Part of Inductor's cache key (torch >= 2.13): change it when the configs change.
        return "nsa_flex.NSAFlexChoices.v1"


def patch_default_choices() -> None:
    """Give InductorChoices itself the 16x16 backward config (idempotent).

    Inductor makes one choices handler per thread, on that thread's first compile, from the
    configured class. A thread that compiled before the install keeps a plain InductorChoices:
    the autograd engine's device thread after any compiled backward earlier in the process,
    which then compiles the selected Flex call's backward and finds no config
    (NoValidChoicesError). Patching the base class reaches those handlers too."""
    original = InductorChoices.get_flex_attention_bwd_configs
    if getattr(original, "nsa_flex_fallback", False):
        return

    def get_flex_attention_bwd_configs(self, *args, **kwargs):
        return with_fallback(original(self, *args, **kwargs))

    get_flex_attention_bwd_configs.nsa_flex_fallback = True
    InductorChoices.get_flex_attention_bwd_configs = get_flex_attention_bwd_configs
