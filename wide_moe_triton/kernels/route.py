"""Routing: sigmoid scores, exact top-K of the biased scores, BF16 weights and the
per-expert routing-list claims, in one launch, which can run the MXFP8 plan's tiles too.

Semantics are ``reference.route`` bit for bit: scores are the FP32 sigmoid correctly
rounded (computed in FP64, rounded once, as ``reference.router_scores``); the top-K ranks
``scores + bias`` (FP32) descending, ties to the lower expert id, NaN as -inf; weights are
the chosen unbiased scores, divided (correctly rounded) by their FP32 sum taken in slot
order when renormalizing, times ``scale`` (FP32), rounded to BF16 on the bits (RNE).

Exact top-K: each FP32 choice maps to an order-preserving int32 key (NaN -> the key of
-inf). A program routes one row on one warp (every reduction stays inside the warp): the
row's experts lie in G groups, one a lane, of S*V <= 32 experts held in registers
(``expert_tiling``). Two steps keep the exact FP64 sigmoid and the K selection rounds off
most of the E experts:

1. Candidates. A fast FP32 sigmoid bounds each score, lo <= score <= hi
   (``sigmoid_bounds``). T, the K-th largest of the groups' largest lower bounds of the
   choice, is reached by K distinct experts, so it is at most the K-th largest exact
   choice: every expert of the top-K has an upper bound >= T. Those are the candidates
   (about K + 5 of 896 on router-like rows), a bit mask a group.
2. Selection. Each group hands over up to CANDIDATES of its candidates, lowest expert id
   first (the pool); their exact scores (the FP64 sigmoid) and keys are computed, and K
   rounds of (largest key, lowest id holding it) take the pool's top-K, each moved to the
   place of its output slot, where ids, weights and claims are then written. A group with
   more candidates (ties, NaN rows, 1 random row in ~50 at 4 slots) calls for more
   batches: the top-K so far stay in the pool's first slots and compete with the next
   candidates of every group. Exact either way, one batch on most rows.

The polled variant reads the logits out of this rank's Lamport mailbox and re-arms them
after the last read; the plan's tiles (``plan.tensor_tile``/``plan.mailbox_tile``) run as
the launch's programs after the route's, so that routing and the plan share one launch.

Routing lists (``RoutingLists``): the kernel reads the parity p = generation[0] & 1 on the
device, appends pair ``t*K + k`` to expert ids[t, k]'s list of parity p by an atomic
counter claim, and zeroes the counters of parity 1-p for the next call. It never
advances the generation (the layer's last kernel does).
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import triton
import triton.language as tl

from ..checks import check_tensor
from ..tuning import config_for
from . import mailbox as mb
from . import plan as plan_k
from . import quiet
from .bits import f32_to_bf16_bits
from .lists import RoutingLists

KERNEL = "route"
KERNEL_PLAN = "route_plan"  # the launch that runs the plan's tiles too
# BLOCK_T rows a program (one a warp); CANDIDATES: the pool's slots a group; ZERO_BLOCK:
# counters of the idle parity one program zeroes per step.
DEFAULT = {"BLOCK_T": 1, "CANDIDATES": 4, "num_warps": 1, "ZERO_BLOCK": 128}
SPACE = [{"BLOCK_T": t, "CANDIDATES": c, "num_warps": w, "ZERO_BLOCK": 128}
         for t in (1, 2) for c in (2, 4, 8) for w in (1, 2, 4) if t <= w]
# The plan's tile in the shared launch: its warps are the route's.
DEFAULT_PLAN = dict(DEFAULT, BLOCK_ROWS=2, BLOCK_COLS=512)
SPACE_PLAN = [dict(c, BLOCK_ROWS=r, BLOCK_COLS=n) for c in SPACE if c["BLOCK_T"] == 1
              for r in (1, 2, 4, 8) for n in (256, 512, 1024) if r * n <= 4096]
# Below the key of -inf (0x807FFFFF), the least real key: a taken or padding column.
REMOVED: tl.constexpr = tl.constexpr(-(1 << 31))
# The bounds' margins around the fast sigmoid (see ``sigmoid_bounds``).
BELOW: tl.constexpr = tl.constexpr(1.0 - 2.0 ** -12)
ABOVE: tl.constexpr = tl.constexpr(1.0 + 2.0 ** -12)
FLUSHED: tl.constexpr = tl.constexpr(2.0 ** -125)
NEG_LOG2E: tl.constexpr = tl.constexpr(-1.4426950408889634)


def shape_key(num_experts: int, top_k: int, latent: int | None = None) -> str:
    """Dims key of a config: the route alone, or with the plan of ``latent`` columns. The
    polled and plain launches share their configs (the poll changes no tile)."""
    return f"E{num_experts}_K{top_k}" + ("" if latent is None else f"_N{latent}")


def expert_tiling(num_experts: int) -> tuple[int, int, int]:
    """(S, G, V): a row's experts as S slices of G groups of V consecutive experts, expert
    (s*G + g)*V + v. Each of a warp's lanes holds a group (V consecutive experts: one
    vector load a slice), and a group is at most 32 experts, the bits of a mask."""
    block_e = triton.next_power_of_2(num_experts)
    v = min(4, max(1, block_e // 32))
    s = min(8, max(1, block_e // (32 * v)))
    return s, block_e // (s * v), v


# ----------------------------------------------------------------------------- jit helpers

@triton.jit
def sigmoid_rn(x):
    """FP32 sigmoid of FP32 ``x`` as ``reference.router_scores``: 1 / (1 + exp(-x)) in
    FP64, rounded once to FP32."""
    d = x.to(tl.float64)
    return (1.0 / (1.0 + tl.exp(-d))).to(tl.float32)


@triton.jit
def sigmoid_bounds(x):
    """FP32 (lo, hi) with lo <= sigmoid_rn(x) <= hi for every FP32 ``x`` (NaN for NaN),
    from a fast FP32 sigmoid, 1/(1 + 2^(-x log2 e)) with the reciprocal as a squared
    reciprocal square root: the rounded product, the approximate exp2 and rsqrt err by
    under 2^-16 relative wherever the sigmoid is above 2^-126 (below, they may flush to
    zero). The margins, 2^-12 relative and 2^-125 absolute, cover both."""
    r = tl.math.rsqrt(1.0 + tl.exp2(x * NEG_LOG2E))
    s = r * r
    return s * BELOW - FLUSHED, s * ABOVE + FLUSHED


@triton.jit
def order_key(choice):
    """int32 keys ordered as the FP32 ``choice`` values, NaN as -inf. (An exact choice is
    never -0: a score is >= +0, and x + y is -0 only when both are.)"""
    bits = choice.to(tl.int32, bitcast=True)
    bits = tl.where(choice != choice, -0x800000, bits)  # 0xFF800000: -inf
    # Negative floats order backwards as integers: flip their magnitude bits.
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


@triton.jit
def bit_or(a, b):
    return a | b


@triton.jit
def lane_groups(x, G: tl.constexpr, V: tl.constexpr):
    """``x`` [BT, S, G*V] (one slice of G*V consecutive experts a row of axis 1) as
    [BT, S, G, V]: axis 2 the groups, one a lane; axes 1 and 3 a group's experts, in
    registers. Every later tensor of the row derives from this view: its reductions and
    broadcasts keep the layout of the row's load, with no shuffles in between."""
    return tl.reshape(x, (x.shape[0], x.shape[1], G, V))


