"""FlexAttention kernel tiles for the three NSA branches, and the one process-global workaround.

The workaround (docs/design.md, "FlexAttention facts"). Inductor lowers the flex backward by walking the
configs that `InductorChoices.get_flex_attention_bwd_configs` returns and drops every config
whose tiles do not divide the BlockMask's block sizes *before* it applies the user's
`kernel_options`. On sm90 the default backward tiles are 64-128 wide, so the selected
branch's 16-row query tiles leave no config and compilation fails with
`NoValidChoicesError`. `NSAFlexChoices` appends one 16x16 config that divides every legal
block size; the tiles that actually run then come from `kernel_options` (below, keyed on
head dim and dtype), which override the config's.

`install_flex_tuning()` installs it, process-global: as `torch._inductor.config.
inductor_choices_class` and as the calling thread's choices handler. Inductor makes one handler
per thread, from that class, on the thread's first compile, so a thread that compiled before the
install keeps Inductor's own class: the autograd engine's device thread, which compiles backward
graphs lazily, after any earlier compiled backward (a GPU test of the Flex selected option failed
with `NoValidChoicesError` that way, after tests that compiled other backwards first). So the
install also gives Inductor's own class the fallback config. `nsa_flex` calls it on its first
eager CUDA call; code that compiles `nsa_flex` (or a model using it) must call it once before
compiling it. Effect on other FlexAttention users in the process: one more candidate backward
config; where both fit their masks, Inductor autotunes between them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nsa_flex.validate import is_byte_count

_INSTALLED = False


@dataclass(frozen=True, kw_only=True)
class FlexTiles:
    """BlockMask block sizes of the three branches (speed knobs; results do not depend on them)."""

    cmp_block: tuple[int, int] = (128, 128)
    """(folded query rows, compressed tokens) per block of the compressed branch (128 rows = 8 tokens at G=16)."""
    win_block: tuple[int, int] = (128, 128)
    """(folded query rows, key tokens) per block of the window branch."""
    sel_q_block: int | None = None
    """Folded query rows per tile of the selected branch (16 at G=16: one token); kv blocks are l'.
    None: chosen from the sequence length by `sel_rows`."""
    max_chunks: int = 16
    """Most chunks the folded query rows of the compressed branch are split into, as extra heads
    (more dK/dV programs: ops.blockmask.query_chunks)."""
    min_chunk_rows: int = 4096
    """Fewest folded query rows per chunk."""
    split_initial: bool | None = None
    """Spread the backward work of the forced initial blocks (every query visits them) over
    copies of their keys, one per `initial_copy_tokens` query tokens (masks.selection.InitialCopies).
    None: only at the lengths where the selected branch takes 16-row tiles (see `sel_rows`)."""
    initial_copy_tokens: int = 2048
    """Query tokens served by one copy of the initial blocks (1024 measured the same at 16k and 64k)."""
    sel_full_blocks: bool = True
    """List the selected branch's causally full blocks apart (their mask_mod is skipped). False: every
    listed block is partial and the mask keeps no full-block lists, whose q-side one grows as T^2
    (kv blocks x query tiles int32: 50 MiB per layer of seeds-125m at 32k tokens). It saves that
    memory but cost time: seeds-125m's training step at T=32768 took 353 against 304 ms (H200,
    docs/records/model_32k_{full_lists,no_full_lists}_h200.json; the op alone: 33.5 against 32.9 ms
    fwd+bwd, docs/records/flex_sel_full_lists_h200.json)."""

    sel_impl: str | None = None
    """The selected branch: "block" (block-centric Triton op, nsa_flex::selected_attention: each
    program loads one key block and walks the tokens that selected it) or "flex" (a Flex call over
    folded query tiles, each walking its tokens' blocks). None: `selected_impl` picks (block)."""

    cmp_impl: str | None = None
    """The compressed branch: "flex" (a Flex call over the folded rows with the compression mask),
    "cudnn" (one causal cuDNN call over token groups, flex.compressed_groups) or "torch" (that
    grouped call in plain torch: any device, for tests). None: cudnn where it applies (CUDA,
    16-bit, Dk = Dv in 64 / 128, one sequence per batch row), else flex."""

    win_impl: str | None = None
    """The window branch: "triton" (the op nsa_flex::window_attention, ops.window: kernels written
    for the band; CUDA, 16-bit, Dk and Dv in 64 / 128, one sequence per batch row), "flex" (a Flex
    call with the window BlockMask) or "torch" (the op's torch twin: any device, for tests). None:
    triton where it applies, else flex."""

    local_partial: bool = True
    """Where the window op runs (win_impl "triton" / "torch"), its tiles fit
    (ops.window.local_fits) and the selection is the op's own with n_local = 2: the window op
    also returns the selected branch's partial over each token's own block and the one before,
    and the block-centric selected op's forward merges it in place of those two slots. False:
    the selected op computes every slot itself (the same values)."""

    gated_node: bool = True
    """With gradients and the local partial (above): the window and selected branches and the
    gated sum run as one autograd node (nsa_flex::gated_branches), whose backward takes those two
    branches' output gradients as the gates times dO inside their kernels, and the local slots in
    the window's kernels: at 64k, fwd+bwd 30.44 against 31.10 ms at g4, 13.57 against 13.76 at
    seeds-125m's heads, 770 / 240 MiB less peak (H100, docs/decisions.md, "The gated sum as one
    op"). False: three ops, the gated sum writing each branch's output gradient.
    nsa_flex_branches (NSAAttention's path, whose gated sum is recomputed in the backward) keeps
    the three ops."""

    sel_partial_bytes: int | None = None
    """Where that node runs: the bytes of the block-centric selected op's partial buffers (o in the
    forward, dQ in the backward) per token range; longer sequences run in several ranges, each
    with its own index build and dK/dV pass. None: the op's default, 640 MiB, a memory bound for the
    op's own peak (ops.selected_attention.launch.PARTIAL_BYTES). A model in training, whose peak is
    the activations, takes more (NSAModelConfig.sel_partial_bytes)."""

    def __post_init__(self) -> None:
        if self.win_impl not in (None, *WINDOW_IMPLS):
            raise ValueError(f"FlexTiles.win_impl={self.win_impl!r}: allowed None (where it applies) or "
                             f"{', '.join(map(repr, WINDOW_IMPLS))}")
        if self.cmp_impl not in (None, *COMPRESSED_IMPLS):
            raise ValueError(f"FlexTiles.cmp_impl={self.cmp_impl!r}: allowed None (where it applies) or "
                             f"{', '.join(map(repr, COMPRESSED_IMPLS))}")
        if self.sel_impl not in (None, *SELECTED_IMPLS):
            raise ValueError(f"FlexTiles.sel_impl={self.sel_impl!r}: allowed None (the measured choice) or "
                             f"{', '.join(map(repr, SELECTED_IMPLS))}")
        for name in ("cmp_block", "win_block"):
            value = getattr(self, name)
            if len(value) != 2 or any(b < 16 or b & (b - 1) for b in value):
                raise ValueError(f"FlexTiles.{name}={value!r}: must be two powers of two >= 16")
        if self.sel_q_block is not None and (self.sel_q_block < 16 or self.sel_q_block & (self.sel_q_block - 1)):
            raise ValueError(f"FlexTiles.sel_q_block={self.sel_q_block!r}: must be a power of two >= 16")
        if self.max_chunks < 1 or self.max_chunks & (self.max_chunks - 1):
            raise ValueError(f"FlexTiles.max_chunks={self.max_chunks!r}: must be a power of two >= 1")
        if self.min_chunk_rows < 1:
            raise ValueError(f"FlexTiles.min_chunk_rows={self.min_chunk_rows!r}: must be >= 1")
        if self.sel_partial_bytes is not None and not is_byte_count(self.sel_partial_bytes):
            raise ValueError(f"FlexTiles.sel_partial_bytes={self.sel_partial_bytes!r}: must be None (the op's "
                             "default) or a positive number of bytes")
        if self.initial_copy_tokens < 1:
            raise ValueError(f"FlexTiles.initial_copy_tokens={self.initial_copy_tokens!r}: must be >= 1")


    def selected_impl(self, T: int, G: int) -> str:
        """The selected branch's implementation at length T and group size G: sel_impl, or the measured choice.

        Block-centric at every group: timed side by side at G = 1, 2, 4, 8, 16 and T = 2k to 64k
        (H200), the op was faster than the token-centric Flex call from 8k on at every G (G=16:
        62.6 against 102.7 ms forward+backward at 64k); at 2k its eager call's fixed host cost
        (~2 ms, gone under torch.compile) made the Flex call faster (docs/decisions.md).
        """
        if self.sel_impl is not None:
            return self.sel_impl
        return "block"

    def split_at(self, T: int, config) -> bool:
        """Whether the initial blocks' keys are split over copies at length T (split_initial, or by length).

        The split pays where block 0's backward program would walk very many query tiles
        (174.1 against 194.6 ms forward+backward at T=64k, G=16:
        docs/records/flex_initial_copies_h200.json); at T <= 2*n*l' one copy would serve every token.
        """
        return (not is_short(T, config)) if self.split_initial is None else self.split_initial

    def sel_rows(self, T: int, config) -> int:
        """Query rows per selected-branch tile at length T: sel_q_block, or when None the measured choice.

        A tile walks the union of its tokens' selected blocks. While the n selected blocks are
        a large share of the sequence (T <= SHORT_SEQ_FACTOR * n * l') the union of a 128-row
        tile is about what causal attention would visit anyway, and 128-row tiles run far
        better MMAs: at T=2048, B=16, G=4 the whole op took 4.9 ms of GPU time forward+backward
        against 7.9 with 16-row tiles. At longer T a token's blocks are a small random share,
        the union grows with every token, and 16 rows win: 23 vs 29 ms at T=8192, G=4, and 8.9
        vs 16.7 ms at T=4096, G=16 (H200, docs/records/flex_sel_rows{,_4k}_h200.json).
        """
        if self.sel_q_block is not None:
            return self.sel_q_block
        return 128 if is_short(T, config) else 16


SHORT_SEQ_FACTOR = 2
"""See FlexTiles.sel_rows."""

SELECTED_IMPLS = ("block", "flex")
COMPRESSED_IMPLS = ("flex", "cudnn", "torch")
WINDOW_IMPLS = ("triton", "flex", "torch")


def is_short(T: int, config) -> bool:
    """T <= SHORT_SEQ_FACTOR * n * l': the selected blocks are a large share of the sequence."""
    return T <= SHORT_SEQ_FACTOR * config.n_selected * config.sel_block


def install_flex_tuning() -> None:
    """Install NSAFlexChoices for the whole process (idempotent). See the module docstring."""
    global _INSTALLED
    if _INSTALLED:
        return
    from torch._inductor import config as inductor_config
    from torch._inductor.choices import InductorChoices
    from torch._inductor.virtualized import V

    from nsa_flex.flex.inductor_choices import NSAFlexChoices as cls
    from nsa_flex.flex.inductor_choices import with_fallback

    current = getattr(inductor_config, "inductor_choices_class", None)
    if current is not None and current is not cls:
        raise RuntimeError(
            f"torch._inductor.config.inductor_choices_class is already set to {current!r}; nsa_flex needs "
            "its own (nsa_flex.flex.inductor_choices.NSAFlexChoices) for the selected branch's backward. Merge "
            "the two classes (one subclass with both changes) and install that instead."
        )
    if hasattr(inductor_config, "inductor_choices_class"):
        inductor_config.inductor_choices_class = cls
    V.set_choices_handler(cls())
    # Handlers that threads made before this install are Inductor's own class (module docstring).
    InductorChoices.get_flex_attention_bwd_configs = with_fallback(InductorChoices.get_flex_attention_bwd_configs)
    _INSTALLED = True


def is_installed() -> bool:
    return _INSTALLED


def branch_kernel_options(branch: str, head_dim: int, dtype: torch.dtype, *, q_block: int = 128,
                          kv_block: int = 128) -> dict:
    """kernel_options for one branch's flex call on CUDA: tiles keyed on the qk head dim and dtype.

    branch: "cmp" / "win" (128x128 BlockMask blocks) or "sel" (folded, q_block-row query
    tiles, l'-token kv blocks). Every tile divides the corresponding BlockMask block size.
    """
    # One code path for every length: the decode kernel would take queries shorter than 128.
    opts: dict = {"FORCE_USE_FLEX_ATTENTION": True}
    wide = head_dim > 128
    f32 = dtype == torch.float32
    if branch in ("cmp", "win"):
        if wide and f32:
            # Inductor's default tiles need ~272 KiB of shared memory at fp32, Dk=192 (Hopper has
            # 227): smaller tiles, one stage in the backward. They divide the 128-wide blocks.
            opts.update(fwd_BLOCK_M=64, fwd_BLOCK_N=32, fwd_num_warps=4, fwd_num_stages=2, bwd_BLOCK_M1=16,
                        bwd_BLOCK_N1=32, bwd_BLOCK_M2=32, bwd_BLOCK_N2=16, bwd_num_warps=4, bwd_num_stages=1)
        elif branch == "win" and head_dim == 128 and not f32 and q_block % 64 == 0 and kv_block % 64 == 0:
            # 64 x 64 forward tiles, 4 warps: 1.00 against 1.11 ms with Inductor's 128 x 64, 8 warps at
            # T=64k, G=4 (H200, Inductor's own max-autotune pick; its backward pick was no faster).
            opts.update(fwd_BLOCK_M=64, fwd_BLOCK_N=64, fwd_num_warps=4, fwd_num_stages=3)
        elif branch == "win" and head_dim <= 64 and not f32 and q_block % 64 == 0 and kv_block % 64 == 0:
            # Backward dK/dV steps of 32 query rows over 64 keys, dQ steps of 64 rows over 32 keys, 4 warps:
            # forward+backward 1.85 against 2.10 ms at T=64k and 0.95 against 1.06 at 8k x 4, Hq=12, Hkv=3,
            # D=64 (seeds-125m's heads; H100, Inductor's 64 x 128 / 128 x 64 tiles with 8 warps before).
            opts.update(bwd_BLOCK_M1=32, bwd_BLOCK_N1=64, bwd_BLOCK_M2=64, bwd_BLOCK_N2=32, bwd_num_warps=4,
                        bwd_num_stages=3)
        return opts
    if branch != "sel":
        raise ValueError(f"unknown branch {branch!r}; allowed: 'cmp', 'win', 'sel'")
    if kv_block < 16 or kv_block & (kv_block - 1):
        raise ValueError(f"NSAConfig.sel_block={kv_block}: impl='flex' on CUDA needs a power of two >= 16 "
                         "(the selected blocks are the kernel's kv blocks); use impl='reference' otherwise")
    block_n = min(kv_block, 32 if (wide or f32) else 64)
    stages = 2 if (wide or f32) else 3
    # Backward: dK/dV loop (M1 query rows per step over N1 keys), dQ loop (M2 rows, N2 keys);
    # Triton needs N1 % M1 == 0 and M2 % N2 == 0. Query tiles of 64+ rows take wider ones:
    # 4.9 against 7.0 ms forward+backward at T=2048, G=4 with 128-row tiles (docs/records/flex_sel_rows_h200.json).
    wide_bwd = q_block >= 64 and not (wide or f32)
    opts.update(
        fwd_BLOCK_M=min(q_block, 64), fwd_BLOCK_N=block_n, fwd_num_warps=4, fwd_num_stages=stages,
        bwd_BLOCK_M1=32 if wide_bwd else 16, bwd_BLOCK_N1=block_n, bwd_BLOCK_M2=64 if wide_bwd else 16,
        bwd_BLOCK_N2=32 if wide_bwd else 16, bwd_num_warps=4, bwd_num_stages=1 if (wide and f32) else stages,
    )
    return opts
