"""The tail: the RMSNorm of the fully reduced latent, ``bf16(x * rsqrt(mean(x^2) + eps) *
w)``, and the latent up-projection added into the shared partial (``add_up_projection``,
a front GEMM with an accumulating epilogue, see kernels/front.py); across T ranks, the
two all-reduces over the tail rows of the mailbox (kernels/mailbox.py).

The all-reduces are one-shot and fixed-order: every rank publishes its BF16 partial
into its slot of every rank's tail rows (``mailbox.publish_partial``), then each rank
polls its own T slots, sums them in FP32 in rank order 0..T-1, rounds once to BF16 and
re-arms the slots (``all_reduce_rms_norm`` fused with the RMSNorm for the latent,
``all_reduce`` for the hidden rows). Every rank adds the same values in the same order,
so every rank holds the same bits, whatever the batch width. The sum starts from +0, so
an element whose partials are all -0 (published as +0) sums to +0.

The RMSNorm is computed in FP32 with one rounding, in the stock path's order: the mean
is the FP32 sum of squares divided by L, the inverse root is ``1 / sqrt`` with both
steps correctly rounded (as torch's CPU ``rsqrt`` is; not the hardware's approximate
``rsqrt``), and the product is ``(x * inv) * w``. Only the order of the sum of squares
differs from ``reference.rms_norm``. One program normalizes whole rows: a row (3584
columns in production) fits in registers, so x is read from memory once. The order of
the sum of squares follows the launch's layout (rows a program, warps), so the norm runs
with one config per L, whatever the batch width: a row's bits do not depend on its batch.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ..checks import check_tensor
from ..tuning import config_for
from . import front, quiet
from . import mailbox as mb
from .bits import bf16_bits_to_f32, f32_to_bf16_bits, round_to_bf16

KERNEL = "rms_norm"
KERNEL_UP = "latent_up"  # the up-projection's tuning name (a front GEMM, see front.py)
DEFAULT = {"BLOCK_T": 1, "num_warps": 4}
# No more rows than warps: at L = 3584 (4096 lanes) fewer warps spill the row tile.
SPACE = [{"BLOCK_T": t, "num_warps": w} for t in (1, 2, 4) for w in (2, 4, 8, 16) if t <= w]
MAX_COLUMNS = 1 << 14  # a whole row lives in one program's registers
KERNEL_REDUCE = "tail_all_reduce"  # the hidden rows' all-reduce
REDUCE_DEFAULT = {"BLOCK_T": 4, "BLOCK_C": 1024, "num_warps": 4}
REDUCE_SPACE = [{"BLOCK_T": t, "BLOCK_C": c, "num_warps": w}
                for t in (1, 2, 4) for c in (512, 1024, 2048) for w in (4, 8) if t * c <= 4096]


def shape_key(L: int) -> str:
    return f"L{L}"


@triton.jit
def _normalized(x, w_ptr, c, c_ok, L, eps):
    """FP32 rows ``x`` [BLOCK_T, BLOCK_L] (columns ``c``, valid where ``c_ok``) times
    ``rsqrt(mean(x^2) + eps)`` and the weight: FP32, before the output's rounding."""
    w = bf16_bits_to_f32(tl.load(w_ptr + c, mask=c_ok, other=0))
    # Triton's `/` is div.full (2 ulp): correctly rounded steps need div_rn/sqrt_rn.
    sum_sq = tl.sum(x * x, axis=1)
    mean = tl.math.div_rn(sum_sq, tl.zeros_like(sum_sq) + L)
    inv = tl.math.div_rn(tl.zeros_like(mean) + 1.0, tl.math.sqrt_rn(mean + eps))
    return (x * inv[:, None]) * w[None, :]


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, b, L, eps, BLOCK_T: tl.constexpr,
                     BLOCK_L: tl.constexpr):
    """Rows [pid*BLOCK_T, (pid+1)*BLOCK_T) of x (BF16 bits) normalized, as BF16 bits."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    c = tl.arange(0, BLOCK_L)
    c_ok = c < L
    mask = (t < b)[:, None] & c_ok[None, :]
    offs = t[:, None].to(tl.int64) * L + c[None, :]
    x = bf16_bits_to_f32(tl.load(x_ptr + offs, mask=mask, other=0))
    tl.store(out_ptr + offs, f32_to_bf16_bits(_normalized(x, w_ptr, c, c_ok, L, eps)),
             mask=mask)


@triton.jit
def _sum_slots(tail_ptr, t, c, mask, row_stride, slot_stride, column, world, spin_limit,
               timeout_ns, error_ptr, PLACE: tl.constexpr):
    """FP32 sum, in rank order, of the T slots' BF16 values at rows ``t`` [BLOCK_T, 1] and
    columns ``column + c`` [1, BLOCK_C] of a tail buffer (where ``mask``), each slot
    polled until published and re-armed behind it (``mailbox.take``; a timeout records
    the slot's rank at ``PLACE``)."""
    at = tail_ptr + t.to(tl.int64) * row_stride + (column + c)
    owner = tl.zeros_like(mask.to(tl.int32))
    total = tl.zeros(mask.shape, tl.float32)
    for s in range(world):
        bits = mb.take(at + s * slot_stride, mask, owner + s, 1, spin_limit, timeout_ns,
                       error_ptr, PLACE, mb.EMPTY_HALF)
        # +0 + v == v for every published v (never -0): the one rounding is the output's.
        total += bf16_bits_to_f32(bits)
    return total


@triton.jit
def _all_reduce_rms_norm_kernel(tail_ptr, row_stride, slot_stride, world, spin_limit,
                                timeout_ns, error_ptr, w_ptr, out_ptr, b, L, eps,
                                PLACE: tl.constexpr, BLOCK_T: tl.constexpr,
                                BLOCK_L: tl.constexpr):
    """Rows [pid*BLOCK_T, (pid+1)*BLOCK_T): the latent slots summed, rounded once to BF16,
    then normalized as ``_rms_norm_kernel`` does, as BF16 bits."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    c = tl.arange(0, BLOCK_L)
    c_ok = c < L
    mask = (t < b)[:, None] & c_ok[None, :]
    latent = round_to_bf16(_sum_slots(tail_ptr, t[:, None], c[None, :], mask, row_stride,
                                      slot_stride, 0, world, spin_limit, timeout_ns,
                                      error_ptr, PLACE))
    y = _normalized(latent, w_ptr, c, c_ok, L, eps)
    tl.store(out_ptr + t[:, None].to(tl.int64) * L + c[None, :], f32_to_bf16_bits(y), mask=mask)


@triton.jit
def _all_reduce_kernel(tail_ptr, row_stride, slot_stride, column, world, spin_limit,
                       timeout_ns, error_ptr, out_ptr, out_stride, b, N, PLACE: tl.constexpr,
                       BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    """A [BLOCK_T, BLOCK_C] tile of the hidden slots summed and rounded once, BF16 bits."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (t < b)[:, None] & (c < N)[None, :]
    total = _sum_slots(tail_ptr, t[:, None], c[None, :], mask, row_stride, slot_stride, column,
                       world, spin_limit, timeout_ns, error_ptr, PLACE)
    tl.store(out_ptr + t[:, None].to(tl.int64) * out_stride + c[None, :],
             f32_to_bf16_bits(total), mask=mask)


def _check_config(cfg: dict) -> None:
    for name in ("BLOCK_T", "num_warps"):
        v = cfg.get(name)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1 or v & (v - 1):
            raise ValueError(f"rms_norm config {name} must be a power of two, got {v!r}")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *,
             out: torch.Tensor | None = None, config: dict | None = None) -> torch.Tensor:
    """``bf16(x * rsqrt(mean(x^2) + eps) * weight)`` per row, in FP32, one rounding
    (round to nearest even): BF16 [b, L].

    ``x``: BF16 [b, L]. ``weight``: BF16 [L]. ``eps``: a finite number >= 0 (a zero row
    gives zeros when eps > 0). ``out``: a BF16 [b, L] buffer to write (may be ``x``
    itself: each program reads its rows whole before writing them). ``config``: launch
    parameters, missing keys from ``DEFAULT`` (default: ``norm_config``, one config for
    every batch width).
    """
    check_tensor("x", x, torch.bfloat16, ("b", "L"))
    b, L = x.shape
    _check_norm_args(L, weight, eps, x.device)
    if out is None:
        out = torch.empty(b, L, dtype=torch.bfloat16, device=x.device)
    check_tensor("out", out, torch.bfloat16, (b, L), x.device)
    if b == 0:
        return out
    return launch_norm(resolve_norm(b, L, eps, x.device, config), x, weight, out)


