"""The routed experts (kernels/experts/) against ``reference.expert_rows``.

Every launch goes through ``launch``, which poisons the outputs and checks that nothing
outside the b*K rows was written; the checks then hold the hidden MXFP8 bits to the
reference's (only FP32-accumulation rounding flips, adjacent and rare), the rows to a
float64 recomputation from the kernel's own hidden bits (within one BF16 rounding) and
to the reference rows, and the results to bitwise independence of the claim order, of
the other tokens in the batch, of the launch config and of the weight layout.
"""

from __future__ import annotations

import functools
import re

import pytest
import torch
import triton
import triton.language as tl
from hypothesis import example, given, settings
from hypothesis import strategies as st

from conftest import DEVICE, QUICK, forbid_launches, poison
from wide_moe_triton import mx, reference
from wide_moe_triton.config import WideMoEConfig
from wide_moe_triton.kernels import experts as ex
from wide_moe_triton.kernels.experts import layout as ex_layout

CFG = WideMoEConfig.tiny()
L, E, K, WIDE_ROWS = CFG.latent, CFG.num_experts, CFG.top_k, CFG.wide_rows
INTERS = (CFG.intermediate_per_rank, CFG.replace(tp=4).intermediate_per_rank)  # 128, 32
BETA, LINEAR_BETA = CFG.beta, CFG.linear_beta
BM = ex.DEFAULT_UP["BLOCK_M"]
SPARE = 3  # poisoned rows after the b*K ones, which the kernels must leave alone
# Launches are slow in the interpreter: the main property runs two thirds of the profile's
# examples (plus its explicit ones), those of two launches an example a quarter.
# The quick GPU check (conftest's gpu-check) keeps 4 and 2: each example compiles.
SOME = 4 if QUICK else max(8, settings.default.max_examples * 2 // 3)
FEW = 2 if QUICK else max(3, settings.default.max_examples // 4)


# ------------------------------------------------------------------------------ data

@functools.lru_cache(maxsize=None)
def stock_weights(inter: int):
    """MXFP4 experts (w13, w13_scales, w2, w2_scales) on the CPU, as LatentMoE draws them."""
    gen = torch.Generator().manual_seed(1234 + inter)
    w13 = mx.quantize_mxfp4(torch.randn(E, 2 * inter, L, generator=gen) * L ** -0.5)
    w2 = mx.quantize_mxfp4(torch.randn(E, L, inter, generator=gen) * inter ** -0.5)
    return (*w13, *w2)


@functools.lru_cache(maxsize=None)
def prepared(inter: int, layout: str = "wgmma", block_k=(None, None)) -> ex.ExpertWeights:
    return ex.prepare_weights(*(t.to(DEVICE) for t in stock_weights(inter)), layout=layout,
                              block_k_up=block_k[0], block_k_down=block_k[1])


def make_plan(b: int, seed: int, nonfinite_tokens=()):
    """MXFP8 plan (CPU) of a random unit-scale BF16 latent [b, L]; the listed tokens get an
    infinite element, so one of their MX blocks is NaN-coded."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(b, L, generator=gen).to(torch.bfloat16)
    for t in nonfinite_tokens:
        x[t, 5] = float("inf")
    return mx.quantize_mxfp8(x)


def make_ids(kind: str, b: int, seed: int) -> torch.Tensor:
    """Expert ids int32 [b, K], K distinct a row: "random"; "hot" (one expert on every
    token, in a random slot); "distinct" (all b*K pairs on distinct experts, b*K <= E)."""
    gen = torch.Generator().manual_seed(seed)
    if kind == "distinct":
        return torch.randperm(E, generator=gen)[:b * K].reshape(b, K).int()
    rows = [torch.randperm(E, generator=gen)[:K] for _ in range(b)]
    if kind == "hot":
        hot = int(torch.randint(E, (1,), generator=gen))
        for i in range(b):
            others = [e for e in torch.randperm(E, generator=gen).tolist() if e != hot][:K - 1]
            slot = int(torch.randint(K, (1,), generator=gen))
            rows[i] = torch.tensor(others[:slot] + [hot] + others[slot:])
    return torch.stack(rows).int()


class Run:
    """A launch's outputs, on the CPU: rows [b*K, L], h_codes [b*K, I], h_scales."""

    def __init__(self, rows, h_codes, h_scales):
        self.rows, self.h_codes, self.h_scales = rows, h_codes, h_scales

    def same_bits(self, other) -> bool:
        return (torch.equal(self.rows.view(torch.int16), other.rows.view(torch.int16))
                and torch.equal(self.h_codes, other.h_codes)
                and torch.equal(self.h_scales, other.h_scales))


def launch(q, q_scales, ids, inter, *, layout="wgmma", generation=0, order_seed=None,
           stale_ids=None, config_up=None, config_down=None, block_k=(None, None)) -> Run:
    """Run the experts over lists built from ``ids`` (order shuffled by ``order_seed``),
    with the other parity holding ``stale_ids``' lists (which must be ignored), into
    poisoned buffers with SPARE extra rows; asserts the extra rows stay poisoned."""
    b = ids.shape[0]
    P = b * K
    order = None if order_seed is None else torch.Generator().manual_seed(order_seed)
    counts, pairs, gen = ex.routing_lists(ids.to(DEVICE), E, WIDE_ROWS,
                                          generation=generation, generator=order)
    if stale_ids is not None:
        stale = ex.routing_lists(stale_ids.to(DEVICE), E, WIDE_ROWS, generation=generation + 1)
        other = 1 - (generation & 1)
        counts[other], pairs[other] = stale[0][other], stale[1][other]
    big = poison(torch.empty(P + SPARE, L, dtype=torch.bfloat16, device=DEVICE))
    work = ex.Workspace(*(poison(t) for t in ex.make_workspace(b + 1, K, L, inter, DEVICE)))
    rows = ex.experts(q.to(DEVICE), q_scales.to(DEVICE), prepared(inter, layout, block_k),
                      counts, pairs, gen, K, BETA, LINEAR_BETA, rows=big[:P], workspace=work,
                      config_up=config_up, config_down=config_down)
    assert rows.data_ptr() == big.data_ptr()
    assert torch.isnan(big[P:].float()).all(), "a row past b*K was written"
    assert (work.h_codes[P:] == 0xA5).all() and (work.h_scales[P:] == 0xA5).all(), \
        "a workspace row past b*K was written"
    assert torch.isnan(work.h_values[P:].float()).all(), "an h_values row past b*K was written"
    assert torch.isnan(work.q_values[b:].float()).all(), "a q_values row past b was written"
    default_down = ex.tuning(layout, DEVICE).default_down
    if (config_down or default_down)["A_BF16"]:  # the BF16 hidden is the MXFP8 one's value
        h = mx.dequantize_mxfp8(work.h_codes[:P], work.h_scales[:P])
        assert torch.equal(work.h_values[:P].float(), h), "h_values differ from the hidden"
    return Run(rows.cpu(), work.h_codes[:P].cpu(), work.h_scales[:P].cpu())


# ------------------------------------------------------------------------- references

def reference_run(q, q_scales, ids, inter) -> Run:
    hidden = {}
    rows = reference.expert_rows(q, q_scales, ids, *stock_weights(inter), BETA, LINEAR_BETA,
                                 hidden_out=hidden)
    P = ids.numel()
    return Run(rows, torch.stack([hidden[p][0] for p in range(P)]),
               torch.stack([hidden[p][1] for p in range(P)]))


def situ64(g, u):
    u = LINEAR_BETA * torch.tanh(u / LINEAR_BETA)
    return BETA * torch.tanh(g / BETA) * torch.sigmoid(g) * u


def hidden64(q, q_scales, ids, inter):
    """(the hidden before quantization [b*K, I] in float64 from exact GEMM products, and a
    bound on how far any FP32 evaluation of it may land: an FP32 sum of L products is
    within 2 L 2**-24 of the sum of their magnitudes in any order, even with truncating
    adds; SiTU's change over that (tiny) interval, taken at its corners, plus 16 ulp for
    SiTU's own FP32 evaluation)."""
    w13, w13_s = stock_weights(inter)[:2]
    latent = mx.dequantize_mxfp8(q, q_scales).double()
    flat = ids.reshape(-1).long()
    h = torch.empty(flat.numel(), inter, dtype=torch.float64)
    tol = torch.empty_like(h)
    gamma = 2 * L * 2.0 ** -24
    for e in flat.unique().tolist():
        pairs = (flat == e).nonzero().squeeze(1)
        w = mx.dequantize_mxfp4(w13[e], w13_s[e]).double()
        a = latent[pairs // K]
        gate_up, mass = a @ w.t(), a.abs() @ w.abs().t()
        g, u = gate_up[:, :inter], gate_up[:, inter:]
        dg, du = gamma * mass[:, :inter], gamma * mass[:, inter:]
        h[pairs] = situ64(g, u)
        moves = [(situ64(g + sg * dg, u + su * du) - h[pairs]).abs()
                 for sg in (-1, 0, 1) for su in (-1, 0, 1)]
        tol[pairs] = torch.stack(moves).amax(0) + 16 * 2.0 ** -24 * h[pairs].abs()
    return h, tol


def through_w2(h: torch.Tensor, ids, inter, absolute=False) -> torch.Tensor:
    """float64 rows [b*K, L] of hidden values ``h`` [b*K, I] times each pair's W2 (of
    |h| and |W2| if ``absolute``)."""
    w2, w2_s = stock_weights(inter)[2:]
    flat = ids.reshape(-1).long()
    out = torch.empty(flat.numel(), L, dtype=torch.float64)
    for e in flat.unique().tolist():
        pairs = (flat == e).nonzero().squeeze(1)
        w = mx.dequantize_mxfp4(w2[e], w2_s[e]).double()
        out[pairs] = h[pairs].abs() @ w.abs().t() if absolute else h[pairs] @ w.t()
    return out


def hidden_values(run: Run) -> torch.Tensor:
    return mx.dequantize_mxfp8(run.h_codes, run.h_scales).double()


def rows_tolerance(run: Run, ids, inter):
    """(float64 product of the run's own hidden bits and W2, how far its FP32-accumulated,
    once BF16-rounded value may be: half a BF16 ulp plus 2 I 2**-24 of the magnitudes)."""
    h = hidden_values(run)
    exact = through_w2(h, ids, inter)
    mass = through_w2(h, ids, inter, absolute=True)
    return exact, 2.0 ** -8 * exact.abs() + 2 * inter * 2.0 ** -24 * mass


def e4m3_ordinal(codes: torch.Tensor) -> torch.Tensor:
    """Position of each E4M3 code on the number line (codes of one sign are monotone;
    +0 and -0 share 0), so adjacent values have ordinals one apart."""
    mag = (codes & 0x7F).to(torch.int32)
    return torch.where((codes & 0x80) != 0, -mag, mag)


def assert_hidden_matches(run: Run, ref: Run, h: torch.Tensor, tol: torch.Tensor):
    """The kernel's MXFP8 hidden equals the reference's, except where FP32 accumulation
    order moved a value across a rounding boundary: such flips are rare (< 1%), between
    adjacent codes, and only where the exact value ``h`` lies within its FP32 error bound
    ``tol`` of the boundary between the two codes (or, for a scale, of a power of two)."""
    P, inter = run.h_codes.shape
    scale_diff = run.h_scales != ref.h_scales
    assert scale_diff.float().mean() < 0.01, "too many hidden scale bytes differ"
    if scale_diff.any():
        assert ((run.h_scales.int() - ref.h_scales.int()).abs()[scale_diff] == 1).all()
        amax = h.reshape(P, -1, 32).abs().amax(-1)[scale_diff]
        slack = tol.reshape(P, -1, 32).amax(-1)[scale_diff]
        power = torch.exp2(torch.log2(amax).round())
        assert ((amax - power).abs() <= slack).all(), \
            "a hidden scale differs though the block's amax is not at a power of two"
    same_scale = (~scale_diff).repeat_interleave(32, dim=1)
    vk, vr = hidden_values(run), hidden_values(ref)
    flip = (vk != vr) & same_scale
    assert flip.float().mean() < 0.01, f"{int(flip.sum())} hidden codes differ"
    steps = (e4m3_ordinal(run.h_codes) - e4m3_ordinal(ref.h_codes)).abs()
    assert (steps[flip] == 1).all(), "a hidden code differs by more than one step"
    boundary = (vk + vr) / 2
    assert ((h - boundary).abs()[flip] <= tol[flip]).all(), \
        "a hidden code differs though the exact value is not within FP32 error of a boundary"


def assert_rows_from_hidden(run: Run, ids, inter):
    """Rows are the FP32-accumulated product of the kernel's own hidden bits and W2, one
    BF16 rounding: within ``rows_tolerance`` of the float64 product, and equal to its
    BF16 rounding almost everywhere."""
    exact, tol = rows_tolerance(run, ids, inter)
    got = run.rows.double()
    assert not torch.isnan(got).any(), "a listed row was not written"
    assert ((got - exact).abs() <= tol).all(), \
        f"rows off the float64 product by {float(((got - exact).abs() - tol).max()):.3g}"
    same = (run.rows == exact.to(torch.bfloat16)).float().mean()
    assert same >= 0.99, f"only {float(same):.4f} of the rows round like the float64 product"


def assert_rows_near_reference(run: Run, ref: Run, ids, inter):
    """Rows differ from the reference's by no more than their hidden bits do (through
    |W2|) plus both FP32/BF16 rounding bounds, and by under 1e-2 relative over the batch.

    (Not per row: one flip of a row's largest hidden element moves that row by up to a
    sixteenth of it, a legitimate few percent.)"""
    tol_k, tol_r = rows_tolerance(run, ids, inter)[1], rows_tolerance(ref, ids, inter)[1]
    moved = through_w2(hidden_values(run) - hidden_values(ref), ids, inter, absolute=True)
    err = (run.rows.double() - ref.rows.double()).abs()
    assert (err <= moved + tol_k + tol_r).all()
    rel = (run.rows.double() - ref.rows.double()).norm() / ref.rows.double().norm()
    assert rel < 1e-2, f"relative error {float(rel):.3g} over the batch"


# ------------------------------------------------------------------------- strategies

seeds = st.integers(0, 2 ** 31 - 1)
cases = st.one_of(
    st.tuples(st.just("random"), st.integers(1, 24), seeds),
    # One expert on every token: one tile, exactly a full tile, one past it, several.
    st.tuples(st.just("hot"), st.sampled_from([BM, BM + 1]) | st.integers(1, 2 * BM + 2),
              seeds),
    st.tuples(st.just("distinct"), st.integers(1, E // K), seeds),
)
a_formats = st.tuples(st.integers(0, 1), st.integers(0, 1))


# The invariance tests need no particular tiles: wide ones run fastest in the interpreter.
FAST_UP = dict(ex.DEFAULT_UP, BLOCK_N=128)
FAST_DOWN = dict(ex.DEFAULT_DOWN, BLOCK_N=256)


def configs(a_bf16, wide=False, layout="wgmma"):
    """(config_up, config_down): the layout's defaults here (or FAST_*) with these
    activation formats (BF16 ones with the "wgmma_decode" layout, which takes no other)."""
    t = ex.tuning(layout, DEVICE)
    up, down = (FAST_UP, FAST_DOWN) if wide else (t.default_up, t.default_down)
    return for_layout(dict(up, A_BF16=a_bf16[0]), dict(down, A_BF16=a_bf16[1]), layout)


def for_layout(up, down, layout):
    """The configs as the layout takes them: BF16 activations for "wgmma_decode"."""
    if layout == "wgmma_decode":
        return dict(up, A_BF16=1), dict(down, A_BF16=1)
    return up, down


# ------------------------------------------------------------------------------ tests

@settings(max_examples=SOME)
@given(case=cases, inter=st.sampled_from(INTERS), a_bf16=a_formats,
       layout=st.sampled_from(ex.LAYOUTS), generation=st.integers(0, 3),
       block_k=st.tuples(st.sampled_from([64, 128, 256]), st.sampled_from([32, 64, 128])),
       wide=st.booleans())
@example(case=("random", 1, 0), inter=128, a_bf16=(0, 0), layout="wgmma", generation=0,
         block_k=(128, 128), wide=False)
@example(case=("hot", BM, 1), inter=128, a_bf16=(1, 1), layout="wgmma", generation=1,
         block_k=(256, 64), wide=False)
@example(case=("hot", BM + 1, 2), inter=32, a_bf16=(0, 1), layout="nk", generation=2,
         block_k=(64, 32), wide=False)
@example(case=("hot", 2 * BM + 1, 3), inter=128, a_bf16=(1, 0), layout="wgmma", generation=3,
         block_k=(128, 32), wide=False)
@example(case=("distinct", E // K, 4), inter=32, a_bf16=(0, 0), layout="nk", generation=1,
         block_k=(128, 32), wide=False)
def test_rows_match_reference(case, inter, a_bf16, layout, generation, block_k, wide):
    """Hidden bits and rows against the reference, for skewed routings, one or several
    reduction steps, the default or wide tiles, in this call's parity (the other one holds
    a different routing that must be ignored)."""
    kind, b, seed = case
    ids = make_ids(kind, b, seed)
    q, qs = make_plan(b, seed)
    up, down = configs(a_bf16, wide, layout)
    run = launch(q, qs, ids, inter, layout=layout, generation=generation, order_seed=seed,
                 stale_ids=make_ids("random", b, seed + 1), config_up=up, config_down=down,
                 block_k=(block_k[0], min(block_k[1], inter)))
    ref = reference_run(q, qs, ids, inter)
    assert_hidden_matches(run, ref, *hidden64(q, qs, ids, inter))
    assert_rows_from_hidden(run, ids, inter)
    assert_rows_near_reference(run, ref, ids, inter)


@settings(max_examples=FEW)
@given(case=cases, inter=st.sampled_from(INTERS), order_seed=seeds)
@example(case=("hot", 2 * BM + 2, 5), inter=128, order_seed=1)
def test_claim_order_does_not_change_bits(case, inter, order_seed):
    """The same lists in ascending and in shuffled claim order: identical bits."""
    kind, b, seed = case
    ids = make_ids(kind, b, seed)
    q, qs = make_plan(b, seed)
    ascending, shuffled = (launch(q, qs, ids, inter, order_seed=o, config_up=FAST_UP,
                                  config_down=FAST_DOWN) for o in (None, order_seed))
    assert ascending.same_bits(shuffled)


@pytest.mark.filterwarnings("ignore:All-NaN slice:RuntimeWarning")  # the NaN-coded block
@settings(max_examples=FEW)
@given(case=cases, extra=st.integers(1, BM + 1), inter=st.sampled_from(INTERS),
       nonfinite=st.booleans())
@example(case=("hot", 3, 6), extra=BM, inter=128, nonfinite=True)
def test_other_tokens_do_not_change_bits(case, extra, inter, nonfinite):
    """A batch's rows are bitwise those it gets alongside more tokens (on the same experts
    too, some with a NaN-coded plan block, which poison only their own rows)."""
    kind, b, seed = case
    ids = make_ids(kind, b, seed)
    q, qs = make_plan(b, seed)
    more_ids = torch.cat([ids, make_ids("random", extra, seed + 7)])
    bad = [b + extra - 1] if nonfinite else []
    more_q, more_qs = make_plan(b + extra, seed, nonfinite_tokens=bad)
    more_q[:b], more_qs[:b] = q, qs
    alone = launch(q, qs, ids, inter, order_seed=seed, config_up=FAST_UP,
                   config_down=FAST_DOWN)
    shared = launch(more_q, more_qs, more_ids, inter, order_seed=seed + 1, config_up=FAST_UP,
                    config_down=FAST_DOWN)
    P = b * K
    assert alone.same_bits(Run(shared.rows[:P], shared.h_codes[:P], shared.h_scales[:P]))
    for t in bad:
        assert torch.isnan(shared.rows[t * K:(t + 1) * K].float()).all()
        assert (shared.h_scales[t * K:(t + 1) * K] == 0xFF).all()
    clean = [t for t in range(b + extra) if t not in bad]
    assert not torch.isnan(shared.rows.reshape(b + extra, K, L)[clean].float()).any()


UP_CONFIGS = [dict(BLOCK_M=m, BLOCK_N=n, A_BF16=a, num_warps=w, num_stages=s, maxnreg=r)
              for m, n, a, w, s, r in ((16, 64, 1, 4, 3, 0), (32, 128, 0, 8, 2, 128),
                                       (64, 256, 1, 8, 4, 0))]
DOWN_CONFIGS = [dict(BLOCK_M=m, BLOCK_N=n, A_BF16=a, num_warps=w, num_stages=s, maxnreg=r)
                for m, n, a, w, s, r in ((16, 64, 1, 4, 2, 128), (32, 256, 0, 8, 3, 0),
                                         (64, 128, 1, 4, 4, 96))]


@pytest.mark.slow  # every config and layout
@settings(max_examples=FEW)
@given(case=cases, inter=st.sampled_from(INTERS), up=st.sampled_from(UP_CONFIGS),
       down=st.sampled_from(DOWN_CONFIGS), layout=st.sampled_from(ex.LAYOUTS))
@example(case=("hot", BM + 1, 8), inter=32, up=UP_CONFIGS[2], down=DOWN_CONFIGS[0],
         layout="nk")
def test_config_and_layout_do_not_change_bits(case, inter, up, down, layout):
    """Everything a batch-width bucket may change (BLOCK_M, BLOCK_N, A_BF16, warps,
    stages) and the weight layout leave the bits as the default config's."""
    kind, b, seed = case
    ids = make_ids(kind, b, seed)
    q, qs = make_plan(b, seed)
    base = launch(q, qs, ids, inter)
    up, down = for_layout(up, down, layout)
    other = launch(q, qs, ids, inter, layout=layout, config_up=up, config_down=down)
    assert base.same_bits(other), f"bits changed with {up}, {down}, layout {layout}"


@pytest.mark.slow  # two experts calls an example
@settings(max_examples=FEW)
@given(case=cases, inter=st.sampled_from(INTERS), cols=st.sampled_from([1, 2, 4, 8]),
       block_n=st.sampled_from([64, 128]), mask_up=st.booleans(), mask_down=st.booleans())
@example(case=("hot", 2 * BM + 1, 5), inter=128, cols=8, block_n=64, mask_up=True,
         mask_down=True)
def test_down_columns_and_masked_rows_keep_bits(case, inter, cols, block_n, mask_up,
                                                mask_down):
    """COLS column tiles a down program (more tiles than the matrix has included), and
    padded activation rows masked rather than read (MASK_ROWS), give the bits of the
    plain kernels."""
    kind, b, seed = case
    ids = make_ids(kind, b, seed)
    q, qs = make_plan(b, seed)
    up = dict(BLOCK_M=16, BLOCK_N=64, A_BF16=1, num_warps=4, num_stages=3, maxnreg=0)
    down = dict(BLOCK_M=16, BLOCK_N=block_n, A_BF16=1, num_warps=4, num_stages=3, maxnreg=0)
    one = launch(q, qs, ids, inter, layout="wgmma_decode", config_up=up, config_down=down)
    many = launch(q, qs, ids, inter, layout="wgmma_decode",
                  config_up=dict(up, MASK_ROWS=int(mask_up)),
                  config_down=dict(down, COLS=cols, MASK_ROWS=int(mask_down)))
    assert one.same_bits(many)


# Lists whose last 32-pair tile holds exactly 16, 17, 1 or no pairs past a whole one.
HALF_COUNTS = st.sampled_from([16, 17, 32, 33, 48, 49]) | st.integers(1, WIDE_ROWS)


@pytest.mark.slow  # two experts calls an example
@settings(max_examples=FEW)
@given(count=HALF_COUNTS, seed=seeds, inter=st.sampled_from(INTERS), cols=st.sampled_from([1, 4]),
       mask=st.booleans())
@example(count=48, seed=3, inter=128, cols=4, mask=True)
@example(count=17, seed=4, inter=32, cols=1, mask=False)
def test_half_tiles_keep_bits(count, seed, inter, cols, mask):
    """32-pair tiles whose lists end in a 16-pair tile where at most 16 pairs remain
    (HALF_TILE) give the bits of 16-pair tiles, for a hot expert with ``count`` pairs
    beside experts of a few pairs each (which take only the half tile)."""
    ids = make_ids("hot", count, seed)
    q, qs = make_plan(count, seed)
    up = dict(BLOCK_M=16, BLOCK_N=64, A_BF16=1, num_warps=4, num_stages=3, maxnreg=0)
    down = dict(BLOCK_M=16, BLOCK_N=64, A_BF16=1, num_warps=4, num_stages=3, maxnreg=0)
    keys = dict(BLOCK_M=32, MASK_ROWS=int(mask), HALF_TILE=1)
    narrow = launch(q, qs, ids, inter, layout="wgmma_decode", config_up=up, config_down=down)
    halved = launch(q, qs, ids, inter, layout="wgmma_decode", config_up=dict(up, **keys),
                    config_down=dict(down, COLS=cols, **keys))
    assert narrow.same_bits(halved)


@pytest.mark.slow  # two experts calls an example
@settings(max_examples=FEW)
@given(case=cases, inter=st.sampled_from([128, 192]), block_m=st.sampled_from([16, 32]),
       block_n=st.sampled_from([64, 128]), mask=st.booleans())
@example(case=("hot", 2 * BM + 1, 5), inter=192, block_m=32, block_n=128, mask=True)
def test_tma_weights_keep_bits(case, inter, block_m, block_n, mask):
    """Up weights read through tensor-memory-accelerator descriptors (TMA) give the bits
    of the threads' own copies, a last column tile past I included (I = 192 in tiles of
    128: the descriptor reads zeros there, the copies clamp their rows)."""
    kind, b, seed = case
    ids = make_ids(kind, b, seed)
    q, qs = make_plan(b, seed)
    up = dict(BLOCK_M=block_m, BLOCK_N=block_n, A_BF16=1, num_warps=4, num_stages=3,
              maxnreg=0, MASK_ROWS=int(mask))
    down = dict(FAST_DOWN, A_BF16=1)  # the same in both runs: wide tiles, the fastest here
    copies = launch(q, qs, ids, inter, layout="wgmma_decode", config_up=up, config_down=down)
    tma = launch(q, qs, ids, inter, layout="wgmma_decode", config_up=dict(up, TMA=1),
                 config_down=down)
    assert copies.same_bits(tma)


@pytest.mark.parametrize("inter, block_k, message", [
    (32, None, r"needs I \(32\)"),  # a 64-row tile would hold gate and up rows
    (128, 256, r"needs the up reduction step \(256\) at most 128"),  # a 512-byte box row
])
def test_tma_refuses_what_a_box_cannot_hold(inter, block_k, message, monkeypatch):
    """Weights the descriptors cannot cut into one box a step are refused by the
    config's name, before any launch."""
    forbid_launches(monkeypatch, ex, "_plan_values_kernel", "_experts_up_kernel",
                    "_experts_down_kernel")
    ids = make_ids("random", 3, 1)
    q, qs = make_plan(3, 1)
    counts, pairs, gen = ex.routing_lists(ids.to(DEVICE), E, WIDE_ROWS)
    up = dict(BLOCK_M=16, BLOCK_N=64, A_BF16=1, num_warps=4, num_stages=3, maxnreg=0, TMA=1)
    down = dict(up, TMA=0)
    weights = prepared(inter, "wgmma_decode", block_k=(block_k, None))
    with pytest.raises(ValueError, match=r"^config_up\['TMA'\] " + message):
        ex.experts(q.to(DEVICE), qs.to(DEVICE), weights, counts, pairs, gen, K, BETA,
                   LINEAR_BETA, config_up=up, config_down=down)


def test_a_bf16_variants_are_bitwise_identical():
    """Both activation formats feed the same exact products to the same FP32 sums."""
    ids = make_ids("hot", BM + 3, 9)
    q, qs = make_plan(BM + 3, 9)
    runs = [launch(q, qs, ids, 128, config_up=up, config_down=down)
            for up, down in map(configs, ((0, 0), (1, 1)))]
    assert runs[0].same_bits(runs[1])


@pytest.mark.slow  # three experts calls an example
@settings(max_examples=FEW)
@given(case=cases, inter=st.sampled_from(INTERS), raised=st.integers(8, 40))
@example(case=("hot", BM + 1, 10), inter=32, raised=40)
def test_decode_layout_with_wide_scales_matches_dot_scaled_bits(case, inter, raised):
    """Scale bytes above 128 (where the decode multiplies twice): the "wgmma_decode"
    layout gives the bits dot_scaled's E2M1 path gives, on Hopper's path (``tl.dot``,
    operands staged) and on the others' (``tl.dot_scaled``, ``staged_dot`` False)."""
    kind, b, seed = case
    ids = make_ids(kind, b, seed)
    q, qs = make_plan(b, seed)
    w13, w13_s, w2, w2_s = stock_weights(inter)
    gen = torch.Generator().manual_seed(seed)
    # Raise a random half of the blocks by ``raised`` (their products stay exact).
    lift = lambda s: torch.where(torch.rand(s.shape, generator=gen) < 0.5,  # noqa: E731
                                 (s.int() + raised).clamp(max=254), s.int()).to(torch.uint8)
    stock = (w13, lift(w13_s), w2, lift(w2_s))
    assert max(int(stock[1].max()), int(stock[3].max())) > 128
    runs = []
    for layout, staged in (("wgmma", None), ("wgmma_decode", None), ("wgmma_decode", False)):
        weights = ex.prepare_weights(*(t.to(DEVICE) for t in stock), layout=layout)
        counts, pairs, gen_t = ex.routing_lists(ids.to(DEVICE), E, WIDE_ROWS)
        rows = poison(torch.empty(b * K, L, dtype=torch.bfloat16, device=DEVICE))
        up, down = configs((1, 1), wide=True)  # the same tiles for every layout
        with pytest.MonkeyPatch.context() as patch:
            if staged is not None:
                patch.setattr(ex, "staged_dot", lambda device: staged)
            ex.experts(q.to(DEVICE), qs.to(DEVICE), weights, counts, pairs, gen_t, K, BETA,
                       LINEAR_BETA, rows=rows, config_up=up, config_down=down)
        runs.append(rows.cpu().view(torch.int16))
    assert torch.equal(runs[0], runs[1]) and torch.equal(runs[0], runs[2])


def test_word_code_is_a_permutation_of_the_word():
    """Each bit of a "wgmma_decode" word holds one bit of one of its 8 codes, and every
    code bit has one place: the moves of the kernel's decode cover the word once."""
    table = ex.word_code()
    assert sorted(table) == [(p, h, c) for p in range(4) for h in range(2) for c in range(4)]


@given(block_k=st.sampled_from([32, 64, 128, 256]), seed=seeds)
def test_encode_words_keeps_each_word_and_inverts(block_k, seed):
    """``encode_words`` moves bits only within each 4-byte word (a lane's 8 codes of a
    32-element block): each word keeps its number of set bits; and it decodes back."""
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (2, 3, 256), generator=gen, dtype=torch.uint8)
    enc = ex.encode_words(codes, block_k)
    ones = lambda t: torch.stack([(t >> i) & 1 for i in range(8)]).sum(0)  # noqa: E731
    assert torch.equal(ones(enc).reshape(2, 3, -1, 4).sum(-1),
                       ones(codes).reshape(2, 3, -1, 4).sum(-1))
    assert torch.equal(ex.decode_words(enc, block_k), codes)
    assert not torch.equal(enc, codes)


@given(block_k=st.sampled_from([32, 128]), rows=st.integers(1, 9), piece=st.integers(1, 4),
       seed=seeds)
def test_words_are_encoded_alike_in_any_pieces(block_k, rows, piece, seed):
    """Re-encoding goes by pieces of rows (its memory would otherwise be 16x the
    weights'): any piece size gives the bytes of one pass over the whole tensor."""
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (rows, 3, block_k), generator=gen, dtype=torch.uint8)
    whole = ex._encode_rows(codes, block_k)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ex_layout, "_WORD_ROWS", piece)
        assert torch.equal(ex.encode_words(codes, block_k), whole)
        assert torch.equal(ex.decode_words(whole, block_k), codes)


@triton.jit
def _decode_tile_kernel(w_ptr, s_ptr, out_ptr, K: tl.constexpr, ROWS: tl.constexpr,
                        BLOCK_K: tl.constexpr, WIDE_SCALES: tl.constexpr,
                        INTERPRET: tl.constexpr):
    rows = tl.arange(0, ROWS)
    for k0 in range(0, K, BLOCK_K):
        v = ex._decoded_weights(w_ptr, s_ptr, rows, k0, K, ROWS, BLOCK_K, ex.ROW_BLOCK,
                                WIDE_SCALES, INTERPRET)
        tl.store(out_ptr + rows[:, None] * K + k0 + tl.arange(0, BLOCK_K)[None, :], v)


@settings(max_examples=FEW)
@given(block_k=st.sampled_from([32, 128]), full_range=st.booleans(), seed=seeds)
@example(block_k=128, full_range=True, seed=3)
def test_decoded_weights_are_the_exact_values(block_k, full_range, seed):
    """The kernel's decode of a "wgmma_decode" tile: every weight's exact value (code
    times 2**(scale - 127)), bit for bit, for scale bytes over the whole E8M0 range
    (0..254, overflow to Inf included) or as drawn, through the arithmetic the experts
    kernel runs here: FP32 in the interpreter, BF16 multiplies on a GPU."""
    gen = torch.Generator().manual_seed(seed)
    rows, k = 2 * ex.ROW_BLOCK, 256
    codes, scales = mx.quantize_mxfp4(torch.randn(1, rows, k, generator=gen))
    if full_range:
        scales = torch.randint(0, 255, scales.shape, generator=gen, dtype=torch.uint8)
    zeros = lambda *shape: torch.zeros(*shape, dtype=torch.uint8, device=DEVICE)  # noqa: E731
    w = ex.prepare_weights(codes.to(DEVICE), scales.to(DEVICE), zeros(1, k, rows // 4),
                           zeros(1, k, rows // 64), layout="wgmma_decode", block_k_up=block_k)
    assert w.wide_scales_up == bool((scales > 128).any())
    out = poison(torch.empty(rows, k, dtype=torch.bfloat16, device=DEVICE))
    _decode_tile_kernel[(1,)](w.w13.view(torch.int32), w.w13_scales, out, K=k, ROWS=rows,
                              BLOCK_K=block_k, WIDE_SCALES=w.wide_scales_up,
                              INTERPRET=ex._interpreting())
    want = mx.dequantize_mxfp4(codes, scales)[0].to(torch.bfloat16)
    assert torch.equal(out.cpu().view(torch.int16), want.view(torch.int16))


def test_decode_layout_refuses_e4m3_activations():
    """The "wgmma_decode" layout with a config asking for E4M3 activations is a named
    error, not a silent switch."""
    ids = make_ids("random", 2, 11)
    q, qs = make_plan(2, 11)
    counts, pairs, gen = ex.routing_lists(ids.to(DEVICE), E, WIDE_ROWS)
    for name, up, down in (("config_up", ex.DEFAULT_UP, ex.DEFAULT_DOWN_DECODE),
                           ("config_down", ex.DEFAULT_UP_DECODE, ex.DEFAULT_DOWN)):
        with pytest.raises(ValueError, match=f"^{name}\\['A_BF16'\\] must be 1"):
            ex.experts(q.to(DEVICE), qs.to(DEVICE), prepared(32, "wgmma_decode"), counts,
                       pairs, gen, K, BETA, LINEAR_BETA, config_up=up, config_down=down)


@pytest.mark.parametrize("layout, staged", [(layout, False) for layout in ex.LAYOUTS]
                         + [("wgmma_decode", True)])
def test_tuning_spaces_hold_their_defaults_and_priors(layout, staged):
    """The sweep times only configs of a launch's space (``tune.candidates`` drops the
    others), so a default or prior outside it would never be tried; every config of a
    space is one the wrapper accepts for that layout (``experts._tuning``: the staged
    path only runs on sm_90, so both of its variants are asked for by name)."""
    t = ex._tuning(layout, staged)
    for name, default, space, priors in (("up", t.default_up, t.space_up, t.priors_up),
                                         ("down", t.default_down, t.space_down,
                                          t.priors_down)):
        assert default in space, (name, default)
        assert all(p in space for p in priors), (name, [p for p in priors if p not in space])
        for config in space:
            up, down = (config, t.default_down) if name == "up" else (t.default_up, config)
            ex._check_configs(up, down, layout == "wgmma_decode", staged)


def test_columns_are_for_the_down_launch_only():
    """COLS in config_up is a named error even where the staged path runs, and nothing
    is written before it is raised."""
    args, P, inter = _valid_args()
    args["weights"] = prepared(inter, "wgmma_decode")
    args["rows"] = poison(torch.empty(P, L, dtype=torch.bfloat16, device=DEVICE))
    t = ex.tuning("wgmma_decode", DEVICE)
    with pytest.raises(ValueError, match=r"^config_up\['COLS'\] is for the down launch"):
        ex.experts(**args, config_up=dict(t.default_up, COLS=2), config_down=t.default_down)
    assert torch.isnan(args["rows"].float()).all()


def test_empty_batch_launches_nothing():
    """b = 0: an empty BF16 [0, L], no launch (a zero-size grid dimension is not one)."""
    q, qs = make_plan(0, 0)
    ids = torch.empty(0, K, dtype=torch.int32)
    counts, pairs, gen = ex.routing_lists(ids.to(DEVICE), E, WIDE_ROWS)
    rows = ex.experts(q.to(DEVICE), qs.to(DEVICE), prepared(32), counts, pairs, gen, K,
                      BETA, LINEAR_BETA)
    assert rows.shape == (0, L) and rows.dtype == torch.bfloat16


@given(case=cases, generation=st.integers(0, 5), order_seed=seeds)
def test_routing_lists_partition_the_pairs(case, generation, order_seed):
    """The helper's lists hold every pair once, under its expert, in parity gen & 1."""
    kind, b, seed = case
    ids = make_ids(kind, b, seed)
    counts, pairs, gen = ex.routing_lists(ids, E, WIDE_ROWS, generation=generation,
                                          generator=torch.Generator().manual_seed(order_seed))
    p = generation & 1
    assert gen.tolist() == [generation]
    assert (counts[1 - p] == 0).all() and (pairs[1 - p] == -1).all()
    seen = []
    for e in range(E):
        members = pairs[p, e, :counts[p, e]]
        assert (pairs[p, e, counts[p, e]:] == -1).all()
        assert (ids.reshape(-1)[members.long()] == e).all()
        seen += members.tolist()
    assert sorted(seen) == list(range(b * K))


def test_reduction_block_is_fixed_per_shape():
    """The reduction step: the largest power of two <= preferred dividing the dim."""
    assert ex.reduction_block(3584, 128) == 128 and ex.reduction_block(384, 128) == 128
    assert ex.reduction_block(256, 256) == 256 and ex.reduction_block(96, 128) == 32
    assert ex.reduction_block(32, 128) == 32
    with pytest.raises(ValueError):
        ex.reduction_block(48, 128)


def test_tuning_spaces_are_valid_and_hold_the_defaults():
    """Every candidate is a complete, valid config without BLOCK_K; defaults are in."""
    for name, space, default, priors in (("up", ex.SPACE_UP, ex.DEFAULT_UP, ex.PRIORS_UP),
                                         ("down", ex.SPACE_DOWN, ex.DEFAULT_DOWN,
                                          ex.PRIORS_DOWN)):
        assert default in space and all(p in space for p in priors), name
        for config in space:
            assert set(config) == set(ex.CONFIG_KEYS)  # never BLOCK_K: see the module doc
            ex._check_config(name, config)
    assert ex.shape_key(3584, 384, 896) == "L3584_I384_E896"


@given(block_k=st.sampled_from([32, 64, 128, 256]), seed=seeds)
def test_lane_order_permutes_within_each_block(block_k, seed):
    """Each row's block of block_k/2 bytes is permuted within itself (byte 4i + q to
    q*block_k/8 + i), nothing crosses a block, and the inverse restores the stock bytes."""
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (3, 5, 2 * 256), generator=gen, dtype=torch.uint8)
    moved = ex.lane_order(codes, block_k)
    half = block_k // 2
    blocks, moved_blocks = codes.reshape(3, 5, -1, half), moved.reshape(3, 5, -1, half)
    for j in (0, 1, 4, 5, half - 1):
        q, i = j % 4, j // 4
        assert torch.equal(moved_blocks[..., q * (block_k // 8) + i], blocks[..., j])
    assert torch.equal(ex.lane_order(moved, block_k, inverse=True), codes)


@given(rows=st.sampled_from([(2, 1), (4, 2), (8, 8)]), step=st.sampled_from([1, 2, 4]),
       seed=seeds)
def test_tiles_are_contiguous_row_blocks_by_steps(rows, step, seed):
    """``tile`` puts each (row block, step) tile's bytes together, row block outermost,
    steps in order; ``untile`` restores the stock order."""
    n_rows, row_block = rows
    gen = torch.Generator().manual_seed(seed)
    t = torch.randint(0, 256, (2, n_rows, 4 * step), generator=gen, dtype=torch.uint8)
    tiled = ex.tile(t, row_block, step).reshape(2, -1)
    tile_bytes = row_block * step
    for e, r, c in ((0, 0, 0), (1, n_rows - 1, 4 * step - 1), (1, n_rows // 2, step)):
        blk, rr, cc = r // row_block, r % row_block, c // step
        at = (blk * 4 + cc) * tile_bytes + rr * step + c % step
        assert tiled[e, at] == t[e, r, c]
    assert torch.equal(ex.untile(ex.tile(t, row_block, step), row_block, step), t)


def test_prepare_weights_fixes_layout_and_reduction_blocks():
    """The layout and reduction blocks chosen at build travel with the weights; the
    stock bytes are kept ("nk") or tiled and lane-ordered ("wgmma") and recoverable;
    bad input is named."""
    stock = stock_weights(32)
    w13, w13_s, w2, w2_s = stock
    nk = ex.prepare_weights(w13, w13_s, w2, w2_s, layout="nk")
    assert (nk.num_experts, nk.latent, nk.inter) == (E, L, 32)
    assert (nk.block_k_up, nk.block_k_down) == (ex.reduction_block(L, ex.BLOCK_K_UP), 32)
    assert all(torch.equal(a, b) for a, b in zip(nk.stock(), stock)) and nk.row_block == 1
    sw = ex.prepare_weights(w13, w13_s, w2, w2_s, layout="wgmma", block_k_up=64)
    assert sw.block_k_up == 64 and sw.row_block == ex.ROW_BLOCK
    assert all(torch.equal(a, b) for a, b in zip(sw.stock(), stock))
    assert not torch.equal(sw.w13, w13)
    assert ex.prepare_weights(w13, w13_s, w2, w2_s).layout == "wgmma_decode"  # CPU default
    with pytest.raises(ValueError, match="^layout "):
        ex.prepare_weights(w13, w13_s, w2, w2_s, layout="kn")
    with pytest.raises(ValueError, match="^w2 "):
        ex.prepare_weights(w13, w13_s, w2[:, :, :8], w2_s)
    with pytest.raises(TypeError, match="^w13_scales "):
        ex.prepare_weights(w13, w13_s.int(), w2, w2_s)
    with pytest.raises(ValueError, match="^block_k_up "):
        ex.prepare_weights(w13, w13_s, w2, w2_s, block_k_up=96)
    with pytest.raises(ValueError, match="^block_k_down "):
        ex.prepare_weights(w13, w13_s, w2, w2_s, block_k_down=64)  # does not divide I = 32


@given(which=st.sampled_from(["w13_scales", "w2_scales"]), at=st.integers(0, 2 ** 20))
def test_prepare_weights_refuses_nan_scales(which, at):
    """A weight block of NaN/Inf (scale byte 0xFF) is refused: the kernels' dot_scaled
    skips the NaN-scale test, so such a block would otherwise read as Inf."""
    tensors = dict(zip(("w13", "w13_scales", "w2", "w2_scales"), stock_weights(32)))
    bad = tensors[which].clone()
    bad.view(-1)[at % bad.numel()] = mx.SCALE_NAN
    tensors[which] = bad
    with pytest.raises(ValueError, match=f"^{which} holds the NaN scale"):
        ex.prepare_weights(**tensors)


def _valid_args():
    b, inter = 3, 32
    ids = make_ids("random", b, 0)
    q, qs = make_plan(b, 0)
    counts, pairs, gen = ex.routing_lists(ids.to(DEVICE), E, WIDE_ROWS)
    args = dict(q=q.to(DEVICE), q_scales=qs.to(DEVICE), weights=prepared(inter),
                counts=counts, pairs=pairs, generation=gen, top_k=K, beta=BETA,
                linear_beta=LINEAR_BETA)
    return args, b * K, inter


_BAD = []
for _name, _make, _exc in [
    ("q", lambda a, P, I: a["q"].to(torch.int8), TypeError),
    ("q", lambda a, P, I: torch.zeros(3, L + 32, dtype=torch.uint8, device=DEVICE), ValueError),
    ("q", lambda a, P, I: a["q"].to("meta"), ValueError),
    ("q_scales", lambda a, P, I: a["q_scales"][:, :4].contiguous(), ValueError),
    ("q_scales", lambda a, P, I: a["q_scales"].t().contiguous().t(), ValueError),
    ("weights", lambda a, P, I: stock_weights(32), TypeError),
    ("counts", lambda a, P, I: a["counts"].long(), TypeError),
    ("counts", lambda a, P, I: a["counts"][:1].contiguous(), ValueError),
    ("pairs", lambda a, P, I: a["pairs"][:, :E - 1].contiguous(), ValueError),
    ("generation", lambda a, P, I: torch.zeros(2, dtype=torch.int32, device=DEVICE),
     ValueError),
    ("generation", lambda a, P, I: torch.zeros(1, dtype=torch.int64, device=DEVICE),
     TypeError),
    ("top_k", lambda a, P, I: 0, ValueError),
    ("rows", lambda a, P, I: torch.empty(P, L, device=DEVICE), TypeError),
    ("rows", lambda a, P, I: torch.empty(P - 1, L, dtype=torch.bfloat16, device=DEVICE),
     ValueError),
    ("workspace", lambda a, P, I: tuple(ex.make_workspace(P // K, K, L, I, DEVICE)), TypeError),
    ("workspace.h_codes", lambda a, P, I: ex.make_workspace(P // K - 1, K, L, I, DEVICE),
     ValueError),
    ("workspace.h_scales", lambda a, P, I: ex.make_workspace(P // K, K, L, I, DEVICE)._replace(
        h_scales=torch.empty(P, I, dtype=torch.uint8, device=DEVICE)), ValueError),
    ("workspace.h_values", lambda a, P, I: ex.make_workspace(P // K, K, L, I, DEVICE)._replace(
        h_values=torch.empty(P, I, dtype=torch.float16, device=DEVICE)), TypeError),
    ("workspace.q_values", lambda a, P, I: ex.make_workspace(P // K, K, L, I, DEVICE)._replace(
        q_values=torch.empty(P // K, L + 32, dtype=torch.bfloat16, device=DEVICE)), ValueError),
    ("config_up", lambda a, P, I: dict(ex.DEFAULT_UP, BLOCK_K=64), ValueError),
    ("config_up", lambda a, P, I: {"BLOCK_M": 16}, ValueError),
    ("config_down", lambda a, P, I: dict(ex.DEFAULT_DOWN, BLOCK_N=48), ValueError),
    ("config_down", lambda a, P, I: dict(ex.DEFAULT_DOWN, BLOCK_N=32), ValueError),
    ("config_up", lambda a, P, I: dict(ex.DEFAULT_UP, maxnreg=100), ValueError),
    ("config_up", lambda a, P, I: dict(ex.DEFAULT_UP, MASKROWS=1), ValueError),
    ("config_down", lambda a, P, I: dict(ex.DEFAULT_DOWN, COLS=3), ValueError),
    ("config_down", lambda a, P, I: dict(ex.DEFAULT_DOWN, MASK_ROWS=2), ValueError),
    ("config_up", lambda a, P, I: dict(ex.DEFAULT_UP, HALF_TILE=2), ValueError),
    ("config_up", lambda a, P, I: dict(ex.DEFAULT_UP, TMA=2), ValueError),
    ("config_down", lambda a, P, I: dict(ex.DEFAULT_DOWN, BLOCK_M=16, HALF_TILE=1), ValueError),
    # the staged path's keys where the weights' layout does not run it
    ("config_up", lambda a, P, I: dict(ex.DEFAULT_UP, MASK_ROWS=1), ValueError),
    ("config_down", lambda a, P, I: dict(ex.DEFAULT_DOWN, COLS=2), ValueError),
    ("config_up", lambda a, P, I: dict(ex.DEFAULT_UP, BLOCK_M=32, HALF_TILE=1), ValueError),
    ("config_up", lambda a, P, I: dict(ex.DEFAULT_UP, TMA=1), ValueError),
    ("config_down", lambda a, P, I: dict(ex.DEFAULT_DOWN, TMA=1), ValueError),
]:
    _BAD.append(pytest.param(_name, _make, _exc, id=f"{_name}-{len(_BAD)}"))


@pytest.mark.parametrize("name, make, exc", _BAD)
def test_bad_argument_is_named(name, make, exc):
    """A wrong dtype, shape, device or value raises an error that starts with its name."""
    args, P, inter = _valid_args()
    arg = name.split(".")[0]
    args[arg] = make(args, P, inter)
    with pytest.raises(exc, match="^" + re.escape(name) + r"\b"):
        ex.experts(**args)
