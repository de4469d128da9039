"""Batch-invariant linear layer on the GPU: y[M, N] = x[M, K] @ w[N, K]^T in fp32 (Triton through
jax-triton).

Why it exists: XLA chooses a GEMM algorithm by shape, so row r of x @ w^T gets different fp32 bits
when the GEMM has 1 row (stock decode) than when it has 8 (speculative verify): measured on the
H200 for 88-99 % of the outputs, whatever the XLA flags (docs/benchmarks.md). Rounded to bf16 at
the next matmul input, those bits make verify and decode drift apart by ~3e-3 nats per token.

What fixes an output element's bits here is the chain of instructions that accumulates it, and
that chain is the same whatever M is:
  * K is walked in BLOCK_K = 128 steps (a module constant, never chosen from the shape). Each
    step is one `tl.dot`, which Triton lowers on sm_90 to BLOCK_K / 16 `mma.sync.m16n8k16` (bf16
    in, fp32 accumulate) in k order, the accumulator register feeding the next one (`acc +=
    tl.dot` is folded into the MMA's C operand). fp32 inputs (tests) take Triton's FMA dot
    instead, also in k order.
  * Fixed split-K: the ceil(K / 128) steps are cut into S equal runs of whole steps, K_SPLIT =
    ceil(K / 128) / S * 128 of k each (split s walks k from s * K_SPLIT upward, from a zero
    accumulator, in the steps above, into its own fp32 partial p_s = [s, M, N]; only the last
    split's last step can be masked at K), and y = (...((p_0 + p_1) + p_2) ... + p_{S-1}),
    elementwise adds in that order (`combine`: a chain of jnp adds, which XLA does not
    reassociate; not a reduction over the split axis, whose order XLA may pick by shape). S,
    and so the boundaries, come from (N, K) alone (`_split_k`; never from M, nor the GPU's SM
    count), so a row's value is the same ordered sum over s = 0..S-1 of the same fixed walks
    whatever M is. S = 1 (gate_up, lm_head) is the plain walk from 0 to K, the kernel of before
    split-K exactly. Another S gives other (equally valid) bits: S is part of the numerics, like
    BLOCK_K, and only the tiles below are free.
  * A program owns BLOCK_M rows as BLOCK_M / DOT_M row blocks (1, 2 or 4) of DOT_M rows, each
    its own `tl.dot` and accumulator; the blocks share each weight tile, which is what makes wide
    row tiles cheap (a 16-row tile re-reads every weight tile M / 16 times from L2). Row tiles
    start at multiples of 16, so row r sits at row r % 16 of an m16 fragment whatever BLOCK_M and
    DOT_M are.
  * Every dot must stay mma.sync (MMA v2): wgmma (MMA v3) is another instruction with its own
    accumulation. Triton 3.6 picks MMA v3 on sm_90 only when the dot's rows are a multiple of 64
    AND num_warps is a multiple of 4 (`supportMMA(op, 3)` in lib/Analysis/Utility.cpp, tried
    first by `getMMAVersionSafe` in lib/Dialect/TritonGPU/Transforms/AccelerateMatmul.cpp;
    env DISABLE_MMA_V3=1 also forbids it, process-wide). So DOT_M <= 32 is mma.sync with any
    warps, and a 64/128-row dot only with 1-2 warps; `make_plan` refuses anything else and
    tests/test_kernels_linear.py compiles every plan it can make for sm_90 and reads the PTX.
  * The v3 family (MMA_FAMILY = "v3", or JSPEC_LINEAR_MMA=v3 in the environment before the
    first import) trades that instruction for wgmma: every plan, decode included, takes
    64-row (or 128-row) tiles in ONE dot with 4 (or 8) warps, which Triton 3.6 lowers on sm_90
    to wgmma.m64nNk16 (bf16 in, fp32 accumulate) in k order. Same argument, other instruction,
    other (equally fixed) bits: a row sits at row r % 64 of an m64 fragment whatever M is, and
    decode's padded rows are masked zeros, as a 1-row GEMM's 15 are in an m16 fragment. Why: the
    verify GEMM at 16-32 lanes (128-256 rows) is compute-heavy, and mma.sync at 128 rows ran at
    about 250 TFLOP/s on the H200 (2026-12-02 profile, docs/benchmarks.md), twice the time of
    the same weights at 16 rows. Measured invariant on the H200 (2026-12-02,
    tests/test_batch_invariance_gpu.py), and more: v2 and v3 gave the SAME bits for every
    shape and row count compared (scripts/bench_linear.py, 20 of 20). That is what the default
    "mixed" family rests on: v2's plans up to MIXED_V2_MAX_ROWS rows (decode, where v3's 64-row
    tile wastes most: a stock step at 1 lane 5.80 ms v2, 6.59 ms v3) and v3's above (a 16-lane
    speculative iteration 13.49 ms v2, 11.48 ms mixed). Should another GPU or Triton break the
    equality, the GPU test's "mixed" case fails and JSPEC_LINEAR_MMA=v2 (or v3) is one family
    again. The module's choice holds for the whole process: the stock and speculative engines
    of a comparison share it.
  * BLOCK_M, DOT_M, BLOCK_N, the warps, the stages and the grid depend on the shape: they decide
    which program and warp compute an element, and which other rows share its MMA, not the
    chain above. That last point assumes an MMA's output element does not depend on the other
    rows of its fragment, the assumption the 16-row tile already made (a row's fragment-mates
    are zeros at M = 1 and real rows at M = 8). Confirmed on the H200 (2026-11-30, jax 0.11.2,
    Triton 3.6) across row tiles and row blocks too: tests/test_batch_invariance_gpu.py (every
    row alone and among 8..256 rows, all five 8B shapes) passed, and none of 56 timed tilings in
    scripts/bench_linear.py (16-128-row tiles, 16/32-row dots, 64/128 columns, 4/8 warps) changed
    a bit of the default plan's output. Should another GPU or Triton break it, FORCE_BLOCK_M = 16
    gives every plan the fixed 16-row tile again. The split walks (qkv 2, o 2, down 3 under
    _split_k's rule) are the default since the H200 timed them (2026-12-04, FORCE_SPLIT_K = 1
    restores the unsplit walk); from V3_SERIAL_MIN_ROWS rows a v3 plan walks the splits in
    turn in one program (SPLIT_SERIAL: the same dots and adds, no partials in memory; measured
    on the H200 to give the split grid's bits, tests/test_batch_invariance_gpu.py).
Rows past M are masked to zero and never stored. The XLA twin is `kernels.linear.linear_xla`
(jnp.einsum with fp32 accumulation: the same math, not batch-invariant).
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np

import triton
import triton.language as tl

from jspec.kernels.linear import mma_family_from_env, sum_in_order

BLOCK_K = 128  # reduction step: fixed (see module docstring)
MMA_M = 16  # rows of one mma.sync fragment: row tiles are multiples of it
MAX_BLOCK_M = 128  # widest row tile a plan takes
MAX_ROW_BLOCKS = 4  # row blocks (dots, accumulators) per program: the kernel has four
FORCE_BLOCK_M: int | None = None  # 16: every plan takes the original fixed 16-row tile
NUM_SMS_DEFAULT = 132  # H100 / H200
SMEM_BUDGET = 160 * 1024  # bytes of pipelined x and w tiles a plan allows (sm_90: 227 KiB max)
# Split-K (see _split_k): programs wanted at M = 1 in 16-column tiles (4 per SM of an H100/H200; a
# fixed number, not the device's, so a shape's split and bits are the same on every GPU), the
# fewest BLOCK_K steps a split walks, and the most splits.
SPLIT_PROGRAMS = 4 * NUM_SMS_DEFAULT
SPLIT_MIN_STEPS = 16
MAX_SPLIT_K = 4
# None: _split_k's rule (the default since the H200 timed it, 2026-12-04: at 64 verify rows qkv
# 43 -> 31 us, o 32 -> 22, down 78 -> 47 in scripts/bench_linear.py, whose repeated calls find
# much of a weight in L2; in the engine a 16-lane iteration 8.1 -> 7.7 ms and a 32-lane stock
# step 10.6 -> 9.7 ms; docs/benchmarks.md); 1: every plan walks K unsplit, the bits of before.
FORCE_SPLIT_K: int | None = None
# The MMA instruction every bf16 plan is built on (module docstring): "v2" mma.sync m16n8k16,
# "v3" wgmma m64nNk16 in 64/128-row single-dot tiles (both measured invariant on the H200).
# fp32 inputs take FMA dots in every family. Part of the numerics, like BLOCK_K.
# "mixed": v2 up to MIXED_V2_MAX_ROWS rows (decode, small verify: where mma.sync's 16-row
# fragments waste least), v3 above (wide verify). Invariant only because the two families give
# the same bits: measured on the H200 (2026-12-02, scripts/gpu_linear_v3.sh: v2's 16-row plan
# against v3's at 1..256 rows, all five 8B shapes, 0 of 20 outputs differed; the GPU invariance
# test runs "mixed" across the switch). The default.
MMA_FAMILIES = ("v2", "v3", "mixed")
MIXED_V2_MAX_ROWS = 32
MMA_FAMILY: str = mma_family_from_env()
V3_BLOCK_M = 64  # the v3 family's default row tile: one warpgroup, one m64 fragment
V3_WIDE_N = 16384  # v3 verify plans of at least this many columns take 8 warps
V3_TUNED_MAX_ROWS = 128  # the most rows the v3 sweep's tiles were measured at
V3_SPLIT_MIN_PROGRAMS = 96  # split verify plans take 128 columns when that leaves this many
# From this many rows a split v3 plan walks its splits in turn in one program (SPLIT_SERIAL: the
# same bits, no split axis, no partials; the unsplit plan's tiles and cost). Measured in the
# engine (H200, 2026-12-04, same replies as the unsplit run before): the split axis paid at 64
# rows (team's verify: 8.1 -> 7.7 ms an iteration) and cost at 128 (busy's verify: 13.6 -> 14.2
# ms), so 128-row verify GEMMs walk serial. Not yet re-measured with this threshold.
V3_SERIAL_MIN_ROWS = 65


def _linear_kernel(x_ptr, w_ptr, y_ptr,
                   M: tl.constexpr, N: tl.constexpr, K: tl.constexpr,
                   BLOCK_M: tl.constexpr, DOT_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, IEEE_DOT: tl.constexpr, SPLIT_K: tl.constexpr,
                   SPLIT_SERIAL: tl.constexpr = False):
    """One program = BLOCK_M rows x BLOCK_N columns of y, as BLOCK_M // DOT_M row blocks (each its
    own dot and accumulator) that share every weight tile; grid axis 0 walks the row tiles so the
    programs that read the same weight columns run side by side (the weights come from L2).
    SPLIT_K > 1: grid axis 2 is the split s, which walks its K_SPLIT = K / SPLIT_K (whole BLOCK_K
    steps; the last split's last step masked at K) into y[s] of an [SPLIT_K, M, N] partial.
    SPLIT_K = 1: the code of before split-K, unchanged (the constexpr branches drop out).
    SPLIT_SERIAL (one row block, SPLIT_K > 1): no split axis; the program walks the SPLIT_K runs
    one after another, each from a zero accumulator as above, and adds them in split order into
    y: the split grid's partials and `combine`, the same dots and fp32 adds, without the
    partials' round trip through memory (wide GEMMs, which have programs enough).
    int8 weights (the drafter's weight-only int8, jspec/draft_weights.py): each tile is widened
    to x's dtype as it is loaded (exact: |v| <= 127), so the GEMM reads one byte a weight and
    writes no widened copy; y is then x @ values^T, unscaled (the caller scales it). For a
    weight already in x's dtype the widening is no conversion at all: the same kernel."""
    BLOCKS: tl.constexpr = BLOCK_M // DOT_M
    PRECISION: tl.constexpr = "ieee" if IEEE_DOT else "tf32"  # tf32: the default (bf16: unused)
    K_SPLIT: tl.constexpr = (K + BLOCK_K * SPLIT_K - 1) // (BLOCK_K * SPLIT_K) * BLOCK_K
    K_WALK: tl.constexpr = K if SPLIT_K == 1 else K_SPLIT  # this program's run of k
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, DOT_M)  # row block 0 (j: + j * DOT_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    col_ok = cols < N
    x_row = x_ptr + rows[:, None].to(tl.int64) * K
    if SPLIT_SERIAL:  # one row block (make_plan: DOT_M == BLOCK_M): the runs in turn, in order
        row_ok = rows < M
        total = tl.zeros([DOT_M, BLOCK_N], dtype=tl.float32)
        for s in tl.static_range(SPLIT_K):
            acc = tl.zeros([DOT_M, BLOCK_N], dtype=tl.float32)
            for k0 in range(s * K_SPLIT, (s + 1) * K_SPLIT, BLOCK_K):
                k = k0 + ks
                k_ok = k < K
                w = tl.load(w_ptr + cols[None, :].to(tl.int64) * K + k[:, None],
                            mask=col_ok[None, :] & k_ok[:, None], other=0.0)
                w = w.to(x_ptr.dtype.element_ty)  # int8 weights widened here; else a no-op
                x = tl.load(x_row + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
                acc += tl.dot(x, w, input_precision=PRECISION)
            if s == 0:
                total = acc  # p_0 itself (0 + p_0 would turn a -0.0 into +0.0)
            else:
                total = total + acc  # ((p_0 + p_1) + p_2) ...: combine's order
        tl.store(y_ptr + rows[:, None].to(tl.int64) * N + cols[None, :], total,
                 mask=row_ok[:, None] & col_ok[None, :])
    else:
        if SPLIT_K > 1:
            ks += tl.program_id(2) * K_SPLIT  # split s starts at k = s * K_SPLIT
            y_ptr += tl.program_id(2).to(tl.int64) * M * N  # and writes partial s
        acc0 = tl.zeros([DOT_M, BLOCK_N], dtype=tl.float32)
        acc1 = tl.zeros([DOT_M, BLOCK_N], dtype=tl.float32)
        acc2 = tl.zeros([DOT_M, BLOCK_N], dtype=tl.float32)
        acc3 = tl.zeros([DOT_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K_WALK, BLOCK_K):
            k = k0 + ks
            k_ok = k < K
            w = tl.load(w_ptr + cols[None, :].to(tl.int64) * K + k[:, None],
                        mask=col_ok[None, :] & k_ok[:, None], other=0.0)  # [BLOCK_K, BLOCK_N]
            w = w.to(x_ptr.dtype.element_ty)  # int8 weights widened here; else a no-op
            x = tl.load(x_row + k[None, :], mask=(rows < M)[:, None] & k_ok[None, :], other=0.0)
            acc0 += tl.dot(x, w, input_precision=PRECISION)
            if BLOCKS > 1:
                x = tl.load(x_row + DOT_M * K + k[None, :],
                            mask=(rows < M - DOT_M)[:, None] & k_ok[None, :], other=0.0)
                acc1 += tl.dot(x, w, input_precision=PRECISION)
            if BLOCKS > 2:
                x = tl.load(x_row + 2 * DOT_M * K + k[None, :],
                            mask=(rows < M - 2 * DOT_M)[:, None] & k_ok[None, :], other=0.0)
                acc2 += tl.dot(x, w, input_precision=PRECISION)
                x = tl.load(x_row + 3 * DOT_M * K + k[None, :],
                            mask=(rows < M - 3 * DOT_M)[:, None] & k_ok[None, :], other=0.0)
                acc3 += tl.dot(x, w, input_precision=PRECISION)
        y = y_ptr + rows[:, None].to(tl.int64) * N + cols[None, :]
        tl.store(y, acc0, mask=(rows < M)[:, None] & col_ok[None, :])
        if BLOCKS > 1:
            tl.store(y + DOT_M * N, acc1, mask=(rows < M - DOT_M)[:, None] & col_ok[None, :])
        if BLOCKS > 2:
            tl.store(y + 2 * DOT_M * N, acc2,
                     mask=(rows < M - 2 * DOT_M)[:, None] & col_ok[None, :])
            tl.store(y + 3 * DOT_M * N, acc3,
                     mask=(rows < M - 3 * DOT_M)[:, None] & col_ok[None, :])


_KERNEL = None


def _kernel():
    """triton.jit at first use (Triton decides between compiling and interpreting then)."""
    global _KERNEL
    if _KERNEL is None:
        _KERNEL = triton.jit(_linear_kernel)
    return _KERNEL


@dataclasses.dataclass(frozen=True)
class Plan:
    M: int
    N: int
    K: int
    block_m: int
    dot_m: int
    block_n: int
    num_warps: int
    num_stages: int
    ieee_dot: bool
    split_k: int = 1
    mma: str = "v2"  # the family (not a constexpr: Triton picks the instruction from the tile)
    split_serial: bool = False  # the splits walked in turn by one program (same bits, no partials)

    @property
    def partials(self) -> int:
        """How many [M, N] partials the kernel writes for `combine` (1: y itself)."""
        return 1 if self.split_serial else self.split_k

    @property
    def grid(self) -> tuple[int, ...]:
        grid = (-(-self.M // self.block_m), -(-self.N // self.block_n))
        return grid if self.partials == 1 else grid + (self.split_k,)

    def constexprs(self) -> dict:
        return dict(M=self.M, N=self.N, K=self.K, BLOCK_M=self.block_m, DOT_M=self.dot_m,
                    BLOCK_N=self.block_n, BLOCK_K=BLOCK_K, IEEE_DOT=self.ieee_dot,
                    SPLIT_K=self.split_k, SPLIT_SERIAL=self.split_serial)

    @property
    def out_shape(self) -> tuple[int, ...]:
        """What the kernel writes: y [M, N], or the partials [split_k, M, N] (see combine)."""
        return (self.M, self.N) if self.partials == 1 else (self.split_k, self.M, self.N)


def combine(partials, split_k: int):
    """y = (...((p[0] + p[1]) + p[2]) ... + p[S-1]): elementwise fp32 adds in split order (jax or
    torch arrays; neither reassociates them). Not a sum over axis 0, whose order XLA picks by
    shape (linear.sum_in_order). split_k = 1: y is partials itself ([M, N]) or its only partial
    ([1, M, N])."""
    if split_k == 1 and partials.ndim == 2:
        return partials
    return sum_in_order(partials[:split_k])


def _pow2(v: int) -> bool:
    return v >= 1 and not v & (v - 1)


def _wide_tiles(M: int, N: int, sms: int, block_n: int | None) -> tuple[int, int] | None:
    """Row and column tiles above 16 rows, as measured on the H200 (scripts/bench_linear.py,
    docs/benchmarks.md, 2026-11-30): at 256 rows, 64-row tiles (two 32-row dots) with 128 columns
    were the fastest at all four Qwen3-8B shapes (1.3-1.5x the 128-row guess); at 32 rows,
    32-row tiles with 64 columns at three of four. None: take the 16-row tile (decode)."""
    del N, sms  # kept in the signature: a later tuning may want them
    if M <= MMA_M:
        return None
    if M <= 32:
        return 32, block_n or 64
    return 64, block_n or 128


def _split_ok(K: int, split_k: int) -> bool:
    """S splits must cut the ceil(K / BLOCK_K) steps into S equal runs of whole steps."""
    return split_k >= 1 and -(-K // BLOCK_K) % split_k == 0


def _split_k(N: int, K: int) -> int:
    """The number of K splits, from (N, K) only: never from M (that is the invariance: every row
    count of a shape sums the same splits), nor from the device. A skinny GEMM at M = 1 is bound
    by the weight bytes in flight: with N = 4096 the decode plan's 16-column tiles give only 256
    programs (~2 per SM of 132), each streaming all of K, and o_proj / down ran 30-45 % behind
    XLA (H200, 2026-11-30). So aim for SPLIT_PROGRAMS (528, 4 per SM) programs of 16 columns:
    S = ceil(528 / ceil(N / 16)), at most MAX_SPLIT_K (4); then the largest S <= that which cuts
    the steps evenly and leaves each split >= SPLIT_MIN_STEPS (16 steps, 2048 of K: the 2-4-stage
    pipeline's ramp and the partial's write stay small next to the walk). Qwen3-8B: qkv (6144 x
    4096) 2, o (4096 x 4096) 2 (3 does not divide 32 steps), down (4096 x 12288) 3, gate_up
    (24576) and lm_head (151936) 1 (>= 1536 programs already). Cost: S partials of M x N fp32
    are written and read back by the combine, S * M * N * 8 bytes (M = 256, o: 16 MiB, mostly
    L2, next to 32 MiB of weights; M = 1: 64 KiB), and since S may not vary with M, S stays
    moderate."""
    steps = -(-K // BLOCK_K)
    want = min(MAX_SPLIT_K, -(-SPLIT_PROGRAMS // -(-N // MMA_M)))
    return next(s for s in range(want, 0, -1)
                if s == 1 or (_split_ok(K, s) and steps // s >= SPLIT_MIN_STEPS))


def _column_tile(M: int, N: int, block_m: int, sms: int) -> int:
    """The widest column tile (128..32, else 16) that still gives two row x column tiles per SM
    (a skinny GEMM is bound by how many weight bytes are in flight, so it needs many programs)."""
    row_tiles = -(-M // block_m)
    for bn in (128, 64, 32):
        if row_tiles * -(-N // bn) >= 2 * sms:
            return bn
    return 16


def _num_stages(block_m: int, block_n: int, ieee_dot: bool) -> int:
    """Pipeline depth from the shared memory of one stage: x [block_m, 128] + w [128, block_n],
    2 bytes (4 with IEEE fp32)."""
    stage_bytes = (block_m + block_n) * BLOCK_K * (4 if ieee_dot else 2)
    return max(2, min(4, SMEM_BUDGET // stage_bytes))


def _make_plan_v3(M, N, K, *, block_m, dot_m, block_n, sms, num_warps, num_stages,
                  split_k, split_serial=None) -> Plan:
    """The wgmma family: one dot per program of block_m (64, or 128 with 8 warps) rows and 4 or
    8 warps, whatever M, so Triton lowers it to wgmma.m64nNk16. Column tiles as v2's: up to 16
    rows the programs-per-SM rule (decode at N = 4096: 16 columns, 256 programs), above it
    the tiles of the 128-row sweep (H200, 2026-12-02, scripts/gpu_linear_v3.sh,
    docs/results/2026-12-02-8b-bench-mixed/linear_v3.json): 64 columns at N <= 4096 (o 35.8 ->
    31.4 us, down 78.6 -> 64.1 us against 128 columns: twice the programs on 132 SMs), 128
    columns above (qkv), and 8 warps at N >= V3_WIDE_N (gate_up 110.8 -> 98.9 us; lm_head
    unchanged); measured again in the engine: a 16-lane speculative iteration 12.03 -> 11.48 ms.
    Above V3_TUNED_MAX_ROWS the 128-column, 4-warp tile: at 256 rows it beat the 128-row choice
    (down 86.0 vs 91.8 us, gate_up 146.9 vs 151.8 us; o the other way, 42.6 vs 39.9 us; not
    swept there). Split verify plans (2026-12-04 sweep at 64 rows, all split): 128 columns
    where that still gives V3_SPLIT_MIN_PROGRAMS programs, else 64 (qkv 128: 30.5 us; o 64:
    21.8 vs 32.2; down 128 with 8 warps: 47.4 vs 56.1). None of these changes a bit."""
    block_m = block_m or V3_BLOCK_M
    if block_m not in (64, 128):
        raise ValueError(f"the v3 (wgmma) family takes 64- or 128-row tiles, got block_m={block_m}")
    if dot_m not in (None, block_m):
        raise ValueError(f"the v3 (wgmma) family computes a tile in one dot: dot_m must be "
                         f"block_m ({block_m}), got {dot_m}")
    tuned = MMA_M < M <= V3_TUNED_MAX_ROWS  # verify at 3..16 lanes: the 128-row sweep's tiles
    split_walk = -(-K // BLOCK_K) // split_k  # BLOCK_K steps per split
    if split_serial is None:  # the split axis only where its programs paid (see the constant)
        split_serial = split_k > 1 and M >= V3_SERIAL_MIN_ROWS
    split_grid = split_k > 1 and not split_serial
    if block_n is None:
        if M <= MMA_M:
            block_n = _column_tile(M, N, block_m, sms)
        elif tuned and split_grid:  # split verify: 128 columns unless too few programs
            programs = -(-M // block_m) * -(-N // 128) * split_k
            block_n = 128 if programs >= V3_SPLIT_MIN_PROGRAMS else 64
        else:  # unsplit (or serial) verify: 64 columns at N <= 4096 up to 128 rows, else 128
            block_n = 64 if tuned and N <= 4096 else 128
    if num_warps is None:  # 8 warps: the wide-N verify GEMM (gate_up) at 64-row tiles, and the
        # long split walks (down: 3 x 32 steps, 47 vs 58 us at 64 rows)
        num_warps = 8 if block_m == 128 or (tuned and (
            N >= V3_WIDE_N or (split_grid and split_walk >= 32))) else 4
        if split_serial and split_k > 2 and block_n >= 128:  # a running total beside the
            num_warps = 8  # accumulator: down's 3-way walk in 64 x 128 with 4 warps spilled
    if num_warps not in (4, 8):
        raise ValueError(f"the v3 (wgmma) family needs 4 or 8 warps (whole warpgroups), got "
                         f"{num_warps}")
    if not _pow2(block_n) or not 16 <= block_n <= 256:
        raise ValueError(f"block_n must be a power of two in [16, 256], got {block_n}")
    return Plan(M=M, N=N, K=K, block_m=block_m, dot_m=block_m, block_n=block_n,
                num_warps=num_warps, num_stages=num_stages or _num_stages(block_m, block_n, False),
                ieee_dot=False, split_k=split_k, mma="v3",
                split_serial=bool(split_serial and split_k > 1))


def make_plan(M: int, N: int, K: int, *, ieee_dot: bool = False, block_m: int | None = None,
              dot_m: int | None = None, block_n: int | None = None, num_sms: int | None = None,
              num_warps: int | None = None, num_stages: int | None = None,
              split_k: int | None = None, mma: str | None = None,
              split_serial: bool | None = None) -> Plan:
    """Tiles from the shape (none of these choices is meant to change a result's bits; see the
    module docstring). Up to 16 rows (decode) and when wide tiles would leave SMs idle: 16-row
    tiles with the widest column tile (16..128) that still gives two row x column tiles per SM
    (a skinny GEMM is bound by how many weight bytes are in flight, so it needs many programs;
    the splits are not counted here, so the decode tile is the one _split_k assumes).
    More rows (verify): the measured tiles of _wide_tiles, so each weight tile is read
    M / BLOCK_M times instead of M / 16. fp32 inputs keep 16 rows (FMA dots, kept small).
    The K splits are _split_k(N, K) whatever M (split_k overrides it, for tuning: another split
    gives other bits, the same for every M; it must cut ceil(K / 128) steps evenly).
    `mma` (default MMA_FAMILY): "v2" as above, "v3" the wgmma family (_make_plan_v3), "mixed"
    v2 up to MIXED_V2_MAX_ROWS rows and v3 above; fp32 inputs take the v2 plan's FMA dots in
    every family."""
    if min(M, N, K) < 1:
        raise ValueError(f"linear: empty operand (M={M}, N={N}, K={K})")
    mma = mma or MMA_FAMILY
    if mma not in MMA_FAMILIES:
        raise ValueError(f"linear: mma family must be one of {MMA_FAMILIES}, got {mma!r} "
                         "(JSPEC_LINEAR_MMA / MMA_FAMILY)")
    if split_k is None:
        split_k = FORCE_SPLIT_K or _split_k(N, K)
    if not _split_ok(K, split_k):
        raise ValueError(f"split_k must divide the {-(-K // BLOCK_K)} steps of {BLOCK_K} in "
                         f"K = {K} evenly, got {split_k}")
    sms = num_sms or NUM_SMS_DEFAULT
    if mma == "mixed":
        mma = "v2" if M <= MIXED_V2_MAX_ROWS else "v3"
    if mma == "v3" and not ieee_dot:
        return _make_plan_v3(M, N, K, block_m=block_m, dot_m=dot_m, block_n=block_n, sms=sms,
                             num_warps=num_warps, num_stages=num_stages, split_k=split_k,
                             split_serial=split_serial)
    if block_m is None:
        wide = None if (FORCE_BLOCK_M or ieee_dot) else _wide_tiles(M, N, sms, block_n)
        block_m, block_n = wide if wide else (FORCE_BLOCK_M or MMA_M, block_n)
    if not _pow2(block_m) or not MMA_M <= block_m <= MAX_BLOCK_M:
        raise ValueError(f"block_m must be a power of two in [{MMA_M}, {MAX_BLOCK_M}], "
                         f"got {block_m}")
    if block_n is None:
        block_n = _column_tile(M, N, block_m, sms)
    if not _pow2(block_n) or block_n < 16:
        raise ValueError(f"block_n must be a power of two >= 16, got {block_n}")
    if num_warps is None:
        num_warps = 8 if block_m * block_n >= 128 * 128 else 4
    if not _pow2(num_warps):
        raise ValueError(f"num_warps must be a power of two, got {num_warps}")
    if dot_m is None:  # 64+-row dots are mma.sync only with 1-2 warps: split into 32-row blocks
        dot_m = block_m if block_m < 64 or num_warps < 4 else 32
    if not _pow2(dot_m) or not MMA_M <= dot_m <= block_m or block_m // dot_m > MAX_ROW_BLOCKS:
        raise ValueError(f"dot_m must be a power of two in [{MMA_M}, block_m] with at most "
                         f"{MAX_ROW_BLOCKS} row blocks, got dot_m={dot_m} for block_m={block_m}")
    if dot_m % 64 == 0 and num_warps % 4 == 0:
        raise ValueError(f"a {dot_m}-row dot with {num_warps} warps lowers to wgmma on sm_90, "
                         "not mma.sync: use dot_m <= 32 or num_warps <= 2")
    if num_stages is None:
        num_stages = _num_stages(block_m, block_n, ieee_dot)
    if split_serial and dot_m != block_m:
        raise ValueError(f"a serial split walk takes one row block (dot_m == block_m), got "
                         f"dot_m={dot_m} for block_m={block_m}")
    return Plan(M=M, N=N, K=K, block_m=block_m, dot_m=dot_m, block_n=block_n,
                num_warps=num_warps, num_stages=num_stages, ieee_dot=bool(ieee_dot),
                split_k=split_k, split_serial=bool(split_serial and split_k > 1))


def interpreter_enabled() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def linear_triton(x, w, **tuning):
    """x [M, K], w [N, K] (x's dtype, or int8 values: x @ w^T unscaled) -> fp32 [M, N] on an
    NVIDIA GPU, batch-invariant. The keyword overrides (row tile, rows per dot, tile width,
    warps, stages; see linear_triton_partials) are for tuning: none is meant to change a
    result's bits (module docstring: checked on the H200 across row tiles). split_k (tuning
    too) does change them: another split is another sum, as invariant in M."""
    partials = linear_triton_partials(x, w, **tuning)
    return combine(partials, partials.shape[0])


def linear_triton_partials(x, w, *, block_m: int | None = None, dot_m: int | None = None,
                           block_n: int | None = None, num_warps: int | None = None,
                           num_stages: int | None = None, split_k: int | None = None,
                           mma: str | None = None, split_serial: bool | None = None):
    """The kernel's own output, fp32 [P, M, N]: the P = Plan.partials split partials that
    `combine` sums in split order into linear_triton's y (P = 1: y itself, as [1, M, N]). For a
    consumer that folds the combine into its own kernel (rowwise_triton's add_rms_norm and
    qk_norm_rope), which saves the combine's launch and round trip."""
    import jax
    import jax.numpy as jnp
    from jspec.kernels.triton_ffi import triton_call

    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"linear: x must be [M, K] and w [N, K], got {x.shape} and {w.shape}")
    if x.dtype != w.dtype and w.dtype != jnp.int8:
        raise ValueError(f"linear: w must have x's dtype or be int8 values (weight-only int8), "
                         f"got x {x.dtype} and w {w.dtype}")
    M, K = x.shape
    N = w.shape[0]
    try:
        sms = int(getattr(jax.devices()[0], "core_count", 0)) or None
    except Exception:  # noqa: BLE001 - a heuristic input only
        sms = None
    plan = make_plan(M, N, K, ieee_dot=np.dtype(x.dtype) == np.float32, block_m=block_m,
                     dot_m=dot_m, block_n=block_n, num_sms=sms, num_warps=num_warps,
                     num_stages=num_stages, split_k=split_k, mma=mma, split_serial=split_serial)
    out = triton_call(
        x, w, kernel=_kernel(), name="linear_bi",
        out_shape=jax.ShapeDtypeStruct(plan.out_shape, jnp.float32), grid=plan.grid,
        num_warps=plan.num_warps, num_stages=plan.num_stages, **plan.constexprs())
    return out.reshape((plan.partials, M, N))


def launch_torch(x, w, *, block_m: int | None = None, dot_m: int | None = None,
                 block_n: int | None = None, num_warps: int | None = None,
                 split_k: int | None = None, mma: str | None = None,
                 split_serial: bool | None = None):
    """The same kernel, plan and combine on torch tensors: Triton's CPU interpreter (tests; the
    process must start with TRITON_INTERPRET=1) or a CUDA torch build."""
    import torch

    if x.device.type == "cpu" and not interpreter_enabled():
        raise RuntimeError("CPU tensors run only under Triton's interpreter: start the process "
                           "with TRITON_INTERPRET=1")
    M, K = x.shape
    N = w.shape[0]
    plan = make_plan(M, N, K, ieee_dot=x.dtype == torch.float32, block_m=block_m, dot_m=dot_m,
                     block_n=block_n, num_warps=num_warps, split_k=split_k, mma=mma,
                     split_serial=split_serial)
    y = torch.full(plan.out_shape, float("nan"), dtype=torch.float32, device=x.device)
    _kernel()[plan.grid](x.contiguous(), w.contiguous(), y, num_warps=plan.num_warps,
                         num_stages=plan.num_stages, **plan.constexprs())
    return combine(y, plan.partials)
