"""The MXFP8 plan: BF16 (or FP32) rows -> E4M3 codes + E8M0 scales per 32 columns.

``mxfp8_tile`` is the one Triton quantizer; the experts kernel uses it for the hidden
too. It is bit-identical to ``wide_moe_triton.mx.quantize_mxfp8`` (see there for the
rules); the E4M3 rounding is done on the FP32 bits rather than by a cast, because casts
differ between backends (Triton's interpreter rounds ties away from zero).

``quantize_mxfp8`` quantizes a tensor; ``quantize_mxfp8_mailbox`` quantizes the BF16
latent straight out of this rank's Lamport mailbox (see ``mailbox.py``), polling each
tile until published and re-arming it after the read. ``tensor_tile`` and ``mailbox_tile``
are one program's work in either case, so that the route launch (``route.py``) can run
the plan's tiles as programs of its own grid.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..checks import check_tensor
from ..tuning import config_for
from .bits import bf16_bits_to_f32, f32_to_bf16_bits  # noqa: F401 (re-exported)
from . import mailbox as mb
from . import quiet

KERNEL = "plan"
DEFAULT = {"BLOCK_ROWS": 16, "BLOCK_COLS": 256, "num_warps": 4}
SPACE = [{"BLOCK_ROWS": r, "BLOCK_COLS": c, "num_warps": w}
         for r in (4, 16, 32) for c in (128, 256, 512) for w in (2, 4, 8)]


def shape_key(cols: int, polled: bool = False) -> str:
    return f"N{cols}" + ("_mailbox" if polled else "")


@triton.jit
def e4m3_codes(y):
    """E4M3 codes (uint8) of FP32 ``y`` already clamped to [-448, 448], RNE."""
    bits = y.to(tl.int32, bitcast=True)
    sign = ((bits >> 24) & 0x80).to(tl.uint8)
    a_bits = bits & 0x7FFFFFFF
    # Normal range: keep 3 mantissa bits, ties to even, then rebias 127 -> 7.
    normal = ((a_bits + 0x7FFFF + ((a_bits >> 20) & 1)) >> 20) - (120 << 3)
    # Below 2**-6 the step is 2**-9: adding 2**23 rounds a*512 to an integer, RNE.
    a = a_bits.to(tl.float32, bitcast=True)
    sub = (a * 512.0 + 8388608.0).to(tl.int32, bitcast=True) - 0x4B000000
    code = tl.where(a < 0.015625, sub, normal)
    return code.to(tl.uint8) | sign


@triton.jit
def mxfp8_tile(x, ROWS: tl.constexpr, COLS: tl.constexpr):
    """(codes uint8 [ROWS, COLS], scale bytes uint8 [ROWS, COLS // 32]) of FP32 ``x``."""
    blocks = tl.reshape(x, (ROWS, COLS // 32, 32))
    # |x| as bits orders as |x| (an integer max: one reduction for both uses), and only
    # +-Inf and NaN reach 0x7F800000: such blocks become NaN-coded.
    amax_bits = tl.max(blocks.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=2)
    nonfinite = amax_bits >= 0x7F800000
    biased = amax_bits >> 23
    exponent = tl.minimum(tl.maximum(biased - 127 - 8, -127), 127)
    factor = ((127 - exponent) << 23).to(tl.float32, bitcast=True)  # 2**-exponent
    y = blocks * factor[:, :, None]
    y = tl.minimum(tl.maximum(y, -448.0), 448.0)
    codes = e4m3_codes(y)
    codes = tl.where(nonfinite[:, :, None], tl.full(codes.shape, 0x7F, tl.uint8), codes)
    scales = tl.where(nonfinite, 0xFF, exponent + 127).to(tl.uint8)
    return tl.reshape(codes, (ROWS, COLS)), scales


@triton.jit
def store_tile(q_ptr, s_ptr, r, c, tile_c, rows, cols, x, BLOCK_ROWS: tl.constexpr,
               BLOCK_COLS: tl.constexpr):
    """MXFP8 of the FP32 tile ``x`` [BLOCK_ROWS, BLOCK_COLS] at rows ``r``, columns ``c``
    (column tile ``tile_c``) into codes [rows, cols] and scales [rows, cols / 32]."""
    codes, scales = mxfp8_tile(x, BLOCK_ROWS, BLOCK_COLS)
    tl.store(q_ptr + r[:, None].to(tl.int64) * cols + c[None, :], codes,
             mask=(r[:, None] < rows) & (c[None, :] < cols))
    sc = tile_c * (BLOCK_COLS // 32) + tl.arange(0, BLOCK_COLS // 32)
    tl.store(s_ptr + r[:, None].to(tl.int64) * (cols // 32) + sc[None, :], scales,
             mask=(r[:, None] < rows) & (sc[None, :] < cols // 32))


@triton.jit
def tensor_tile(x_ptr, x_stride, q_ptr, s_ptr, rows, cols, tile_r, tile_c,
                BF16_BITS: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr):
    """One tile of ``quantize_mxfp8``: rows tile ``tile_r``, columns tile ``tile_c`` of
    ``x`` (BF16 bits as int16 when ``BF16_BITS``, else FP32)."""
    r = tile_r * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    c = tile_c * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    mask = (r[:, None] < rows) & (c[None, :] < cols)
    x = tl.load(x_ptr + r[:, None].to(tl.int64) * x_stride + c[None, :], mask=mask, other=0)
    x = bf16_bits_to_f32(x) if BF16_BITS else x.to(tl.float32)
    store_tile(q_ptr, s_ptr, r, c, tile_c, rows, cols, x, BLOCK_ROWS, BLOCK_COLS)


@triton.jit
def mailbox_tile(mb_ptr, gen_ptr, row_stride, parity_stride, q_ptr, s_ptr, rows, cols,
                 latent_per_rank, error_ptr, spin_limit, timeout_ns, tile_r, tile_c,
                 BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr):
    """One tile of ``quantize_mxfp8_mailbox``: the tile's BF16 latent polled out of the
    mailbox (``mb_ptr`` int16), quantized, and re-armed behind the read."""
    r = tile_r * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    c = tile_c * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    mask = (r[:, None] < rows) & (c[None, :] < cols)
    parity = tl.load(gen_ptr) & 1
    ptrs = (mb_ptr + parity.to(tl.int64) * parity_stride
            + r[:, None].to(tl.int64) * row_stride + c[None, :])
    column = tl.zeros_like(r)[:, None] + c[None, :]
    bits = mb.take(ptrs, mask, column, latent_per_rank, spin_limit, timeout_ns, error_ptr,
                   parity, mb.EMPTY_HALF)
    store_tile(q_ptr, s_ptr, r, c, tile_c, rows, cols, bf16_bits_to_f32(bits), BLOCK_ROWS,
               BLOCK_COLS)


@triton.jit
def _plan_kernel(x_ptr, x_stride, q_ptr, s_ptr, rows, cols, BF16_BITS: tl.constexpr,
                 BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr):
    tensor_tile(x_ptr, x_stride, q_ptr, s_ptr, rows, cols, tl.program_id(0), tl.program_id(1),
                BF16_BITS, BLOCK_ROWS, BLOCK_COLS)


def check_input(x) -> tuple[int, int]:
    """(rows, n) of a valid ``quantize_mxfp8`` input, else an error naming ``x``."""
    check_tensor("x", x, None, ("rows", "n"), contiguous=False)
    if x.dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(f"x must be torch.bfloat16 or torch.float32, got {x.dtype}")
    rows, cols = x.shape
    if cols % 32:
        raise ValueError(f"x's last dimension ({cols}) must be a multiple of 32")
    if x.stride(1) != 1:
        raise ValueError("x must have contiguous rows (stride 1 along its last dim)")
    return rows, cols


def check_mailbox_latent(latent, world: int, columns: int) -> None:
    """Raise unless ``latent`` fits a mailbox of ``columns`` columns shared by ``world``
    ranks (each rank's shard whole MX blocks)."""
    if (not isinstance(latent, int) or isinstance(latent, bool) or latent < 32
            or latent % (32 * world) or latent >= columns):
        raise ValueError(f"latent must be a multiple of 32 * world = {32 * world} below the "
                         f"mailbox's {columns} columns, got {latent!r}")


def outputs(out, rows: int, cols: int, device) -> tuple:
    """``out`` = (codes uint8 [rows, cols], scales uint8 [rows, cols/32]) checked, or new
    buffers when None."""
    if out is None:
        out = (torch.empty(rows, cols, dtype=torch.uint8, device=device),
               torch.empty(rows, cols // 32, dtype=torch.uint8, device=device))
    check_tensor("out[0]", out[0], torch.uint8, (rows, cols), device)
    check_tensor("out[1]", out[1], torch.uint8, (rows, cols // 32), device)
    return out


def quantize_mxfp8(x: torch.Tensor, *, out: tuple | None = None, config: dict | None = None):
    """MXFP8 of ``x`` [rows, n] (BF16 or FP32, rows contiguous, n a multiple of 32)
    along its last dim: (codes uint8 [rows, n], scales uint8 [rows, n/32]), bit-identical
    to ``mx.quantize_mxfp8``."""
    rows, cols = check_input(x)
    out = outputs(out, rows, cols, x.device)
    if rows == 0:
        return out
    cfg = config or config_for(KERNEL, shape_key(cols), rows, DEFAULT, x.device)
    grid = (triton.cdiv(rows, cfg["BLOCK_ROWS"]), triton.cdiv(cols, cfg["BLOCK_COLS"]))
    bits = x.dtype == torch.bfloat16
    with quiet():
        _plan_kernel[grid](x.view(torch.int16) if bits else x, x.stride(0), out[0], out[1],
                           rows, cols, BF16_BITS=bits,
                           BLOCK_ROWS=cfg["BLOCK_ROWS"], BLOCK_COLS=cfg["BLOCK_COLS"],
                           num_warps=cfg["num_warps"])
    return out


@triton.jit
def _plan_mailbox_kernel(mb_ptr, gen_ptr, row_stride, parity_stride, q_ptr, s_ptr, rows,
                         cols, latent_per_rank, error_ptr, spin_limit, timeout_ns,
                         BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr):
    mailbox_tile(mb_ptr, gen_ptr, row_stride, parity_stride, q_ptr, s_ptr, rows, cols,
                 latent_per_rank, error_ptr, spin_limit, timeout_ns, tl.program_id(0),
                 tl.program_id(1), BLOCK_ROWS, BLOCK_COLS)


def quantize_mxfp8_mailbox(mailbox: torch.Tensor, generation: torch.Tensor, rows: int, *,
                           latent: int, world: int, error: torch.Tensor,
                           spin_limit: int = mb.DEFAULT_SPIN_LIMIT, out: tuple | None = None,
                           poll_timeout: float | None = None, config: dict | None = None):
    """MXFP8 (codes uint8 [rows, latent], scales uint8 [rows, latent/32]) of the BF16
    latent in this rank's ``mailbox`` (int16/BF16 [2, wide_rows, latent + 2E]), rows
    0..rows-1 of parity ``generation[0] & 1`` (read on the device): bit-identical to
    ``mx.quantize_mxfp8`` of that BF16 latent.

    Each tile is polled until published (at most ``spin_limit`` rounds or ``poll_timeout``
    seconds, ``mailbox.poll``; on a timeout the
    ranks of the still-empty columns, ``world`` ranks of latent/world columns each, and
    the parity go to ``error``, int32 [2], and the empty columns quantize as -0), then
    re-armed."""
    device = mb.check_poll_args(mailbox, generation, rows, world, error, spin_limit)
    timeout_ns = mb.poll_timeout_ns(poll_timeout)
    check_mailbox_latent(latent, world, mailbox.shape[2])
    out = outputs(out, rows, latent, device)
    if rows == 0:
        return out
    cfg = config or config_for(KERNEL, shape_key(latent, polled=True), rows, DEFAULT, device)
    grid = (triton.cdiv(rows, cfg["BLOCK_ROWS"]), triton.cdiv(latent, cfg["BLOCK_COLS"]))
    columns = mailbox.shape[2]
    with quiet():
        _plan_mailbox_kernel[grid](mailbox.view(torch.int16), generation, columns,
                                   mailbox.shape[1] * columns, out[0], out[1], rows, latent,
                                   latent // world, error, spin_limit, timeout_ns,
                                   BLOCK_ROWS=cfg["BLOCK_ROWS"], BLOCK_COLS=cfg["BLOCK_COLS"],
                                   num_warps=cfg["num_warps"])
    return out
