"""Routing: sigmoid scores, exact top-K of the biased scores, BF16 weights and the
per-expert routing-list claims, in one launch.

Semantics are ``reference.route`` bit for bit: scores are the FP32 sigmoid correctly
rounded (computed in FP64, rounded once, as ``reference.router_scores``); the top-K ranks
``scores + bias`` (FP32) descending, ties to the lower expert id, NaN as -inf; weights are
the chosen unbiased scores, divided (correctly rounded) by their FP32 sum taken in slot
order when renormalizing, times ``scale`` (FP32), rounded to BF16 on the bits (RNE).

Exact top-K: each FP32 choice maps to an order-preserving int32 key (NaN -> the key of
-inf). Slot k takes the largest remaining key of the row, the lowest id among equal keys
(a max, then a min over the ids holding it), and removes it (its key set below every real
key). The chosen scores are then recomputed from their logits, bit-identical to the
scores ranked.

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
from .bits import f32_to_bf16_bits

KERNEL = "route"
# ZERO_BLOCK: counters of the idle parity one program zeroes per step.
DEFAULT = {"BLOCK_T": 2, "num_warps": 4, "ZERO_BLOCK": 128}
# At E = 896 (1024 columns) more than ~64 columns a thread spill: t <= 2 * w.
SPACE = [{"BLOCK_T": t, "num_warps": w, "ZERO_BLOCK": 128}
         for t in (1, 2, 4, 8) for w in (1, 2, 4, 8) if t <= 2 * w]
# Below the key of -inf (0x807FFFFF), the least real key: a taken or padding column.
REMOVED: tl.constexpr = tl.constexpr(-(1 << 31))


def shape_key(num_experts: int, top_k: int, polled: bool = False) -> str:
    return f"E{num_experts}_K{top_k}" + ("_mailbox" if polled else "")


@dataclasses.dataclass
class RoutingLists:
    """Per-expert routing lists of both parities.

    ``counts`` int32 [2, E]: pairs listed per expert; ``pairs`` int32 [2, E, wide_rows]:
    ``pairs[p, e, :counts[p, e]]`` are the pair ids ``t*K + k`` routed to expert e in the
    call of parity p (in claim order, which varies run to run); ``generation`` int32 [1]:
    the call counter whose low bit is the parity the route claims in."""

    counts: torch.Tensor
    pairs: torch.Tensor
    generation: torch.Tensor

    @classmethod
    def empty(cls, num_experts: int, wide_rows: int, device, generation=None) -> "RoutingLists":
        """Zeroed lists (both parities) for ``num_experts`` experts of up to ``wide_rows``
        pairs each, with a fresh generation counter (0) unless one is given to share."""
        for name, value in (("num_experts", num_experts), ("wide_rows", wide_rows)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if generation is None:
            generation = torch.zeros(1, dtype=torch.int32, device=device)
        return cls(torch.zeros(2, num_experts, dtype=torch.int32, device=device),
                   torch.zeros(2, num_experts, wide_rows, dtype=torch.int32, device=device),
                   generation)

    @property
    def num_experts(self) -> int:
        return self.counts.shape[1]

    @property
    def wide_rows(self) -> int:
        return self.pairs.shape[2]

    def check(self, num_experts: int, device) -> None:
        """Raise naming the field unless the lists fit ``num_experts`` on ``device``."""
        check_tensor("lists.counts", self.counts, torch.int32, (2, num_experts), device)
        check_tensor("lists.pairs", self.pairs, torch.int32, (2, num_experts, None), device)
        check_tensor("lists.generation", self.generation, torch.int32, (1,), device)


# ----------------------------------------------------------------------------- jit helpers

@triton.jit
def sigmoid_rn(x):
    """FP32 sigmoid of FP32 ``x`` as ``reference.router_scores``: 1 / (1 + exp(-x)) in
    FP64, rounded once to FP32."""
    d = x.to(tl.float64)
    return (1.0 / (1.0 + tl.exp(-d))).to(tl.float32)


@triton.jit
def order_key(choice):
    """int32 keys ordered as the FP32 ``choice`` values, NaN as -inf. (A choice is never
    -0: a score is >= +0, and x + y is -0 only when both are.)"""
    bits = choice.to(tl.int32, bitcast=True)
    bits = tl.where(choice != choice, -0x800000, bits)  # 0xFF800000: -inf
    # Negative floats order backwards as integers: flip their magnitude bits.
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


@triton.jit
def top_k_ids(keys, e, TOP_K: tl.constexpr, BLOCK_K: tl.constexpr):
    """ids int32 [BT, BLOCK_K] of the TOP_K largest ``keys`` [BT, BE] of each row (column
    ids ``e`` [1, BE]), slot k the k-th largest, equal keys in ascending id order."""
    slot = tl.arange(0, BLOCK_K)[None, :]
    ids = tl.zeros((keys.shape[0], BLOCK_K), tl.int32)
    for k in range(TOP_K):
        # Two 32-bit reductions (a warp does each in one instruction) are cheaper than
        # one over (key, id) packed in 64 bits.
        best = tl.max(keys, axis=1)
        winner = tl.min(tl.where(keys == best[:, None], e, keys.shape[1]), axis=1)
        keys = tl.where(e == winner[:, None], REMOVED, keys)
        ids = tl.where(slot == k, winner[:, None], ids)
    return ids


@triton.jit
def slot_order_sum(chosen, TOP_K: tl.constexpr):
    """FP32 sum of ``chosen`` [BT, BLOCK_K] over slots 0..TOP_K-1 of each row, added in
    slot order (the reference's rounding sequence)."""
    slot = tl.arange(0, chosen.shape[1])[None, :]
    # -0 + s == s for every s: the sum starts exactly at the first chosen score.
    total = tl.full((chosen.shape[0],), -0.0, tl.float32)
    for k in range(TOP_K):
        # One term and +0s: the reduction is exact, whatever its order.
        total = total + tl.sum(tl.where(slot == k, chosen, 0.0), axis=1)
    return total


@triton.jit
def claim_pairs(ids, t, in_out, counts_ptr, pairs_ptr, gen_ptr, E, wide_rows,
                TOP_K: tl.constexpr, BLOCK_K: tl.constexpr):
    """Append pair t*K + k to expert ids[t, k]'s list of parity generation & 1."""
    parity = tl.load(gen_ptr) & 1
    expert = parity * E + ids
    at = tl.atomic_add(counts_ptr + expert, 1, mask=in_out, sem="relaxed")
    pair = t[:, None] * TOP_K + tl.arange(0, BLOCK_K)[None, :]
    # A token lists an expert at most once, so at < rows <= wide_rows; the bound is a guard.
    tl.store(pairs_ptr + expert.to(tl.int64) * wide_rows + at, pair,
             mask=in_out & (at < wide_rows))


@triton.jit
def zero_other_parity(counts_ptr, gen_ptr, E, ZERO: tl.constexpr):
    """Zero counts[1 - parity, :], the programs sharing the E counters."""
    other = 1 - (tl.load(gen_ptr) & 1)
    step = tl.num_programs(0) * ZERO
    for start in range(tl.program_id(0) * ZERO, E, step):
        c = start + tl.arange(0, ZERO)
        tl.store(counts_ptr + other * E + c, tl.zeros((ZERO,), tl.int32), mask=c < E)


@triton.jit
def _route_kernel(src_ptr, src_row_stride, src_offset, src_parity_stride, mb_gen_ptr,
                  error_ptr, spin_limit, experts_per_rank,
                  bias_ptr, ids_ptr, w_ptr, counts_ptr, pairs_ptr, list_gen_ptr, wide_rows,
                  rows, E, scale,
                  TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr, CLAIM: tl.constexpr,
                  POLLED: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
                  BLOCK_K: tl.constexpr, ZERO: tl.constexpr):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    e = tl.arange(0, BLOCK_E)[None, :]
    valid = (t[:, None] < rows) & (e < E)
    slot = tl.arange(0, BLOCK_K)[None, :]
    in_out = (t[:, None] < rows) & (slot < TOP_K)
    # The logits are read as int32 words: FP32 bits in a tensor or in the mailbox rows.
    row = t[:, None].to(tl.int64) * src_row_stride + src_offset
    if POLLED:
        parity = tl.load(mb_gen_ptr) & 1
        row += parity.to(tl.int64) * src_parity_stride
        owner = tl.zeros_like(t)[:, None] + e // experts_per_rank
        bits, empty = mb.poll(src_ptr + row + e, valid, spin_limit, mb.EMPTY_WORD)
        mb.record_missing(error_ptr, empty, owner, parity)
    else:
        bits = tl.load(src_ptr + row + e, mask=valid, other=0)
    scores = sigmoid_rn(bits.to(tl.float32, bitcast=True))
    bias = tl.load(bias_ptr + e, mask=e < E, other=0.0)
    keys = tl.where(valid, order_key(scores + bias), REMOVED)
    ids = top_k_ids(keys, e, TOP_K, BLOCK_K)
    # The chosen scores, recomputed from their logits (cheaper than one more reduction
    # per slot); in the mailbox, before the words are re-armed.
    chosen_bits = tl.load(src_ptr + row + ids, mask=in_out, other=0, volatile=POLLED)
    if POLLED:
        mb.rearm(src_ptr + row + e, valid, mb.EMPTY_WORD)
    chosen = sigmoid_rn(chosen_bits.to(tl.float32, bitcast=True))
    if RENORMALIZE:
        chosen = tl.math.div_rn(chosen, slot_order_sum(chosen, TOP_K)[:, None])
    weights = f32_to_bf16_bits(chosen * scale)
    out = t[:, None] * TOP_K + slot
    tl.store(ids_ptr + out, ids, mask=in_out)
    tl.store(w_ptr + out, weights, mask=in_out)
    if CLAIM:
        claim_pairs(ids, t, in_out, counts_ptr, pairs_ptr, list_gen_ptr, E, wide_rows,
                    TOP_K, BLOCK_K)
        zero_other_parity(counts_ptr, list_gen_ptr, E, ZERO)


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


def _launch(src, row_stride, offset, parity_stride, mb_gen, error, spin_limit,
            experts_per_rank, bias, top_k, renormalize, scale, lists, ids, weights,
            rows, num_experts, polled, config):
    device = bias.device
    ids, weights = _outputs(rows, top_k, device, ids, weights)
    counts, pairs, list_gen, wide_rows = _lists_args(lists, rows, num_experts, device, ids)
    if rows == 0 and lists is None:
        return ids, weights
    cfg = config or config_for(KERNEL, shape_key(num_experts, top_k, polled), rows,
                               DEFAULT, device)
    scale32 = _fp32(float(scale))
    zero_block = cfg.get("ZERO_BLOCK", DEFAULT["ZERO_BLOCK"])
    grid = (max(1, triton.cdiv(rows, cfg["BLOCK_T"])),)
    _route_kernel[grid](
        src, row_stride, offset, parity_stride, mb_gen, error, spin_limit, experts_per_rank,
        bias, ids, weights.view(torch.int16), counts, pairs, list_gen, wide_rows,
        rows, num_experts, scale32,
        TOP_K=top_k, RENORMALIZE=renormalize, CLAIM=lists is not None, POLLED=polled,
        BLOCK_T=cfg["BLOCK_T"], BLOCK_E=triton.next_power_of_2(num_experts),
        BLOCK_K=triton.next_power_of_2(top_k), ZERO=zero_block, num_warps=cfg["num_warps"])
    return ids, weights


def route(logits: torch.Tensor, bias: torch.Tensor, top_k: int, renormalize: bool,
          scale: float, *, lists: RoutingLists | None = None, ids: torch.Tensor | None = None,
          weights: torch.Tensor | None = None, config: dict | None = None):
    """(ids int32 [b, K], weights bf16 [b, K]) of FP32 ``logits`` [b, E] (any row stride,
    columns contiguous) and FP32 ``bias`` [E], bit-identical to ``reference.route``.

    With ``lists``, also claims every pair into ``lists`` (parity generation & 1 read on
    the device) and zeroes the other parity's counters. ``ids``/``weights``: optional
    output buffers; ``config``: a launch config overriding the tuned one."""
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2:
        raise ValueError(f"logits must be a 2-D tensor [b, E], got "
                         f"{getattr(logits, 'shape', type(logits).__name__)}")
    check_tensor("logits", logits, torch.float32, contiguous=False)
    if logits.stride(1) != 1:
        raise ValueError("logits must have contiguous rows (stride 1 along its last dim)")
    rows, num_experts = logits.shape
    if num_experts == 0:
        raise ValueError("logits must have at least one expert column")
    _check_routing_args(bias, top_k, renormalize, scale, num_experts, logits.device)
    src = logits.view(torch.int32)
    return _launch(src, logits.stride(0), 0, 0, src, src, 1, num_experts, bias, top_k,
                   renormalize, scale, lists, ids, weights, rows, num_experts, False, config)


def route_mailbox(mailbox: torch.Tensor, generation: torch.Tensor, rows: int,
                  bias: torch.Tensor, top_k: int, renormalize: bool, scale: float, *,
                  latent: int, world: int, error: torch.Tensor,
                  spin_limit: int = mb.DEFAULT_SPIN_LIMIT, lists: RoutingLists | None = None,
                  ids: torch.Tensor | None = None, weights: torch.Tensor | None = None,
                  config: dict | None = None):
    """``route`` of the logits in this rank's ``mailbox`` (int16/BF16 [2, wide_rows,
    latent + 2E]), rows 0..rows-1 of parity ``generation[0] & 1`` (read on the device).

    Each row's E logits words are polled until published (at most ``spin_limit`` rounds;
    on a timeout the ranks of the still-empty words and the parity go to ``error``, int32
    [2], and routing proceeds on what was read: ids stay in [0, E)), then re-armed.
    ``world`` ranks own E/world words each. Everything else as ``route``."""
    device = mb.check_poll_args(mailbox, generation, rows, world, error, spin_limit)
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
    words = mailbox.view(torch.int16).view(torch.int32)
    row_words = columns // 2
    return _launch(words, row_words, latent // 2, mailbox.shape[1] * row_words, generation,
                   error, spin_limit, num_experts // world, bias, top_k, renormalize, scale,
                   lists, ids, weights, rows, num_experts, True, config)
