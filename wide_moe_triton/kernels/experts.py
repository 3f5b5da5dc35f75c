"""The routed experts: ``rows[p] = bf16(W2_e . mxfp8(situ(W13_e . q[t])))`` for every
listed (token t, slot k) pair p = t*K + k routed to expert e (``reference.expert_rows``).

Two launches, both with grid (expert, column tile), both building their row tiles on the
device from the routing lists (no host sync, CUDA-graph capturable):

- ``up``   (E, cdiv(I, BLOCK_N)): for each tile of BLOCK_M pairs of expert e, gathers the
  tokens' MXFP8 plan rows, computes BLOCK_N gate and BLOCK_N up columns with one dot a
  reduction step over the tile's 2*BLOCK_N weight rows (E2M1 weights x E4M3
  activations, exact products, see below; FP32 accumulation) over L, applies SiTU in
  FP32 and quantizes the hidden to MXFP8 per 32 columns (``plan.mxfp8_tile``) into the
  workspace at row p.
- ``down`` (E, cdiv(L, BLOCK_N)): same list walk; the dot of W2_e with the hidden rows
  over I, rounded once to BF16 into ``rows`` at row p.

Each program streams its weight slice once per tile of BLOCK_M pairs, so an expert with
at most BLOCK_M pairs streams its weights once per call; an expert no pair chose costs
one load of its count.

How the weights stream (Hopper; benchmarks/NOTES.md has the measurements):

- Swap-AB: the weights are the MMA's left operand, so that a weight tile fills the
  tensor cores' 64-row side and the handful of tokens an expert gets their narrow side
  (16 or more), instead of a token tile padded to 64 rows.
- Hopper has no MX tensor cores: the E2M1 tile is upcast to BF16 in registers and feeds
  wgmma's register operand. The tiled layouts (``ExpertWeights``) order each row's
  bytes the way that operand's threads take them and store each (64 rows x one
  reduction step) tile contiguously, so tiles arrive as wide, contiguous, asynchronous
  copies.
- "wgmma_decode", the Hopper default, also permutes the bits of each 4-byte word so
  that our own decode is a few shifts and masks (``_bf16_pairs``), about a third fewer
  instructions than Triton's E2M1 table lookup, and on Hopper multiplies the exact BF16
  tiles with ``tl.dot`` (``staged_dot``), whose operands the compiler's pipeliner
  stages in shared memory asynchronously: the gathered activation rows then feed the
  MMA from shared memory with no store through registers, no fence and one barrier
  less a step (``_reduce_staged``, ``_bf16_weights_dot``). "wgmma" feeds the E2M1
  codes to ``tl.dot_scaled``, whose activation operand the pipeliner does not stage
  (``_reduce_prefetched``).
- ``maxnreg`` (a register cap, per config) buys resident warps to hide latency.
- The staged path's MMAs take the decoded weights from registers: each step waits for
  its MMAs before the next step decodes into those registers (``_settled``), which
  Triton 3.6 does not ensure by itself.

Reproducibility: an output row of an MMA depends only on its own input row and on the
order of the reduction, which is fixed by BLOCK_K (chosen per shape, at
``prepare_weights``, never per batch width). So rows do not depend on the claim order
within a list nor on which other tokens share the batch; only the launch config
(CONFIG_KEYS, and STAGED_KEYS on the staged path) varies with the batch-width bucket.
(On a GPU, Triton may pick a different MMA instruction for another BLOCK_M, a half
tile or num_warps; that it sums a row in the same order is the hardware's property,
which tests/test_experts.py checks bit for bit.)

``A_BF16`` (a config choice, 0/1; 1 for "wgmma_decode"): feed the activations to the
dot as E4M3 codes with their scales, or as their BF16 values, computed once ahead (the
plan's by ``_plan_values_kernel``, the hidden's by the up kernel, into the workspace).
E4M3 times an E8M0 scale is exact in BF16 for scale bytes 3..246, i.e. for every block
whose amax is at least 2**-116 (below that, BF16's subnormals run out): DESIGN.md's
exact upcast. Both variants feed the same BF16 products to the same FP32 MMA; which one
streams faster is measured.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from ..checks import check_tensor
from .. import mx
from ..config import MX_BLOCK
from ..tuning import config_for
from .bits import f32_to_bf16_bits
from .front import _interpreting
from .pdl import allow_dependent_launch, dependent_launch
from .plan import mxfp8_tile
from .situ import situ

KERNEL_UP = "experts_up"
KERNEL_DOWN = "experts_down"
# Defaults: the best measured on the H200 at TP8, b = 65..256 (benchmarks/NOTES.md).
DEFAULT_UP = {"BLOCK_M": 16, "BLOCK_N": 64, "A_BF16": 0, "num_warps": 4, "num_stages": 3,
              "maxnreg": 128}
DEFAULT_DOWN = {"BLOCK_M": 16, "BLOCK_N": 128, "A_BF16": 0, "num_warps": 4, "num_stages": 3,
                "maxnreg": 0}
# With the "wgmma_decode" layout (BF16 activations only) where the dot_scaled path runs
# it (off Hopper): the best of the H200 probe at TP8, b = 65 and 256 before the staged
# path (benchmarks/NOTES.md, fourth lease; not measured off Hopper).
DEFAULT_UP_DECODE = {"BLOCK_M": 16, "BLOCK_N": 64, "A_BF16": 1, "num_warps": 4,
                     "num_stages": 3, "maxnreg": 128}
DEFAULT_DOWN_DECODE = {"BLOCK_M": 16, "BLOCK_N": 256, "A_BF16": 1, "num_warps": 8,
                       "num_stages": 3, "maxnreg": 128}
# Keys only the staged path (``staged_dot``) takes, with the values that leave a launch
# as it is without them (a config may omit them):
# - MASK_ROWS 1: a tile's rows past the expert's count are zeros rather than reads of
#   pair 0's activations; the copies stay asynchronous but cost instructions a step, so
#   it pays where tiles are mostly padding (b = 65-256 at TP8), not at b = 1024.
# - COLS (down launch only): column tiles a down program takes, their steps in one
#   pipelined loop (``_down_columns``); at TP8 a tile is only I / BLOCK_K = 3 steps.
# - HALF_TILE 1 (BLOCK_M >= 32): a list's last tile of at most BLOCK_M/2 pairs runs as
#   a BLOCK_M/2 tile (``_full_tiles``): for the 32-row tiles of b = 1024 at TP8.
# - TMA 1 (up launch only): the weight tiles and their scales are read by the tensor
#   memory accelerator (``_tma_weights``, ``_weight_descriptors``) instead of four
#   16-byte copies and their 64-bit addresses a thread a step. At b = 1024 those copies
#   drew a quarter of the loop's stall samples, each waiting to reuse the one register
#   pair its address is built in (benchmarks/NOTES.md, tenth lease). Not yet timed.
STAGED_KEYS = {"MASK_ROWS": 0, "COLS": 1, "HALF_TILE": 0, "TMA": 0}
# The staged path's defaults: the best of the H200 probe at TP8, b = 65 and 256
# (benchmarks/NOTES.md, fifth lease): 358 + 174 µs at b = 65, 522 + 252 at 256, against
# 409 + 247 and 542 + 377 for the fourth lease's (above, without the keys).
DEFAULT_UP_STAGED = {"BLOCK_M": 16, "BLOCK_N": 64, "A_BF16": 1, "num_warps": 4,
                     "num_stages": 3, "maxnreg": 96, "MASK_ROWS": 1}
DEFAULT_DOWN_STAGED = {"BLOCK_M": 16, "BLOCK_N": 128, "A_BF16": 1, "num_warps": 4,
                       "num_stages": 3, "maxnreg": 128, "MASK_ROWS": 1, "COLS": 4}
# BLOCK_K is deliberately absent: it fixes the reduction order, so it is a function of
# the shape only (``reduction_block``), never of the batch-width bucket.
# The up and the down launch share one space (each its own copy).
SPACE_UP = [{"BLOCK_M": m, "BLOCK_N": n, "A_BF16": a, "num_warps": w, "num_stages": s,
             "maxnreg": r}
            for m in (16, 32, 64) for n in (64, 128, 256) for a in (0, 1)
            for w in (4, 8) for s in (3, 4, 5) for r in (0, 128)]
SPACE_DOWN = [dict(c) for c in SPACE_UP]
# Configs the tuner always tries besides the default's neighbours: the best measured on
# the H200 at wide batches (several changes away from the default).
PRIORS_UP = [{"BLOCK_M": 32, "BLOCK_N": 128, "A_BF16": 0, "num_warps": 8, "num_stages": 3,
              "maxnreg": 128},
             # Deeper pipelines and wider tiles: more weight bytes in flight a program
             # (the engine reads 30% of DRAM bandwidth with the integer pipe half idle).
             {"BLOCK_M": 16, "BLOCK_N": 128, "A_BF16": 0, "num_warps": 4, "num_stages": 4,
              "maxnreg": 0},
             {"BLOCK_M": 16, "BLOCK_N": 128, "A_BF16": 0, "num_warps": 8, "num_stages": 4,
              "maxnreg": 128},
             {"BLOCK_M": 16, "BLOCK_N": 64, "A_BF16": 0, "num_warps": 4, "num_stages": 5,
              "maxnreg": 128}]
PRIORS_DOWN = [{"BLOCK_M": 32, "BLOCK_N": 256, "A_BF16": 0, "num_warps": 8, "num_stages": 3,
                "maxnreg": 128},
               {"BLOCK_M": 16, "BLOCK_N": 256, "A_BF16": 0, "num_warps": 8, "num_stages": 3,
                "maxnreg": 128},
               {"BLOCK_M": 16, "BLOCK_N": 256, "A_BF16": 0, "num_warps": 8, "num_stages": 4,
                "maxnreg": 128},
               {"BLOCK_M": 16, "BLOCK_N": 128, "A_BF16": 0, "num_warps": 4, "num_stages": 5,
                "maxnreg": 0}]
CONFIG_KEYS = ("BLOCK_M", "BLOCK_N", "A_BF16", "num_warps", "num_stages", "maxnreg")


def config_rows(rows) -> list[dict]:
    """Launch configs from rows of values in CONFIG_KEYS order."""
    return [dict(zip(CONFIG_KEYS, row)) for row in rows]


# The "wgmma_decode" layout's priors: the probe's best at b = 1024 (32-row tiles) and
# its runners-up at b = 65-256 (benchmarks/NOTES.md, fourth lease).
PRIORS_UP_DECODE = config_rows([(32, 128, 1, 8, 4, 128), (16, 128, 1, 8, 3, 128),
                                (16, 64, 1, 4, 4, 128)])
PRIORS_DOWN_DECODE = config_rows([(32, 256, 1, 8, 4, 128), (16, 256, 1, 8, 4, 128),
                                  (16, 128, 1, 4, 4, 128)])
# The staged path's: the probe's best at b = 1024 (32-row tiles; the eighth lease's,
# the down one ending in a half tile; the up one with masked rows too, which won there
# once SiTU stopped dividing: 528 against 551 µs, tenth lease) and the fifth lease's
# runners-up at b = 65-256. Then twice the rows on one warpgroup (up 128 hidden
# columns, down 256 latent ones), whose loops issue 5-14% fewer instructions a weight
# element (AOT, ninth lease): timed in the tenth lease, 16x128 uncapped is the tuner's
# pick at b = 64-256 (4% faster than 16x64), while at b = 1024 all are 6-48% slower.
PRIORS_UP_STAGED = [dict(c, MASK_ROWS=m) for c, m in zip(config_rows(
    [(32, 64, 1, 4, 3, 168), (32, 64, 1, 4, 3, 168), (32, 128, 1, 8, 4, 128),
     (16, 64, 1, 4, 3, 128), (32, 128, 1, 4, 3, 168), (16, 128, 1, 4, 3, 168),
     (32, 128, 1, 4, 3, 0), (16, 128, 1, 4, 3, 0)]), (1, 0, 0, 1, 0, 1, 0, 1))]
# The down launch's first prior, the 32x128 half-tile one at maxnreg 168, is the probe's
# best at b = 1024 since its wgmma stopped waiting each out (_down_columns; eleventh lease).
PRIORS_DOWN_STAGED = [dict(c, MASK_ROWS=m, COLS=k, HALF_TILE=h) for c, m, k, h in zip(
    config_rows([(32, 128, 1, 4, 3, 168), (32, 128, 1, 4, 3, 128), (32, 256, 1, 8, 3, 128),
                 (16, 256, 1, 8, 3, 128), (32, 256, 1, 4, 3, 168), (16, 256, 1, 4, 3, 168),
                 (32, 256, 1, 4, 3, 0)]),
    (1, 1, 1, 1, 1, 1, 1), (4, 4, 2, 2, 2, 2, 2), (1, 1, 0, 0, 1, 0, 1))]


class Tuning(NamedTuple):
    """What the sweep tries for one weight layout: the table key's suffix, the defaults,
    the spaces and the priors of the up and the down launch."""
    suffix: str
    default_up: dict
    default_down: dict
    space_up: list
    space_down: list
    priors_up: list
    priors_down: list


def tuning(layout: str, device) -> Tuning:
    """The sweep's configs for weights in ``layout`` on ``device``: "wgmma_decode" takes
    BF16 activations only, so its spaces are the others' configs with A_BF16 = 1; where
    it runs staged (``staged_dot``) they also range over STAGED_KEYS (and maxnreg 88 and
    96, and two stages).
    Built once per (layout, staged), shared: ``experts`` asks for it on every call."""
    return _tuning(layout, layout == "wgmma_decode" and staged_dot(device))


@functools.lru_cache(maxsize=None)
def _tuning(layout: str, staged: bool) -> Tuning:
    if layout != "wgmma_decode":
        return Tuning("", DEFAULT_UP, DEFAULT_DOWN, SPACE_UP, SPACE_DOWN, PRIORS_UP,
                      PRIORS_DOWN)
    bf16 = lambda configs: [c for c in configs if c["A_BF16"]]  # noqa: E731
    if not staged:
        return Tuning("_decode", DEFAULT_UP_DECODE, DEFAULT_DOWN_DECODE, bf16(SPACE_UP),
                      bf16(SPACE_DOWN), PRIORS_UP_DECODE, PRIORS_DOWN_DECODE)
    regs = [dict(c, maxnreg=r) for c in bf16(SPACE_UP) if c["maxnreg"]
            for r in (88, 96, 128)]
    regs += [c for c in bf16(SPACE_UP) if not c["maxnreg"]]
    # Two stages too: a 32-row up tile's three stages take 50 KB of shared memory, which
    # leaves room for four programs a SM where maxnreg 96 or 88 allows five.
    regs += [dict(c, num_stages=2) for c in regs if c["num_stages"] == 3]
    masked = [dict(c, MASK_ROWS=m) for c in regs for m in (0, 1)]
    masked += [dict(c, HALF_TILE=1) for c in masked if c["BLOCK_M"] >= 32]
    cols = [dict(c, COLS=k) for c in masked for k in (1, 2, 4)]
    # The sweep times only configs of its space: the priors join it where their register
    # cap is outside the grid above (maxnreg 168).
    return Tuning("_decode", DEFAULT_UP_STAGED, DEFAULT_DOWN_STAGED,
                  masked + [p for p in PRIORS_UP_STAGED if p not in masked],
                  cols + [p for p in PRIORS_DOWN_STAGED if p not in cols],
                  PRIORS_UP_STAGED, PRIORS_DOWN_STAGED)

# Preferred reduction steps (elements along L for up, along I for down); the step used is
# the largest power of two <= this that divides the dimension.
BLOCK_K_UP = 128
BLOCK_K_DOWN = 128

LAYOUTS = ("wgmma", "wgmma_decode", "nk")
# Layouts the kernels read in tiles of row_block rows by one reduction step, lane-ordered.
TILED_LAYOUTS = ("wgmma", "wgmma_decode")
# Rows of a weight tile in the "wgmma" layout: one wgmma M atom (64 rows a warpgroup).
ROW_BLOCK = 64


def shape_key(latent: int, inter: int, num_experts: int) -> str:
    """Tuning key of both kernels: the dims that change their best config."""
    return f"L{latent}_I{inter}_E{num_experts}"


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


# ----------------------------------------------------------------------------- weights

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
    FP32 sum (see the module docstring)."""

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
    each row's shape), gathered into one tensor of t's shape."""
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
    pipeliner, 1.44x and 1.45x faster than "wgmma" at TP8, b = 256 and 65, in one probe
    run on the H200 (benchmarks/NOTES.md, fourth lease). "nk" on other GPUs, whose MX
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
    if bool((scales == mx.SCALE_NAN).any()):
        raise ValueError(f"{name} holds the NaN scale 0xFF (a block of non-finite weights); "
                         f"refusing weights that cannot be multiplied exactly")


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
    wide_up, wide_down = bool((w13_scales > 128).any()), bool((w2_scales > 128).any())
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


# --------------------------------------------------------------------------- workspace

class Workspace(NamedTuple):
    """Buffers between the stages of the experts, row p = pair t*K + k, row t = token.

    ``h_codes`` uint8 [P, I] and ``h_scales`` uint8 [P, I/32]: the MXFP8 hidden (E4M3,
    E8M0), the layer's rounding point; ``h_values`` bf16 [P, I]: the same values in BF16
    (exact), written for a down launch that takes BF16 activations; ``q_values`` bf16
    [R, L]: the plan's values in BF16, for an up launch that does."""

    h_codes: torch.Tensor
    h_scales: torch.Tensor
    h_values: torch.Tensor
    q_values: torch.Tensor