@triton.jit
def expert_bit(S: tl.constexpr, G: tl.constexpr, V: tl.constexpr):
    """[1, S, 1, V]: the bit of expert (s*G + g)*V + v in its group's mask, s*V + v."""
    return tl.arange(0, S)[None, :, None, None] * V + tl.arange(0, V)[None, None, None, :]


@triton.jit
def threshold(lower, TOP_K: tl.constexpr):
    """[BT, 1, 1, 1] the TOP_K-th largest of the groups' largest ``lower`` values (FP32
    [BT, S, G, V], no NaN): TOP_K distinct experts reach it, so it is at most the TOP_K-th
    largest exact choice. -inf (every expert a candidate) when there are fewer groups
    than TOP_K."""
    best = tl.max(tl.max(lower, axis=3), axis=1)
    # Each group's rank: the groups ahead of it, larger or equal with a lower index. Axis
    # 1 (the others) is gathered into every lane's registers; axis 2 stays the lanes.
    g = tl.arange(0, best.shape[1])
    other, mine = best[:, :, None], best[:, None, :]
    ahead = (other > mine) | ((other == mine) & (g[None, :, None] < g[None, None, :]))
    rank = tl.sum(ahead.to(tl.int32), axis=1)
    kth = tl.max(tl.where(rank == TOP_K - 1, best, -float("inf")), axis=1)
    if TOP_K > best.shape[1]:
        kth = tl.full(kth.shape, -float("inf"), tl.float32)
    return kth[:, None, None, None]


@triton.jit
def candidate_masks(bits, bias, valid, bit, TOP_K: tl.constexpr):
    """int32 [BT, G]: bit ``bit`` of a group's mask set for each expert that may be among
    the TOP_K, its upper bound reaching ``threshold``; ``bits`` (FP32 logits bits),
    ``bias`` (-inf where not ``valid``), ``valid`` [BT, S, G, V].

    In FP32 order, not the keys': the keys only split -0 from +0, which can only add
    candidates here. A NaN bound counts as -inf (``maximum`` drops a NaN operand), as a
    NaN choice ranks: it can only be chosen when the threshold is -inf."""
    lo, hi = sigmoid_bounds(bits.to(tl.float32, bitcast=True))
    least = threshold(tl.maximum(lo + bias, -float("inf")), TOP_K)
    cand = valid & (tl.maximum(hi + bias, -float("inf")) >= least)
    flags = tl.where(cand, 1 << bit, 0)
    return tl.reduce(tl.reduce(flags, 3, bit_or), 1, bit_or)


