"""The one torch reference for the OCP Microscaling (MX v1.0) formats used here.

MXFP8 (E4M3 elements) and MXFP4 (E2M1 elements), blocks of 32 along the last dimension,
one E8M0 scale byte per block (value 2**(byte - 127)). Every Triton kernel that
quantizes matches ``quantize_mxfp8`` bit for bit; the tests hold them to it.

Scale of a block (OCP MX v1.0 §6.3, torchao's FLOOR mode): ``floor(log2(amax)) - emax``
with ``emax`` 8 for E4M3 and 2 for E2M1, clamped to [-127, 127]. Elements are multiplied
by 2**-scale (exact: a power of two), clamped to the element format's ±max (448, 6), and
rounded to nearest, ties to even.

Special values, the policy every kernel follows:
- an all-zero block (±0 only) gets scale byte 0 (2**-127) and zero elements;
- a block holding a NaN or ±Inf gets scale byte 0xFF (E8M0's NaN) and every element
  NaN-coded (0x7F for E4M3; E2M1 has no NaN, so 0x7 / max), so it dequantizes to NaN;
- a negative zero element stays negative zero (sign kept, as a conversion does).
"""

from __future__ import annotations

import torch

from .config import MX_BLOCK

E4M3_MAX = 448.0
E2M1_MAX = 6.0
E4M3_EMAX = 8
E2M1_EMAX = 2
SCALE_NAN = 0xFF
E4M3_NAN = 0x7F

