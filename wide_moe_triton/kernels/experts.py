"""The routed experts: ``rows[p] = bf16(W2_e . mxfp8(situ(W13_e . q[t])))`` for every
listed (token t, slot k) pair p = t*K + k routed to expert e (``reference.expert_rows``).

Two launches, both with grid (expert, column tile), both building their row tiles on the
device from the routing lists (no host sync, CUDA-graph capturable):

- ``up``   (E, cdiv(I, BLOCK_N)): for each tile of BLOCK_M pairs of expert e, gathers the
  tokens' MXFP8 plan rows, computes the gate and up columns of one BLOCK_N slice with two
  ``tl.dot_scaled`` (E4M3 x E2M1, FP32 accumulation) over L, applies SiTU in FP32 and
  quantizes the hidden to MXFP8 per 32 columns (``plan.mxfp8_tile``) into the workspace
  at row p.
- ``down`` (E, cdiv(L, BLOCK_N)): same list walk; ``tl.dot_scaled`` of the hidden rows
  (E4M3) with W2_e (E2M1) over I, rounded once to BF16 into ``rows`` at row p.

Each program streams its weight slice once per tile of BLOCK_M pairs, so an expert with
at most BLOCK_M pairs streams its weights once per call; an expert no pair chose costs
one load of its count.

Reproducibility: an output row of an MMA depends only on its own input row and on the
order of the reduction, which is fixed by BLOCK_K (chosen per shape, never per batch
width: ``reduction_block``). So rows do not depend on the claim order within a list nor
on which other tokens share the batch; only BLOCK_M, BLOCK_N, A_BF16, num_warps and
num_stages vary with the batch-width bucket. (On a GPU, Triton may pick a different MMA
instruction for another BLOCK_M or num_warps; that it sums a row in the same order is
the hardware's property, which tests/test_experts.py checks bit for bit.)

``A_BF16`` (a config choice, 0/1): feed the activations to ``tl.dot_scaled`` as E4M3
codes with their scales, or as BF16 values after an upcast in the kernel. E4M3 times an
E8M0 scale is exact in BF16 for scale bytes 3..246, i.e. for every block whose amax is
at least 2**-116 (below that, BF16's subnormals run out): DESIGN.md's exact upcast. On
Hopper, ``dot_scaled`` upcasts both operands to BF16 itself, so both variants feed the
same BF16 products to the same FP32 MMA; which one streams faster is measured.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..checks import check_tensor
from ..config import MX_BLOCK
from ..tuning import config_for
from .bits import f32_to_bf16_bits
from .plan import mxfp8_tile
from .situ import situ

KERNEL_UP = "experts_up"
KERNEL_DOWN = "experts_down"
DEFAULT_UP = {"BLOCK_M": 16, "BLOCK_N": 64, "A_BF16": 0, "num_warps": 4, "num_stages": 3}
DEFAULT_DOWN = {"BLOCK_M": 16, "BLOCK_N": 128, "A_BF16": 0, "num_warps": 4, "num_stages": 3}
# BLOCK_K is deliberately absent: it fixes the reduction order, so it is a function of
# the shape only (``reduction_block``), never of the batch-width bucket.
SPACE_UP = [{"BLOCK_M": m, "BLOCK_N": n, "A_BF16": a, "num_warps": w, "num_stages": s}
            for m in (16, 32, 64) for n in (32, 64, 128) for a in (0, 1)
            for w in (4, 8) for s in (2, 3, 4)]
SPACE_DOWN = [{"BLOCK_M": m, "BLOCK_N": n, "A_BF16": a, "num_warps": w, "num_stages": s}
              for m in (16, 32, 64) for n in (64, 128, 256) for a in (0, 1)
              for w in (4, 8) for s in (2, 3, 4)]
CONFIG_KEYS = ("BLOCK_M", "BLOCK_N", "A_BF16", "num_warps", "num_stages")

# Preferred reduction steps (elements along L for up, along I for down); the step used is
# the largest power of two <= this that divides the dimension.
BLOCK_K_UP = 128
BLOCK_K_DOWN = 128

LAYOUTS = ("nk", "kn")


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
    """The experts' MXFP4 weights in the layout the kernels stream (``prepare_weights``).

    ``layout`` "nk": the stock layout, output rows outermost (w13 [E, 2I, L/2], w13_scales
    [E, 2I, L/32], w2 [E, L, I/2], w2_scales [E, L, I/32]); "kn": the same bytes with the
    last two dims swapped (w13 [E, L/2, 2I], w13_scales [E, L/32, 2I], ...), so a tile's
    output columns are contiguous. Packing stays along the reduction dim (low nibble
    first) in both. The kernels read either through strides."""

    w13: torch.Tensor
    w13_scales: torch.Tensor
    w2: torch.Tensor
    w2_scales: torch.Tensor
    layout: str
    num_experts: int
    latent: int
    inter: int

    @property
    def device(self) -> torch.device:
        return self.w13.device

    def strides(self, name: str) -> tuple[int, int, int]:
        """(expert, output row n, reduction k) strides of tensor ``name``, in elements
        (packed bytes for the codes): the same kernel reads every layout."""
        t = getattr(self, name)
        if self.layout == "nk":
            return t.stride(0), t.stride(1), t.stride(2)
        return t.stride(0), t.stride(2), t.stride(1)


def prepare_weights(w13: torch.Tensor, w13_scales: torch.Tensor, w2: torch.Tensor,
                    w2_scales: torch.Tensor, layout: str = "nk") -> ExpertWeights:
    """The stock MXFP4 experts (see ``reference.expert_rows``) in the layout the kernels
    stream (a one-time conversion at module build). ``layout`` is "nk" (the stock bytes,
    read as transposed tiles) or "kn" (output columns contiguous); a Hopper-specific
    swizzle would be one more layout here plus its stride/offset mapping in the kernels."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
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
    tensors = (w13, w13_scales, w2, w2_scales)
    if layout == "nk":
        tensors = tuple(t.contiguous() for t in tensors)
    else:
        tensors = tuple(t.transpose(1, 2).contiguous() for t in tensors)
    return ExpertWeights(*tensors, layout=layout, num_experts=E, latent=latent, inter=inter)