@triton.jit
def lowest_bit(masks):
    """(the lowest set bit of each mask, its index): the index is the FP32 exponent of
    the isolated bit, exact for every power of two (negative for an empty mask)."""
    low = masks & -masks
    f = low.to(tl.uint32, bitcast=True).to(tl.float32)
    return low, (f.to(tl.int32, bitcast=True) >> 23) - 127


@triton.jit
def empty_pool(BLOCK_T: tl.constexpr, SLOTS: tl.constexpr, G: tl.constexpr):
    """A pool of SLOTS places a group, all empty: (ids -1, keys REMOVED, score bits 0),
    each [BT, SLOTS, G, 1] (axis 1 in registers, axis 2 the lanes)."""
    shape: tl.constexpr = (BLOCK_T, SLOTS, G, 1)
    ids = tl.full(shape, -1, tl.int32)
    return ids, tl.full(shape, REMOVED, tl.int32), tl.zeros(shape, tl.int32)


@triton.jit
def take_candidates(src_ptr, row, bias_ptr, masks, row_ok, ids, keys, scores,
                    FIRST: tl.constexpr, POLLED: tl.constexpr, G: tl.constexpr,
                    V: tl.constexpr):
    """Fill pool slots FIRST onwards with the next candidates of each group, lowest bit of
    ``masks`` first, each with its exact key and score bits (the FP64 sigmoid, as the
    reference); a slot left empty has id -1 and key REMOVED. Returns the masks of the
    candidates not taken, and the pool. ``row`` [BT, 1]: where each row's logits start."""
    g = tl.arange(0, G)[None, :]
    slot = tl.arange(0, keys.shape[1])[None, :, None, None]
    for j in tl.static_range(FIRST, keys.shape[1]):
        low, at = lowest_bit(masks)
        masks = masks ^ low
        taken = (low != 0) & row_ok
        e = (at // V) * (G * V) + g * V + at % V
        # Gathered from memory (cached: the row was just read), in the mailbox before the
        # words are re-armed.
        x = tl.load(src_ptr + row + e, mask=taken, other=0, volatile=POLLED)
        b = tl.load(bias_ptr + e, mask=taken, other=0.0)
        score = sigmoid_rn(x.to(tl.float32, bitcast=True))
        key = tl.where(taken, order_key(score + b), REMOVED)
        score = tl.where(taken, score.to(tl.int32, bitcast=True), 0)
        ids = tl.where(slot == j, tl.where(taken, e, -1)[:, None, :, None], ids)
        keys = tl.where(slot == j, key[:, None, :, None], keys)
        scores = tl.where(slot == j, score[:, None, :, None], scores)
    return masks, ids, keys, scores


@triton.jit
def row_max(x):
    """[BT, 1, 1, 1] max of each row of ``x`` [BT, SLOTS, G, 1]: the registers first, then
    the lanes."""
    return tl.max(tl.max(tl.max(x, axis=3, keep_dims=True), axis=1, keep_dims=True), axis=2,
                  keep_dims=True)


@triton.jit
def row_min(x):
    """[BT, 1, 1, 1] min of each row of ``x`` [BT, SLOTS, G, 1], as ``row_max``."""
    return tl.min(tl.min(tl.min(x, axis=3, keep_dims=True), axis=1, keep_dims=True), axis=2,
                  keep_dims=True)


@triton.jit
def slot_of(keys):
    """The output slot each place of a pool [BT, SLOTS, G, 1] carries: slot k at pool slot
    k // G, lane k % G."""
    return (tl.arange(0, keys.shape[1])[None, :, None, None] * keys.shape[2]
            + tl.arange(0, keys.shape[2])[None, None, :, None])


@triton.jit
def rank_top_k(ids, keys, scores, TOP_K: tl.constexpr):
    """The TOP_K best of the pool, moved to the places of their output slots (``slot_of``;
    every other place emptied), and the FP32 sum of their scores added in slot order,
    the reference's rounding sequence. Round k takes the largest remaining key, the
    lowest id among its holders."""
    at = slot_of(keys)
    top_ids, top_keys, top_scores = empty_pool(keys.shape[0], keys.shape[1], keys.shape[2])
    # -0 + s == s for every s: the sum starts exactly at the first chosen score.
    total = tl.full((keys.shape[0], 1, 1, 1), -0.0, tl.float32)
    for k in tl.static_range(TOP_K):
        best = row_max(keys)
        winner = row_min(tl.where(keys == best, ids, 0x7FFFFFFF))
        # One holder of the winner's id: the max of its bits and INT_MIN elsewhere is its
        # score, exactly.
        score = row_max(tl.where(ids == winner, scores, -(1 << 31)))
        total = total + score.to(tl.float32, bitcast=True)
        keys = tl.where(ids == winner, REMOVED, keys)
        top_ids = tl.where(at == k, winner, top_ids)
        top_keys = tl.where(at == k, best, top_keys)
        top_scores = tl.where(at == k, score, top_scores)
    return top_ids, top_keys, top_scores, total


@triton.jit
def claim_pairs(ids, pair, chosen, counts_ptr, pairs_ptr, gen_ptr, E, wide_rows):
    """Append ``pair`` (t*K + k) to expert ``ids``' list of parity generation & 1, where
    ``chosen``."""
    expert = (tl.load(gen_ptr) & 1) * E + ids
    at = tl.atomic_add(counts_ptr + expert, 1, mask=chosen, sem="relaxed")
    # A token lists an expert at most once, so at < rows <= wide_rows; the bound is a guard.
    tl.store(pairs_ptr + expert.to(tl.int64) * wide_rows + at, pair,
             mask=chosen & (at < wide_rows))


@triton.jit
def select(src_ptr, row, bias_ptr, masks, t, rows, ids_ptr, w_ptr, scale, counts_ptr,
           pairs_ptr, list_gen_ptr, E, wide_rows, TOP_K: tl.constexpr,
           RENORMALIZE: tl.constexpr, CLAIM: tl.constexpr, POLLED: tl.constexpr,
           SLOTS: tl.constexpr, KEPT: tl.constexpr, G: tl.constexpr, V: tl.constexpr):
    """Rank the candidates in ``masks`` [BT, G] of rows ``t`` [BT, 1] and write each
    chosen one at its slot: id, BF16 weight, list claim.

    Batches of up to SLOTS candidates a group (nearly always one batch): each batch's
    best TOP_K, kept in the first KEPT slots of the pool, compete again with the next
    batch of SLOTS - KEPT candidates a group, until every candidate has been pooled."""
    row_ok = t < rows
    ids, keys, scores = empty_pool(masks.shape[0], SLOTS, G)
    masks, ids, keys, scores = take_candidates(src_ptr, row, bias_ptr, masks, row_ok, ids,
                                               keys, scores, 0, POLLED, G, V)
    ids, keys, scores, total = rank_top_k(ids, keys, scores, TOP_K)
    while tl.max((masks != 0).to(tl.int32)) != 0:
        masks, ids, keys, scores = take_candidates(src_ptr, row, bias_ptr, masks, row_ok,
                                                   ids, keys, scores, KEPT, POLLED, G, V)
        ids, keys, scores, total = rank_top_k(ids, keys, scores, TOP_K)
    t = t[:, :, None, None]
    k = slot_of(keys)
    chosen = (k < TOP_K) & (t < rows)
    w = scores.to(tl.float32, bitcast=True)
    if RENORMALIZE:
        w = tl.math.div_rn(w, total)
    pair = t * TOP_K + k
    tl.store(ids_ptr + pair, ids, mask=chosen)
    tl.store(w_ptr + pair, f32_to_bf16_bits(w * scale), mask=chosen)
    if CLAIM:
        claim_pairs(ids, pair, chosen, counts_ptr, pairs_ptr, list_gen_ptr, E, wide_rows)


@triton.jit
def zero_other_parity(counts_ptr, gen_ptr, E, program, programs, ZERO: tl.constexpr):
    """Zero counts[1 - parity, :], the ``programs`` route programs sharing the E counters."""
    other = 1 - (tl.load(gen_ptr) & 1)
    for start in range(program * ZERO, E, programs * ZERO):
        c = start + tl.arange(0, ZERO)
        tl.store(counts_ptr + other * E + c, tl.zeros((ZERO,), tl.int32), mask=c < E)


@triton.jit
def route_rows(program, programs, src_ptr, src_row_stride, src_offset, src_parity_stride,
               mb_gen_ptr, error_ptr, spin_limit, timeout_ns, experts_per_rank, bias_ptr,
               ids_ptr, w_ptr, counts_ptr, pairs_ptr, list_gen_ptr, wide_rows, rows, E, scale,
               TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr, CLAIM: tl.constexpr,
               POLLED: tl.constexpr, CANDIDATES: tl.constexpr, KEPT: tl.constexpr,
               BLOCK_T: tl.constexpr, S: tl.constexpr, G: tl.constexpr, V: tl.constexpr,
               ZERO: tl.constexpr):
    """Route program ``program`` of ``programs``: rows program*BLOCK_T onwards."""
    t = program * BLOCK_T + tl.arange(0, BLOCK_T)[:, None]
    # The row as [BT, S, G*V]: V consecutive words a lane (one vector load), S slices.
    e = tl.arange(0, S)[None, :, None] * (G * V) + tl.arange(0, G * V)[None, None, :]
    in_row = (t[:, :, None] < rows) & (e < E)
    # The logits are read as int32 words: FP32 bits in a tensor or in the mailbox rows.
    row = t.to(tl.int64) * src_row_stride + src_offset
    if POLLED:
        parity = tl.load(mb_gen_ptr) & 1
        row += parity.to(tl.int64) * src_parity_stride
        words = src_ptr + row[:, :, None] + e
        bits = mb.poll(words, in_row, e + t[:, :, None] * 0, experts_per_rank, spin_limit,
                       timeout_ns, error_ptr, parity, mb.EMPTY_WORD)
    else:
        bits = tl.load(src_ptr + row[:, :, None] + e, mask=in_row, other=0)
    # A full-shape bias load: the logits' layout, one row a warp, holds for both. -inf
    # past the row: no lower bound there reaches the threshold.
    bias = tl.load(bias_ptr + e + t[:, :, None] * 0, mask=in_row, other=-float("inf"))
    bit = expert_bit(S, G, V)
    masks = candidate_masks(lane_groups(bits, G, V), lane_groups(bias, G, V),
                            lane_groups(in_row, G, V), bit, TOP_K)
    select(src_ptr, row, bias_ptr, masks, t, rows, ids_ptr, w_ptr, scale, counts_ptr,
           pairs_ptr, list_gen_ptr, E, wide_rows, TOP_K, RENORMALIZE, CLAIM, POLLED,
           CANDIDATES, KEPT, G, V)
    if POLLED:
        mb.rearm(words, in_row, mb.EMPTY_WORD)
    if CLAIM:
        zero_other_parity(counts_ptr, list_gen_ptr, E, program, programs, ZERO)


@triton.jit
def _route_kernel(src_ptr, src_row_stride, src_offset, src_parity_stride, mb_gen_ptr,
                  error_ptr, spin_limit, timeout_ns, experts_per_rank,
                  bias_ptr, ids_ptr, w_ptr, counts_ptr, pairs_ptr, list_gen_ptr, wide_rows,
                  rows, E, scale, route_programs,
                  lat_ptr, lat_row_stride, lat_parity_stride, q_ptr, qs_ptr, latent,
                  latent_per_rank, col_tiles,
                  TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr, CLAIM: tl.constexpr,
                  POLLED: tl.constexpr, PLAN: tl.constexpr, LAT_BF16: tl.constexpr,
                  CANDIDATES: tl.constexpr, KEPT: tl.constexpr, BLOCK_T: tl.constexpr,
                  S: tl.constexpr, G: tl.constexpr, V: tl.constexpr, ZERO: tl.constexpr,
                  BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr):
    # The route's programs first: they take longest, the plan's tiles fill in behind.
    program = tl.program_id(0)
    if program < route_programs:
        route_rows(program, route_programs, src_ptr, src_row_stride, src_offset,
                   src_parity_stride, mb_gen_ptr, error_ptr, spin_limit, timeout_ns,
                   experts_per_rank, bias_ptr, ids_ptr, w_ptr, counts_ptr, pairs_ptr,
                   list_gen_ptr, wide_rows, rows, E, scale, TOP_K, RENORMALIZE, CLAIM,
                   POLLED, CANDIDATES, KEPT, BLOCK_T, S, G, V, ZERO)
    elif PLAN:
        tile = program - route_programs
        if POLLED:
            plan_k.mailbox_tile(lat_ptr, mb_gen_ptr, lat_row_stride, lat_parity_stride, q_ptr,
                                qs_ptr, rows, latent, latent_per_rank, error_ptr, spin_limit,
                                timeout_ns, tile // col_tiles, tile % col_tiles, BLOCK_ROWS,
                                BLOCK_COLS)
        else:
            plan_k.tensor_tile(lat_ptr, lat_row_stride, q_ptr, qs_ptr, rows, latent,
                               tile // col_tiles, tile % col_tiles, LAT_BF16, BLOCK_ROWS,
                               BLOCK_COLS)


# ----------------------------------------------------------------------------- wrappers

def _check_routing_args(bias, top_k, renormalize, scale, num_experts, device):
    check_tensor("bias", bias, torch.float32, (num_experts,), device)
    if not isinstance(top_k, int) or isinstance(top_k, bool) or not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be an int in [1, num_experts={num_experts}], "
                         f"got {top_k!r}")
    if not isinstance(renormalize, bool):
        raise TypeError(f"renormalize must be a bool, got {type(renormalize).__name__}")
    if not isinstance(scale, (int, float)) or isinstance(scale, bool):
        raise TypeError(f"scale must be a float, got {type(scale).__name__}")