def resolve_norm(b: int, L: int, eps: float, device, config: dict | None = None) -> tuple:
    """(grid, arguments but the tensors) of ``rms_norm`` at b >= 1 rows of L columns
    (``norm_config``'s config)."""
    cfg = norm_config(L, device, config)
    return ((triton.cdiv(b, cfg["BLOCK_T"]),),
            dict(b=b, L=L, eps=float(eps), BLOCK_T=cfg["BLOCK_T"],
                 BLOCK_L=triton.next_power_of_2(L), num_warps=cfg["num_warps"]))


def launch_norm(run: tuple, x: torch.Tensor, weight: torch.Tensor,
                out: torch.Tensor) -> torch.Tensor:
    """``rms_norm`` of checked arguments with a resolved launch (``resolve_norm``)."""
    grid, args = run
    with quiet():
        _rms_norm_kernel[grid](x_ptr=x.view(torch.int16), w_ptr=weight.view(torch.int16),
                               out_ptr=out.view(torch.int16), **args)
    return out


def resolve_up(b: int, N: int, L: int, device) -> front.GemmLaunch:
    """The tuned launch of ``add_up_projection`` at b >= 1 rows, N output columns."""
    return front.resolve(b, N, L, front.EPI_ADD_BF16, KERNEL_UP, device)