def make_workspace(rows: int, top_k: int, latent: int, inter: int, device) -> Workspace:
    """An uninitialized workspace for batches of up to ``rows`` tokens (e.g. wide_rows,
    so that one allocation serves every batch width, CUDA graphs included)."""
    pairs = rows * top_k
    empty = lambda *shape, dtype: torch.empty(*shape, dtype=dtype, device=device)  # noqa: E731
    return Workspace(empty(pairs, inter, dtype=torch.uint8),
                     empty(pairs, inter // MX_BLOCK, dtype=torch.uint8),
                     empty(pairs, inter, dtype=torch.bfloat16),
                     empty(rows, latent, dtype=torch.bfloat16))


# ------------------------------------------------------------------------ routing lists

def routing_lists(ids: torch.Tensor, num_experts: int, wide_rows: int, *, generation: int = 0,
                  generator: torch.Generator | None = None):
    """Routing lists as the route kernel leaves them, built on the host (a test and
    reference helper): (counts int32 [2, E], pairs int32 [2, E, wide_rows], generation
    int32 [1]) for ``ids`` [b, K], claimed in parity ``generation & 1``. The other parity
    is empty, unused list entries are -1. With ``generator``, each list's order is a
    random permutation (as atomic claims leave it); else pairs ascend."""
    b, top_k = ids.shape
    if b > wide_rows:
        raise ValueError(f"b ({b}) must be <= wide_rows ({wide_rows})")
    device = ids.device
    parity = generation & 1
    counts = torch.zeros(2, num_experts, dtype=torch.int32, device=device)
    pairs = torch.full((2, num_experts, wide_rows), -1, dtype=torch.int32, device=device)
    flat = ids.reshape(-1).long().cpu()
    for e in range(num_experts):
        members = (flat == e).nonzero().squeeze(1)
        if generator is not None:
            members = members[torch.randperm(len(members), generator=generator)]
        counts[parity, e] = len(members)
        pairs[parity, e, :len(members)] = members.to(device=device, dtype=torch.int32)
    gen = torch.tensor([generation], dtype=torch.int32, device=device)
    return counts, pairs, gen


# ----------------------------------------------------------------------------- helpers

@triton.jit
def _list_of_expert(counts_ptr, pairs_ptr, generation_ptr, e, num_experts, wide_rows):
    """(number of pairs, pointer to the first pair id) of expert ``e``'s routing list in
    this call's parity, read from device memory (so graph replays follow the counter)."""
    parity = tl.load(generation_ptr) & 1
    count = tl.load(counts_ptr + parity * num_experts + e)
    # Never walk past the end of a list, whatever the counter says.
    count = tl.minimum(count, wide_rows)
    base = pairs_ptr + (parity * num_experts + e).to(tl.int64) * wide_rows
    return count, base


@triton.jit
def _load_pairs(list_ptr, m0, count, BLOCK_M: tl.constexpr):
    """(pair ids int64 [BLOCK_M], row mask) of list entries m0 .. m0+BLOCK_M-1. Rows past
    the count read pair 0: a valid row whose results are never stored, so the operand
    loads need no mask (the staged path's MASK_ROWS masks them all the same, to spare
    the reads)."""
    m = m0 + tl.arange(0, BLOCK_M)
    ok = m < count
    pair = tl.load(list_ptr + m, mask=ok, other=0)
    return pair.to(tl.int64), ok


@triton.jit
def _row_chunks(rows, k0, ROW_BYTES: tl.constexpr, STEP_BYTES: tl.constexpr,
                ROW_BLOCK: tl.constexpr, BLOCK_K: tl.constexpr):
    """Byte offset, in an expert's matrix, of each row's chunk for reduction step k0
    (STEP_BYTES a row a step, ROW_BYTES a row in all), in the tiled order of
    ``ExpertWeights``: tiles of ROW_BLOCK rows by one step, contiguous, those of a row
    block in step order. ROW_BLOCK 1 is the stock row-major order."""
    return ((rows // ROW_BLOCK) * (ROW_BLOCK * ROW_BYTES)
            + (k0 // BLOCK_K) * (ROW_BLOCK * STEP_BYTES) + (rows % ROW_BLOCK) * STEP_BYTES)


@triton.jit
def _weight_codes(w_ptr, rows, k0, K: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, ROW_BLOCK: tl.constexpr, WGMMA_ORDER: tl.constexpr):
    """Packed E2M1 codes uint8 [BLOCK_N, BLOCK_K/2] of weight ``rows`` (all inside the
    matrix, see ``_clamped``) of a [*, K] expert matrix, reduction k0 .. k0+BLOCK_K-1, in
    logical byte order.

    Byte j of a row's chunk is read as (lane group q = j % 4, step i = j // 4), the split
    in which the tensor cores' register operand takes it (``lane_order``): with
    WGMMA_ORDER the chunk is stored q-major, so each q's bytes are one contiguous
    vector; in the stock order they are strided. The permute back to j order renames
    registers, it moves no data, when the layouts agree."""
    STEPS: tl.constexpr = BLOCK_K // 8
    q = tl.arange(0, 4)[None, :, None]
    i = tl.arange(0, STEPS)[None, None, :]
    if WGMMA_ORDER:
        offset = q * STEPS + i
    else:
        offset = i * 4 + q
    chunk = _row_chunks(rows, k0, K // 2, BLOCK_K // 2, ROW_BLOCK, BLOCK_K)
    codes = tl.load(w_ptr + chunk[:, None, None] + offset)
    return tl.reshape(tl.permute(codes, (0, 2, 1)), (BLOCK_N, BLOCK_K // 2))


@triton.jit
def _bf16_pairs(w):
    """The four BF16 pairs (uint32 [...], low half first) of "wgmma_decode" words w
    (uint32 [...]): pair p holds codes 2p, 2p+1 of the word's 8 as value * 2**-126, each
    code's sign and E, E, M bits moved to bits 15, 8, 7, 6 of its half (``word_code``
    is the inverse on the host). A shift and a mask a pair, the last two of each."""
    p0 = w & BF16_PAIR_FIELDS
    p1 = (w << 6) & BF16_PAIR_FIELDS
    p2 = ((w >> 4) | (w << 28)) & BF16_PAIR_FIELDS
    p3 = ((w << 2) & 0x80C080C0) | ((w >> 6) & 0x01000100)
    return p0, p1, p2, p3


@triton.jit
def _scale_exponents(scales, WIDE_SCALES: tl.constexpr):
    """Biased exponents (e1, e2) [...] of E8M0 scale bytes s [...]: 2**(e1 - 127) *
    2**(e2 - 127) = 2**(s - 1), the factor that turns a decoded value * 2**-126 into
    value * 2**(s - 127). Each factor a power of two in BF16's range, so both products
    are exact. Without WIDE_SCALES every s is <= 128 (``prepare_weights`` checked) and
    one factor does it (e2 returned as e1, unused)."""
    s = scales.to(tl.uint32)
    if WIDE_SCALES:
        e1 = tl.minimum(s, 128) + 126
        e2 = tl.maximum(s, 128) - 1
    else:
        e1 = s + 126
        e2 = e1
    return e1, e2


@triton.jit
def _scaled_pairs(pairs, e1, e2, WIDE_SCALES: tl.constexpr):
    """BF16 values (low, high) [...] of BF16 pairs [...] (uint32) times 2**(e1 - 127)
    (and 2**(e2 - 127)), e1/e2 [...]: one multiply a pair, whose product stays in the
    register the tensor cores take it from (Triton's BF16 multiply of the halves would
    split each pair and pack it again: 3 byte permutes a word). ``mul.rn.bf16x2`` needs
    sm_90 or newer: the "wgmma_decode" layout's GPUs (H200, B200)."""
    f1 = (e1 << 7) | (e1 << 23)
    if WIDE_SCALES:
        lo, hi = tl.inline_asm_elementwise(
            "{ .reg .b32 t; mul.rn.bf16x2 t, $2, $3; mul.rn.bf16x2 t, t, $4; "
            "mov.b32 {$0, $1}, t; }", "=h,=h,r,r,r", [pairs, f1, (e2 << 7) | (e2 << 23)],
            dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=1)
    else:
        lo, hi = tl.inline_asm_elementwise(
            "{ .reg .b32 t; mul.rn.bf16x2 t, $2, $3; mov.b32 {$0, $1}, t; }", "=h,=h,r,r",
            [pairs, f1], dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=1)
    return lo, hi


@triton.jit
def _scaled_pairs_interpreted(pairs, e1, e2, WIDE_SCALES: tl.constexpr):
    """``_scaled_pairs`` in Triton's interpreter, which runs no PTX, computes BF16
    products wrongly and flushes BF16 subnormals: the same exact values in FP32, then
    their BF16 bits (the FP32 values are BF16 ones: their top halves)."""
    lo = (pairs << 16).to(tl.float32, bitcast=True)
    hi = (pairs & 0xFFFF0000).to(tl.float32, bitcast=True)
    lo = lo * (e1 << 23).to(tl.float32, bitcast=True)
    hi = hi * (e1 << 23).to(tl.float32, bitcast=True)
    if WIDE_SCALES:
        lo = lo * (e2 << 23).to(tl.float32, bitcast=True)
        hi = hi * (e2 << 23).to(tl.float32, bitcast=True)
    lo = (lo.to(tl.uint32, bitcast=True) >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)
    hi = (hi.to(tl.uint32, bitcast=True) >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)
    return lo, hi


@triton.jit
def _decoded_weights(w_ptr, s_ptr, rows, k0, K: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, ROW_BLOCK: tl.constexpr,
                     WIDE_SCALES: tl.constexpr, INTERPRET: tl.constexpr):
    """Exact BF16 values [BLOCK_N, BLOCK_K] of weight ``rows`` of a [*, K] expert matrix
    in the "wgmma_decode" layout (w_ptr: its words, int32), reduction k0 .. k0+BLOCK_K-1."""
    chunk = _row_chunks(rows, k0, K // 8, BLOCK_K // 8, ROW_BLOCK, BLOCK_K)
    # A row's words of a step are one contiguous run: loaded as one axis, a warp's copies
    # cover whole 32-byte sectors (8 rows x 64 bytes). Loaded as [rows, words, lanes],
    # Triton gave each thread one row's four 16-byte vectors, so each copy instruction
    # read half of every sector it touched and the weights crossed from L2 twice (Nsight
    # Compute, benchmarks/NOTES.md, seventh lease).
    w = tl.load(w_ptr + chunk[:, None] + tl.arange(0, BLOCK_K // 8)[None, :])
    scales = _weight_scales(s_ptr, rows, k0, K, BLOCK_K, ROW_BLOCK)
    return _decoded_tile(w, scales, BLOCK_N, BLOCK_K, WIDE_SCALES, INTERPRET)


@triton.jit
def _tma_weights(w_desc, ws_desc, step, ROWS: tl.constexpr, BLOCK_K: tl.constexpr,
                 ROW_BLOCK: tl.constexpr, WIDE_SCALES: tl.constexpr,
                 INTERPRET: tl.constexpr):
    """``_decoded_weights`` for the up program (e, j) of ROWS / 2 hidden columns, its gate
    rows then its up rows, reduction step ``step``, read through the descriptors of
    ``_weight_descriptors``: one box of each holds the step's tiles of both halves."""
    e = tl.program_id(0)
    row_block = tl.program_id(1) * (ROWS // 2 // ROW_BLOCK)
    w = w_desc.load([e, 0, row_block, step * ROW_BLOCK, 0])
    scales = ws_desc.load([e, 0, row_block, step, 0])
    return _decoded_tile(tl.reshape(w, (ROWS, BLOCK_K // 8)),
                         tl.reshape(scales, (ROWS, BLOCK_K // 32)), ROWS, BLOCK_K,
                         WIDE_SCALES, INTERPRET)


@triton.jit
def _decoded_tile(w, scales, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  WIDE_SCALES: tl.constexpr, INTERPRET: tl.constexpr):
    """Exact BF16 values [BLOCK_N, BLOCK_K] of a weight tile's "wgmma_decode" words w
    (int32 [BLOCK_N, BLOCK_K/8], a row's words in lane order) and scale bytes [BLOCK_N,
    BLOCK_K/32].

    Lane q's words of a row are one contiguous vector (lane order), and word i's 8 codes
    are elements 32*i + 8*p + 2*q + h (pair p, half h): the joins and the permute below
    put each pair in the register the tensor cores take it from, so they move no data."""
    WORDS: tl.constexpr = BLOCK_K // 32
    w = tl.permute(tl.reshape(w, (BLOCK_N, 4, WORDS)), (0, 2, 1)).to(tl.uint32, bitcast=True)
    p0, p1, p2, p3 = _bf16_pairs(w)  # [BLOCK_N, WORDS, 4]
    pairs = tl.join(tl.join(p0, p2), tl.join(p1, p3))  # [.., 4 (q), 2, 2 (pair)]
    # One scale a word: its exponents broadcast over the word's pairs.
    e1, e2 = _scale_exponents(scales, WIDE_SCALES)
    e1 = tl.broadcast_to(e1[:, :, None, None, None], pairs.shape)
    e2 = tl.broadcast_to(e2[:, :, None, None, None], pairs.shape)
    if INTERPRET:
        lo, hi = _scaled_pairs_interpreted(pairs, e1, e2, WIDE_SCALES)
    else:
        lo, hi = _scaled_pairs(pairs, e1, e2, WIDE_SCALES)
    v = tl.join(lo, hi)  # [.., 2 (half)]
    return tl.reshape(tl.permute(v, (0, 1, 3, 4, 2, 5)), (BLOCK_N, BLOCK_K))


@triton.jit
def _weight_scales(s_ptr, rows, k0, K: tl.constexpr, BLOCK_K: tl.constexpr,
                   ROW_BLOCK: tl.constexpr):
    """E8M0 scale bytes uint8 [BLOCK_N, BLOCK_K/32] of weight ``rows`` of a [*, K]
    expert matrix, reduction k0 .. k0+BLOCK_K-1 (tiled like the codes)."""
    chunk = _row_chunks(rows, k0, K // 32, BLOCK_K // 32, ROW_BLOCK, BLOCK_K)
    return tl.load(s_ptr + chunk[:, None] + tl.arange(0, BLOCK_K // 32)[None, :])


@triton.jit
def _clamped(n, count: tl.constexpr, SPAN: tl.constexpr):
    """Row indices ``n`` (consecutive rows of a program whose grid covers the ``count``
    rows in spans of SPAN: its BLOCK_N, or BLOCK_N * COLS for a down program of COLS
    column tiles) with those past ``count`` replaced by the last row: their results are
    never stored, so their loads need no mask (none to compute a step). When SPAN
    divides count no row is past it, and ``n`` is left as it is: the compiler then sees
    consecutive rows, so a step's weight copies can share an address register and
    differ by constant offsets."""
    if count % SPAN != 0:
        n = tl.minimum(n, count - 1)
    return n


@triton.jit
def _activations(codes_ptr, scales_ptr, row, k0, cols, BLOCK_K: tl.constexpr):
    """MXFP8 activation tile of rows ``row`` (int64 [M]), columns k0 .. k0+BLOCK_K-1 of a
    [*, cols] plan: (E4M3 codes uint8 [M, BLOCK_K], scale bytes uint8 [M, BLOCK_K/32])."""
    k = k0 + tl.arange(0, BLOCK_K)
    codes = tl.load(codes_ptr + row[:, None] * cols + k[None, :])
    ks = k0 // 32 + tl.arange(0, BLOCK_K // 32)
    scales = tl.load(scales_ptr + row[:, None] * (cols // 32) + ks[None, :])
    return codes, scales


@triton.jit
def _bf16_activations(values_ptr, row, k0, cols, BLOCK_K: tl.constexpr):
    """BF16 activation tile of rows ``row`` (int64 [M]) of a [*, cols] BF16 matrix,
    columns k0 .. k0+BLOCK_K-1, loaded transposed ([BLOCK_K, M]): ``dot_scaled``'s right
    operand, the weights being its left."""
    k = k0 + tl.arange(0, BLOCK_K)
    return tl.load(values_ptr + row[None, :] * cols + k[:, None])


@triton.jit
def _next_step(k0, cols, BLOCK_K: tl.constexpr):
    """The reduction step after k0, wrapping to 0 after the last. The hint says what the
    compiler cannot see through the modulo, that it is a multiple of BLOCK_K: without it
    the activation tiles at that offset are loaded a byte (or a BF16 value) at a time,
    16 loads a thread a step instead of one 16-byte load."""
    return tl.multiple_of((k0 + BLOCK_K) % cols, BLOCK_K)


@triton.jit
def _activation_tile(codes_ptr, scales_ptr, values_ptr, row, k0, cols,
                     A_BF16: tl.constexpr, BLOCK_K: tl.constexpr):
    """The activations of rows ``row`` for reduction step k0 as ``_mx_dot`` takes them:
    (E4M3 codes, scales) or, with A_BF16, (BF16 values transposed, a placeholder)."""
    if A_BF16:
        a = _bf16_activations(values_ptr, row, k0, cols, BLOCK_K)
        a_s = tl.zeros((1, 1), tl.uint8)  # BF16 activations carry no scales
    else:
        a, a_s = _activations(codes_ptr, scales_ptr, row, k0, cols, BLOCK_K)
    return a, a_s


@triton.jit
def _e4m3_to_bf16(codes, scales, ROWS: tl.constexpr, COLS: tl.constexpr):
    """BF16 values [ROWS, COLS] of E4M3 codes times their E8M0 scales [ROWS, COLS/32].

    Built on FP32 bits (casts differ between backends): the E4M3 value and the power of
    two are exact in FP32, so is their product; it has at most 4 significant bits, so its
    BF16 truncation is the exact value whenever BF16 holds it (scale bytes 3..246)."""
    c = codes.to(tl.int32)
    mag = c & 0x7F
    # Normal E4M3: exponent field + 120 rebiases 7 -> 127; 3 mantissa bits move to 22..20.
    normal = tl.where(mag == 0x7F, 0x7FC00000, (mag + (120 << 3)) << 20)
    subnormal = (mag & 7).to(tl.float32) * 0.001953125  # mantissa * 2**-9
    v = tl.where(mag < 8, subnormal, normal.to(tl.float32, bitcast=True))
    v = tl.where((c & 0x80) != 0, -v, v)
    s = scales.to(tl.int32)
    # 2**(s - 127): byte 0 is the FP32 subnormal 2**-127, byte 255 is NaN.
    s_bits = tl.where(s == 0, 0x00400000, s << 23)
    s_bits = tl.where(s == 255, 0x7FC00000, s_bits)
    factor = s_bits.to(tl.float32, bitcast=True)
    y = tl.reshape(v, (ROWS, COLS // 32, 32)) * factor[:, :, None]
    y = tl.reshape(y, (ROWS, COLS))
    bits = (y.to(tl.int32, bitcast=True) >> 16).to(tl.int16)
    return bits.to(tl.bfloat16, bitcast=True)


@triton.jit
def _mx_dot(acc, w, w_scales, a, a_scales, A_BF16: tl.constexpr):
    """acc + W @ A.T in FP32: W MXFP4 [N, K] (packed along K) on the left, so that the
    weights fill the tensor cores' 64-row side and the few tokens their narrow side; A
    MXFP8 [M, K] (E4M3 codes + scales [M, K/32]) or, when A_BF16, its BF16 values
    already transposed ([K, M], ``_bf16_activations``).

    fast_math skips the NaN test of the scales: ``prepare_weights`` refuses weights with
    the NaN scale, and a NaN-coded activation block (codes 0x7F) is NaN without it."""
    if A_BF16:
        return tl.dot_scaled(w, w_scales, "e2m1", a, None, "bf16", acc, fast_math=True)
    else:
        return tl.dot_scaled(w, w_scales, "e2m1", tl.trans(a), a_scales, "e4m3", acc,
                             fast_math=True)


@triton.jit
def _bf16_weights_dot(acc, w, a, STAGED: tl.constexpr, INTERPRET: tl.constexpr):
    """acc + W @ A in FP32 of BF16 weights W [N, K] (``_decoded_weights``) and BF16
    activations A [K, M].

    Both operands hold the exact values of the MX operands (DESIGN.md: exact upcast).
    STAGED (Hopper, ``staged_dot``): ``tl.dot``, the product ``tl.dot_scaled`` forms on
    Hopper too (no MX tensor cores there: it upcasts to BF16 for wgmma), because Triton
    3.6's pipeliner stages a ``tl.dot`` operand in shared memory asynchronously but not
    a ``dot_scaled`` one (even with formats "bf16"): that cost each step a store of the
    activations through registers, a fence and a barrier, 1.36x and 1.39x the time at
    TP8, b = 65 and 256 (the probe's figures of the third and the fourth lease,
    benchmarks/NOTES.md). Else ``tl.dot_scaled``.

    Triton's interpreter computes BF16 products as if FP16 (values past 65504 become
    Inf, subnormals 0), so there the same exact values go to an FP32 dot, which it sums
    as one FP32 matmul."""
    if INTERPRET:
        acc = tl.dot(_bf16_as_f32(w), _bf16_as_f32(a), acc, input_precision="ieee")
    elif STAGED:
        acc = tl.dot(w, a, acc)
    else:
        acc = tl.dot_scaled(w, None, "bf16", a, None, "bf16", acc, fast_math=True)
    return acc


@triton.jit
def _bf16_as_f32(x):
    """The FP32 values of BF16 ``x``, built on the bits (subnormals kept)."""
    bits = x.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    return (bits << 16).to(tl.float32, bitcast=True)


@triton.jit
def _reduce(acc, codes_ptr, scales_ptr, values_ptr, act_rows, act_ok, w_e, ws_e, w_rows,
            K: tl.constexpr, MASK_ROWS: tl.constexpr, A_BF16: tl.constexpr,
            DECODE: tl.constexpr, STAGED: tl.constexpr, WIDE_SCALES: tl.constexpr,
            INTERPRET: tl.constexpr, ROW_BLOCK: tl.constexpr, WGMMA_ORDER: tl.constexpr,
            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr,
            TMA: tl.constexpr):
    """acc + W[w_rows, :] @ A[act_rows, :].T over the whole reduction (K elements) in
    steps of BLOCK_K, in order: W the expert matrix at w_e/ws_e (codes, scales), A the
    activations, gathered by ``act_rows`` (codes_ptr/scales_ptr: MXFP8; values_ptr: their
    BF16 values, the only ones DECODE takes). STAGED: DECODE on Hopper (``staged_dot``),
    where MASK_ROWS reads only the activation rows ``act_ok`` (zeros for the others).
    TMA (STAGED, up launch): w_e/ws_e are the descriptors of ``_weight_descriptors`` and
    W the up program's rows (``_tma_weights``), w_rows unused."""
    if STAGED:
        acc = _reduce_staged(acc, values_ptr, act_rows, act_ok, w_e, ws_e, w_rows, K,
                             MASK_ROWS, WIDE_SCALES, INTERPRET, ROW_BLOCK, BLOCK_N, BLOCK_K,
                             NUM_STAGES, TMA)
    else:
        acc = _reduce_prefetched(acc, codes_ptr, scales_ptr, values_ptr, act_rows, w_e, ws_e,
                                 w_rows, K, A_BF16, DECODE, WIDE_SCALES, INTERPRET,
                                 ROW_BLOCK, WGMMA_ORDER, BLOCK_N, BLOCK_K, NUM_STAGES)
    return acc


@triton.jit
def _reduce_staged(acc, values_ptr, act_rows, act_ok, w_e, ws_e, w_rows, K: tl.constexpr,
                   MASK_ROWS: tl.constexpr, WIDE_SCALES: tl.constexpr, INTERPRET: tl.constexpr,
                   ROW_BLOCK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   NUM_STAGES: tl.constexpr, TMA: tl.constexpr):
    """``_reduce`` for "wgmma_decode" weights: both operands of each step loaded in that
    step, so that the compiler's pipeliner stages both through shared memory with
    asynchronous copies, NUM_STAGES - 1 steps ahead. The weights then load into
    registers in the layout the tensor cores take them from (lane order), are decoded
    there, and the activation rows feed the MMA straight from shared memory (read
    transposed, a view): no store of theirs through registers, no fence a step. With
    TMA the weights arrive by the tensor memory accelerator instead of the threads'
    copies, staged the same way."""
    for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        a = _staged_activations(values_ptr, act_rows, act_ok, k0, K, MASK_ROWS, BLOCK_K)
        if TMA:
            w = _tma_weights(w_e, ws_e, k0 // BLOCK_K, BLOCK_N, BLOCK_K, ROW_BLOCK,
                             WIDE_SCALES, INTERPRET)
        else:
            w = _decoded_weights(w_e, ws_e, w_rows, k0, K, BLOCK_N, BLOCK_K, ROW_BLOCK,
                                 WIDE_SCALES, INTERPRET)
        acc = _bf16_weights_dot(acc, w, tl.trans(a), True, INTERPRET)
        acc = _settled(acc, INTERPRET)
    return acc


@triton.jit
def _settled(acc, INTERPRET: tl.constexpr):
    """acc, once every MMA of the step has completed.

    The step's MMAs read the decoded weights from registers after they issue. Left to
    itself, Triton 3.6's pipeliner waits for all but the last MMA group of a step, and
    the next step's decode overwrites the registers of the groups still in flight
    (triton-lang/triton#9433): rows then depend on timing (on the H200, when another
    kernel's programs share the SMs: benchmarks/NOTES.md, fourteenth lease). A read of
    acc by an instruction that is not an MMA (a register move) makes the compiler
    complete them before anything overwrites their registers (Triton 3.6 then waits for
    each group as it issues, which the H200 ran faster, not slower: NOTES);
    the SASS of every tuned config is checked for such writes (tests/sass_hazards.py:
    test_compile.py without a GPU, test_sass_hazards.py on a Hopper GPU)."""
    if not INTERPRET:
        acc = tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [acc], dtype=tl.float32,
                                        is_pure=True, pack=1)
    return acc


@triton.jit
def _staged_activations(values_ptr, rows, ok, k0, cols, MASK_ROWS: tl.constexpr,
                        BLOCK_K: tl.constexpr):
    """BF16 activations [M, BLOCK_K] of rows ``rows`` of a [*, cols] matrix, columns k0 ..;
    with MASK_ROWS the rows not ``ok`` are zeros, not read (the copy stays asynchronous)."""
    ptrs = values_ptr + rows[:, None] * cols + (k0 + tl.arange(0, BLOCK_K))[None, :]
    if MASK_ROWS:
        a = tl.load(ptrs, mask=ok[:, None], other=0.0)
    else:
        a = tl.load(ptrs)
    return a


@triton.jit
def _reduce_prefetched(acc, codes_ptr, scales_ptr, values_ptr, act_rows, w_e, ws_e, w_rows,
                       K: tl.constexpr, A_BF16: tl.constexpr, DECODE: tl.constexpr,
                       WIDE_SCALES: tl.constexpr, INTERPRET: tl.constexpr,
                       ROW_BLOCK: tl.constexpr, WGMMA_ORDER: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr):
    """``_reduce`` with ``tl.dot_scaled``: of the E2M1 codes ("wgmma", "nk"), or of our
    decode of "wgmma_decode" words off Hopper.

    The compiler's pipeliner stages the weights through shared memory, but not the
    operand of a ``dot_scaled`` that feeds the MMA from shared memory (Triton 3.6), so
    the gathered activation tiles are loaded a step ahead by hand; each step then stores
    its tile into shared memory through registers."""
    a, a_s = _activation_tile(codes_ptr, scales_ptr, values_ptr, act_rows, 0, K, A_BF16,
                              BLOCK_K)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        # The next step's activations, a step ahead; the last step reloads step 0.
        a_next, a_s_next = _activation_tile(codes_ptr, scales_ptr, values_ptr, act_rows,
                                            _next_step(k0, K, BLOCK_K), K, A_BF16, BLOCK_K)
        if DECODE:
            w = _decoded_weights(w_e, ws_e, w_rows, k0, K, BLOCK_N, BLOCK_K, ROW_BLOCK,
                                 WIDE_SCALES, INTERPRET)
            acc = _bf16_weights_dot(acc, w, a, False, INTERPRET)
        else:
            w = _weight_codes(w_e, w_rows, k0, K, BLOCK_N, BLOCK_K, ROW_BLOCK, WGMMA_ORDER)
            w_s = _weight_scales(ws_e, w_rows, k0, K, BLOCK_K, ROW_BLOCK)
            acc = _mx_dot(acc, w, w_s, a, a_s, A_BF16)
        a, a_s = a_next, a_s_next
    return acc


# ----------------------------------------------------------------------------- kernels

@triton.jit
def _experts_up_kernel(
        q_ptr, qs_ptr, qv_ptr, counts_ptr, pairs_ptr, generation_ptr,
        w_ptr, ws_ptr, w_desc, ws_desc, h_ptr, hs_ptr, hv_ptr, num_experts, wide_rows, beta,
        linear_beta,
        LATENT: tl.constexpr, INTER: tl.constexpr, TOP_K: tl.constexpr,
        HAS_LINEAR_BETA: tl.constexpr, A_BF16: tl.constexpr, STORE_VALUES: tl.constexpr,
        ROW_BLOCK: tl.constexpr, WGMMA_ORDER: tl.constexpr, DECODE: tl.constexpr,
        STAGED: tl.constexpr, WIDE_SCALES: tl.constexpr, INTERPRET: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        NUM_STAGES: tl.constexpr, MASK_ROWS: tl.constexpr, HALF_TILE: tl.constexpr,
        TMA: tl.constexpr):
    """Program (e, j): hidden columns j*BLOCK_N .. of every pair listed for expert e,
    h = mxfp8(situ(W13_gate q, W13_up q)), stored at the pair's workspace row (and its
    exact BF16 values too, when STORE_VALUES). A_BF16: the activations are the plan's
    BF16 values (``q_values``) rather than its codes and scales. DECODE: the weights are
    in the "wgmma_decode" layout, w_ptr their int32 words. HALF_TILE: ``_full_tiles``.
    TMA (STAGED): the weights are read through w_desc / ws_desc (``_weight_descriptors``),
    else through w_ptr / ws_ptr (the descriptors are then None)."""
    e = tl.program_id(0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    count, list_ptr = _list_of_expert(counts_ptr, pairs_ptr, generation_ptr, e,
                                      num_experts, wide_rows)
    if TMA:  # the descriptors cover every expert: _tma_weights picks e's boxes
        w_e, ws_e = w_desc, ws_desc
    else:
        w_e = w_ptr + e.to(tl.int64) * (2 * INTER * LATENT // (8 if DECODE else 2))
        ws_e = ws_ptr + e.to(tl.int64) * (2 * INTER * LATENT // 32)
    # An expert with no pairs runs zero iterations: its weights are never read.
    full = _full_tiles(count, BLOCK_M, HALF_TILE)
    for m0 in range(0, full, BLOCK_M):
        _up_tile(q_ptr, qs_ptr, qv_ptr, list_ptr, m0, count, n, w_e, ws_e,
                 h_ptr, hs_ptr, hv_ptr, beta, linear_beta, LATENT, INTER, TOP_K,
                 HAS_LINEAR_BETA, A_BF16, STORE_VALUES, ROW_BLOCK, WGMMA_ORDER, DECODE,
                 STAGED, WIDE_SCALES, INTERPRET, BLOCK_M, BLOCK_N, BLOCK_K, NUM_STAGES,
                 MASK_ROWS, TMA)
    if HALF_TILE:
        for m0 in range(full, count, BLOCK_M // 2):
            _up_tile(q_ptr, qs_ptr, qv_ptr, list_ptr, m0, count, n, w_e, ws_e,
                     h_ptr, hs_ptr, hv_ptr, beta, linear_beta, LATENT, INTER, TOP_K,
                     HAS_LINEAR_BETA, A_BF16, STORE_VALUES, ROW_BLOCK, WGMMA_ORDER, DECODE,
                     STAGED, WIDE_SCALES, INTERPRET, BLOCK_M // 2, BLOCK_N, BLOCK_K,
                     NUM_STAGES, MASK_ROWS, TMA)


@triton.jit
def _full_tiles(count, BLOCK_M: tl.constexpr, HALF_TILE: tl.constexpr):
    """How many of a list's ``count`` pairs run in tiles of BLOCK_M; with HALF_TILE, a
    last tile of at most BLOCK_M/2 pairs runs as a BLOCK_M/2 tile instead (the rest).

    The MMA's narrow side is the tile's pairs, padding included: a 32-pair tile costs
    1.2-1.5x a 16-pair one on the same weights, and at b = 1024 (TP8) a third of the
    lists hold at most 16 of their 18 pairs on average (benchmarks/NOTES.md, eighth
    lease: the down launch 4.5% faster there, the up launch unchanged). A row's sum runs
    over the same steps in the same order in either tile."""
    full = count
    if HALF_TILE:
        last = count % BLOCK_M
        full = tl.where((last > 0) & (last <= BLOCK_M // 2), count - last, count)
    return full


@triton.jit
def _up_tile(q_ptr, qs_ptr, qv_ptr, list_ptr, m0, count, n, w_e, ws_e,
             h_ptr, hs_ptr, hv_ptr, beta, linear_beta, LATENT: tl.constexpr,
             INTER: tl.constexpr, TOP_K: tl.constexpr, HAS_LINEAR_BETA: tl.constexpr,
             A_BF16: tl.constexpr, STORE_VALUES: tl.constexpr, ROW_BLOCK: tl.constexpr,
             WGMMA_ORDER: tl.constexpr, DECODE: tl.constexpr, STAGED: tl.constexpr,
             WIDE_SCALES: tl.constexpr, INTERPRET: tl.constexpr, BLOCK_M: tl.constexpr,
             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr,
             MASK_ROWS: tl.constexpr, TMA: tl.constexpr):
    """The up kernel's hidden columns ``n`` of list entries m0 .. m0+BLOCK_M-1."""
    n_ok = n < INTER
    n_in = _clamped(n, INTER, BLOCK_N)
    # The tile's gate rows, then its up rows (the up rows follow the I gate rows): one
    # dot a step over both, so one shared-memory fence, barrier and MMA wait a step.
    rows = tl.reshape(tl.join(n_in, n_in + INTER).permute(1, 0), (2 * BLOCK_N,))
    sc = tl.program_id(1) * (BLOCK_N // 32) + tl.arange(0, BLOCK_N // 32)
    pair, m_ok = _load_pairs(list_ptr, m0, count, BLOCK_M)
    acc = _reduce(tl.zeros((2 * BLOCK_N, BLOCK_M), tl.float32), q_ptr, qs_ptr, qv_ptr,
                  pair // TOP_K, m_ok, w_e, ws_e, rows, LATENT, MASK_ROWS, A_BF16, DECODE,
                  STAGED, WIDE_SCALES, INTERPRET, ROW_BLOCK, WGMMA_ORDER, 2 * BLOCK_N,
                  BLOCK_K, NUM_STAGES, TMA)
    acc_g, acc_u = tl.split(tl.permute(tl.reshape(acc, (2, BLOCK_N, BLOCK_M)), (1, 2, 0)))
    h = tl.trans(situ(acc_g, acc_u, beta, linear_beta, HAS_LINEAR_BETA, INTERPRET))
    codes, scales = mxfp8_tile(h, BLOCK_M, BLOCK_N)
    tl.store(h_ptr + pair[:, None] * INTER + n[None, :], codes,
             mask=m_ok[:, None] & n_ok[None, :])
    tl.store(hs_ptr + pair[:, None] * (INTER // 32) + sc[None, :], scales,
             mask=m_ok[:, None] & (sc[None, :] < INTER // 32))
    if STORE_VALUES:
        tl.store(hv_ptr + pair[:, None] * INTER + n[None, :],
                 _e4m3_to_bf16(codes, scales, BLOCK_M, BLOCK_N),
                 mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _experts_down_kernel(
        h_ptr, hs_ptr, hv_ptr, counts_ptr, pairs_ptr, generation_ptr,
        w_ptr, ws_ptr, rows_ptr, num_experts, wide_rows,
        LATENT: tl.constexpr, INTER: tl.constexpr, A_BF16: tl.constexpr,
        ROW_BLOCK: tl.constexpr, WGMMA_ORDER: tl.constexpr, DECODE: tl.constexpr,
        STAGED: tl.constexpr, WIDE_SCALES: tl.constexpr, INTERPRET: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        NUM_STAGES: tl.constexpr, COLS: tl.constexpr, MASK_ROWS: tl.constexpr,
        HALF_TILE: tl.constexpr, PDL_TRIGGER: tl.constexpr):
    """Program (e, j): latent columns j*BLOCK_N .. of every pair listed for expert e,
    rows[p] = bf16(W2_e h[p]), from the MXFP8 hidden in the workspace (its BF16 values
    when A_BF16; DECODE as in the up kernel). COLS > 1 (STAGED only): program (e, g)
    takes the COLS column tiles g*COLS .. (``_down_columns``). HALF_TILE:
    ``_full_tiles``. PDL_TRIGGER: the kernel after it (finalize, a dependent launch) may
    start once this one's programs have all started (``pdl``)."""
    allow_dependent_launch(PDL_TRIGGER)
    e = tl.program_id(0)
    count, list_ptr = _list_of_expert(counts_ptr, pairs_ptr, generation_ptr, e,
                                      num_experts, wide_rows)
    w_e = w_ptr + e.to(tl.int64) * (LATENT * INTER // (8 if DECODE else 2))
    ws_e = ws_ptr + e.to(tl.int64) * (LATENT * INTER // 32)
    full = _full_tiles(count, BLOCK_M, HALF_TILE)
    for m0 in range(0, full, BLOCK_M):
        _down_tile(h_ptr, hs_ptr, hv_ptr, list_ptr, m0, count, w_e, ws_e, rows_ptr, LATENT,
                   INTER, A_BF16, ROW_BLOCK, WGMMA_ORDER, DECODE, STAGED, WIDE_SCALES,
                   INTERPRET, BLOCK_M, BLOCK_N, BLOCK_K, NUM_STAGES, COLS, MASK_ROWS)
    if HALF_TILE:
        for m0 in range(full, count, BLOCK_M // 2):
            _down_tile(h_ptr, hs_ptr, hv_ptr, list_ptr, m0, count, w_e, ws_e, rows_ptr,
                       LATENT, INTER, A_BF16, ROW_BLOCK, WGMMA_ORDER, DECODE, STAGED,
                       WIDE_SCALES, INTERPRET, BLOCK_M // 2, BLOCK_N, BLOCK_K, NUM_STAGES,
                       COLS, MASK_ROWS)


@triton.jit
def _down_tile(h_ptr, hs_ptr, hv_ptr, list_ptr, m0, count, w_e, ws_e, rows_ptr,
               LATENT: tl.constexpr, INTER: tl.constexpr, A_BF16: tl.constexpr,
               ROW_BLOCK: tl.constexpr, WGMMA_ORDER: tl.constexpr, DECODE: tl.constexpr,
               STAGED: tl.constexpr, WIDE_SCALES: tl.constexpr, INTERPRET: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               NUM_STAGES: tl.constexpr, COLS: tl.constexpr, MASK_ROWS: tl.constexpr):
    """The down kernel's program columns for list entries m0 .. m0+BLOCK_M-1."""
    pair, m_ok = _load_pairs(list_ptr, m0, count, BLOCK_M)
    if COLS > 1:
        _down_columns(hv_ptr, pair, m_ok, w_e, ws_e, rows_ptr, tl.program_id(1) * COLS,
                      LATENT, INTER, ROW_BLOCK, WIDE_SCALES, INTERPRET, BLOCK_M, BLOCK_N,
                      BLOCK_K, NUM_STAGES, COLS, MASK_ROWS)
    else:
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = _reduce(tl.zeros((BLOCK_N, BLOCK_M), tl.float32), h_ptr, hs_ptr, hv_ptr,
                      pair, m_ok, w_e, ws_e, _clamped(n, LATENT, BLOCK_N), INTER, MASK_ROWS,
                      A_BF16, DECODE, STAGED, WIDE_SCALES, INTERPRET, ROW_BLOCK,
                      WGMMA_ORDER, BLOCK_N, BLOCK_K, NUM_STAGES, False)
        tl.store(rows_ptr + pair[:, None] * LATENT + n[None, :],
                 f32_to_bf16_bits(tl.trans(acc)), mask=m_ok[:, None] & (n < LATENT)[None, :])


@triton.jit
def _down_columns(hv_ptr, pair, m_ok, w_e, ws_e, rows_ptr, j0, LATENT: tl.constexpr,
                  INTER: tl.constexpr, ROW_BLOCK: tl.constexpr, WIDE_SCALES: tl.constexpr,
                  INTERPRET: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr, COLS: tl.constexpr,
                  MASK_ROWS: tl.constexpr):
    """The down launch's columns j0*BLOCK_N .. (j0+COLS)*BLOCK_N of one tile of pairs
    ("wgmma_decode" weights, staged): the steps of the COLS column tiles in one pipelined
    loop, so that the copies of the next tile's first steps overlap this tile's last, and
    the list walk and pipeline fill are paid once for COLS tiles (I / BLOCK_K is only 3
    steps a tile at TP8). Each row's sum runs over the same steps in the same order as
    with COLS = 1."""
    STEPS: tl.constexpr = INTER // BLOCK_K
    acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
    for it in tl.range(0, COLS * STEPS, num_stages=NUM_STAGES):
        n = (j0 + it // STEPS) * BLOCK_N + tl.arange(0, BLOCK_N)
        k0 = (it % STEPS) * BLOCK_K
        a = _staged_activations(hv_ptr, pair, m_ok, k0, INTER, MASK_ROWS, BLOCK_K)
        w = _decoded_weights(w_e, ws_e, _clamped(n, LATENT, BLOCK_N * COLS), k0, INTER,
                             BLOCK_N, BLOCK_K, ROW_BLOCK, WIDE_SCALES, INTERPRET)
        # Zeroed before a column tile's first product, not after its store: reset there,
        # the accumulator is written by other instructions inside the loop's wgmma
        # pipeline, and Triton 3.6's ptxas then waits out every wgmma (its advice C7515),
        # 4-6% of the launch's time (benchmarks/NOTES.md, eleventh lease).
        if k0 == 0:
            acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
        acc = _bf16_weights_dot(acc, w, tl.trans(a), True, INTERPRET)
        if it % STEPS == STEPS - 1:
            tl.store(rows_ptr + pair[:, None] * LATENT + n[None, :],
                     f32_to_bf16_bits(tl.trans(acc)),
                     mask=m_ok[:, None] & (n < LATENT)[None, :])


@triton.jit
def _plan_values_kernel(q_ptr, qs_ptr, out_ptr, COLS: tl.constexpr, BLOCK: tl.constexpr):
    """Program (t, j): the exact BF16 values of plan row t, columns j*BLOCK .."""
    t = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    codes = tl.load(q_ptr + t * COLS + c)[None, :]
    sc = tl.program_id(1) * (BLOCK // 32) + tl.arange(0, BLOCK // 32)
    scales = tl.load(qs_ptr + t * (COLS // 32) + sc)[None, :]
    tl.store(out_ptr + t * COLS + c[None, :], _e4m3_to_bf16(codes, scales, 1, BLOCK))


# ----------------------------------------------------------------------------- wrapper

def _check_config(name: str, config: dict) -> dict:
    if not isinstance(config, dict):
        raise TypeError(f"{name} must be a dict of launch parameters, got "
                        f"{type(config).__name__}")
    if "BLOCK_K" in config:
        raise ValueError(f"{name} must not set BLOCK_K: the reduction step is fixed per "
                         f"shape, by prepare_weights, so that results never depend on the "
                         f"batch-width bucket")
    missing = [k for k in CONFIG_KEYS if k not in config]
    if missing:
        raise ValueError(f"{name} lacks {missing}")
    unknown = [k for k in config if k not in CONFIG_KEYS and k not in STAGED_KEYS]
    if unknown:
        raise ValueError(f"{name} has unknown keys {unknown} (known: "
                         f"{[*CONFIG_KEYS, *STAGED_KEYS]})")
    m, n = config["BLOCK_M"], config["BLOCK_N"]
    if m < 16 or m & (m - 1):
        raise ValueError(f"{name}['BLOCK_M'] must be a power of two >= 16, got {m}")
    if n < ROW_BLOCK or n & (n - 1):
        raise ValueError(f"{name}['BLOCK_N'] must be a power of two >= {ROW_BLOCK} (whole "
                         f"weight tiles), got {n}")
    if config["maxnreg"] not in (0, *range(24, 256, 8)):
        raise ValueError(f"{name}['maxnreg'] must be 0 (no cap) or a multiple of 8 in "
                         f"[24, 248], got {config['maxnreg']}")
    cols = config.get("COLS", 1)
    if not isinstance(cols, int) or cols < 1 or cols & (cols - 1):
        raise ValueError(f"{name}['COLS'] must be a power of two >= 1, got {cols!r}")
    if config.get("MASK_ROWS", 0) not in (0, 1):
        raise ValueError(f"{name}['MASK_ROWS'] must be 0 or 1, got {config['MASK_ROWS']!r}")
    if config.get("TMA", 0) not in (0, 1):
        raise ValueError(f"{name}['TMA'] must be 0 or 1, got {config['TMA']!r}")
    if config.get("HALF_TILE", 0) not in (0, 1):
        raise ValueError(f"{name}['HALF_TILE'] must be 0 or 1, got {config['HALF_TILE']!r}")
    if config.get("HALF_TILE", 0) and m < 32:
        raise ValueError(f"{name}['HALF_TILE'] needs BLOCK_M >= 32 (a half tile has at "
                         f"least 16 rows, the MMA's least), got BLOCK_M {m}")
    if config["A_BF16"] not in (0, 1):
        raise ValueError(f"{name}['A_BF16'] must be 0 or 1, got {config['A_BF16']}")
    return config


def _check_staged_keys(name: str, config: dict, staged: bool, up: bool) -> None:
    """STAGED_KEYS away from their neutral values only where a launch takes them."""
    set_keys = [k for k, v in STAGED_KEYS.items() if config.get(k, v) != v]
    if set_keys and not staged:
        raise ValueError(f"{name} sets {set_keys}, which only 'wgmma_decode' weights on "
                         f"Hopper take (experts.staged_dot)")
    if "COLS" in set_keys and up:
        raise ValueError(f"{name}['COLS'] is for the down launch only, got "
                         f"{config['COLS']}")
    if "TMA" in set_keys and not up:
        raise ValueError(f"{name}['TMA'] is for the up launch only, got {config['TMA']!r}")


def _check_decode_config(name: str, config: dict) -> None:
    # With BF16 weights and E4M3 activations, Triton 3.6 lowers dot_scaled with the
    # operands swapped and the weights through shared memory (no wgmma from registers):
    # the decoded layout is only worth it with BF16 activations.
    if not config["A_BF16"]:
        raise ValueError(f"{name}['A_BF16'] must be 1 with weights in the 'wgmma_decode' "
                         f"layout (their BF16 tile needs BF16 activations beside it)")


def _check_configs(config_up: dict, config_down: dict, decode: bool,
                   staged: bool) -> tuple[dict, dict]:
    """(config_up, config_down) checked as ``experts`` takes them for weights that run
    the decode layout (``decode``) and the staged path (``staged``), or a named error."""
    cfg_up = _check_config("config_up", config_up)
    cfg_down = _check_config("config_down", config_down)
    if decode:
        _check_decode_config("config_up", cfg_up)
        _check_decode_config("config_down", cfg_down)
    _check_staged_keys("config_up", cfg_up, staged, up=True)
    _check_staged_keys("config_down", cfg_down, staged, up=False)
    return cfg_up, cfg_down


def _check_block_k(name: str, block_k: int, dim: int, dim_name: str) -> int:
    if block_k < 32 or block_k & (block_k - 1) or dim % block_k:
        raise ValueError(f"{name} ({block_k}) must be a power of two >= 32 dividing "
                         f"{dim_name} ({dim})")
    return block_k


def _check_workspace(workspace, b: int, top_k: int, latent: int, inter: int,
                     device) -> Workspace:
    if not isinstance(workspace, Workspace):
        raise TypeError(f"workspace must be a Workspace (from make_workspace), got "
                        f"{type(workspace).__name__}")
    check_tensor("workspace.h_codes", workspace.h_codes, torch.uint8, (None, inter), device)
    pairs = workspace.h_codes.shape[0]
    check_tensor("workspace.h_scales", workspace.h_scales, torch.uint8,
                 (pairs, inter // MX_BLOCK), device)
    check_tensor("workspace.h_values", workspace.h_values, torch.bfloat16, (pairs, inter),
                 device)
    check_tensor("workspace.q_values", workspace.q_values, torch.bfloat16, (None, latent),
                 device)
    if pairs < b * top_k:
        raise ValueError(f"workspace.h_codes must have >= b*K = {b * top_k} rows, got {pairs}")
    if workspace.q_values.shape[0] < b:
        raise ValueError(f"workspace.q_values must have >= b = {b} rows, got "
                         f"{workspace.q_values.shape[0]}")
    return workspace


def tma_boxes(block_n: int, block_k: int, row_block: int = ROW_BLOCK):
    """The box shapes of ``_weight_descriptors`` for up programs of ``block_n`` hidden
    columns and steps of ``block_k``: (words, scales)."""
    blocks = block_n // row_block
    return ([1, 2, blocks, row_block, block_k // 8],
            [1, 2, blocks, 1, row_block * block_k // MX_BLOCK])


def _weight_descriptors(weights: ExpertWeights, block_n: int):
    """Tensor-memory-accelerator descriptors of the up weights for programs of ``block_n``
    hidden columns (``_tma_weights``): w13's words as [E, 2 (gate, up), I / row_block,
    steps * row_block, words a row a step] and its scales as [E, 2, I / row_block, steps,
    row_block * scales a row a step], each the tiled order of ``ExpertWeights`` seen as
    5 dimensions; one box of each is a program's step: the tiles of its gate rows and of
    its up rows. For "wgmma_decode" weights (the staged path, ``_check_staged_keys``)
    whose I is a multiple of row_block (else a tile would hold gate and up rows;
    BLOCK_N always is one) and whose scales of a tile's step fit a box's 256 bytes a
    dimension (the hardware's limit: BLOCK_K <= 128)."""
    E, I, rb, bk = weights.num_experts, weights.inter, weights.row_block, weights.block_k_up
    word_box, scale_box = tma_boxes(block_n, bk, rb)
    if I % rb:
        raise ValueError(f"config_up['TMA'] needs I ({I}) a multiple of the weights' row "
                         f"block ({rb})")
    if scale_box[-1] > 256:
        raise ValueError(f"config_up['TMA'] needs the up reduction step ({bk}) at most "
                         f"{256 * MX_BLOCK // rb}: a box holds at most 256 bytes of a row")
    steps = weights.latent // bk
    words = weights.w13.view(torch.int32).view(E, 2, I // rb, steps * rb, word_box[-1])
    scales = weights.w13_scales.view(E, 2, I // rb, steps, scale_box[-1])
    return (TensorDescriptor.from_tensor(words, word_box),
            TensorDescriptor.from_tensor(scales, scale_box))


def _launch_options(config: dict) -> dict:
    """Compiler options of a config: warps, pipeline depth, and a register cap (maxnreg,
    0 = the compiler's choice), which trades registers for resident warps: the weight
    upcast is a long chain of dependent integer ops whose latency only other warps hide."""
    options = dict(num_warps=config["num_warps"], num_stages=config["num_stages"])
    if config.get("maxnreg"):
        options["maxnreg"] = config["maxnreg"]
    return options


class _NoLaunch:
    """A kernel handle whose launches do nothing."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


@contextlib.contextmanager
def only_launch(kind: str):
    """Within: ``experts`` launches only its ``kind`` kernel ("up" or "down") and skips the
    other, so that one launch can be timed alone (the tuner, the benchmarks). The skipped
    launch's outputs keep what an earlier call wrote (down reads the hidden the last up
    launch left in the workspace). It swaps module globals: not for concurrent callers."""
    global _experts_up_kernel, _experts_down_kernel
    if kind not in ("up", "down"):
        raise ValueError(f"kind must be 'up' or 'down', got {kind!r}")
    saved = _experts_up_kernel, _experts_down_kernel
    if kind == "up":
        _experts_down_kernel = _NoLaunch()
    else:
        _experts_up_kernel = _NoLaunch()
    try:
        yield
    finally:
        _experts_up_kernel, _experts_down_kernel = saved


def _plan_values(q: torch.Tensor, q_scales: torch.Tensor, out: torch.Tensor) -> None:
    """out[:b] = the exact BF16 values of the MXFP8 plan (for BF16 activations)."""
    b, cols = q.shape
    block = reduction_block(cols, 512)
    _plan_values_kernel[(b, cols // block)](q, q_scales, out, COLS=cols, BLOCK=block,
                                            num_warps=4)


def experts(q: torch.Tensor, q_scales: torch.Tensor, weights: ExpertWeights,
            counts: torch.Tensor, pairs: torch.Tensor, generation: torch.Tensor,
            top_k: int, beta: float, linear_beta: float | None, *,
            rows: torch.Tensor | None = None, workspace: Workspace | None = None,
            config_up: dict | None = None, config_down: dict | None = None) -> torch.Tensor:
    """``rows[t*K + k] = bf16(W2_e . mxfp8(situ(W13_e . q[t])))`` for every pair listed
    in this call's parity of the routing lists; BF16 [b*K, L].

    q/q_scales: the MXFP8 plan, uint8 [b, L] / [b, L/32]. weights: ``prepare_weights``'s
    result. counts int32 [2, E], pairs int32 [2, E, R], generation int32 [1]: the routing
    lists; the kernels use parity ``generation[0] & 1``, read on the device, and expert
    e's pairs ``pairs[p, e, :counts[p, e]]`` in any order (each pair p < b*K listed
    exactly once, as the route kernel guarantees: rows of unlisted pairs are not written).
    beta/linear_beta: SiTU's parameters (linear_beta None: u' = u).

    rows: the output buffer (BF16 [b*K, L]), allocated if None. workspace: the buffers
    between the stages (``make_workspace`` for >= b tokens), allocated if None; pass both
    for CUDA graphs. config_up/config_down: launch configs (``CONFIG_KEYS``; on the staged
    path also ``STAGED_KEYS``, COLS for the down launch only), else the tuned ones for
    batch width b. The reduction steps are the weights'
    (``prepare_weights``)."""
    if not isinstance(weights, ExpertWeights):
        raise TypeError(f"weights must be an ExpertWeights (from prepare_weights), got "
                        f"{type(weights).__name__}")
    E, L, inter = weights.num_experts, weights.latent, weights.inter
    device = weights.device
    check_tensor("q", q, torch.uint8, (None, L), device)
    b = q.shape[0]
    check_tensor("q_scales", q_scales, torch.uint8, (b, L // MX_BLOCK), device)
    check_tensor("counts", counts, torch.int32, (2, E), device)
    check_tensor("pairs", pairs, torch.int32, (2, E, None), device)
    check_tensor("generation", generation, torch.int32, (1,), device)
    wide_rows = pairs.shape[2]
    if not isinstance(top_k, int) or isinstance(top_k, bool) or not 1 <= top_k <= E:
        raise ValueError(f"top_k must be an int in [1, {E}], got {top_k!r}")
    if not beta > 0 or (linear_beta is not None and not linear_beta > 0):
        raise ValueError(f"beta ({beta}) and linear_beta ({linear_beta}) must be positive")
    num_pairs = b * top_k
    if rows is None:
        rows = torch.empty(num_pairs, L, dtype=torch.bfloat16, device=device)
    check_tensor("rows", rows, torch.bfloat16, (num_pairs, L), device)
    if workspace is None:
        workspace = make_workspace(b, top_k, L, inter, device)
    ws = _check_workspace(workspace, b, top_k, L, inter, device)
    decode = weights.layout == "wgmma_decode"
    tune = tuning(weights.layout, device)
    key = shape_key(L, inter, E) + tune.suffix
    staged = decode and staged_dot(device)
    cfg_up, cfg_down = _check_configs(
        config_up if config_up is not None else
        config_for(KERNEL_UP, key, b, tune.default_up, device),
        config_down if config_down is not None else
        config_for(KERNEL_DOWN, key, b, tune.default_down, device), decode, staged)
    tma = cfg_up.get("TMA", 0)
    descriptors = _weight_descriptors(weights, cfg_up["BLOCK_N"]) if tma else (None, None)
    if num_pairs == 0:
        return rows
    if cfg_up["A_BF16"]:
        _plan_values(q, q_scales, ws.q_values)
    tiles = dict(ROW_BLOCK=weights.row_block, WGMMA_ORDER=weights.layout in TILED_LAYOUTS,
                 DECODE=decode, STAGED=staged,
                 INTERPRET=_interpreting())
    codes = (lambda t: t.view(torch.int32)) if decode else (lambda t: t)
    _experts_up_kernel[(E, triton.cdiv(inter, cfg_up["BLOCK_N"]))](
        q, q_scales, ws.q_values, counts, pairs, generation, codes(weights.w13),
        weights.w13_scales, *descriptors,
        ws.h_codes, ws.h_scales, ws.h_values, E, wide_rows, float(beta),
        float(linear_beta) if linear_beta is not None else 1.0,
        LATENT=L, INTER=inter, TOP_K=top_k, HAS_LINEAR_BETA=linear_beta is not None,
        A_BF16=cfg_up["A_BF16"], STORE_VALUES=cfg_down["A_BF16"], **tiles,
        WIDE_SCALES=weights.wide_scales_up,
        BLOCK_M=cfg_up["BLOCK_M"], BLOCK_N=cfg_up["BLOCK_N"], BLOCK_K=weights.block_k_up,
        NUM_STAGES=cfg_up["num_stages"], MASK_ROWS=cfg_up.get("MASK_ROWS", 0),
        HALF_TILE=cfg_up.get("HALF_TILE", 0), TMA=tma, **_launch_options(cfg_up))
    cols = cfg_down.get("COLS", 1)
    _experts_down_kernel[(E, triton.cdiv(triton.cdiv(L, cfg_down["BLOCK_N"]), cols))](
        ws.h_codes, ws.h_scales, ws.h_values, counts, pairs, generation, codes(weights.w2),
        weights.w2_scales, rows.view(torch.int16), E, wide_rows,
        LATENT=L, INTER=inter, A_BF16=cfg_down["A_BF16"], **tiles,
        WIDE_SCALES=weights.wide_scales_down,
        BLOCK_M=cfg_down["BLOCK_M"], BLOCK_N=cfg_down["BLOCK_N"],
        BLOCK_K=weights.block_k_down, NUM_STAGES=cfg_down["num_stages"], COLS=cols,
        MASK_ROWS=cfg_down.get("MASK_ROWS", 0), HALF_TILE=cfg_down.get("HALF_TILE", 0),
        PDL_TRIGGER=dependent_launch(device),
        **_launch_options(cfg_down))
    return rows