def _outputs(rows, top_k, device, ids, weights):
    if ids is None:
        ids = torch.empty(rows, top_k, dtype=torch.int32, device=device)
    if weights is None:
        weights = torch.empty(rows, top_k, dtype=torch.bfloat16, device=device)
    check_tensor("ids", ids, torch.int32, (rows, top_k), device)
    check_tensor("weights", weights, torch.bfloat16, (rows, top_k), device)
    return ids, weights


def _lists_args(lists, rows, num_experts, device, dummy):
    if lists is None:
        return dummy, dummy, dummy, 1
    if not isinstance(lists, RoutingLists):
        raise TypeError(f"lists must be a RoutingLists, got {type(lists).__name__}")
    lists.check(num_experts, device)
    if rows > lists.wide_rows:
        raise ValueError(f"{rows} rows do not fit lists of wide_rows={lists.wide_rows}")
    return lists.counts, lists.pairs, lists.generation, lists.wide_rows


@functools.lru_cache(maxsize=64)
def _fp32(value: float) -> float:
    """``value`` rounded to FP32 once (RNE, overflow to inf), as the reference's
    ``torch.tensor(scale, dtype=torch.float32)``: the kernel then gets it exactly."""
    return float(torch.tensor(value, dtype=torch.float32))


@dataclasses.dataclass
class _Logits:
    """Where a launch reads the logits: int32 words ``src``, row t of parity p at word
    ``offset + p * parity_stride + t * row_stride``; polled from a mailbox when
    ``generation`` is given (with its error record, spin limit and E/T words a rank)."""

    src: torch.Tensor
    row_stride: int
    offset: int = 0
    parity_stride: int = 0
    generation: torch.Tensor | None = None
    error: torch.Tensor | None = None
    spin_limit: int = 1
    experts_per_rank: int = 1
    timeout_ns: int = 1