def norm_config(L: int, device, config: dict | None = None) -> dict:
    """The launch config of the RMSNorm at L columns, with or without the all-reduce:
    ``config`` over ``DEFAULT``, else the tuned table's narrowest bucket for every batch
    width (its layout fixes the order of the sum of squares)."""
    cfg = config_for(KERNEL, shape_key(L), 1, DEFAULT, device, given=config)
    _check_config(cfg)
    return cfg


def _check_norm_args(L: int, weight, eps, device) -> None:
    if not 1 <= L <= MAX_COLUMNS:
        raise ValueError(f"x must have between 1 and {MAX_COLUMNS} columns, got {L}")
    check_tensor("weight", weight, torch.bfloat16, (L,), device)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not (
            math.isfinite(eps) and eps >= 0):
        raise ValueError(f"eps must be a finite number >= 0, got {eps!r}")


def _check_tail_poll(tail, dims: mb.TailDims, rows, error, spin_limit) -> None:
    mb.check_tail("tail", tail, dims)
    if not isinstance(rows, int) or isinstance(rows, bool) or not 0 <= rows <= dims.wide_rows:
        raise ValueError(f"rows must be an int in [0, wide_rows={dims.wide_rows}], "
                         f"got {rows!r}")
    if not isinstance(spin_limit, int) or isinstance(spin_limit, bool) or spin_limit < 1:
        raise ValueError(f"spin_limit must be a positive int, got {spin_limit!r}")
    check_tensor("error", error, torch.int32, (2,), tail.device)


def all_reduce_rms_norm(tail: torch.Tensor, dims: mb.TailDims, rows: int,
                        weight: torch.Tensor, eps: float, *, out: torch.Tensor,
                        error: torch.Tensor, spin_limit: int = mb.DEFAULT_SPIN_LIMIT,
                        poll_timeout: float | None = None,
                        config: dict | None = None) -> torch.Tensor:
    """``rms_norm(bf16(Σ_s fp32(latent_s)), weight, eps)`` for rows 0..rows-1 of this
    rank's ``tail`` buffer (int16 [wide_rows, T, L + H] of ``dims``): the T published
    latent partials summed in FP32 in rank order, rounded once, normalized with the bits
    of ``rms_norm``; one launch. Each slot is polled until published (at most
    ``spin_limit`` rounds or ``poll_timeout`` seconds a slot, ``mailbox.poll``; on a
    timeout the missing ranks go to ``error``, int32 [2], and the sum proceeds on what
    was read) and re-armed. ``out``: BF16 [rows, L]
    (may be the latent partial that was published). ``config``: as ``rms_norm``'s."""
    _check_tail_poll(tail, dims, rows, error, spin_limit)
    timeout_ns = mb.poll_timeout_ns(poll_timeout)
    L = dims.latent
    _check_norm_args(L, weight, eps, tail.device)
    check_tensor("out", out, torch.bfloat16, (rows, L), tail.device)
    if rows == 0:
        return out
    cfg = norm_config(L, tail.device, config)
    with quiet():
        _all_reduce_rms_norm_kernel[(triton.cdiv(rows, cfg["BLOCK_T"]),)](
            tail, dims.world * dims.columns, dims.columns, dims.world, spin_limit, timeout_ns,
            error, weight.view(torch.int16), out.view(torch.int16), rows, L, float(eps),
            PLACE=mb.TAIL_LATENT, BLOCK_T=cfg["BLOCK_T"], BLOCK_L=triton.next_power_of_2(L),
            num_warps=cfg["num_warps"])
    return out


