"""The experts' weight formats: the stock MXFP4 tensors laid out as the kernels stream
them (``prepare_weights``, ``ExpertWeights``), the bit encoding of "wgmma_decode" words
and its inverse, and which format and which dot a device takes (``default_layout``,
``staged_dot``).

Host code, apart from ``BF16_PAIR_FIELDS``: the one constant the device's decode
(``tiles._bf16_pairs``) shares with the encoding here, the two being each other's
inverse."""

from __future__ import annotations

import dataclasses

import torch
import triton.language as tl

from ...checks import check_tensor
from ... import mx
from ...config import MX_BLOCK

# Preferred reduction steps (elements along L for up, along I for down); the step used is
# the largest power of two <= this that divides the dimension.
BLOCK_K_UP = 128
BLOCK_K_DOWN = 128

LAYOUTS = ("wgmma", "wgmma_decode", "nk")
# Layouts the kernels read in tiles of row_block rows by one reduction step, lane-ordered.
TILED_LAYOUTS = ("wgmma", "wgmma_decode")
# Rows of a weight tile in the "wgmma" layout: one wgmma M atom (64 rows a warpgroup).
ROW_BLOCK = 64


def reduction_block(n: int, preferred: int) -> int:
    """The reduction step along a dimension of ``n`` (a multiple of 32) elements: the
    largest power of two <= ``preferred`` (and >= 32) that divides ``n``."""
    if n % MX_BLOCK or preferred < MX_BLOCK or preferred & (preferred - 1):
        raise ValueError(f"need n ({n}) a multiple of 32 and preferred ({preferred}) a "
                         f"power of two >= 32")
    step = preferred
    while n % step:
        step //= 2
    return step



