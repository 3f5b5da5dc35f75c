"""The front GEMM: router logits and the latent-down projection in one pass over x.

``front = x @ packed.T`` with ``packed = [router rows E/T of rank r ; latent-down rows
L/T of rank r]`` (``pack_front``), BF16 operands, FP32 accumulation, FP32 output. The
latent columns are rounded to BF16 by the stage that publishes them, not here.

Reduction order and batch invariance. The K dimension (H) is cut into blocks of
``BLOCK_K`` and the blocks into ``SPLIT_K`` consecutive segments. Each segment is
accumulated from zero by the tensor cores, block after block; the segment sums are
then added in FP32, segment 0 first. That order is all a row's result depends on, and
it is fixed per shape (``shape_key``), never per batch width: the launch wrapper takes
``BLOCK_K``/``SPLIT_K`` from the smallest batch bucket's config whatever ``b`` is. What
may vary per bucket changes no bit:

- ``BLOCK_M`` (batch rows a program) and ``BLOCK_N`` (packed rows a program): an
  output element only ever sees its own row of x and its own row of packed;
- ``SPLIT_GRID``: 1 runs each segment in its own program (partials to an FP32
  workspace, then a fixed-order reduction kernel), 0 runs all segments in one program
  (same additions in the same order, no workspace): split-K for small batches, whose
  few output tiles would leave most SMs idle while the weights stream, none for wide
  ones;
- ``num_warps`` (4 or 8: one or two warpgroups, always wgmma) and ``num_stages``.

The MMA is ``packed_tile @ x_tile.T`` (swap-AB): the weight rows fill the 64-row
wgmma M dimension and the batch is its N, so a batch of 1 still runs wgmma with a
16-wide tile instead of a 64-row tile that is mostly padding, and the instruction
(and with it every product's accumulation) is the same at every batch width.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ..checks import check_tensor
from ..tuning import config_for
from .bits import bf16_bits_to_f32

KERNEL = "front"
# The base of every config; ``default_config`` sizes SPLIT_K, BLOCK_M and SPLIT_GRID.
DEFAULT = {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 128, "SPLIT_K": 1, "SPLIT_GRID": 0,
           "num_warps": 4, "num_stages": 4}
# Keys that set the reduction order: per shape only (see the module docstring).
REDUCTION_KEYS = ("BLOCK_K", "SPLIT_K")
_SMEM_BUDGET = 200 * 1024  # pipeline bytes a candidate may take (H200: 227 KB a block)
SPACE = [
    {"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k, "SPLIT_K": s, "SPLIT_GRID": g,
     "num_warps": w, "num_stages": st}
    for m in (16, 32, 64, 128) for n in (64, 128) for k in (64, 128)
    for s in (1, 2, 4, 7, 8, 14, 28) for g in (0, 1) for w in (4, 8) for st in (3, 4, 5)
    if (g == 0 or s > 1) and st * (m + n) * k * 2 <= _SMEM_BUDGET
    # Two FP32 accumulators (segment and total) of m*n/(32*w) registers a thread each
    # must leave room for the rest under 255, or the kernel spills.
    and m * n // (32 * w) <= 64
]
_SM_COUNT = 132  # H200; only the untuned defaults below use it
_REDUCE_BLOCK = 1024


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


@triton.jit(do_not_specialize=["num_blocks", "blocks_per_split"])
def _front_kernel(x_ptr, w_ptr, dst_ptr, b, N, H, num_blocks, blocks_per_split,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  SPLIT_GRID: tl.constexpr, ONE_SEGMENT: tl.constexpr, EVEN_K: tl.constexpr,
                  INTERPRET: tl.constexpr):
    """dst[(s,) m, n] = sum over the K blocks of this program's segments of
    x[m] . packed[n], as FP32; one program per (N tile, M tile[, segment]).
    ONE_SEGMENT: the program sums a single segment (SPLIT_GRID, or SPLIT_K = 1)."""
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
        k_lo = tl.program_id(2) * blocks_per_split
        k_hi = tl.minimum(k_lo + blocks_per_split, num_blocks)
        dst_ptr += tl.program_id(2).to(tl.int64) * b * N
    else:
        k_lo = 0
        k_hi = num_blocks
    w_ptrs = w_ptr + rows_n[:, None] * H + (k_lo * BLOCK_K + offs_k)[None, :]
    x_ptrs = x_ptr + rows_m[:, None] * H + (k_lo * BLOCK_K + offs_k)[None, :]

    # -0 + s == s for every s, so starting the total at -0 makes it bitwise the first
    # segment's sum, as the split-grid reduction (which starts from partial 0) has it.
    # A single segment needs no total: acc is it, and the registers go to the tiles.
    total = tl.full((BLOCK_N, BLOCK_M), -0.0, tl.float32)
    acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
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
        if not ONE_SEGMENT:
            # A segment ends at every multiple of blocks_per_split and at the last block.
            if ((kb + 1) % blocks_per_split == 0) | (kb + 1 == num_blocks):
                total += acc
                acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
    if ONE_SEGMENT:
        total = acc

    out_ptrs = dst_ptr + offs_m[None, :].to(tl.int64) * N + offs_n[:, None]
    tl.store(out_ptrs, total, mask=(offs_n[:, None] < N) & (offs_m[None, :] < b))


@triton.jit
def _front_reduce_kernel(ws_ptr, out_ptr, numel, N_SPLITS: tl.constexpr, BLOCK: tl.constexpr):
    """out = ws[0] + ws[1] + ... + ws[N_SPLITS - 1], left to right, in FP32."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    # Every partial is loaded before the first add: N_SPLITS loads in flight, not one.
    parts = ()
    ptrs = ws_ptr + offs
    for s in tl.static_range(N_SPLITS):
        parts = parts + (tl.load(ptrs, mask=mask),)
        ptrs += numel
    total = parts[0]
    for s in tl.static_range(1, N_SPLITS):
        total += parts[s]
    tl.store(out_ptr + offs, total, mask=mask)