@dataclasses.dataclass
class _Latent:
    """Where the shared launch reads the latent for the plan: int16 (BF16 bits) or FP32
    ``src``, row t of parity p at ``p * parity_stride + t * row_stride``; ``out`` the
    checked (codes, scales); ``per_rank`` columns a rank (for the error record)."""

    src: torch.Tensor
    row_stride: int
    columns: int
    out: tuple
    parity_stride: int = 0
    per_rank: int = 1


def _launch(logits: _Logits, bias, top_k, renormalize, scale, lists, ids, weights, rows,
            num_experts, config, latent: _Latent | None = None):
    device = bias.device
    ids, weights = _outputs(rows, top_k, device, ids, weights)
    if rows == 0 and lists is None:
        return ids, weights
    launch(resolve(logits, bias, top_k, renormalize, scale, lists, ids, weights, rows,
                   num_experts, config, latent))
    return ids, weights


def resolve(logits: _Logits, bias, top_k, renormalize, scale, lists, ids, weights, rows,
            num_experts, config=None, latent: _Latent | None = None) -> tuple:
    """(grid, every argument) of one route launch (with the plan's tiles when ``latent``)
    over checked arguments (``lists`` is checked here): ``config`` as given or the tuned
    one. The tensors are bound too: a layer resolves its launch once per batch width over
    its own buffers."""
    device = bias.device
    counts, pairs, list_gen, wide_rows = _lists_args(lists, rows, num_experts, device, ids)
    kernel, default = (KERNEL, DEFAULT) if latent is None else (KERNEL_PLAN, DEFAULT_PLAN)
    cfg = dict(default, **(config or config_for(
        kernel, shape_key(num_experts, top_k, latent and latent.columns), rows, default,
        device)))
    slices, groups, width = expert_tiling(num_experts)
    # The pool keeps the best top_k in its first ``kept`` slots a group between batches.
    kept = triton.cdiv(top_k, groups)
    slots = max(min(cfg["CANDIDATES"], slices * width), triton.next_power_of_2(kept + 1))
    # Programs [0, route): the rows (one at least: the idle parity's counters need zeroing);
    # programs [route, route + tiles): the plan's tiles.
    route_programs = max(1, triton.cdiv(rows, cfg["BLOCK_T"]))
    tiles, col_tiles = 0, 1
    if latent is not None:
        col_tiles = triton.cdiv(latent.columns, cfg["BLOCK_COLS"])
        tiles = triton.cdiv(rows, cfg["BLOCK_ROWS"]) * col_tiles
    # A route alone passes placeholders for the plan's arguments (PLAN=False: never read).
    plan = latent or _Latent(ids, 0, 32, (ids, ids))
    polled = logits.generation is not None
    return (route_programs + tiles,), dict(
        src_ptr=logits.src, src_row_stride=logits.row_stride, src_offset=logits.offset,
        src_parity_stride=logits.parity_stride,
        mb_gen_ptr=logits.generation if polled else ids,
        error_ptr=logits.error if polled else ids, spin_limit=logits.spin_limit,
        timeout_ns=logits.timeout_ns,
        experts_per_rank=logits.experts_per_rank, bias_ptr=bias, ids_ptr=ids,
        w_ptr=weights.view(torch.int16), counts_ptr=counts, pairs_ptr=pairs,
        list_gen_ptr=list_gen, wide_rows=wide_rows, rows=rows, E=num_experts,
        scale=_fp32(float(scale)), route_programs=route_programs,
        lat_ptr=plan.src, lat_row_stride=plan.row_stride,
        lat_parity_stride=plan.parity_stride, q_ptr=plan.out[0], qs_ptr=plan.out[1],
        latent=plan.columns, latent_per_rank=plan.per_rank, col_tiles=col_tiles,
        TOP_K=top_k, RENORMALIZE=renormalize, CLAIM=lists is not None, POLLED=polled,
        PLAN=latent is not None, LAT_BF16=plan.src.dtype == torch.int16,
        CANDIDATES=slots, KEPT=kept, BLOCK_T=cfg["BLOCK_T"],
        S=slices, G=groups, V=width, ZERO=cfg["ZERO_BLOCK"],
        BLOCK_ROWS=cfg.get("BLOCK_ROWS", 1), BLOCK_COLS=cfg.get("BLOCK_COLS", 32),
        num_warps=cfg["num_warps"])


