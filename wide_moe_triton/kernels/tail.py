"""The tail: the RMSNorm of the fully reduced latent, ``bf16(x * rsqrt(mean(x^2) + eps) *
w)``, and the latent up-projection added into the shared partial (``add_up_projection``,
a front GEMM with an accumulating epilogue, see kernels/front.py).

The RMSNorm is computed in FP32 with one rounding, in the stock path's order: the mean
is the FP32 sum of squares divided by L, the inverse root is ``1 / sqrt`` with both
steps correctly rounded (as torch's CPU ``rsqrt`` is; not the hardware's approximate
``rsqrt``), and the product is ``(x * inv) * w``. Only the order of the sum of squares
differs from ``reference.rms_norm``. One program normalizes whole rows: a row (3584
columns in production) fits in registers, so x is read from memory once.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ..checks import check_tensor
from ..tuning import config_for
from . import front
from .bits import bf16_bits_to_f32, f32_to_bf16_bits

KERNEL = "rms_norm"
KERNEL_UP = "latent_up"  # the up-projection's tuning name (a front GEMM, see front.py)
DEFAULT = {"BLOCK_T": 1, "num_warps": 4}
# No more rows than warps: at L = 3584 (4096 lanes) fewer warps spill the row tile.
SPACE = [{"BLOCK_T": t, "num_warps": w} for t in (1, 2, 4) for w in (2, 4, 8, 16) if t <= w]
MAX_COLUMNS = 1 << 14  # a whole row lives in one program's registers


def shape_key(L: int) -> str:
    return f"L{L}"


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
    w = bf16_bits_to_f32(tl.load(w_ptr + c, mask=c_ok, other=0))
    # Triton's `/` is div.full (2 ulp): correctly rounded steps need div_rn/sqrt_rn.
    sum_sq = tl.sum(x * x, axis=1)
    mean = tl.math.div_rn(sum_sq, tl.zeros_like(sum_sq) + L)
    inv = tl.math.div_rn(tl.zeros_like(mean) + 1.0, tl.math.sqrt_rn(mean + eps))
    y = (x * inv[:, None]) * w[None, :]
    tl.store(out_ptr + offs, f32_to_bf16_bits(y), mask=mask)


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
    parameters, missing keys from ``DEFAULT`` (default: the tuned table for this GPU).
    """
    check_tensor("x", x, torch.bfloat16, (None, None))
    b, L = x.shape
    if not 1 <= L <= MAX_COLUMNS:
        raise ValueError(f"x must have between 1 and {MAX_COLUMNS} columns, got {L}")
    check_tensor("weight", weight, torch.bfloat16, (L,), x.device)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not (
            math.isfinite(eps) and eps >= 0):
        raise ValueError(f"eps must be a finite number >= 0, got {eps!r}")
    if out is None:
        out = torch.empty(b, L, dtype=torch.bfloat16, device=x.device)
    check_tensor("out", out, torch.bfloat16, (b, L), x.device)
    if b == 0:
        return out
    cfg = {**DEFAULT, **config} if config is not None else config_for(
        KERNEL, shape_key(L), b, DEFAULT, x.device)
    _check_config(cfg)
    _rms_norm_kernel[(triton.cdiv(b, cfg["BLOCK_T"]),)](
        x.view(torch.int16), weight.view(torch.int16), out.view(torch.int16), b, L,
        float(eps), BLOCK_T=cfg["BLOCK_T"], BLOCK_L=triton.next_power_of_2(L),
        num_warps=cfg["num_warps"])
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
    check_tensor("normed", normed, torch.bfloat16, (None, None))
    check_tensor("latent_up", latent_up, torch.bfloat16, (None, normed.shape[1]), normed.device)
    check_tensor("shared", shared, torch.bfloat16, (normed.shape[0], latent_up.shape[0]),
                 normed.device, contiguous=False)
    return front.linear(normed, latent_up, out=shared, accumulate=True, kernel=KERNEL_UP,
                        workspace=workspace, config=config)