# E2M1 code -> value, codes 0..15 (bit 3 is the sign).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
               -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def _blocks(x: torch.Tensor) -> torch.Tensor:
    if x.shape[-1] % MX_BLOCK:
        raise ValueError(f"last dimension ({x.shape[-1]}) must be a multiple of {MX_BLOCK}")
    return x.float().reshape(*x.shape[:-1], x.shape[-1] // MX_BLOCK, MX_BLOCK)


def block_exponents(blocks: torch.Tensor, emax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale exponent int32 [..., n/32], finite-block mask) of FP32 blocks [..., n/32, 32].

    floor(log2(amax)) is read off amax's FP32 exponent field, so it is exact; a
    subnormal or zero amax reads -127 and lands on the lower clamp."""
    amax = blocks.abs().amax(dim=-1)
    finite = torch.isfinite(amax)
    biased = (amax.view(torch.int32) >> 23) & 0xFF
    exponent = torch.clamp(biased - 127 - emax, -127, 127)
    exponent = torch.where(amax == 0, torch.full_like(exponent, -127), exponent)
    return exponent.to(torch.int32), finite


def _scaled(blocks: torch.Tensor, exponent: torch.Tensor, limit: float) -> torch.Tensor:
    # 2**-e is a normal FP32 number for every e in [-127, 127], so the product is exact.
    factor = torch.exp2(-exponent.float()).unsqueeze(-1)
    return torch.clamp(blocks * factor, -limit, limit)


def quantize_mxfp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP8 of ``x`` [..., n] (any float dtype, n a multiple of 32) along its last dim.

    Returns (E4M3 codes uint8 [..., n], E8M0 scale bytes uint8 [..., n/32])."""
    blocks = _blocks(x)
    exponent, finite = block_exponents(blocks, E4M3_EMAX)
    codes = _scaled(blocks, exponent, E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
    codes = torch.where(finite.unsqueeze(-1), codes, torch.full_like(codes, E4M3_NAN))
    scales = torch.where(finite, exponent + 127, torch.full_like(exponent, SCALE_NAN))
    return codes.reshape(x.shape), scales.to(torch.uint8)


def _round_e2m1(y: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (uint8, 0..15) of FP32 values already clamped to [-6, 6], RNE."""
    magnitude = y.abs()
    grid = torch.tensor(E2M1_VALUES[:8], dtype=torch.float32, device=y.device)
    # Index of the nearest grid point; at a midpoint take the even code (codes 0, 2, 4, 6
    # have an even mantissa bit), which is the OCP round-to-nearest-even rule.
    upper = torch.searchsorted(grid, magnitude.contiguous(), right=False).clamp(max=7)
    lower = (upper - 1).clamp(min=0)
    below, above = grid[lower], grid[upper]
    pick_upper = (above - magnitude) < (magnitude - below)
    tie = (above - magnitude) == (magnitude - below)
    pick_upper = pick_upper | (tie & (upper % 2 == 0))
    code = torch.where(pick_upper, upper, lower)
    code = torch.where(magnitude == 0, torch.zeros_like(code), code)
    sign = torch.signbit(y).to(code.dtype) << 3
    return (code | sign).to(torch.uint8)


# Elements quantized at once by ``quantize_mxfp4``: its temporaries (int64 grid indices
# among them) take about 40 bytes an element, so a whole layer's experts at once took
# tens of GiB; rows are independent, so pieces of rows give the same bits.
PIECE_ELEMENTS = 1 << 24


def quantize_mxfp4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4 of ``x`` [..., n] along its last dim, two codes a byte, first in the low
    nibble (the layout ``tl.dot_scaled`` reads for "e2m1"); in pieces of whole rows of
    at most ``PIECE_ELEMENTS`` (one row at least).

    Returns (packed codes uint8 [..., n/2], E8M0 scale bytes uint8 [..., n/32])."""
    if x.dim() < 2:
        return _quantize_mxfp4(x)
    n = x.shape[-1]
    rows = x.reshape(-1, n)
    step = max(1, PIECE_ELEMENTS // max(1, n))
    if rows.shape[0] <= step:
        return _quantize_mxfp4(x)
    pieces = [_quantize_mxfp4(rows[i:i + step]) for i in range(0, rows.shape[0], step)]
    packed = torch.cat([p for p, _ in pieces]).reshape(*x.shape[:-1], n // 2)
    scales = torch.cat([s for _, s in pieces]).reshape(*x.shape[:-1], n // MX_BLOCK)
    return packed, scales


def _quantize_mxfp4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    blocks = _blocks(x)
    exponent, finite = block_exponents(blocks, E2M1_EMAX)
    codes = _round_e2m1(_scaled(torch.nan_to_num(blocks, nan=0.0), exponent, E2M1_MAX))
    codes = torch.where(finite.unsqueeze(-1), codes, torch.full_like(codes, 0x7))
    codes = codes.reshape(*x.shape[:-1], x.shape[-1] // 2, 2)
    packed = codes[..., 0] | (codes[..., 1] << 4)
    scales = torch.where(finite, exponent + 127, torch.full_like(exponent, SCALE_NAN))
    return packed, scales.to(torch.uint8)


def scale_values(scales: torch.Tensor) -> torch.Tensor:
    """FP32 values of E8M0 scale bytes: 2**(byte - 127), NaN for 0xFF."""
    s = scales.to(torch.int32)
    # 2**-127 is subnormal in FP32 but exact; build it by two exact steps.
    values = torch.exp2((s - 127).clamp(min=-126).float()) * torch.where(
        s == 0, torch.tensor(0.5, device=s.device), torch.tensor(1.0, device=s.device))
    return torch.where(s == SCALE_NAN, torch.tensor(float("nan"), device=s.device), values)


def dequantize_mxfp8(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """FP32 values [..., n] of MXFP8 codes uint8 [..., n] and scales uint8 [..., n/32]."""
    values = codes.view(torch.float8_e4m3fn).float()
    blocks = values.reshape(*codes.shape[:-1], -1, MX_BLOCK)
    return (blocks * scale_values(scales).unsqueeze(-1)).reshape(codes.shape)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """FP32 element values [..., 2m] of packed E2M1 bytes [..., m] (low nibble first)."""
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=packed.device)
    lo, hi = table[(packed & 0xF).long()], table[(packed >> 4).long()]
    return torch.stack([lo, hi], dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def dequantize_mxfp4(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """FP32 values [..., n] of MXFP4 packed codes uint8 [..., n/2] and scales [..., n/32]."""
    values = unpack_e2m1(packed)
    blocks = values.reshape(*values.shape[:-1], -1, MX_BLOCK)
    return (blocks * scale_values(scales).unsqueeze(-1)).reshape(values.shape)