def launch(run: tuple) -> None:
    """Launch a resolved route (``resolve``)."""
    grid, args = run
    with quiet():
        _route_kernel[grid](**args)


def _check_logits(logits):
    check_tensor("logits", logits, torch.float32, ("b", "E"), contiguous=False)
    if logits.stride(1) != 1:
        raise ValueError("logits must have contiguous rows (stride 1 along its last dim)")
    if logits.shape[1] == 0:
        raise ValueError("logits must have at least one expert column")
    return logits.shape


def route(logits: torch.Tensor, bias: torch.Tensor, top_k: int, renormalize: bool,
          scale: float, *, lists: RoutingLists | None = None, ids: torch.Tensor | None = None,
          weights: torch.Tensor | None = None, config: dict | None = None):
    """(ids int32 [b, K], weights bf16 [b, K]) of FP32 ``logits`` [b, E] (any row stride,
    columns contiguous) and FP32 ``bias`` [E], bit-identical to ``reference.route``.

    With ``lists``, also claims every pair into ``lists`` (parity generation & 1 read on
    the device) and zeroes the other parity's counters. ``ids``/``weights``: optional
    output buffers; ``config``: a launch config overriding the tuned one."""
    rows, num_experts = _check_logits(logits)
    _check_routing_args(bias, top_k, renormalize, scale, num_experts, logits.device)
    return _launch(_Logits(logits.view(torch.int32), logits.stride(0)), bias, top_k,
                   renormalize, scale, lists, ids, weights, rows, num_experts, config)