# --------------------------------------------------------------------------- workspace

class Workspace(NamedTuple):
    """The MXFP8 hidden between the two launches: ``h_codes`` uint8 [P, I] (E4M3) and
    ``h_scales`` uint8 [P, I/32] (E8M0), row p = pair t*K + k; P >= b*K."""

    h_codes: torch.Tensor
    h_scales: torch.Tensor


def make_workspace(num_pairs: int, inter: int, device) -> Workspace:
    """An uninitialized workspace for up to ``num_pairs`` pairs (e.g. wide_rows * K, so
    that one allocation serves every batch width, CUDA graphs included)."""
    return Workspace(torch.empty(num_pairs, inter, dtype=torch.uint8, device=device),
                     torch.empty(num_pairs, inter // MX_BLOCK, dtype=torch.uint8,
                                 device=device))


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
    loads need no mask."""
    m = m0 + tl.arange(0, BLOCK_M)
    ok = m < count
    pair = tl.load(list_ptr + m, mask=ok, other=0)
    return pair.to(tl.int64), ok


@triton.jit
def _load_act(codes_ptr, scales_ptr, row, k0, cols, BLOCK_K: tl.constexpr):
    """MXFP8 activation tile of rows ``row`` (int64 [M]), columns k0 .. k0+BLOCK_K-1 of a
    [*, cols] plan: (E4M3 codes uint8 [M, BLOCK_K], scale bytes uint8 [M, BLOCK_K/32])."""
    k = k0 + tl.arange(0, BLOCK_K)
    codes = tl.load(codes_ptr + row[:, None] * cols + k[None, :])
    ks = k0 // 32 + tl.arange(0, BLOCK_K // 32)
    scales = tl.load(scales_ptr + row[:, None] * (cols // 32) + ks[None, :])
    return codes, scales


@triton.jit
def _load_weight(w_ptr, stride_n, stride_k, s_ptr, s_stride_n, s_stride_k, n, n_ok, k0,
                 BLOCK_K: tl.constexpr):
    """MXFP4 weight tile of output rows ``n`` [N] (``n_ok`` masks rows past the matrix),
    reduction k0 .. k0+BLOCK_K-1, as dot_scaled's rhs: (packed codes uint8 [BLOCK_K/2, N],
    scale bytes uint8 [N, BLOCK_K/32]). Masked rows read code 0 with scale 1: zeros."""
    k2 = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    codes = tl.load(w_ptr + n[None, :] * stride_n + k2[:, None] * stride_k,
                    mask=n_ok[None, :], other=0)
    ks = k0 // 32 + tl.arange(0, BLOCK_K // 32)
    scales = tl.load(s_ptr + n[:, None] * s_stride_n + ks[None, :] * s_stride_k,
                     mask=n_ok[:, None], other=127)
    return codes, scales


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
def _mx_dot(acc, a_codes, a_scales, b_codes, b_scales, A_BF16: tl.constexpr):
    """acc + A @ B in FP32: A MXFP8 (E4M3 codes + scales, or their BF16 values when
    A_BF16), B MXFP4 packed along K."""
    if A_BF16:
        return tl.dot_scaled(a_codes, None, "bf16", b_codes, b_scales, "e2m1", acc)
    else:
        return tl.dot_scaled(a_codes, a_scales, "e4m3", b_codes, b_scales, "e2m1", acc)


# ----------------------------------------------------------------------------- kernels

@triton.jit
def _experts_up_kernel(
        q_ptr, qs_ptr, counts_ptr, pairs_ptr, generation_ptr,
        w_ptr, w_se, w_sn, w_sk, ws_ptr, ws_se, ws_sn, ws_sk,
        h_ptr, hs_ptr, num_experts, wide_rows, beta, linear_beta,
        LATENT: tl.constexpr, INTER: tl.constexpr, TOP_K: tl.constexpr,
        HAS_LINEAR_BETA: tl.constexpr, A_BF16: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Program (e, j): hidden columns j*BLOCK_N .. of every pair listed for expert e,
    h = mxfp8(situ(q W13_gate^T, q W13_up^T)), stored at the pair's workspace row."""
    e = tl.program_id(0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < INTER
    count, list_ptr = _list_of_expert(counts_ptr, pairs_ptr, generation_ptr, e,
                                      num_experts, wide_rows)
    gate_ptr = w_ptr + e.to(tl.int64) * w_se
    gate_s_ptr = ws_ptr + e.to(tl.int64) * ws_se
    up_ptr = gate_ptr + INTER * w_sn  # up rows follow the I gate rows
    up_s_ptr = gate_s_ptr + INTER * ws_sn
    sc = tl.program_id(1) * (BLOCK_N // 32) + tl.arange(0, BLOCK_N // 32)
    # An expert with no pairs runs zero iterations: its weights are never read.
    for m0 in range(0, count, BLOCK_M):
        pair, m_ok = _load_pairs(list_ptr, m0, count, BLOCK_M)
        token = pair // TOP_K
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for k0 in range(0, LATENT, BLOCK_K):
            a, a_s = _load_act(q_ptr, qs_ptr, token, k0, LATENT, BLOCK_K)
            if A_BF16:
                a = _e4m3_to_bf16(a, a_s, BLOCK_M, BLOCK_K)
            bg, bg_s = _load_weight(gate_ptr, w_sn, w_sk, gate_s_ptr, ws_sn, ws_sk,
                                    n, n_ok, k0, BLOCK_K)
            bu, bu_s = _load_weight(up_ptr, w_sn, w_sk, up_s_ptr, ws_sn, ws_sk,
                                    n, n_ok, k0, BLOCK_K)
            acc_g = _mx_dot(acc_g, a, a_s, bg, bg_s, A_BF16)
            acc_u = _mx_dot(acc_u, a, a_s, bu, bu_s, A_BF16)
        h = situ(acc_g, acc_u, beta, linear_beta, HAS_LINEAR_BETA)
        codes, scales = mxfp8_tile(h, BLOCK_M, BLOCK_N)
        tl.store(h_ptr + pair[:, None] * INTER + n[None, :], codes,
                 mask=m_ok[:, None] & n_ok[None, :])
        tl.store(hs_ptr + pair[:, None] * (INTER // 32) + sc[None, :], scales,
                 mask=m_ok[:, None] & (sc[None, :] < INTER // 32))


@triton.jit
def _experts_down_kernel(
        h_ptr, hs_ptr, counts_ptr, pairs_ptr, generation_ptr,
        w_ptr, w_se, w_sn, w_sk, ws_ptr, ws_se, ws_sn, ws_sk,
        rows_ptr, num_experts, wide_rows,
        LATENT: tl.constexpr, INTER: tl.constexpr, A_BF16: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Program (e, j): latent columns j*BLOCK_N .. of every pair listed for expert e,
    rows[p] = bf16(h[p] W2_e^T), from the MXFP8 hidden in the workspace."""
    e = tl.program_id(0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < LATENT
    count, list_ptr = _list_of_expert(counts_ptr, pairs_ptr, generation_ptr, e,
                                      num_experts, wide_rows)
    w_e = w_ptr + e.to(tl.int64) * w_se
    ws_e = ws_ptr + e.to(tl.int64) * ws_se
    for m0 in range(0, count, BLOCK_M):
        pair, m_ok = _load_pairs(list_ptr, m0, count, BLOCK_M)
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for k0 in range(0, INTER, BLOCK_K):
            a, a_s = _load_act(h_ptr, hs_ptr, pair, k0, INTER, BLOCK_K)
            if A_BF16:
                a = _e4m3_to_bf16(a, a_s, BLOCK_M, BLOCK_K)
            b, b_s = _load_weight(w_e, w_sn, w_sk, ws_e, ws_sn, ws_sk, n, n_ok, k0, BLOCK_K)
            acc = _mx_dot(acc, a, a_s, b, b_s, A_BF16)
        tl.store(rows_ptr + pair[:, None] * LATENT + n[None, :], f32_to_bf16_bits(acc),
                 mask=m_ok[:, None] & n_ok[None, :])


# ----------------------------------------------------------------------------- wrapper

def _check_config(name: str, config: dict) -> dict:
    if not isinstance(config, dict):
        raise TypeError(f"{name} must be a dict of launch parameters, got "
                        f"{type(config).__name__}")
    if "BLOCK_K" in config:
        raise ValueError(f"{name} must not set BLOCK_K: the reduction step is fixed per "
                         f"shape (pass block_k_up / block_k_down), so that results never "
                         f"depend on the batch-width bucket")
    missing = [k for k in CONFIG_KEYS if k not in config]
    if missing:
        raise ValueError(f"{name} lacks {missing}")
    m, n = config["BLOCK_M"], config["BLOCK_N"]
    if m < 16 or m & (m - 1):
        raise ValueError(f"{name}['BLOCK_M'] must be a power of two >= 16, got {m}")
    if n < 32 or n & (n - 1):
        raise ValueError(f"{name}['BLOCK_N'] must be a power of two >= 32 (whole MX "
                         f"blocks), got {n}")
    if config["A_BF16"] not in (0, 1):
        raise ValueError(f"{name}['A_BF16'] must be 0 or 1, got {config['A_BF16']}")
    return config


def _check_block_k(name: str, block_k: int, dim: int, dim_name: str) -> int:
    if block_k < 32 or block_k & (block_k - 1) or dim % block_k:
        raise ValueError(f"{name} ({block_k}) must be a power of two >= 32 dividing "
                         f"{dim_name} ({dim})")
    return block_k


def experts(q: torch.Tensor, q_scales: torch.Tensor, weights: ExpertWeights,
            counts: torch.Tensor, pairs: torch.Tensor, generation: torch.Tensor,
            top_k: int, beta: float, linear_beta: float | None, *,
            rows: torch.Tensor | None = None, workspace: Workspace | None = None,
            config_up: dict | None = None, config_down: dict | None = None,
            block_k_up: int | None = None, block_k_down: int | None = None) -> torch.Tensor:
    """``rows[t*K + k] = bf16(W2_e . mxfp8(situ(W13_e . q[t])))`` for every pair listed
    in this call's parity of the routing lists; BF16 [b*K, L].

    q/q_scales: the MXFP8 plan, uint8 [b, L] / [b, L/32]. weights: ``prepare_weights``'s
    result. counts int32 [2, E], pairs int32 [2, E, R], generation int32 [1]: the routing
    lists; the kernels use parity ``generation[0] & 1``, read on the device, and expert
    e's pairs ``pairs[p, e, :counts[p, e]]`` in any order (each pair p < b*K listed
    exactly once, as the route kernel guarantees: rows of unlisted pairs are not written).
    beta/linear_beta: SiTU's parameters (linear_beta None: u' = u).

    rows: the output buffer (BF16 [b*K, L]), allocated if None. workspace: the MXFP8
    hidden (``make_workspace``, >= b*K rows), allocated if None; pass both for CUDA
    graphs. config_up/config_down: launch configs (``CONFIG_KEYS``), else the tuned ones
    for batch width b. block_k_up/block_k_down: reduction steps along L and I (fixed per
    shape; default ``reduction_block``)."""
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
        workspace = make_workspace(num_pairs, inter, device)
    if not isinstance(workspace, tuple) or len(workspace) != 2:
        raise TypeError("workspace must be a Workspace (h_codes, h_scales)")
    check_tensor("workspace.h_codes", workspace[0], torch.uint8, (None, inter), device)
    check_tensor("workspace.h_scales", workspace[1], torch.uint8,
                 (workspace[0].shape[0], inter // MX_BLOCK), device)
    if workspace[0].shape[0] < num_pairs:
        raise ValueError(f"workspace.h_codes must have >= b*K = {num_pairs} rows, got "
                         f"{workspace[0].shape[0]}")
    key = shape_key(L, inter, E)
    cfg_up = _check_config("config_up", config_up if config_up is not None else
                           config_for(KERNEL_UP, key, b, DEFAULT_UP, device))
    cfg_down = _check_config("config_down", config_down if config_down is not None else
                             config_for(KERNEL_DOWN, key, b, DEFAULT_DOWN, device))
    bk_up = _check_block_k("block_k_up", block_k_up or reduction_block(L, BLOCK_K_UP), L, "L")
    bk_down = _check_block_k("block_k_down", block_k_down or
                             reduction_block(inter, BLOCK_K_DOWN), inter, "I")
    if num_pairs == 0:
        return rows
    h_codes, h_scales = workspace
    _experts_up_kernel[(E, triton.cdiv(inter, cfg_up["BLOCK_N"]))](
        q, q_scales, counts, pairs, generation,
        weights.w13, *weights.strides("w13"), weights.w13_scales,
        *weights.strides("w13_scales"),
        h_codes, h_scales, E, wide_rows, float(beta),
        float(linear_beta) if linear_beta is not None else 1.0,
        LATENT=L, INTER=inter, TOP_K=top_k, HAS_LINEAR_BETA=linear_beta is not None,
        A_BF16=cfg_up["A_BF16"], BLOCK_M=cfg_up["BLOCK_M"], BLOCK_N=cfg_up["BLOCK_N"],
        BLOCK_K=bk_up, num_warps=cfg_up["num_warps"], num_stages=cfg_up["num_stages"])
    _experts_down_kernel[(E, triton.cdiv(L, cfg_down["BLOCK_N"]))](
        h_codes, h_scales, counts, pairs, generation,
        weights.w2, *weights.strides("w2"), weights.w2_scales, *weights.strides("w2_scales"),
        rows.view(torch.int16), E, wide_rows,
        LATENT=L, INTER=inter, A_BF16=cfg_down["A_BF16"], BLOCK_M=cfg_down["BLOCK_M"],
        BLOCK_N=cfg_down["BLOCK_N"], BLOCK_K=bk_down, num_warps=cfg_down["num_warps"],
        num_stages=cfg_down["num_stages"])
    return rows
