"""The front GEMM: router logits and the latent-down projection in one pass over x.

``front = x @ packed.T`` with ``packed = [router rows E/T of rank r ; latent-down rows
L/T of rank r]`` (``pack_front``), BF16 operands, FP32 accumulation, FP32 output. The
latent columns are rounded to BF16 by the stage that publishes them, not here.

Reduction order and batch invariance. The K dimension (H) is cut into blocks of
``BLOCK_K`` and the blocks into ``SPLIT_K`` consecutive segments. Each segment is
accumulated from zero by the tensor cores, block after block; the segment sums are
then added in FP32 as a fixed binary tree, bottom-up and pairwise (level by level,
neighbours 2i and 2i+1 added left to right, an odd last one carried up as it is:
``((s0+s1)+(s2+s3))+((s4+s5)+s6)`` for 7 segments). That order is all a row's result
depends on, and it is fixed per shape (``shape_key``), never per batch width: the
launch wrapper takes ``BLOCK_K``/``SPLIT_K`` from the smallest batch bucket's config
whatever ``b`` is. What may vary per bucket changes no bit:

- ``BLOCK_M`` (batch rows a program) and ``BLOCK_N`` (packed rows a program): an
  output element only ever sees its own row of x and its own row of packed;
- ``SPLIT_GRID`` and ``GROUP``: how the segments are shared among programs. With
  ``SPLIT_GRID`` 1 a program sums an aligned group of ``GROUP`` segments (a power of
  two) as its subtree, the partials go to an FP32 workspace and a reduction kernel adds
  them as the tree's upper levels; with 0 one program sums all segments (no
  workspace). Aligned power-of-two groups are subtrees of the tree, so every choice
  adds the same sums in the same order: many programs for small batches, whose few
  output tiles would leave most SMs idle while the weights stream, few or none for
  wide ones. A program holds one pending subtree a level of its group, so it sums at
  most 8 segments (3 levels);
- ``num_warps`` (4 or 8: one or two warpgroups, always wgmma) and ``num_stages``.

The MMA is ``packed_tile @ x_tile.T`` (swap-AB): the weight rows fill the 64-row
wgmma M dimension and the batch is its N, so a batch of 1 still runs wgmma with a
16-wide tile instead of a 64-row tile that is mostly padding, and the instruction
(and with it every product's accumulation) is the same at every batch width.

The same GEMM serves every dense linear of the layer, so that each gets this
guarantee rather than a BLAS kernel chosen per batch width: an epilogue (a constexpr)
says what becomes of an output tile's FP32 sums, applied by the GEMM program or, with
split-K programs, by the reduction kernel after the last partial (the same function on
the same sums, so both modes store the same bits):

- ``front_gemm``: FP32 out (``EPI_F32``);
- ``linear``: one rounding to BF16 (``EPI_BF16``, F.linear's epilogue), or, with
  ``accumulate``, ``out = bf16(fp32(out) + sums)`` in place (``EPI_ADD_BF16``, addmm_'s);
- ``linear_situ``: weight rows interleaved gate/up (row 2j gate j, row 2j+1 up j), each
  sum rounded to BF16 as a BF16 linear's output is, then ``bf16(situ(g, u))`` in FP32
  (``EPI_SITU``): the shared expert's first linear and its activation in one pass.

Each caller names its own tuning ``kernel`` (e.g. ``"shared_down"``), so every
(kernel, shape) has its own table entry and its own per-shape reduction keys. The
kernels are compiled without FMA contraction: the SiTU epilogue must give the same bits
in the GEMM program and in the reduction kernel, whatever each one's code around it.
"""

from __future__ import annotations

import math
import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..checks import check_tensor
from ..tuning import config_for
from . import quiet
from .bits import bf16_bits_to_f32, f32_to_bf16_bits, round_to_bf16
from .situ import situ

KERNEL = "front"
# The base of every config; ``default_config`` sizes SPLIT_K, BLOCK_M and SPLIT_GRID.
DEFAULT = {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 128, "SPLIT_K": 1, "SPLIT_GRID": 0,
           "GROUP": 1, "num_warps": 4, "num_stages": 4}
# Keys that set the reduction order: per shape only (see the module docstring).
REDUCTION_KEYS = ("BLOCK_K", "SPLIT_K")
_SMEM_BUDGET = 200 * 1024  # pipeline bytes a candidate may take (H200: 227 KB a block)
_MAX_LEVELS = 3  # a program sums at most 8 segments (the tree's pending subtrees)


