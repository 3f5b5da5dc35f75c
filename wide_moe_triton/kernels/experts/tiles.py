"""The experts' device code: every ``@triton.jit`` body of the up and down launches and
of the plan's BF16 values, from the walk of a routing list, the weight loads and their
decode to the reduction loops and the kernels.

One module, because a jit function finds the functions it calls among its own module's
globals. The weight formats these loads read are ``layout``'s; the launch is in the
package's ``__init__``."""

from __future__ import annotations

import triton
import triton.language as tl

from ..bits import f32_to_bf16_bits
from ..pdl import allow_dependent_launch
from ..plan import mxfp8_tile
from ..situ import situ
from .layout import BF16_PAIR_FIELDS


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
    # Compute; NOTES: Sector-wide copies).
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
    TP8, b = 65 and 256 (NOTES: Exact decode instead of dot_scaled on Hopper). Else
    ``tl.dot_scaled``.

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
    kernel's programs share the SMs: NOTES: Register-operand wait). A read of
    acc by an instruction that is not an MMA (a register move) makes the compiler
    complete them before anything overwrites their registers (Triton 3.6 then waits for
    each group as it issues, which the H200 ran faster, not slower: same section);
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
    lists hold at most 16 of their 18 pairs on average (the down launch 4.5% faster
    there, the up launch unchanged; NOTES: Half tiles). A row's sum runs
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
        # 4-6% of the launch's time (NOTES: Column tiles in the down launch).
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