def route_and_plan(logits: torch.Tensor, latent: torch.Tensor, bias: torch.Tensor,
                   top_k: int, renormalize: bool, scale: float, *,
                   lists: RoutingLists | None = None, ids: torch.Tensor | None = None,
                   weights: torch.Tensor | None = None, out: tuple | None = None,
                   config: dict | None = None):
    """``route`` of ``logits`` and ``plan.quantize_mxfp8`` of ``latent`` [b, L] (BF16 or
    FP32, rows contiguous, L a multiple of 32) in one launch: (ids, weights, codes,
    scales), each bit-identical to its stage's own function."""
    rows, num_experts = _check_logits(logits)
    _check_routing_args(bias, top_k, renormalize, scale, num_experts, logits.device)
    lat_rows, columns = plan_k.check_input(latent)
    if lat_rows != rows or latent.device != logits.device:
        raise ValueError(f"latent must hold the logits' {rows} rows on {logits.device}, got "
                         f"{lat_rows} on {latent.device}")
    out = plan_k.outputs(out, rows, columns, latent.device)
    src = latent.view(torch.int16) if latent.dtype == torch.bfloat16 else latent
    ids, weights = _launch(_Logits(logits.view(torch.int32), logits.stride(0)), bias, top_k,
                           renormalize, scale, lists, ids, weights, rows, num_experts, config,
                           _Latent(src, latent.stride(0), columns, out))
    return ids, weights, out[0], out[1]


