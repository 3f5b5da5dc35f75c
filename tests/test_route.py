"""Routing: ids and weights bit-identical to ``reference.route``; routing-list claims."""

import pytest
import torch
import triton
import triton.language as tl
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import DEVICE, examples, poison
from wide_moe_triton import mx, reference
from wide_moe_triton.kernels import route as R

# Few programs per launch: the interpreter's cost is per program.
FAST = {"BLOCK_T": 16, "num_warps": 4, "ZERO_BLOCK": 8}
WIDE = {"BLOCK_T": 64, "num_warps": 4, "ZERO_BLOCK": 128}
INF, NAN = float("inf"), float("nan")


def make_logits(seed: int, rows: int, experts: int, kind: str) -> torch.Tensor:
    """FP32 logits [rows, experts] of one of a few families that stress the ranking."""
    gen = torch.Generator().manual_seed(seed)
    if kind == "ties":   # integer-valued: many exactly equal scores
        x = torch.randint(-2, 3, (rows, experts), generator=gen).float()
    elif kind == "wide":  # saturating sigmoids (scores 0 or 1, subnormal scores)
        x = torch.randn(rows, experts, generator=gen) * 60.0
    else:
        x = torch.randn(rows, experts, generator=gen) * 2.0
    if kind == "specials" and rows:
        pick = torch.randint(0, rows, (4,), generator=gen)
        x[pick[0]] = NAN                                       # a NaN row
        x[pick[1], : experts // 2] = INF
        x[pick[2], ::3] = -INF
        x[pick[3], 1::2] = NAN
        x.view(-1)[torch.randint(0, x.numel(), (8,), generator=gen)] = -0.0
        x.view(-1)[torch.randint(0, x.numel(), (8,), generator=gen)] = -100.0
    return x


def make_bias(seed: int, experts: int, kind: str) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed + 1)
    if kind == "zero":
        return torch.zeros(experts)
    if kind == "negzero":
        return torch.full((experts,), -0.0)
    if kind == "ties":   # equal biases on pairs of experts keep ties alive
        return (torch.randint(-1, 2, (experts // 2 + 1,), generator=gen).float() * 0.25
                ).repeat_interleave(2)[:experts].contiguous()
    return torch.randn(experts, generator=gen) * 0.05


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality of BF16 tensors, any NaN equal to any NaN (backends differ in
    the NaN they write)."""
    nan = a.isnan() & b.isnan()
    return bool(((a.view(torch.int16) == b.view(torch.int16)) | nan).all())


def assert_route_matches(logits, bias, top_k, renormalize, scale, ids, weights):
    ref_ids, ref_w = reference.route(logits.cpu(), bias.cpu(), top_k, renormalize, scale)
    ids, weights = ids.cpu(), weights.cpu()
    assert ((ids >= 0) & (ids < logits.shape[1])).all()
    assert torch.equal(ids, ref_ids), (ids, ref_ids)
    assert same_bits(weights, ref_w), (weights, ref_w)


def listed_pairs(lists: R.RoutingLists, parity: int) -> dict:
    counts = lists.counts[parity].cpu()
    pairs = lists.pairs[parity].cpu()
    return {e: sorted(pairs[e, : counts[e]].tolist()) for e in range(counts.shape[0])}


def expected_pairs(ids: torch.Tensor, experts: int) -> dict:
    top_k = ids.shape[1]
    out = {e: [] for e in range(experts)}
    for t, row in enumerate(ids.cpu().tolist()):
        for k, e in enumerate(row):
            out[e].append(t * top_k + k)
    return out


experts_st = st.sampled_from([16, 20, 24])
kind_st = st.sampled_from(["normal", "ties", "wide", "specials"])
bias_st = st.sampled_from(["zero", "negzero", "ties", "normal"])
scale_st = st.sampled_from([1.0, 2.5, 2.827, -1.5, 1e-3])


@settings(max_examples=examples(40))
@given(seed=st.integers(0, 2**31 - 1), rows=st.integers(1, 64), experts=experts_st,
       k_choice=st.sampled_from(["one", "four", "all"]), kind=kind_st, bias_kind=bias_st,
       renormalize=st.booleans(), scale=scale_st, pad=st.sampled_from([0, 3]),
       config=st.sampled_from([FAST, WIDE]))
def test_route_matches_reference(seed, rows, experts, k_choice, kind, bias_kind, renormalize,
                                 scale, pad, config):
    top_k = {"one": 1, "four": 4, "all": experts}[k_choice]
    # A wider parent makes the row stride differ from E.
    logits = make_logits(seed, rows, experts + pad, kind)[:, :experts].to(DEVICE)
    bias = make_bias(seed, experts, bias_kind).to(DEVICE)
    ids = poison(torch.empty(rows, top_k, dtype=torch.int32, device=DEVICE))
    weights = poison(torch.empty(rows, top_k, dtype=torch.bfloat16, device=DEVICE))
    R.route(logits, bias, top_k, renormalize, scale, ids=ids, weights=weights, config=config)
    assert_route_matches(logits, bias, top_k, renormalize, scale, ids, weights)


def test_route_default_config_many_programs():
    """The tuned/default launch (two rows a program) over a partial last block."""
    logits = make_logits(7, 9, 24, "specials").to(DEVICE)
    bias = make_bias(7, 24, "ties").to(DEVICE)
    ids, weights = R.route(logits, bias, 4, True, 2.827)
    assert_route_matches(logits, bias, 4, True, 2.827, ids, weights)


def test_route_all_nan_and_all_ninf_rows_pick_lowest_ids():
    logits = torch.tensor([[NAN] * 16, [-INF] * 16, [INF] * 16], device=DEVICE)
    bias = torch.zeros(16, device=DEVICE)
    ids, weights = R.route(logits, bias, 4, True, 1.0, config=FAST)
    assert ids.cpu().tolist() == [[0, 1, 2, 3]] * 3
    assert_route_matches(logits, bias, 4, True, 1.0, ids, weights)


def test_nan_and_inf_choices_rank_as_reference():
    """NaN choices of both signs (from logits or bias) rank as -inf, next to real -inf."""
    experts = 16
    logits = torch.randn(6, experts, generator=torch.Generator().manual_seed(5))
    logits[0, [1, 4, 9]] = NAN
    logits[0, [2, 7]] = -INF
    logits[1, [3, 5]] = -NAN
    logits[1, [0, 6]] = -INF
    logits[2] = INF
    logits[3, ::2] = -NAN
    bias = torch.zeros(experts)
    bias[[0, 8]] = NAN
    bias[[3, 11]] = -NAN
    bias[[5, 12]] = INF
    bias[[6, 13]] = -INF
    for top_k in (4, 12, experts):
        ids, weights = R.route(logits.to(DEVICE), bias.to(DEVICE), top_k, True, 1.0,
                               config=FAST)
        assert_route_matches(logits, bias, top_k, True, 1.0, ids, weights)


# Rows of many experts a group (E = 896: 32 groups of 32, the production tiling), so that
# the candidate masks, the pool and its extra batches all take part; CANDIDATES 1 and 2
# make extra batches common.
POOLED = [{"BLOCK_T": 1, "CANDIDATES": c, "num_warps": 1, "ZERO_BLOCK": 128}
          for c in (1, 2, 4, 8)] + [{"BLOCK_T": 4, "CANDIDATES": 4, "num_warps": 4,
                                     "ZERO_BLOCK": 64}]


def routed(logits, bias, top_k, renormalize, scale, config, lists=None):
    """``R.route`` into poisoned outputs (every slot must be written)."""
    rows = logits.shape[0]
    ids = poison(torch.empty(rows, top_k, dtype=torch.int32, device=DEVICE))
    weights = poison(torch.empty(rows, top_k, dtype=torch.bfloat16, device=DEVICE))
    return R.route(logits, bias, top_k, renormalize, scale, lists=lists, ids=ids,
                   weights=weights, config=config)


@settings(max_examples=examples(16))
@given(seed=st.integers(0, 2**31 - 1), rows=st.integers(1, 9),
       experts=st.sampled_from([96, 200, 896]), top_k=st.sampled_from([1, 16, 48]),
       kind=kind_st, bias_kind=bias_st, renormalize=st.booleans(),
       config=st.sampled_from(POOLED))
def test_pooled_candidates_match_reference(seed, rows, experts, top_k, kind, bias_kind,
                                           renormalize, config):
    logits = make_logits(seed, rows, experts, kind).to(DEVICE)
    bias = make_bias(seed, experts, bias_kind).to(DEVICE)
    ids, weights = routed(logits, bias, top_k, renormalize, 2.827, config)
    assert_route_matches(logits, bias, top_k, renormalize, 2.827, ids, weights)


def one_group(experts: int, lane: int) -> list[int]:
    """The experts of lane ``lane``'s group in ``R.expert_tiling``'s layout."""
    slices, groups, width = R.expert_tiling(experts)
    members = [(s * groups + lane) * width + v for s in range(slices) for v in range(width)]
    return [e for e in members if e < experts]


# One candidate a batch: a batch for each of the crowded group's 28 experts, 13-16 CPU-s a
# case in the interpreter.
@pytest.mark.parametrize("candidates", [pytest.param(1, marks=pytest.mark.slow), 4])
@pytest.mark.parametrize("spread", ["distinct", "tied", "integer"])
def test_candidates_crowded_into_one_group(candidates, spread):
    """The best experts all in one group, more than a batch of the pool: the batches
    carry the best so far, ties still go to the lower id, slots stay in order."""
    experts, top_k = 896, 16
    gen = torch.Generator().manual_seed(11)
    logits = torch.randn(3, experts, generator=gen)
    group = one_group(experts, lane=5)
    assert len(group) == 28  # 7 of the 8 slices hold experts
    if spread == "distinct":
        logits[:, group] = 4.0 + torch.rand(3, len(group), generator=gen)
    elif spread == "tied":
        logits[:, group] = 4.0
    else:  # a few levels, each held by several experts of the group
        logits[:, group] = 4.0 + torch.randint(0, 3, (3, len(group)), generator=gen).float()
    logits[1, one_group(experts, lane=30)] = 4.5  # a second crowded group
    bias = torch.zeros(experts)
    config = {"BLOCK_T": 1, "CANDIDATES": candidates, "num_warps": 1, "ZERO_BLOCK": 128}
    ids, weights = routed(logits.to(DEVICE), bias.to(DEVICE), top_k, True, 1.0, config)
    assert_route_matches(logits, bias, top_k, True, 1.0, ids, weights)


# slow: K = E unrolls the selection E times, minutes of compiling on a GPU (108 s for
# E = 64 on an H100), so the GPU run starts it first (conftest)
@pytest.mark.slow
@pytest.mark.parametrize("experts", [64, 100])
def test_every_expert_chosen_with_ties(experts):
    """K = E over groups of several experts: every expert is a candidate, every slot
    is filled, in reference order (integer logits: ties everywhere)."""
    logits = make_logits(3, 5, experts, "ties").to(DEVICE)
    bias = make_bias(3, experts, "ties").to(DEVICE)
    for config in (POOLED[0], POOLED[2]):
        ids, weights = routed(logits, bias, experts, True, 1.0, config)
        assert_route_matches(logits, bias, experts, True, 1.0, ids, weights)


def test_nan_rows_and_extreme_logits_over_many_experts():
    """NaN rows (every expert a candidate), saturated and subnormal scores, and huge
    biases, at the production tiling."""
    experts = 896
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(7, experts, generator=gen) * 3.0
    logits[0] = NAN
    logits[1, ::2] = NAN
    logits[2] = torch.linspace(-110.0, 110.0, experts)     # scores from 1e-48 to 1
    logits[3] = -100.0 + torch.randn(experts, generator=gen)  # only subnormal scores
    logits[4] = INF
    logits[5, :20] = -INF
    bias = make_bias(4, experts, "normal")
    bias[::97] = 1e30
    bias[1::89] = -INF
    for config in POOLED[:3]:
        ids, weights = routed(logits.to(DEVICE), bias.to(DEVICE), 16, True, 2.5, config)
        assert_route_matches(logits, bias, 16, True, 2.5, ids, weights)


@triton.jit
def _bounds_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + i, mask=i < n, other=0.0)
    lo, hi = R.sigmoid_bounds(x)
    tl.store(out_ptr + i, lo, mask=i < n)
    tl.store(out_ptr + n + i, R.sigmoid_rn(x), mask=i < n)
    tl.store(out_ptr + 2 * n + i, hi, mask=i < n)


def test_sigmoid_bounds_bracket_the_exact_score():
    """lo <= sigmoid_rn(x) <= hi over the whole FP32 range (NaN in, NaN out): what makes
    the candidates a superset of the top-K."""
    gen = torch.Generator().manual_seed(8)
    bits = torch.randint(-2**31, 2**31, (3000,), generator=gen, dtype=torch.int64)
    x = bits.to(torch.int32).view(torch.float32)
    near = torch.cat([torch.linspace(-110, 40, 800), torch.randn(400, generator=gen) * 20])
    fixed = torch.tensor([0.0, -0.0, INF, -INF, NAN, 88.72, -88.72, -87.3, -103.97,
                          -104.0, -126.0, 3.4e38, -3.4e38, 1e-45, -1e-45, 17.0, 16.63])
    x = torch.cat([fixed, near, x]).contiguous()
    n = x.numel()
    out = torch.empty(3 * n, device=DEVICE)
    _bounds_kernel[(1,)](x.to(DEVICE), out, n, BLOCK=triton.next_power_of_2(n))
    lo, exact, hi = out.cpu().view(3, n)
    assert torch.equal(exact[~x.isnan()], reference.router_scores(x)[~x.isnan()])
    real = ~exact.isnan()
    assert (lo[real] <= exact[real]).all() and (exact[real] <= hi[real]).all()
    assert lo[~real].isnan().all() and hi[~real].isnan().all()


@pytest.mark.parametrize("experts", [16, 24, 896])
def test_expert_tiling_covers_the_row_in_lane_groups(experts):
    slices, groups, width = R.expert_tiling(experts)
    assert slices * groups * width == triton.next_power_of_2(experts)
    assert slices * width <= 32  # a group's candidates fit an int32 mask
    assert groups >= min(32, triton.next_power_of_2(experts))


PLANNED = [dict(POOLED[2], BLOCK_ROWS=2, BLOCK_COLS=128),
           {"BLOCK_T": 4, "CANDIDATES": 2, "num_warps": 4, "ZERO_BLOCK": 8, "BLOCK_ROWS": 8,
            "BLOCK_COLS": 64}]


@given(seed=st.integers(0, 2**31 - 1), rows=st.integers(0, 24),
       experts=st.sampled_from([24, 200]), config=st.sampled_from(PLANNED),
       generation=st.integers(0, 3), dtype=st.sampled_from([torch.bfloat16, torch.float32]))
def test_route_and_plan_equal_their_stages(seed, rows, experts, config, generation, dtype):
    """One launch, each output bit-identical to its own stage, every pair listed once."""
    top_k, latent = 8, 192
    logits = make_logits(seed, rows, experts, "specials").to(DEVICE)
    bias = make_bias(seed, experts, "normal").to(DEVICE)
    gen = torch.Generator().manual_seed(seed)
    lat = (torch.randn(rows, latent, generator=gen) * 10).to(dtype).to(DEVICE)
    lists = R.RoutingLists.empty(experts, 32, DEVICE)
    lists.generation.fill_(generation)
    lists.counts[1 - (generation & 1)].fill_(7)
    out = (poison(torch.empty(rows, latent, dtype=torch.uint8, device=DEVICE)),
           poison(torch.empty(rows, latent // 32, dtype=torch.uint8, device=DEVICE)))
    ids = poison(torch.empty(rows, top_k, dtype=torch.int32, device=DEVICE))
    weights = poison(torch.empty(rows, top_k, dtype=torch.bfloat16, device=DEVICE))
    got = R.route_and_plan(logits, lat, bias, top_k, True, 2.827, lists=lists, ids=ids,
                           weights=weights, out=out, config=config)
    assert_route_matches(logits, bias, top_k, True, 2.827, got[0], got[1])
    ref_q, ref_s = mx.quantize_mxfp8(lat.cpu())
    assert torch.equal(got[2].cpu(), ref_q) and torch.equal(got[3].cpu(), ref_s)
    assert listed_pairs(lists, generation & 1) == expected_pairs(got[0], experts)
    assert (lists.counts[1 - (generation & 1)] == 0).all()


def test_route_and_plan_argument_errors():
    logits, bias = torch.zeros(4, 16, device=DEVICE), torch.zeros(16, device=DEVICE)
    with pytest.raises(ValueError, match="latent"):
        R.route_and_plan(logits, torch.zeros(3, 64, device=DEVICE), bias, 4, True, 1.0)
    with pytest.raises(ValueError, match="multiple of 32"):
        R.route_and_plan(logits, torch.zeros(4, 48, device=DEVICE), bias, 4, True, 1.0)


def searched_rows(experts: int, count: int, differs) -> torch.Tensor:
    """Up to ``count`` random logit rows (K = E, renormalized, scale 1) on which
    ``differs(chosen scores) -> bool per row`` holds: rows that tell a near-miss apart."""
    gen = torch.Generator().manual_seed(1234)
    logits = torch.randn(100_000, experts, generator=gen) * 2.0
    ids, _ = reference.route(logits, torch.zeros(experts), experts, True, 1.0)
    chosen = torch.gather(reference.router_scores(logits), 1, ids.long())
    return logits[differs(chosen)][:count]


def bf16_weights(chosen: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    return (chosen / total[:, None]).to(torch.bfloat16).view(torch.int16)


def sequential_total(chosen: torch.Tensor, order) -> torch.Tensor:
    total = chosen[:, order[0]].clone()
    for k in order[1:]:
        total = total + chosen[:, k]
    return total


def test_renormalization_sums_in_slot_order_and_divides_correctly_rounded():
    """Rows where summing in another order, or multiplying by a rounded reciprocal,
    changes a BF16 weight: only the reference's arithmetic gets them all right."""
    experts = 24
    order = list(range(experts))

    def other_order(chosen):
        want = bf16_weights(chosen, sequential_total(chosen, order))
        return (bf16_weights(chosen, sequential_total(chosen, order[::-1])) != want).any(1)

    def reciprocal(chosen):
        total = sequential_total(chosen, order)
        want = bf16_weights(chosen, total)
        approx = (chosen * (1.0 / total)[:, None]).to(torch.bfloat16).view(torch.int16)
        return (approx != want).any(1)

    rows = torch.cat([searched_rows(experts, 24, other_order),
                      searched_rows(experts, 8, reciprocal)])
    assert rows.shape[0] >= 16  # the search found enough telling rows
    bias = torch.zeros(experts)
    ids, weights = R.route(rows.to(DEVICE), bias.to(DEVICE), experts, True, 1.0, config=WIDE)
    assert_route_matches(rows, bias, experts, True, 1.0, ids, weights)


def test_weights_at_bf16_ties_round_to_even():
    """Logits whose FP32 scores sit exactly halfway between two BF16 values."""
    gen = torch.Generator().manual_seed(99)
    x = torch.randn(2_000_000, generator=gen) * 3.0
    bits = reference.router_scores(x).view(torch.int32)
    ties = x[(bits & 0xFFFF) == 0x8000]
    up = ties[(reference.router_scores(ties).view(torch.int32) >> 16) & 1 == 1]
    down = ties[(reference.router_scores(ties).view(torch.int32) >> 16) & 1 == 0]
    assert len(up) >= 4 and len(down) >= 4
    row = torch.cat([up[:8], down[:8]])[None, :]
    bias = torch.zeros(row.shape[1])
    ids, weights = R.route(row.to(DEVICE), bias.to(DEVICE), row.shape[1], False, 1.0,
                           config=FAST)
    assert_route_matches(row, bias, row.shape[1], False, 1.0, ids, weights)


@given(seed=st.integers(0, 2**31 - 1), rows=st.integers(0, 64), experts=experts_st,
       top_k=st.sampled_from([1, 4]), generation=st.integers(0, 5),
       config=st.sampled_from([FAST, WIDE]))
def test_lists_hold_every_pair_once(seed, rows, experts, top_k, generation, config):
    logits = make_logits(seed, rows, experts, "ties").to(DEVICE)
    bias = make_bias(seed, experts, "normal").to(DEVICE)
    lists = R.RoutingLists.empty(experts, 64, DEVICE)
    lists.generation.fill_(generation)
    parity = generation & 1
    poison(lists.pairs)
    lists.counts[1 - parity].fill_(12345)  # left over from two calls ago
    ids, _ = R.route(logits, bias, top_k, True, 1.0, lists=lists, config=config)
    assert listed_pairs(lists, parity) == expected_pairs(ids, experts)
    assert int(lists.counts[parity].sum()) == rows * top_k
    assert (lists.counts[1 - parity] == 0).all()
    assert int(lists.generation) == generation  # the route never advances it


def test_consecutive_calls_do_not_see_each_others_lists():
    experts, top_k = 24, 4
    bias = make_bias(3, experts, "normal").to(DEVICE)
    lists = R.RoutingLists.empty(experts, 64, DEVICE)
    calls = [make_logits(s, rows, experts, "normal").to(DEVICE)
             for s, rows in ((1, 40), (2, 17), (3, 33))]
    for n, logits in enumerate(calls):
        ids, _ = R.route(logits, bias, top_k, True, 1.0, lists=lists, config=FAST)
        assert listed_pairs(lists, n & 1) == expected_pairs(ids, experts), n
        assert (lists.counts[1 - (n & 1)] == 0).all()
        lists.generation += 1  # what the layer's last kernel does


@pytest.mark.parametrize("args, name", [((0, 8), "num_experts"), ((16, 0), "wide_rows"),
                                        ((16.0, 8), "num_experts")])
def test_routing_lists_argument_errors(args, name):
    with pytest.raises(ValueError, match=name):
        R.RoutingLists.empty(*args, DEVICE)


def test_rows_beyond_the_lists_are_refused():
    lists = R.RoutingLists.empty(16, 8, DEVICE)
    logits = torch.zeros(9, 16, device=DEVICE)
    with pytest.raises(ValueError, match="wide_rows"):
        R.route(logits, torch.zeros(16, device=DEVICE), 4, True, 1.0, lists=lists)


@pytest.mark.parametrize("change, name", [
    (dict(logits=torch.zeros(4, 16, dtype=torch.bfloat16)), "logits"),
    (dict(logits=torch.zeros(16)), "logits"),
    (dict(logits=torch.zeros(16, 4).t()), "logits"),
    (dict(bias=torch.zeros(15)), "bias"),
    (dict(bias=torch.zeros(16, dtype=torch.float64)), "bias"),
    (dict(top_k=0), "top_k"),
    (dict(top_k=17), "top_k"),
    (dict(renormalize=1), "renormalize"),
    (dict(scale="2"), "scale"),
    (dict(ids=torch.zeros(4, 3, dtype=torch.int32)), "ids"),
    (dict(weights=torch.zeros(4, 4)), "weights"),
    (dict(lists=R.RoutingLists.empty(15, 8, "cpu")), "lists.counts"),
    (dict(lists=(1, 2, 3)), "lists"),
])
def test_argument_errors_name_the_argument(change, name):
    args = dict(logits=torch.zeros(4, 16), bias=torch.zeros(16), top_k=4, renormalize=True,
                scale=1.0)
    args.update(change)
    args = {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in args.items()}
    if isinstance(args.get("lists"), R.RoutingLists):
        lists = args["lists"]
        args["lists"] = R.RoutingLists(lists.counts.to(DEVICE), lists.pairs.to(DEVICE),
                                       lists.generation.to(DEVICE))
    with pytest.raises((TypeError, ValueError), match=name):
        R.route(**args)