# ----------------------------------------------------------------------------- configs

def _split_plan(H: int, cfg: dict) -> tuple[int, int, int]:
    """(K blocks, blocks a segment, segments): no segment is empty, so both SPLIT_GRID
    modes add exactly the same partial sums."""
    num_blocks = triton.cdiv(H, cfg["BLOCK_K"])
    per_split = triton.cdiv(num_blocks, min(cfg["SPLIT_K"], num_blocks))
    return num_blocks, per_split, triton.cdiv(num_blocks, per_split)


def default_config(N: int, H: int, b: int) -> dict:
    """The untuned config (a tuned table replaces it): the split count from the shape
    alone (about 1.5 programs per SM over the N tiles, segments of at least 4 K
    blocks), the batch tile from ``b``, and split-K programs only where the tiles alone
    leave most SMs idle, or some idle while the weights' read dominates (b <= 64)."""
    cfg = dict(DEFAULT)
    n_tiles = triton.cdiv(N, cfg["BLOCK_N"])
    num_blocks = triton.cdiv(H, cfg["BLOCK_K"])
    cfg["SPLIT_K"] = max(1, min(num_blocks // 4, (3 * _SM_COUNT) // (2 * n_tiles)))
    cfg["BLOCK_M"] = min(64, max(16, triton.next_power_of_2(max(b, 1))))
    tiles = n_tiles * triton.cdiv(max(b, 1), cfg["BLOCK_M"])
    idle = 2 * tiles <= _SM_COUNT or (tiles < _SM_COUNT and b <= 64)
    cfg["SPLIT_GRID"] = int(cfg["SPLIT_K"] > 1 and idle)
    return cfg


def launch_config(N: int, H: int, b: int, device=None) -> dict:
    """The tuned config for a batch of ``b``, its reduction keys taken from the smallest
    bucket's entry, so a row's bits never depend on the batch it came in."""
    key = shape_key(N, H)
    cfg = config_for(KERNEL, key, b, default_config(N, H, b), device)
    order = config_for(KERNEL, key, 1, default_config(N, H, 1), device)
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
    if not isinstance(cfg.get("num_stages"), int) or cfg["num_stages"] < 1:
        raise ValueError(f"front config num_stages must be a positive int, got "
                         f"{cfg.get('num_stages')!r}")


# ----------------------------------------------------------------------------- workspace

_workspaces: dict = {}


def workspace_numel(b: int, N: int, H: int, config: dict) -> int:
    """FP32 elements of workspace one call of ``front_gemm`` with ``config`` needs (0
    when it runs without split-K programs)."""
    cfg = {**DEFAULT, **config}
    _, _, splits = _split_plan(H, cfg)
    return splits * b * N if cfg["SPLIT_GRID"] and splits > 1 else 0


def max_workspace_numel(rows: int, N: int, H: int, device=None) -> int:
    """FP32 elements of a workspace that serves every call of up to ``rows`` rows with
    the tuned configs: the split count is fixed per shape, so it is splits * rows * N
    (0 when the shape never splits K)."""
    _, _, splits = _split_plan(H, launch_config(N, H, 1, device))
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


def front_gemm(x: torch.Tensor, packed: torch.Tensor, *, out: torch.Tensor | None = None,
               workspace: torch.Tensor | None = None, config: dict | None = None) -> torch.Tensor:
    """``x @ packed.T`` for x BF16 [b, H] and packed BF16 [N, H]: FP32 [b, N], FP32
    accumulation, no rounding of the result.

    Deterministic (no atomics) and batch invariant: with a fixed config per shape a
    row's bits depend on nothing but that row of x (see the module docstring).
    ``out``: an FP32 [b, N] buffer to write. ``workspace``: an FP32 contiguous tensor of
    at least ``workspace_numel(b, N, H, config)`` elements for the split-K partials
    (default: a buffer per device, reused across calls). ``config``: launch parameters,
    missing keys from ``DEFAULT``, used as given: its BLOCK_K/SPLIT_K set the order, so
    keep them fixed across batch widths (default: the tuned table for this GPU, see
    ``launch_config``).
    """
    check_tensor("x", x, torch.bfloat16, (None, None))
    b, H = x.shape
    if H == 0:
        raise ValueError("x must have at least one column (H >= 1)")
    check_tensor("packed", packed, torch.bfloat16, (None, H), x.device)
    N = packed.shape[0]
    if out is None:
        out = torch.empty(b, N, dtype=torch.float32, device=x.device)
    check_tensor("out", out, torch.float32, (b, N), x.device)
    if b == 0 or N == 0:
        return out
    cfg = {**DEFAULT, **config} if config is not None else launch_config(N, H, b, x.device)
    _check_config(cfg)
    num_blocks, per_split, splits = _split_plan(H, cfg)
    split_grid = bool(cfg["SPLIT_GRID"]) and splits > 1
    if split_grid:
        need = splits * b * N
        if workspace is None:
            workspace = _shared_workspace(need, x.device)
        check_tensor("workspace", workspace, torch.float32, None, x.device)
        if workspace.numel() < need:
            raise ValueError(f"workspace must hold at least {need} FP32 elements "
                             f"({splits} splits x {b} x {N}), got {workspace.numel()}")
    grid = (triton.cdiv(N, cfg["BLOCK_N"]), triton.cdiv(b, cfg["BLOCK_M"]),
            splits if split_grid else 1)
    _front_kernel[grid](
        x, packed, workspace if split_grid else out, b, N, H, num_blocks, per_split,
        BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"],
        SPLIT_GRID=split_grid, ONE_SEGMENT=split_grid or splits == 1,
        EVEN_K=H % cfg["BLOCK_K"] == 0, INTERPRET=_interpreting(),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    if split_grid:
        _front_reduce_kernel[(triton.cdiv(b * N, _REDUCE_BLOCK),)](
            workspace, out, b * N, N_SPLITS=splits, BLOCK=_REDUCE_BLOCK, num_warps=4)
    return out


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