def all_reduce(tail: torch.Tensor, dims: mb.TailDims, rows: int, *, out: torch.Tensor,
               error: torch.Tensor, spin_limit: int = mb.DEFAULT_SPIN_LIMIT,
               poll_timeout: float | None = None,
               config: dict | None = None) -> torch.Tensor:
    """``bf16(Σ_s fp32(hidden_s))`` for rows 0..rows-1 of this rank's ``tail`` buffer: the
    T published hidden partials summed in FP32 in rank order and rounded once, into
    ``out`` (BF16 [rows, H], rows may be strided; may be the partial that was published).
    Polls, re-arming and ``error`` as ``all_reduce_rms_norm``. ``config``: BLOCK_T,
    BLOCK_C, num_warps (default: the tuned table, kernel ``tail_all_reduce``; any config
    gives the same bits)."""
    _check_tail_poll(tail, dims, rows, error, spin_limit)
    timeout_ns = mb.poll_timeout_ns(poll_timeout)
    H = dims.hidden
    check_tensor("out", out, torch.bfloat16, (rows, H), tail.device, contiguous=False)
    if out.stride(1) != 1:
        raise ValueError("out must have contiguous rows (stride 1 along its last dim)")
    if rows == 0:
        return out
    cfg = config_for(KERNEL_REDUCE, f"H{H}_T{dims.world}", rows, REDUCE_DEFAULT, tail.device,
                     given=config)
    grid = (triton.cdiv(rows, cfg["BLOCK_T"]), triton.cdiv(H, cfg["BLOCK_C"]))
    with quiet():
        _all_reduce_kernel[grid](
            tail, dims.world * dims.columns, dims.columns, dims.latent, dims.world, spin_limit,
            timeout_ns, error, out.view(torch.int16), out.stride(0), rows, H, PLACE=mb.TAIL_HIDDEN,
            BLOCK_T=cfg["BLOCK_T"], BLOCK_C=cfg["BLOCK_C"], num_warps=cfg["num_warps"])
    return out


def add_up_projection(normed: torch.Tensor, latent_up: torch.Tensor, shared: torch.Tensor, *,
                      workspace: torch.Tensor | None = None,
                      config: dict | None = None) -> torch.Tensor:
    """``shared = bf16(fp32(shared) + normed @ latent_up.T)`` in place: FP32 accumulation,
    one rounding, the stock tail's contract; returns ``shared``.

    On the front GEMM (``front.linear``, tuning kernel ``latent_up``), not a BLAS
    ``addmm_``: its reduction order is fixed per shape, so a row's bits do not depend on
    the batch. ``normed``: BF16 [b, L]. ``latent_up``: BF16 [N, L], this rank's rows of
    the up-projection. ``shared``: BF16 [b, N], rows may be strided (this rank's columns
    of the shared partial [b, H]). ``workspace``, ``config``: as in ``front.front_gemm``."""
    check_tensor("normed", normed, torch.bfloat16, ("b", "L"))
    check_tensor("latent_up", latent_up, torch.bfloat16, ("N", normed.shape[1]),
                 normed.device)
    check_tensor("shared", shared, torch.bfloat16, (normed.shape[0], latent_up.shape[0]),
                 normed.device, contiguous=False)
    return front.linear(normed, latent_up, out=shared, accumulate=True, kernel=KERNEL_UP,
                        workspace=workspace, config=config)