@dataclasses.dataclass(frozen=True)
class ExpertWeights:
    """The experts' MXFP4 weights as the kernels stream them (``prepare_weights``).

    Each tensor holds the bytes of its stock counterpart, w13 [E, 2I, L/2] (gate rows
    then up rows), w13_scales [E, 2I, L/32], w2 [E, L, I/2], w2_scales [E, L, I/32]
    (codes two a byte along the reduction dim, low nibble first), in the order
    ``layout`` names:

    - "nk": the stock order, row-major.
    - "wgmma": each expert matrix cut into tiles of ``row_block`` rows by one reduction
      step (``block_k_up`` elements of a W13 row, ``block_k_down`` of a W2 row), each
      tile contiguous, the tiles of a row block in step order; within a tile the code
      bytes of each row in lane order (``lane_order``). A program streaming a row block
      then reads one contiguous run of memory, where row-major order would have it
      read a short piece of every row (one DRAM page each).
    - "wgmma_decode": the tiles and lane order of "wgmma", and within each 4-byte word
      (the 8 codes a thread feeds one MMA row per 32 reduction elements) the 32 bits
      permuted (``encode_words``) so that the kernels' own decode (``_bf16_pairs``), a
      few shifts and masks a word, places each code's bits in the BF16 fields of the
      MMA's registers; ``tl.dot_scaled`` then takes the weights as exact BF16.

    The reduction steps are fixed here, at build, because they fix the order of every
    FP32 sum (see the package docstring, ``experts``)."""

    w13: torch.Tensor
    w13_scales: torch.Tensor
    w2: torch.Tensor
    w2_scales: torch.Tensor
    layout: str
    num_experts: int
    latent: int
    inter: int
    block_k_up: int
    block_k_down: int
    row_block: int
    # Any scale byte above 128 in w13_scales / w2_scales: the decode then multiplies
    # twice (``_scale_exponents``), since 2**(s - 1) overflows BF16 past s = 128.
    wide_scales_up: bool = True
    wide_scales_down: bool = True

    @property
    def device(self) -> torch.device:
        return self.w13.device

    def stock(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The stock tensors (w13, w13_scales, w2, w2_scales) these bytes came from."""
        if self.layout == "nk":
            return self.w13, self.w13_scales, self.w2, self.w2_scales
        words = decode_words if self.layout == "wgmma_decode" else (lambda t, bk: t)
        return (untile(lane_order(words(self.w13, self.block_k_up), self.block_k_up,
                                  inverse=True), self.row_block, self.block_k_up // 2),
                untile(self.w13_scales, self.row_block, self.block_k_up // MX_BLOCK),
                untile(lane_order(words(self.w2, self.block_k_down), self.block_k_down,
                                  inverse=True), self.row_block, self.block_k_down // 2),
                untile(self.w2_scales, self.row_block, self.block_k_down // MX_BLOCK))


def lane_order(codes: torch.Tensor, block_k: int, inverse: bool = False) -> torch.Tensor:
    """Packed E2M1 codes [..., K/2] with the bytes of each block of ``block_k`` elements
    reordered so that byte j = 4*i + q of the block goes to position q*(block_k/8) + i
    (``inverse``: back).

    Why: Hopper's tensor cores take the weights as the left operand straight from
    registers (after ``dot_scaled`` upcasts them), and that operand gives the four
    threads of a row group the bytes j = q, q + 4, q + 8, ... of each block: thread q's
    bytes are every fourth. Stored q-major, they are one contiguous vector a thread, so
    a tile arrives with wide loads and no shuffle through shared memory."""
    steps = block_k // 8
    split = (steps, 4) if not inverse else (4, steps)
    blocks = codes.reshape(*codes.shape[:-1], -1, *split)
    return blocks.transpose(-1, -2).contiguous().reshape(codes.shape)


# The BF16 fields each E2M1 code bit lands in: code bit 0 (mantissa) at 6, bits 1..2
# (exponent) at 7..8, bit 3 (sign) at 15, of the low (code h = 0) or high (h = 1) half of
# a register. There the bits read as the code's value times 2**-126, subnormal 0.5 and
# zero included.
_FIELD_OF_CODE_BIT = (6, 7, 8, 15)
BF16_PAIR_FIELDS: tl.constexpr = tl.constexpr(0x81C081C0)


def _source_bit(pair: int, target: int) -> int:
    """The word bit that ``_bf16_pairs`` moves to bit ``target`` of its output ``pair``
    (the same shifts, written for the host)."""
    if pair == 0:
        return target
    if pair == 1:
        return target - 6
    if pair == 2:
        return (target + 4) % 32
    return target - 2 if (0x80C080C0 >> target) & 1 else target + 6


def word_code() -> list[tuple[int, int, int]]:
    """Bit b of a "wgmma_decode" word holds bit ``word_code()[b] = (pair, half, code_bit)``
    of the code of element 8*(pair // 2) ... (see ``encode_words``): the inverse of
    ``_bf16_pairs``'s moves."""
    table = [None] * 32
    for pair in range(4):
        for half in range(2):
            for code_bit, field in enumerate(_FIELD_OF_CODE_BIT):
                table[_source_bit(pair, field + 16 * half)] = (pair, half, code_bit)
    if None in table:
        raise AssertionError("the decode's moves do not cover the word")
    return table


def _word_bytes(codes: torch.Tensor, block_k: int) -> torch.Tensor:
    """Lane-ordered packed bytes [..., K/2] as [..., K/block_k, 4 (lane q), block_k/32
    (word), 4 (byte of the word)]: lane order puts q major within a reduction step."""
    steps, words = codes.shape[-1] * 2 // block_k, block_k // 32
    return codes.reshape(*codes.shape[:-1], steps, 4, words, 4)


def _word_elements(codes: torch.Tensor, block_k: int) -> torch.Tensor:
    """Lane-ordered packed codes [..., K/2] as nibbles [..., K/block_k, 4 (lane q),
    block_k/32 (word), 4 (pair), 2 (half)]: the 8 codes of each of a lane's words, in
    the order its MMA registers take them (element 32*word + 8*pair + 2*q + half)."""
    bytes_ = _word_bytes(codes, block_k)
    return torch.stack((bytes_ & 15, bytes_ >> 4), dim=-1)  # byte i: pair i, its halves


# Rows a piece when re-encoding words: the bit-by-bit work holds 16 int64 a byte, so a
# whole TP1 W13 (896 x 6144 rows of 1792 bytes) at once would take 150 GB; 4096 rows
# take under 1 GB.
_WORD_ROWS = 1 << 12


def _by_rows(fn, t: torch.Tensor, block_k: int) -> torch.Tensor:
    """fn(piece, block_k) over pieces of _WORD_ROWS rows of ``t`` [..., K/2] (fn keeps
    each row's shape), gathered into one tensor of t's shape (a meta tensor's values
    are never computed: only its shape, which fn keeps)."""
    if t.is_meta:
        return torch.empty_like(t)
    rows = t.reshape(-1, t.shape[-1])
    out = torch.empty_like(rows)
    for start in range(0, rows.shape[0], _WORD_ROWS):
        piece = rows[start:start + _WORD_ROWS]
        out[start:start + _WORD_ROWS] = fn(piece, block_k)
    return out.reshape(t.shape)


def encode_words(codes: torch.Tensor, block_k: int) -> torch.Tensor:
    """Lane-ordered packed E2M1 codes (``lane_order``) [..., K/2] with each 4-byte word
    (a lane's 8 codes of 32 reduction elements) re-encoded bit by bit as ``word_code``
    says, little-endian (same shape, uint8)."""
    return _by_rows(_encode_rows, codes, block_k)


def decode_words(words: torch.Tensor, block_k: int) -> torch.Tensor:
    """The inverse of ``encode_words``."""
    return _by_rows(_decode_rows, words, block_k)


def _encode_rows(codes: torch.Tensor, block_k: int) -> torch.Tensor:
    nib = _word_elements(codes, block_k).to(torch.int64)
    word = torch.zeros(nib.shape[:-2], dtype=torch.int64, device=codes.device)
    for bit, (pair, half, code_bit) in enumerate(word_code()):
        word |= ((nib[..., pair, half] >> code_bit) & 1) << bit
    out = torch.stack([(word >> (8 * i)) & 255 for i in range(4)], dim=-1)
    return out.to(torch.uint8).reshape(codes.shape)


def _decode_rows(words: torch.Tensor, block_k: int) -> torch.Tensor:
    b = _word_bytes(words, block_k).to(torch.int64)
    word = b[..., 0] | b[..., 1] << 8 | b[..., 2] << 16 | b[..., 3] << 24
    nib = torch.zeros(*word.shape, 4, 2, dtype=torch.int64, device=words.device)
    for bit, (pair, half, code_bit) in enumerate(word_code()):
        nib[..., pair, half] |= ((word >> bit) & 1) << code_bit
    return (nib[..., 0] | nib[..., 1] << 4).to(torch.uint8).reshape(words.shape)


def tile(t: torch.Tensor, row_block: int, step: int) -> torch.Tensor:
    """[E, R, C] bytes in tiles of ``row_block`` rows by ``step`` columns, each tile
    contiguous, the tiles of a row block in column order (same shape, same bytes)."""
    E, R, C = t.shape
    tiles = t.reshape(E, R // row_block, row_block, C // step, step).transpose(2, 3)
    return tiles.contiguous().reshape(E, R, C)


def untile(t: torch.Tensor, row_block: int, step: int) -> torch.Tensor:
    """The inverse of ``tile``."""
    E, R, C = t.shape
    tiles = t.reshape(E, R // row_block, C // step, row_block, step).transpose(2, 3)
    return tiles.contiguous().reshape(E, R, C)


# Hopper's compute capability (major): wgmma, which takes its left operand from
# registers, and no MX tensor cores.
HOPPER = 9


def _hopper(device) -> bool:
    """A Hopper GPU, or the interpreter (a CPU device), which stands in for one so that
    CPU tests run what the H200 runs."""
    device = torch.device(device)
    return device.type != "cuda" or torch.cuda.get_device_capability(device)[0] == HOPPER


def default_layout(device) -> str:
    """"wgmma_decode" where the weights enter the tensor cores from registers (Hopper, and
    the interpreter): our own exact decode, and both operands staged by the compiler's
    pipeliner, 1.45x and 1.48x faster than "wgmma" at TP8, b = 65 and 256, on the H200
    (NOTES: Exact decode instead of dot_scaled on Hopper). "nk" on other GPUs, whose MX
    tensor cores (Blackwell) read both operands from shared memory (there the tiled
    order would likely pay too, but it was not measured)."""
    return "wgmma_decode" if _hopper(device) else "nk"


def staged_dot(device) -> bool:
    """Whether "wgmma_decode" weights are multiplied with ``tl.dot``, both operands
    staged by the compiler's pipeliner (``_reduce_staged``): on Hopper, where
    ``tl.dot_scaled`` would form the same BF16 products, and in the interpreter, which
    stands in for it. Elsewhere ``tl.dot_scaled``, as DESIGN.md has it (and Triton 3.9
    cannot compile the ``tl.dot`` form for sm_100 at every tile: 128 x 32 weight tiles
    fail)."""
    return _hopper(device)


def _check_scales_finite(name: str, scales: torch.Tensor) -> None:
    # The kernels skip dot_scaled's NaN-scale test (fast_math); a weight block of NaN or
    # Inf would then read as Inf, not NaN. Such a checkpoint is corrupt: refuse it.
    if not scales.is_meta and bool((scales == mx.SCALE_NAN).any()):
        raise ValueError(f"{name} holds the NaN scale 0xFF (a block of non-finite weights); "
                         f"refusing weights that cannot be multiplied exactly")



def _wide_scales(scales: torch.Tensor) -> bool:
    """Whether any scale byte exceeds 128 (the kernels' wider scale path); False for a
    meta tensor, which holds no values (a layer on the meta device only plans its
    launches: ``tables.coverage``)."""
    return not scales.is_meta and bool((scales > 128).any())


def _check_block_k(name: str, block_k: int, dim: int, dim_name: str) -> int:
    if block_k < 32 or block_k & (block_k - 1) or dim % block_k:
        raise ValueError(f"{name} ({block_k}) must be a power of two >= 32 dividing "
                         f"{dim_name} ({dim})")
    return block_k



def prepare_weights(w13: torch.Tensor, w13_scales: torch.Tensor, w2: torch.Tensor,
                    w2_scales: torch.Tensor, layout: str | None = None, *,
                    block_k_up: int | None = None,
                    block_k_down: int | None = None) -> ExpertWeights:
    """The stock MXFP4 experts (see ``reference.expert_rows``) as the kernels stream them:
    a one-time conversion at module build, no change of any value.

    ``layout``: "wgmma", "wgmma_decode" or "nk" (``ExpertWeights``; default
    ``default_layout``).
    ``block_k_up``/``block_k_down``: the reduction steps along L and along I (powers of
    two >= 32 dividing them; default ``reduction_block``). Weights holding the NaN scale
    byte are refused (ValueError)."""
    check_tensor("w13", w13, torch.uint8, (None, None, None), contiguous=False)
    E, two_i, half_l = w13.shape
    if two_i % 2:
        raise ValueError(f"w13 must have 2I rows (gate then up), got {two_i}")
    inter, latent = two_i // 2, half_l * 2
    if latent % MX_BLOCK or inter % MX_BLOCK:
        raise ValueError(f"latent L ({latent}) and intermediate I ({inter}) must be "
                         f"multiples of {MX_BLOCK}")
    device = w13.device
    check_tensor("w13_scales", w13_scales, torch.uint8, (E, two_i, latent // MX_BLOCK),
                 device, contiguous=False)
    check_tensor("w2", w2, torch.uint8, (E, latent, inter // 2), device, contiguous=False)
    check_tensor("w2_scales", w2_scales, torch.uint8, (E, latent, inter // MX_BLOCK),
                 device, contiguous=False)
    layout = default_layout(device) if layout is None else layout
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    bk_up = _check_block_k("block_k_up", block_k_up or reduction_block(latent, BLOCK_K_UP),
                           latent, "L")
    bk_down = _check_block_k("block_k_down", block_k_down or
                             reduction_block(inter, BLOCK_K_DOWN), inter, "I")
    _check_scales_finite("w13_scales", w13_scales)
    _check_scales_finite("w2_scales", w2_scales)
    w13, w13_scales, w2, w2_scales = (t.contiguous() for t in (w13, w13_scales, w2, w2_scales))
    row_block = 1
    wide_up, wide_down = (_wide_scales(s) for s in (w13_scales, w2_scales))
    if layout in TILED_LAYOUTS:
        words = encode_words if layout == "wgmma_decode" else (lambda t, bk: t)
        row_block = ROW_BLOCK if latent % ROW_BLOCK == 0 else MX_BLOCK  # divides L and 2I
        w13 = tile(words(lane_order(w13, bk_up), bk_up), row_block, bk_up // 2)
        w13_scales = tile(w13_scales, row_block, bk_up // MX_BLOCK)
        w2 = tile(words(lane_order(w2, bk_down), bk_down), row_block, bk_down // 2)
        w2_scales = tile(w2_scales, row_block, bk_down // MX_BLOCK)
    return ExpertWeights(w13, w13_scales, w2, w2_scales, layout=layout, num_experts=E,
                         latent=latent, inter=inter, block_k_up=bk_up, block_k_down=bk_down,
                         row_block=row_block, wide_scales_up=wide_up,
                         wide_scales_down=wide_down)