def _mailbox_logits(mailbox, generation, rows, bias, top_k, renormalize, scale, latent,
                    world, error, spin_limit, poll_timeout) -> tuple[_Logits, int]:
    """The polled logits of a mailbox launch and E, all arguments checked."""
    device = mb.check_poll_args(mailbox, generation, rows, world, error, spin_limit)
    timeout_ns = mb.poll_timeout_ns(poll_timeout)
    if not isinstance(latent, int) or isinstance(latent, bool) or latent < 2 or latent % 2:
        raise ValueError(f"latent must be a positive even int, got {latent!r}")
    columns = mailbox.shape[2]
    if columns <= latent:
        raise ValueError(f"mailbox has {columns} columns, no room for logits after "
                         f"latent={latent}")
    num_experts = (columns - latent) // 2
    if num_experts % world:
        raise ValueError(f"the mailbox's {num_experts} experts are not a multiple of "
                         f"world ({world})")
    _check_routing_args(bias, top_k, renormalize, scale, num_experts, device)
    row_words = columns // 2
    words = mailbox.view(torch.int16).view(torch.int32)
    return _Logits(words, row_words, latent // 2, mailbox.shape[1] * row_words, generation,
                   error, spin_limit, num_experts // world, timeout_ns), num_experts


def route_mailbox(mailbox: torch.Tensor, generation: torch.Tensor, rows: int,
                  bias: torch.Tensor, top_k: int, renormalize: bool, scale: float, *,
                  latent: int, world: int, error: torch.Tensor,
                  spin_limit: int = mb.DEFAULT_SPIN_LIMIT, lists: RoutingLists | None = None,
                  ids: torch.Tensor | None = None, weights: torch.Tensor | None = None,
                  poll_timeout: float | None = None, config: dict | None = None):
    """``route`` of the logits in this rank's ``mailbox`` (int16/BF16 [2, wide_rows,
    latent + 2E]), rows 0..rows-1 of parity ``generation[0] & 1`` (read on the device).

    Each row's E logits words are polled until published (``mailbox.poll``: at most
    ``spin_limit`` rounds or ``poll_timeout`` seconds; on a timeout the ranks of the
    still-empty words and the parity go to ``error``, int32 [2], and routing proceeds on
    what was read: ids stay in [0, E)), then re-armed.
    ``world`` ranks own E/world words each. Everything else as ``route``."""
    logits, num_experts = _mailbox_logits(mailbox, generation, rows, bias, top_k, renormalize,
                                          scale, latent, world, error, spin_limit,
                                          poll_timeout)
    return _launch(logits, bias, top_k, renormalize, scale, lists, ids, weights, rows,
                   num_experts, config)


def route_and_plan_mailbox(mailbox: torch.Tensor, generation: torch.Tensor, rows: int,
                           bias: torch.Tensor, top_k: int, renormalize: bool, scale: float,
                           *, latent: int, world: int, error: torch.Tensor,
                           spin_limit: int = mb.DEFAULT_SPIN_LIMIT,
                           lists: RoutingLists | None = None, ids: torch.Tensor | None = None,
                           weights: torch.Tensor | None = None, out: tuple | None = None,
                           poll_timeout: float | None = None, config: dict | None = None):
    """``route_mailbox`` and ``plan.quantize_mxfp8_mailbox`` of the same mailbox rows in
    one launch: (ids, weights, codes, scales), each bit-identical to its stage's own
    function. Every program polls the words it reads (the route a row's logits, the plan
    a tile of latent) and re-arms them; timeouts go to ``error`` as in either."""
    run, outputs = resolve_route_and_plan_mailbox(
        mailbox, generation, rows, bias, top_k, renormalize, scale, latent=latent,
        world=world, error=error, spin_limit=spin_limit, lists=lists, ids=ids,
        weights=weights, out=out, poll_timeout=poll_timeout, config=config)
    if run is not None:
        launch(run)
    return outputs


def resolve_route_and_plan_mailbox(mailbox, generation, rows, bias, top_k, renormalize,
                                   scale, *, latent, world, error,
                                   spin_limit=mb.DEFAULT_SPIN_LIMIT, lists=None, ids=None,
                                   weights=None, out=None, poll_timeout=None, config=None):
    """``route_and_plan_mailbox``'s arguments checked and its launch resolved, launching
    nothing: (the launch for ``launch``, or None when there is nothing to do; (ids,
    weights, codes, scales), the buffers it writes)."""
    logits, num_experts = _mailbox_logits(mailbox, generation, rows, bias, top_k, renormalize,
                                          scale, latent, world, error, spin_limit,
                                          poll_timeout)
    plan_k.check_mailbox_latent(latent, world, mailbox.shape[2])
    out = plan_k.outputs(out, rows, latent, mailbox.device)
    ids, weights = _outputs(rows, top_k, mailbox.device, ids, weights)
    outputs = (ids, weights, out[0], out[1])
    if rows == 0 and lists is None:
        return None, outputs
    columns = mailbox.shape[2]
    run = resolve(logits, bias, top_k, renormalize, scale, lists, ids, weights, rows,
                  num_experts, config, _Latent(mailbox.view(torch.int16), columns, latent,
                                               out, mailbox.shape[1] * columns,
                                               latent // world))
    return run, outputs