def _tiles_held(s: int, group: int) -> int:
    """FP32 accumulator tiles a program holds: the running segment and one pending
    subtree a tree level of its group (none for a single segment)."""
    return 1 + (min(group, triton.next_power_of_2(s)).bit_length() - 1 if s > 1 else 0)


SPACE = [
    {"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k, "SPLIT_K": s, "SPLIT_GRID": g, "GROUP": grp,
     "num_warps": w, "num_stages": st}
    for m in (16, 32, 64, 128) for n in (64, 128) for k in (64, 128)
    for s in (1, 2, 4, 7, 8, 14, 28) for g in (0, 1) for grp in (1, 2, 4)
    # 2 stages of 128 x 64 tiles leave room for two programs a SM: the best at b >= 512
    # on the H200 (NOTES: Front split-K)
    for w in (4, 8) for st in (2, 3, 4, 5)
    if (g == 0 or s > grp) and (g == 1 or grp == 1)
    and _tiles_held(s, grp if g else 1 << 30) <= 1 + _MAX_LEVELS
    and st * (m + n) * k * 2 <= _SMEM_BUDGET
    # The accumulator tiles, m*n/(32*w) registers a thread each, must leave room for the
    # rest under 255 (tiles, pointers), or the kernel spills.
    and _tiles_held(s, grp if g else 1 << 30) * (m * n // (32 * w)) <= 128
]
_SM_COUNT = 132  # H200; only the untuned defaults below use it
_REDUCE_N, _REDUCE_M = 128, 8  # the reduction kernel's tile: 1024 elements, N contiguous

# What a program does with an output tile's FP32 sums (see the module docstring). The
# kernels compare their EPILOGUE with these; launches pass the plain ``.value``.
EPI_F32 = tl.constexpr(0)
EPI_BF16 = tl.constexpr(1)
EPI_ADD_BF16 = tl.constexpr(2)
EPI_SITU = tl.constexpr(3)


def shape_key(N: int, H: int) -> str:
    return f"N{N}_H{H}"


# ----------------------------------------------------------------------------- kernels

@triton.jit
def _block_dot(w, x, acc, INTERPRET: tl.constexpr):
    """acc + w @ x.T for BF16 tiles w [BLOCK_N, BLOCK_K] and x [BLOCK_M, BLOCK_K]."""
    if INTERPRET:
        # The interpreter's tl.dot multiplies BF16 tiles as their raw uint16 storage,
        # and its numpy matmul sums in an order that depends on the tile's shape; an
        # elementwise product (exact in FP32) and a per-element sum over K keep the
        # interpreter's results independent of BLOCK_M/BLOCK_N, as wgmma's are.
        wf = bf16_bits_to_f32(w.to(tl.int16, bitcast=True))
        xf = bf16_bits_to_f32(x.to(tl.int16, bitcast=True))
        return acc + tl.sum(wf[:, None, :] * xf[None, :, :], axis=2)
    else:
        return tl.dot(w, tl.trans(x), acc)


@triton.jit
def _store_tile(total, n0, offs_m, N, b, out_ptr, out_stride, beta, linear_beta,
                BLOCK_N: tl.constexpr, EPILOGUE: tl.constexpr, HAS_LINEAR_BETA: tl.constexpr,
                INTERPRET: tl.constexpr):
    """Apply EPILOGUE to an output tile and store it. ``total`` [BLOCK_N, BLOCK_M]: the
    FP32 sums of weight rows n0 + i (dim 0) for batch rows offs_m (dim 1); batch row m of
    the output starts at ``out_ptr + m * out_stride`` (BF16 outputs as int16 bits)."""
    BLOCK_M: tl.constexpr = total.shape[1]
    row = offs_m[None, :].to(tl.int64) * out_stride
    m_ok = (offs_m < b)[None, :]
    if EPILOGUE == EPI_SITU:
        # Rows 2j and 2j+1 (gate j, up j) are neighbours in the tile: split them apart,
        # each rounded to BF16 first, as the stock path's BF16 linear output is.
        pairs = tl.reshape(round_to_bf16(total), (BLOCK_N // 2, 2, BLOCK_M))
        g, u = tl.split(tl.permute(pairs, (0, 2, 1)))
        h = situ(g, u, beta, linear_beta, HAS_LINEAR_BETA, INTERPRET)
        j = n0 // 2 + tl.arange(0, BLOCK_N // 2)
        tl.store(out_ptr + row + j[:, None], f32_to_bf16_bits(h),
                 mask=(j < N // 2)[:, None] & m_ok)
    else:
        n = n0 + tl.arange(0, BLOCK_N)
        ptrs = out_ptr + row + n[:, None]
        ok = (n < N)[:, None] & m_ok
        if EPILOGUE == EPI_F32:
            tl.store(ptrs, total, mask=ok)
        else:
            if EPILOGUE == EPI_ADD_BF16:
                total = bf16_bits_to_f32(tl.load(ptrs, mask=ok, other=0)) + total
            tl.store(ptrs, f32_to_bf16_bits(total), mask=ok)


@triton.jit
def _fold_segment(acc, c, l0, l1, l2, LEVELS: tl.constexpr):
    """Fold segment ``c`` (its sum ``acc``) of a program's group into the pending
    subtrees ``l0..l2`` of the binary tree over the group (a binary counter: level l holds
    the finished subtree of 2**l segments whose right sibling is under way). When ``c``
    completes the group, the group's sum ends in ``l[LEVELS - 1]``."""
    # Selects, not branches: nested ifs on the accumulator make Triton's pipeliner wait
    # for every wgmma (or ptxas serialize them); a segment ends every few K blocks only.
    carry = acc
    if LEVELS >= 1:
        merge = (c & 1) == 1
        l0, carry = tl.where(merge, l0, carry), tl.where(merge, l0 + carry, carry)
    if LEVELS >= 2:
        merge = (c & 3) == 3
        l1, carry = tl.where((c & 3) == 1, carry, l1), tl.where(merge, l1 + carry, carry)
    if LEVELS >= 3:
        merge = (c & 7) == 7
        l2, carry = tl.where((c & 7) == 3, carry, l2), tl.where(merge, l2 + carry, carry)
    # The top level keeps the group's sum once complete (its subtree is the whole group).
    complete = (c & ((1 << LEVELS) - 1)) == (1 << LEVELS) - 1
    if LEVELS == 1:
        l0 = tl.where(complete, carry, l0)
    if LEVELS == 2:
        l1 = tl.where(complete, carry, l1)
    if LEVELS == 3:
        l2 = tl.where(complete, carry, l2)
    return l0, l1, l2


@triton.jit
def _group_sum(l0, l1, l2, r, LEVELS: tl.constexpr):
    """The tree sum of a group of ``r`` segments from ``_fold_segment``'s subtrees: the
    whole group's sum if ``r == 2**LEVELS``, else the pending subtrees (one per set bit
    of r) added right to left, as the bottom-up pairwise tree over a ragged tail has
    them. -0 is the identity of FP32 addition (-0 + s == s for every s, -0 included)."""
    total = tl.full(l0.shape, -0.0, tl.float32)
    if (r & 1) == 1:
        total = l0 + total
    top = l0
    if LEVELS >= 2:
        top = l1
        if (r & 2) == 2:
            total = l1 + total
    if LEVELS >= 3:
        top = l2
        if (r & 4) == 4:
            total = l2 + total
    if r == (1 << LEVELS):
        total = top
    return total


@triton.jit(do_not_specialize=["num_blocks", "blocks_per_split"])
def _front_kernel(x_ptr, w_ptr, dst_ptr, b, N, H, num_blocks, blocks_per_split, dst_stride,
                  beta, linear_beta,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  LEVELS: tl.constexpr, SPLIT_GRID: tl.constexpr, EVEN_K: tl.constexpr,
                  EPILOGUE: tl.constexpr, HAS_LINEAR_BETA: tl.constexpr,
                  INTERPRET: tl.constexpr):
    """dst[(g,) m, n] = EPILOGUE(tree sum over this program's group of 2**LEVELS
    consecutive segments of x[m] . w[n]); one program per (N tile, M tile[, group]).
    SPLIT_GRID: dst is the FP32 workspace [groups, b, N] (EPILOGUE is then EPI_F32, the
    reduction kernel sums the groups and applies the caller's)."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    # Out-of-range rows re-read valid ones (their results are never stored), which keeps
    # the hot loop free of row masks.
    rows_n = (offs_n % N).to(tl.int64)
    rows_m = (offs_m % b).to(tl.int64)
    if SPLIT_GRID:
        k_lo = tl.program_id(2) * (blocks_per_split << LEVELS)
        k_hi = tl.minimum(k_lo + (blocks_per_split << LEVELS), num_blocks)
        dst_ptr += tl.program_id(2).to(tl.int64) * b * N
    else:
        k_lo = 0
        k_hi = num_blocks
    w_ptrs = w_ptr + rows_n[:, None] * H + (k_lo * BLOCK_K + offs_k)[None, :]
    x_ptrs = x_ptr + rows_m[:, None] * H + (k_lo * BLOCK_K + offs_k)[None, :]

    # One flat loop over the K blocks keeps the load pipeline and the wgmma queue full
    # across segment ends; a segment's sum is folded into the tree where it ends.
    acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
    l0 = acc
    l1 = acc
    l2 = acc
    for kb in range(k_lo, k_hi):
        if EVEN_K:
            w = tl.load(w_ptrs)
            x = tl.load(x_ptrs)
        else:
            k_ok = (kb * BLOCK_K + offs_k < H)[None, :]
            w = tl.load(w_ptrs, mask=k_ok, other=0.0)
            x = tl.load(x_ptrs, mask=k_ok, other=0.0)
        acc = _block_dot(w, x, acc, INTERPRET)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
        if LEVELS > 0:
            # A segment ends at every multiple of blocks_per_split and at the last block.
            if ((kb + 1) % blocks_per_split == 0) | (kb + 1 == num_blocks):
                l0, l1, l2 = _fold_segment(acc, (kb - k_lo) // blocks_per_split, l0, l1, l2,
                                           LEVELS)
                acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
    if LEVELS > 0:
        acc = _group_sum(l0, l1, l2, tl.cdiv(k_hi - k_lo, blocks_per_split), LEVELS)

    _store_tile(acc, pid_n * BLOCK_N, offs_m, N, b, dst_ptr, dst_stride, beta, linear_beta,
                BLOCK_N, EPILOGUE, HAS_LINEAR_BETA, INTERPRET)


@triton.jit
def _front_reduce_kernel(ws_ptr, out_ptr, b, N, numel, out_stride, beta, linear_beta,
                         N_PARTS: tl.constexpr, TREE_DEPTH: tl.constexpr,
                         EPILOGUE: tl.constexpr,
                         HAS_LINEAR_BETA: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_M: tl.constexpr, INTERPRET: tl.constexpr):
    """out = EPILOGUE(bottom-up pairwise tree sum of ws[0..N_PARTS-1]) in FP32 (each of
    the TREE_DEPTH levels adds neighbours 2i and 2i+1, an odd last one goes up as it is), over a
    [BLOCK_N, BLOCK_M] tile oriented as the GEMM's (``_store_tile``)."""
    n0 = tl.program_id(0) * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    mask = (offs_n[:, None] < N) & (offs_m[None, :] < b)
    # Every partial is loaded before the first add: N_PARTS loads in flight, not one.
    parts = ()
    ptrs = ws_ptr + offs_m[None, :].to(tl.int64) * N + offs_n[:, None]
    for s in tl.static_range(N_PARTS):
        parts = parts + (tl.load(ptrs, mask=mask, other=0.0),)
        ptrs += numel
    for level in tl.static_range(TREE_DEPTH):
        pairs = ()
        for i in tl.static_range(len(parts) // 2):
            pairs = pairs + (parts[2 * i] + parts[2 * i + 1],)
        if len(parts) % 2 == 1:
            pairs = pairs + (parts[len(parts) - 1],)
        parts = pairs
    _store_tile(parts[0], n0, offs_m, N, b, out_ptr, out_stride, beta, linear_beta, BLOCK_N,
                EPILOGUE, HAS_LINEAR_BETA, INTERPRET)


# ----------------------------------------------------------------------------- configs

def _split_plan(H: int, cfg: dict) -> tuple[int, int, int]:
    """(K blocks, blocks a segment, segments): no segment is empty, so every grouping of
    the segments into programs adds exactly the same partial sums."""
    num_blocks = triton.cdiv(H, cfg["BLOCK_K"])
    per_split = triton.cdiv(num_blocks, min(cfg["SPLIT_K"], num_blocks))
    return num_blocks, per_split, triton.cdiv(num_blocks, per_split)


def _group_plan(segments: int, cfg: dict) -> tuple[int, int]:
    """(tree levels a program sums, programs a tile): a program sums an aligned group of
    2**levels segments (all of them without SPLIT_GRID, GROUP of them with it), a subtree
    of the segments' tree, so every grouping gives the same bits."""
    whole = triton.next_power_of_2(segments)
    group = whole if not cfg["SPLIT_GRID"] else min(cfg.get("GROUP", 1), whole)
    levels = group.bit_length() - 1
    if levels > _MAX_LEVELS:
        raise ValueError(f"front config: a program sums at most {1 << _MAX_LEVELS} segments, "
                         f"got {group} (SPLIT_K {cfg['SPLIT_K']}, SPLIT_GRID "
                         f"{cfg['SPLIT_GRID']}, GROUP {cfg.get('GROUP', 1)})")
    return levels, triton.cdiv(segments, group)


def default_config(N: int, H: int, b: int) -> dict:
    """The untuned config (a tuned table replaces it): the split count from the shape
    alone (about 1.5 programs per SM over the N tiles, segments of at least 4 K
    blocks), the batch tile from ``b``, and split-K programs only where the tiles alone
    leave most SMs idle, or some idle while the weights' read dominates (b <= 64)."""
    cfg = dict(DEFAULT)
    n_tiles = triton.cdiv(N, cfg["BLOCK_N"])
    num_blocks = triton.cdiv(H, cfg["BLOCK_K"])
    # At most 8 segments: a wide batch runs them all in one program (SPLIT_GRID 0),
    # which holds one pending subtree a tree level.
    cfg["SPLIT_K"] = max(1, min(num_blocks // 4, (3 * _SM_COUNT) // (2 * n_tiles),
                                1 << _MAX_LEVELS))
    cfg["BLOCK_M"] = min(64, max(16, triton.next_power_of_2(max(b, 1))))
    tiles = n_tiles * triton.cdiv(max(b, 1), cfg["BLOCK_M"])
    idle = 2 * tiles <= _SM_COUNT or (tiles < _SM_COUNT and b <= 64)
    cfg["SPLIT_GRID"] = int(cfg["SPLIT_K"] > 1 and idle)
    return cfg


def launch_config(N: int, H: int, b: int, device=None, kernel: str = KERNEL) -> dict:
    """``kernel``'s tuned config for a batch of ``b`` at shape (N, H), its reduction keys
    taken from the smallest bucket's entry, so a row's bits never depend on the batch it
    came in."""
    key = shape_key(N, H)
    cfg = config_for(kernel, key, b, default_config(N, H, b), device)
    order = config_for(kernel, key, 1, default_config(N, H, 1), device)
    cfg.update({k: order[k] for k in REDUCTION_KEYS})
    return cfg


def _check_config(cfg: dict) -> None:
    def power_of_two(name, lo):
        v = cfg.get(name)
        if not isinstance(v, int) or v < lo or v & (v - 1):
            raise ValueError(f"front config {name} must be a power of two >= {lo}, got {v!r}")

    power_of_two("BLOCK_M", 16)
    power_of_two("BLOCK_K", 16)
    # wgmma needs 64-row M tiles and whole warpgroups; anything else would fall back to
    # mma.sync, whose accumulation need not match bit for bit.
    if not isinstance(cfg.get("BLOCK_N"), int) or cfg["BLOCK_N"] not in (64, 128, 256):
        raise ValueError(f"front config BLOCK_N must be 64, 128 or 256, got {cfg.get('BLOCK_N')!r}")
    if cfg.get("num_warps") not in (4, 8):
        raise ValueError(f"front config num_warps must be 4 or 8, got {cfg.get('num_warps')!r}")
    if not isinstance(cfg.get("SPLIT_K"), int) or cfg["SPLIT_K"] < 1:
        raise ValueError(f"front config SPLIT_K must be a positive int, got {cfg.get('SPLIT_K')!r}")
    if cfg.get("SPLIT_GRID") not in (0, 1):
        raise ValueError(f"front config SPLIT_GRID must be 0 or 1, got {cfg.get('SPLIT_GRID')!r}")
    power_of_two("GROUP", 1)
    if not isinstance(cfg.get("num_stages"), int) or cfg["num_stages"] < 1:
        raise ValueError(f"front config num_stages must be a positive int, got "
                         f"{cfg.get('num_stages')!r}")


# ----------------------------------------------------------------------------- workspace

_workspaces: dict = {}


def workspace_numel(b: int, N: int, H: int, config: dict) -> int:
    """FP32 elements of workspace one call of the GEMM (``front_gemm``, ``linear``,
    ``linear_situ``) at (b, N, H) with ``config`` needs (0 when it runs without split-K
    programs)."""
    cfg = {**DEFAULT, **config}
    _, _, segments = _split_plan(H, cfg)
    _, parts = _group_plan(segments, cfg)
    return parts * b * N if parts > 1 else 0


def max_workspace_numel(rows: int, N: int, H: int, device=None, kernel: str = KERNEL) -> int:
    """FP32 elements of a workspace that serves every call of ``kernel`` at shape (N, H)
    of up to ``rows`` rows with the tuned configs: the split count is fixed per shape, so
    at most segments * rows * N (0 when the shape never splits K)."""
    _, _, splits = _split_plan(H, launch_config(N, H, 1, device, kernel))
    return splits * rows * N if splits > 1 else 0


def _shared_workspace(numel: int, device: torch.device) -> torch.Tensor:
    # One buffer per device, grown to the widest call seen: no allocation per call.
    # Calls on concurrent streams, or under CUDA-graph capture, should pass their own.
    ws = _workspaces.get(device)
    if ws is None or ws.numel() < numel:
        ws = torch.empty(numel, dtype=torch.float32, device=device)
        _workspaces[device] = ws
    return ws


# ----------------------------------------------------------------------------- wrappers

def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _check_operands(x: torch.Tensor, weight_name: str, weight: torch.Tensor) -> None:
    check_tensor("x", x, torch.bfloat16, ("b", "H"))
    if x.shape[1] == 0:
        raise ValueError("x must have at least one column (H >= 1)")
    check_tensor(weight_name, weight, torch.bfloat16, ("N", x.shape[1]), x.device)


def _check_out(out: torch.Tensor, dtype: torch.dtype, b: int, N: int, device) -> None:
    """``out`` [b, N] of ``dtype``; its rows may be strided (a column slice of a wider
    tensor), its columns must be adjacent."""
    check_tensor("out", out, dtype, (b, N), device, contiguous=False)
    if N > 1 and out.stride(1) != 1:
        raise ValueError(f"out must have adjacent columns (stride 1), got strides "
                         f"{tuple(out.stride())}")


def _check_workspace(workspace, parts: int, b: int, N: int, device) -> torch.Tensor:
    need = parts * b * N
    if workspace is None:
        return _shared_workspace(need, device)
    check_tensor("workspace", workspace, torch.float32, None, device)
    if workspace.numel() < need:
        raise ValueError(f"workspace must hold at least {need} FP32 elements "
                         f"({parts} partial sums x {b} x {N}), got {workspace.numel()}")
    return workspace


class GemmLaunch(NamedTuple):
    """One GEMM call's launch, resolved once for its (kernel, shape, b): the grids and
    every argument of the two kernels but the tensors and the output's row stride."""

    grid: tuple
    gemm: dict
    parts: int          # programs a tile's segments are shared among (> 1: split-K)
    reduce_grid: tuple
    reduce: dict


def resolve(b: int, N: int, H: int, epilogue, kernel: str, device, config: dict | None = None,
            beta: float = 1.0, linear_beta: float | None = None) -> GemmLaunch:
    """The launch of ``kernel``'s GEMM at (b >= 1, N, H) with ``epilogue`` (EPI_*):
    ``config`` as given (missing keys from ``DEFAULT``) or the tuned one
    (``launch_config``), checked."""
    cfg = {**DEFAULT, **config} if config is not None else launch_config(N, H, b, device,
                                                                          kernel)
    _check_config(cfg)
    num_blocks, per_split, segments = _split_plan(H, cfg)
    levels, parts = _group_plan(segments, cfg)
    split_grid = parts > 1
    common = dict(b=b, N=N, beta=float(beta),
                  linear_beta=1.0 if linear_beta is None else float(linear_beta),
                  HAS_LINEAR_BETA=linear_beta is not None, INTERPRET=_interpreting(),
                  # No FMA contraction: the epilogue's math must not depend on the code
                  # around it (GEMM program or reduction kernel).
                  enable_fp_fusion=False)
    gemm = dict(common, H=H, num_blocks=num_blocks, blocks_per_split=per_split,
                BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"],
                LEVELS=levels if segments > 1 else 0, SPLIT_GRID=split_grid,
                EVEN_K=H % cfg["BLOCK_K"] == 0,
                EPILOGUE=(EPI_F32 if split_grid else epilogue).value,
                num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    reduce = dict(common, numel=b * N, N_PARTS=parts, TREE_DEPTH=(parts - 1).bit_length(),
                  EPILOGUE=epilogue.value, BLOCK_N=_REDUCE_N, BLOCK_M=_REDUCE_M, num_warps=4)
    return GemmLaunch((triton.cdiv(N, cfg["BLOCK_N"]), triton.cdiv(b, cfg["BLOCK_M"]), parts),
                      gemm, parts,
                      (triton.cdiv(N, _REDUCE_N), triton.cdiv(b, _REDUCE_M)), reduce)


def launch(run: GemmLaunch, x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor,
           workspace: torch.Tensor | None) -> torch.Tensor:
    """``out`` = the epilogue of ``x @ weight.T`` for operands already checked against
    ``run``'s shape (``workspace``: FP32, at least ``run.parts * b * N`` elements where
    ``run.parts > 1``); returns ``out``."""
    out_view = out if out.dtype == torch.float32 else out.view(torch.int16)
    with quiet():
        if run.parts > 1:
            _front_kernel[run.grid](x_ptr=x, w_ptr=weight, dst_ptr=workspace,
                                    dst_stride=run.gemm["N"], **run.gemm)
            _front_reduce_kernel[run.reduce_grid](ws_ptr=workspace, out_ptr=out_view,
                                                  out_stride=out.stride(0), **run.reduce)
        else:
            _front_kernel[run.grid](x_ptr=x, w_ptr=weight, dst_ptr=out_view,
                                    dst_stride=out.stride(0), **run.gemm)
    return out


def _launch(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, epilogue, kernel: str,
            workspace, config, beta: float = 1.0, linear_beta: float | None = None):
    """``out`` = epilogue(x @ weight.T) for checked operands; see ``front_gemm``."""
    b, H = x.shape
    N = weight.shape[0]
    if b == 0 or N == 0:
        return out
    run = resolve(b, N, H, epilogue, kernel, x.device, config, beta, linear_beta)
    if run.parts > 1:
        workspace = _check_workspace(workspace, run.parts, b, N, x.device)
    return launch(run, x, weight, out, workspace)


def front_gemm(x: torch.Tensor, packed: torch.Tensor, *, out: torch.Tensor | None = None,
               workspace: torch.Tensor | None = None, config: dict | None = None) -> torch.Tensor:
    """``x @ packed.T`` for x BF16 [b, H] and packed BF16 [N, H]: FP32 [b, N], FP32
    accumulation, no rounding of the result.

    Deterministic (no atomics) and batch invariant: with a fixed config per shape a
    row's bits depend on nothing but that row of x (see the module docstring).
    ``out``: an FP32 [b, N] buffer to write. ``workspace``: an FP32 contiguous tensor of
    at least ``workspace_numel(b, N, H, config)`` elements for the split-K partials
    (default: a buffer per device, reused across calls; calls that may run concurrently,
    on other streams, must each pass their own). ``config``: launch parameters, missing
    keys from ``DEFAULT``, used as given: its BLOCK_K/SPLIT_K set the order, so keep them
    fixed across batch widths (default: the tuned table for this GPU, see
    ``launch_config``).
    """
    _check_operands(x, "packed", packed)
    b, N = x.shape[0], packed.shape[0]
    if out is None:
        out = torch.empty(b, N, dtype=torch.float32, device=x.device)
    check_tensor("out", out, torch.float32, (b, N), x.device)
    return _launch(x, packed, out, EPI_F32, KERNEL, workspace, config)


def linear(x: torch.Tensor, weight: torch.Tensor, *, out: torch.Tensor | None = None,
           accumulate: bool = False, kernel: str = "linear",
           workspace: torch.Tensor | None = None, config: dict | None = None) -> torch.Tensor:
    """A BF16 linear on the front GEMM: BF16 [b, N] = ``bf16(x @ weight.T)`` for x BF16
    [b, H] and weight BF16 [N, H], FP32 accumulation and one rounding to nearest even
    (``F.linear``'s contract), batch invariant as ``front_gemm``.

    ``accumulate``: ``out = bf16(fp32(out) + x @ weight.T)`` in place, one rounding
    (``out.addmm_(x, weight.t())``'s contract); ``out`` is then required. ``out``: a
    BF16 [b, N] buffer whose rows may be strided (e.g. a column slice of a wider tensor).
    ``kernel``: the tuning table's name for this linear (each caller its own, so each
    shape gets its own config and reduction keys). ``workspace``, ``config``: as in
    ``front_gemm``."""
    _check_operands(x, "weight", weight)
    b, N = x.shape[0], weight.shape[0]
    if out is None:
        if accumulate:
            raise ValueError("out must be given when accumulate is True (it is added to)")
        out = torch.empty(b, N, dtype=torch.bfloat16, device=x.device)
    _check_out(out, torch.bfloat16, b, N, x.device)
    return _launch(x, weight, out, EPI_ADD_BF16 if accumulate else EPI_BF16, kernel,
                   workspace, config)


def _check_situ_params(beta, linear_beta) -> None:
    def positive(name, v):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not (
                math.isfinite(v) and v > 0):
            raise ValueError(f"{name} must be a finite number > 0, got {v!r}")

    positive("beta", beta)
    if linear_beta is not None:
        positive("linear_beta", linear_beta)


def linear_situ(x: torch.Tensor, gate_up: torch.Tensor, beta: float,
                linear_beta: float | None, *, out: torch.Tensor | None = None,
                kernel: str = "linear_situ", workspace: torch.Tensor | None = None,
                config: dict | None = None) -> torch.Tensor:
    """A BF16 gate/up linear and SiTU in one pass: BF16 [b, N/2] = ``bf16(situ(g, u))``
    with ``g = bf16(x @ gate_up[0::2].T)`` and ``u = bf16(x @ gate_up[1::2].T)`` (FP32
    accumulation, each rounded once, as two BF16 linears' outputs), SiTU in FP32
    (``reference.situ``) rounded once. Batch invariant as ``front_gemm``.

    ``gate_up``: BF16 [N, H], N even, rows interleaved (row 2j gate j, row 2j+1 up j;
    ``shared.interleave_gate_up`` makes it from the stock [gate rows; up rows]).
    ``beta``, ``linear_beta``: SiTU's parameters (linear_beta None: no clamp of u).
    ``out``: a BF16 [b, N/2] buffer (rows may be strided). ``kernel``, ``workspace``,
    ``config``: as in ``linear``."""
    _check_operands(x, "gate_up", gate_up)
    b, N = x.shape[0], gate_up.shape[0]
    if N % 2:
        raise ValueError(f"gate_up must have an even number of rows (gate/up pairs), got {N}")
    _check_situ_params(beta, linear_beta)
    if out is None:
        out = torch.empty(b, N // 2, dtype=torch.bfloat16, device=x.device)
    _check_out(out, torch.bfloat16, b, N // 2, x.device)
    return _launch(x, gate_up, out, EPI_SITU, kernel, workspace, config, beta, linear_beta)


def pack_front(gate_weight: torch.Tensor, latent_down: torch.Tensor, rank: int,
               world: int) -> torch.Tensor:
    """Rank ``rank`` of ``world``'s front weights, BF16 [E/T + L/T, H]: its router rows
    ``gate_weight[r*E/T:(r+1)*E/T]`` then its latent-down rows
    ``latent_down[r*L/T:(r+1)*L/T]`` (``LatentMoE.gate_weight`` [E, H] and
    ``LatentMoE.latent_down`` [L, H])."""
    check_tensor("gate_weight", gate_weight, torch.bfloat16, (None, None), contiguous=False)
    E, H = gate_weight.shape
    check_tensor("latent_down", latent_down, torch.bfloat16, (None, H), gate_weight.device,
                 contiguous=False)
    L = latent_down.shape[0]
    if not isinstance(world, int) or isinstance(world, bool) or world < 1:
        raise ValueError(f"world must be a positive int, got {world!r}")
    if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < world:
        raise ValueError(f"rank must be an int in [0, {world}), got {rank!r}")
    if E % world:
        raise ValueError(f"gate_weight's rows ({E}) must be a multiple of world ({world})")
    if L % world:
        raise ValueError(f"latent_down's rows ({L}) must be a multiple of world ({world})")
    e, l = E // world, L // world
    return torch.cat([gate_weight[rank * e:(rank + 1) * e],
                      latent_down[rank * l:(rank + 1) * l]])
