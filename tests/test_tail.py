"""The tail: its RMSNorm, bf16(x * rsqrt(mean(x^2) + eps) * weight) in FP32, its
up-projection added into the shared partial, bf16(fp32(shared) + normed @ up.T), and its
all-reduces over T simulated ranks' tail rows (the sum in rank order, rounded once)."""

import pytest
import torch
from hypothesis import given, settings, strategies as st

from conftest import DEVICE, forbid_launches, poison
from gemm_cases import (LAYOUTS, REDUCTIONS, assert_mostly_equal, assert_one_rounding,
                        draw_row_and_configs, error_bound)
from gemm_cases import make_inputs as gemm_inputs
from wide_moe_triton import reference
from wide_moe_triton.kernels import mailbox, tail
from wide_moe_triton.kernels.tail import add_up_projection, rms_norm

EPS = 1e-6
CONFIGS = [None, dict(BLOCK_T=1, num_warps=1), dict(BLOCK_T=2, num_warps=4),
           dict(BLOCK_T=4, num_warps=8)]


def bf16_ulp(v: torch.Tensor) -> torch.Tensor:
    """The BF16 spacing at |v| (FP64): 2^(e - 7), subnormal spacing 2^-133 below 2^-126."""
    e = torch.floor(torch.log2(v.abs())).clamp(min=-126)
    return torch.exp2(e - 7)


def make_inputs(b, L, scale, seed):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(b, L, generator=gen, dtype=torch.float64) * scale).to(torch.bfloat16)
    weight = (torch.randn(L, generator=gen) * 0.5 + 1.0).to(torch.bfloat16)
    return x.to(DEVICE), weight.to(DEVICE)


def run(x, weight, eps=EPS, config=None):
    out = poison(torch.empty_like(x))
    result = rms_norm(x, weight, eps, out=out, config=config)
    assert result is out
    return out


def exact_rms_norm(x, weight, eps):
    xd = x.double()
    return xd / torch.sqrt(xd.square().mean(-1, keepdim=True) + eps) * weight.double()


def assert_within_one_ulp(out, exact):
    err = (out.double() - exact).abs()
    # One BF16 ulp, and relatively: the FP32 value before the one rounding is within a
    # few FP32 ulps of exact, so the rounding is the whole error (at most half an ulp of
    # BF16's 8 significant bits, i.e. 2^-8 relative, plus slack for the FP32 part).
    assert (err <= bf16_ulp(exact)).all(), f"max excess {(err - bf16_ulp(exact)).max():.3g}"
    assert (err <= 2.0 ** -8 * exact.abs() * (1 + 1e-5) + 2.0 ** -134).all()


# Scales from BF16 subnormals (x^2 underflows FP32: eps alone sets the norm) to values
# whose squares sum to ~1e37, just inside FP32 (the stock path overflows beyond).
@given(b=st.integers(1, 64), L=st.sampled_from([256, 96, 200]),
       scale=st.sampled_from([2.0 ** -130, 1e-20, 1e-3, 1.0, 1e6, 2.0 ** 56]),
       config=st.sampled_from(CONFIGS), seed=st.integers(0, 2 ** 16))
def test_rms_norm_vs_float64(b, L, scale, config, seed):
    x, weight = make_inputs(b, L, scale, seed)
    out = run(x, weight, config=config)
    assert torch.isfinite(out).all()
    exact = exact_rms_norm(x, weight, EPS)
    assert_within_one_ulp(out, exact)
    # The stock path differs only in its sum order and rsqrt: never by more than an ulp.
    ref = reference.rms_norm(x, weight, EPS).double()
    assert ((out.double() - ref).abs() <= bf16_ulp(exact)).all()


@given(b=st.integers(1, 16), L=st.sampled_from([256, 96]), seed=st.integers(0, 2 ** 16),
       eps=st.sampled_from([1e-6, 1e-2, 0.5]))
def test_zero_rows_stay_zero_and_finite(b, L, seed, eps):
    x, weight = make_inputs(b, L, 1.0, seed)
    zero = torch.arange(b, device=DEVICE) % 2 == 0
    x[zero] = 0.0
    out = run(x, weight, eps=eps)
    assert torch.isfinite(out).all()
    assert (out[zero] == 0).all()
    assert_within_one_ulp(out, exact_rms_norm(x, weight, eps))


def test_mixed_magnitudes_in_a_row():
    # A few huge entries dominate the mean; the small ones land near BF16's bottom.
    x, weight = make_inputs(4, 256, 1.0, seed=5)
    x[:, ::37] = 3.0e15
    x[:, 1::53] = -1e-30
    out = run(x, weight)
    assert_within_one_ulp(out, exact_rms_norm(x, weight, EPS))


def test_production_width_and_in_place():
    x, weight = make_inputs(3, 3584, 1.0, seed=9)
    expected = run(x, weight)
    assert_within_one_ulp(expected, exact_rms_norm(x, weight, EPS))
    same = x.clone()
    assert rms_norm(same, weight, EPS, out=same) is same
    assert torch.equal(same.view(torch.int16), expected.view(torch.int16))


def test_empty_batch_launches_nothing(monkeypatch):
    forbid_launches(monkeypatch, tail, "_rms_norm_kernel")
    x = torch.empty(0, 96, dtype=torch.bfloat16, device=DEVICE)
    weight = torch.ones(96, dtype=torch.bfloat16, device=DEVICE)
    out = rms_norm(x, weight, EPS)
    assert out.shape == (0, 96) and out.dtype == torch.bfloat16


# ------------------------------------------------------------------------- up-projection

def shared_partial(b, H, seed, spare_rows=2):
    """A BF16 [b + spare_rows, H] shared partial of unit scale (the layer's rows are its
    first b)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(b + spare_rows, H, generator=gen).bfloat16().to(DEVICE)


# (columns of this rank, L): the tiny layer at TP1 and TP4, and an L that is not a
# multiple of BLOCK_K 64 with a column count that is not a multiple of 8.
UP_SHAPES = [(256, 256), (64, 256), (37, 96)]


@given(b=st.integers(1, 64), shape=st.sampled_from(UP_SHAPES), layout=st.sampled_from(LAYOUTS),
       reduction=st.sampled_from(REDUCTIONS), rank=st.integers(0, 2),
       seed=st.integers(0, 2 ** 16))
def test_up_projection_adds_with_one_rounding(b, shape, layout, reduction, rank, seed):
    N, L = shape
    normed, up = gemm_inputs(b, N, L, seed)
    full = shared_partial(b, 3 * N, seed + 1)
    before = full.clone()
    cols = full[:b, rank * N:(rank + 1) * N]  # this rank's columns: strided rows
    assert add_up_projection(normed, up, cols, config={**layout, **reduction}) is cols
    # Only this rank's columns of the first b rows changed.
    others = torch.ones_like(full, dtype=torch.bool)
    others[:b, rank * N:(rank + 1) * N] = False
    assert torch.equal(full[others].view(torch.int16), before[others].view(torch.int16))
    # bf16(fp32(shared) + sums): the sums within their FP32-order bound of the float64
    # products, the FP32 add then monotone, and one rounding.
    start = before[:b, rank * N:(rank + 1) * N]
    exact = start.double() + normed.double() @ up.double().t()
    assert_one_rounding(cols, exact, error_bound(normed, up))
    ref = (start.float() + reference.mm_f32(normed, up)).to(torch.bfloat16)
    assert_mostly_equal(cols, ref)


@given(b=st.integers(2, 64), data=st.data(), reduction=st.sampled_from(REDUCTIONS),
       seed=st.integers(0, 2 ** 16))
def test_up_projection_batch_invariance(b, data, reduction, seed):
    normed, up = gemm_inputs(b, 64, 256, seed)
    full = shared_partial(b, 256, seed + 1)
    row, alone_cfg, wide_cfg = draw_row_and_configs(data, b, reduction)
    alone = full[row:row + 1, :64].clone()
    add_up_projection(normed[row:row + 1].contiguous(), up, alone, config=alone_cfg)
    add_up_projection(normed, up, full[:b, :64], config=wide_cfg)
    assert torch.equal(alone.view(torch.int16), full[row:row + 1, :64].view(torch.int16))
    # And through the tail's own tuning entry, whose tiles differ between 1 and b rows.
    one, many = full[row:row + 1].clone(), full[:b].clone()
    add_up_projection(normed[row:row + 1].contiguous(), up, one[:, 64:128])
    add_up_projection(normed, up, many[:, 64:128])
    assert torch.equal(one.view(torch.int16), many[row:row + 1].view(torch.int16))


def test_up_projection_nan_stays_in_its_row():
    normed, up = gemm_inputs(5, 64, 256, seed=6)
    normed[2, 7] = float("nan")
    full = shared_partial(5, 64, seed=7)
    clean = full.clone()
    add_up_projection(normed, up, full[:5])
    assert torch.isnan(full[2].float()).all()
    keep = [0, 1, 3, 4]
    clean = clean[keep]  # a copy: the rows without the NaN, on their own
    add_up_projection(normed[keep].contiguous(), up, clean)
    assert torch.equal(full[keep].view(torch.int16), clean.view(torch.int16))


def _bad_calls():
    bf16 = dict(dtype=torch.bfloat16, device=DEVICE)
    x, w = torch.zeros(4, 64, **bf16), torch.ones(64, **bf16)
    up, cols = torch.zeros(32, 64, **bf16), torch.zeros(4, 96, **bf16)[:, 32:64]
    return [
        (lambda: rms_norm(x.float(), w, EPS), TypeError, "x must be torch.bfloat16"),
        (lambda: rms_norm(x[0], w, EPS), ValueError, "x must have shape"),
        (lambda: rms_norm(torch.zeros(64, 4, **bf16).t(), w, EPS), ValueError,
         "x must be contiguous"),
        (lambda: rms_norm(x[:, :0], w[:0], EPS), ValueError, "x must have between"),
        (lambda: rms_norm(x, w[:63], EPS), ValueError, "weight must have shape"),
        (lambda: rms_norm(x, w.float(), EPS), TypeError, "weight must be torch.bfloat16"),
        (lambda: rms_norm(x, w.to("meta"), EPS), ValueError, "weight must be on"),
        (lambda: rms_norm(x, w, -1e-6), ValueError, "eps must be"),
        (lambda: rms_norm(x, w, float("nan")), ValueError, "eps must be"),
        (lambda: rms_norm(x, w, "1e-6"), ValueError, "eps must be"),
        (lambda: rms_norm(x, w, EPS, out=torch.zeros(4, 64, device=DEVICE)), TypeError,
         "out must be torch.bfloat16"),
        (lambda: rms_norm(x, w, EPS, config=dict(BLOCK_T=3, num_warps=4)), ValueError,
         "BLOCK_T"),
        (lambda: add_up_projection(x.float(), up, cols), TypeError,
         "normed must be torch.bfloat16"),
        (lambda: add_up_projection(x, up[:, :32], cols), ValueError,
         "latent_up must have shape"),
        (lambda: add_up_projection(x, up.float(), cols), TypeError,
         "latent_up must be torch.bfloat16"),
        (lambda: add_up_projection(x, up, cols[:3]), ValueError, "shared must have shape"),
        (lambda: add_up_projection(x, up, cols.float()), TypeError,
         "shared must be torch.bfloat16"),
        (lambda: add_up_projection(x, up, torch.zeros(4, 96, **bf16)[:, ::3]), ValueError,
         "out must have adjacent columns"),
    ]


@pytest.mark.parametrize("index", range(len(_bad_calls())))
def test_argument_errors_name_the_argument(index):
    call, error, message = _bad_calls()[index]
    with pytest.raises(error, match=message):
        call()


# ------------------------------------------------------------------- tail all-reduces

class TailRanks:
    """T simulated ranks: one tail buffer each and the table of their pointers."""

    def __init__(self, world, latent, hidden, wide_rows=16):
        self.dims = mailbox.TailDims(wide_rows, world, latent, hidden)
        self.buffers = [mailbox.arm_tail(torch.empty(wide_rows, world, latent + hidden,
                                                     dtype=torch.int16, device=DEVICE))
                        for _ in range(world)]
        self.table = mailbox.tail_table(self.buffers)
        self.error = mailbox.new_error_record(DEVICE)

    def publish(self, partials, which, skip=()):
        for r, p in enumerate(partials):
            if r not in skip:
                mailbox.publish_partial(p, self.table, r, self.dims, which)

    def norm(self, rank, rows, weight, spin_limit=8, config=None):
        out = poison(torch.empty(rows, self.dims.latent, dtype=torch.bfloat16, device=DEVICE))
        return tail.all_reduce_rms_norm(self.buffers[rank], self.dims, rows, weight, EPS,
                                        out=out, error=self.error, spin_limit=spin_limit,
                                        config=config)

    def reduce(self, rank, rows, spin_limit=8, config=None, spare=0):
        """Rank ``rank``'s hidden sum, into the first H columns of rows ``spare`` wider."""
        wide = poison(torch.empty(rows, self.dims.hidden + spare, dtype=torch.bfloat16,
                                  device=DEVICE))
        out = wide[:, :self.dims.hidden]
        assert tail.all_reduce(self.buffers[rank], self.dims, rows, out=out, error=self.error,
                               spin_limit=spin_limit, config=config) is out
        return out

    def all_empty(self) -> bool:
        return all(bool((b == mailbox.SENTINEL_BF16).all()) for b in self.buffers)


def rank_order_sum(partials):
    """The reference: the BF16 partials added in FP32 in rank order 0..T-1 from +0 (as
    published: a -0 goes out as +0), rounded once to BF16."""
    total = torch.zeros(partials[0].shape, dtype=torch.float32, device=DEVICE)
    for p in partials:
        total = total + p.float()
    return total.to(torch.bfloat16)


# Values whose FP32 sums depend on the order they are added in, and edge values.
EDGES = [0.0, -0.0, 2.0 ** 24, -2.0 ** 24, 1.0, 3.0, 2.0 ** -133, -1e38, 3e38,
         float("inf"), -float("inf"), float("nan")]


@st.composite
def partials_of(draw, world, b, n):
    """T BF16 partials [b, n]: random rows with drawn edge values planted."""
    seed = draw(st.integers(0, 2 ** 16))
    gen = torch.Generator().manual_seed(seed)
    scale = draw(st.sampled_from([1e-3, 1.0, 1e6]))
    parts = [torch.randn(b, n, generator=gen) * scale for _ in range(world)]
    for _ in range(draw(st.integers(0, 6))):
        r, t, c = (draw(st.integers(0, m - 1)) for m in (world, b, n))
        parts[r][t, c] = draw(st.sampled_from(EDGES))
    return [p.bfloat16().to(DEVICE) for p in parts]


def bits(t):
    return t.view(torch.int16)


def assert_same_bits(out, expected, what=""):
    """Bitwise equal, except that a NaN is the quiet NaN 0x7FC0 every kernel writes (torch
    keeps a NaN's sign and payload through its BF16 rounding)."""
    nan = torch.isnan(expected.float())
    assert torch.equal(torch.isnan(out.float()), nan), what
    assert (bits(out)[nan] == mailbox.BF16_NAN).all(), what
    assert torch.equal(bits(out)[~nan], bits(expected)[~nan]), what


@pytest.mark.parametrize("world", [2, 4, 8])
@given(data=st.data(), b=st.integers(1, 16), L=st.sampled_from([256, 96]),
       config=st.sampled_from(CONFIGS))
@settings(max_examples=4)
def test_all_reduce_rms_norm_same_bits_on_every_rank(world, data, b, L, config):
    ranks = TailRanks(world, L, 64)
    parts = data.draw(partials_of(world, b, L))
    _, weight = make_inputs(1, L, 1.0, seed=b)
    ranks.publish(parts, "latent")
    expected = tail.rms_norm(rank_order_sum(parts), weight, EPS, config=config)
    for r in range(world):
        out = ranks.norm(r, b, weight, config=config)
        assert_same_bits(out, expected, f"rank {r}")
    assert ranks.all_empty(), "not re-armed"
    mailbox.check_mailbox_error(ranks.error)


@pytest.mark.parametrize("world", [2, 4, 8])
@given(data=st.data(), b=st.integers(1, 16), H=st.sampled_from([64, 200]),
       config=st.sampled_from([None, dict(BLOCK_T=1, BLOCK_C=64, num_warps=2),
                               dict(BLOCK_T=4, BLOCK_C=128, num_warps=4)]))
@settings(max_examples=4)
def test_all_reduce_same_bits_on_every_rank(world, data, b, H, config):
    ranks = TailRanks(world, 96, H)
    parts = data.draw(partials_of(world, b, H))
    ranks.publish(parts, "hidden")
    expected = rank_order_sum(parts)
    for r in range(world):
        out = ranks.reduce(r, b, config=config, spare=3)
        assert_same_bits(out, expected, f"rank {r}")
    assert ranks.all_empty(), "not re-armed"
    mailbox.check_mailbox_error(ranks.error)


@pytest.mark.parametrize("order", [(0, 1, 2), (2, 0, 1), (1, 2, 0)])
def test_sum_runs_in_rank_order(order):
    # 2^24 + 1 rounds back to 2^24 in FP32: the three values sum to 0, 1 or 2 depending on
    # which two are added first. Each rank order of the same values gives its own sum.
    values = [2.0 ** 24, 1.0, -2.0 ** 24]
    ranks = TailRanks(3, 96, 64)
    parts = [torch.full((2, 64), values[i], dtype=torch.bfloat16, device=DEVICE) for i in order]
    ranks.publish(parts, "hidden")
    exact = 0.0
    for i in order:
        exact = float(torch.tensor(exact, dtype=torch.float32) + values[i])
    out = ranks.reduce(1, 2)
    assert (out.float() == exact).all()
    assert torch.equal(bits(out), bits(rank_order_sum(parts)))


def test_published_rows_are_the_only_ones_read():
    # Rows past b stay as published (the next call's data), and the latent and hidden
    # regions do not touch each other.
    ranks = TailRanks(2, 96, 64)
    gen = torch.Generator().manual_seed(3)
    lat = [torch.randn(5, 96, generator=gen).bfloat16().to(DEVICE) for _ in range(2)]
    hid = [torch.randn(5, 64, generator=gen).bfloat16().to(DEVICE) for _ in range(2)]
    ranks.publish(lat, "latent")
    ranks.publish(hid, "hidden")
    _, weight = make_inputs(1, 96, 1.0, seed=0)
    ranks.norm(0, 3, weight)
    assert (ranks.buffers[0][:3, :, :96] == mailbox.SENTINEL_BF16).all()
    assert torch.equal(ranks.buffers[0][3:5, :, :96], ranks.buffers[1][3:5, :, :96])
    assert (ranks.buffers[0][3:5, :, :96] != mailbox.SENTINEL_BF16).all()
    assert torch.equal(ranks.reduce(0, 5), rank_order_sum(hid))
    assert (ranks.buffers[0][:, :, 96:] == mailbox.SENTINEL_BF16).all()
    mailbox.check_mailbox_error(ranks.error)


@pytest.mark.parametrize("which", ["latent", "hidden"])
def test_rank_that_never_publishes_is_named_then_rearm_recovers(which):
    world, missing, b = 3, 2, 4
    ranks = TailRanks(world, 96, 64)
    gen = torch.Generator().manual_seed(11)
    n = 96 if which == "latent" else 64
    parts = [torch.randn(b, n, generator=gen).bfloat16().to(DEVICE) for _ in range(world)]
    _, weight = make_inputs(1, 96, 1.0, seed=1)

    def read(rank):
        if which == "latent":
            return ranks.norm(rank, b, weight, spin_limit=3)
        return ranks.reduce(rank, b, spin_limit=3)

    ranks.publish(parts, which, skip={missing})
    for r in range(world - 1):
        read(r)  # returns: the poll is bounded
    place = "latent" if which == "latent" else "hidden"
    with pytest.raises(RuntimeError, match=rf"tail rows of the {place} all-reduce.*\[{missing}\]"):
        mailbox.check_mailbox_error(ranks.error, "layer 3")
    for buffer in ranks.buffers:
        mailbox.arm_tail(buffer)
    ranks.error.zero_()
    ranks.publish(parts, which)
    expected = rank_order_sum(parts)
    if which == "latent":
        expected = tail.rms_norm(expected, weight, EPS)
    for r in range(world):
        assert torch.equal(bits(read(r)), bits(expected))
    assert ranks.all_empty()
    mailbox.check_mailbox_error(ranks.error)


def test_all_reduce_in_place_over_the_published_partial():
    ranks = TailRanks(2, 96, 64)
    gen = torch.Generator().manual_seed(5)
    lat = [torch.randn(3, 96, generator=gen).bfloat16().to(DEVICE) for _ in range(2)]
    _, weight = make_inputs(1, 96, 1.0, seed=2)
    ranks.publish(lat, "latent")
    expected = tail.rms_norm(rank_order_sum(lat), weight, EPS)
    out = tail.all_reduce_rms_norm(ranks.buffers[0], ranks.dims, 3, weight, EPS, out=lat[0],
                                   error=ranks.error)
    assert out is lat[0] and torch.equal(bits(out), bits(expected))


def test_rms_norm_config_is_one_for_every_width(monkeypatch):
    # The layout orders the sum of squares: a table whose buckets disagree must not
    # change it with the batch width.
    def table(kernel, shape, rows, default, device=None, given=None):
        assert given is None   # the layer passes no config of its own
        return {**default, "BLOCK_T": 1 if rows <= 16 else 4,
                "num_warps": 8 if rows <= 16 else 4}

    monkeypatch.setattr(tail, "config_for", table)
    seen = []
    real = tail._rms_norm_kernel

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                seen.append((kwargs["BLOCK_T"], kwargs["num_warps"]))
                return real[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(tail, "_rms_norm_kernel", Spy())
    for b in (1, 40):
        x, weight = make_inputs(b, 96, 1.0, seed=b)
        rms_norm(x, weight, EPS)
    assert seen == [(1, 8), (1, 8)]


def _bad_tail_calls():
    ranks = TailRanks(2, 96, 64)
    buf, dims, err = ranks.buffers[0], ranks.dims, ranks.error
    bf16 = dict(dtype=torch.bfloat16, device=DEVICE)
    w, lat, hid = torch.ones(96, **bf16), torch.zeros(3, 96, **bf16), torch.zeros(3, 64, **bf16)
    return [
        (lambda: tail.all_reduce_rms_norm(buf[:8], dims, 3, w, EPS, out=lat, error=err),
         ValueError, "tail must have shape"),
        (lambda: tail.all_reduce_rms_norm(buf, dims, 17, w, EPS, out=lat, error=err),
         ValueError, "rows must be"),
        (lambda: tail.all_reduce_rms_norm(buf, dims, 3, w[:64], EPS, out=lat, error=err),
         ValueError, "weight must have shape"),
        (lambda: tail.all_reduce_rms_norm(buf, dims, 3, w, EPS, out=lat[:2], error=err),
         ValueError, "out must have shape"),
        (lambda: tail.all_reduce_rms_norm(buf, dims, 3, w, EPS, out=lat, error=err[:1]),
         ValueError, "error must have shape"),
        (lambda: tail.all_reduce(buf, dims, 3, out=hid, error=err, spin_limit=0),
         ValueError, "spin_limit"),
        (lambda: tail.all_reduce(buf, dims, 3, out=hid.float(), error=err),
         TypeError, "out must be torch.bfloat16"),
        (lambda: tail.all_reduce(buf, dims, 3, out=torch.zeros(3, 128, **bf16)[:, ::2],
                                 error=err), ValueError, "out must have contiguous rows"),
        (lambda: mailbox.publish_partial(hid, ranks.table, 2, dims, "hidden"),
         ValueError, "rank must be"),
        (lambda: mailbox.publish_partial(hid, ranks.table, 0, dims, "latent"),
         ValueError, "partial must have shape"),
        (lambda: mailbox.publish_partial(hid, ranks.table, 0, dims, "shared"),
         ValueError, "which must be"),
        (lambda: mailbox.publish_partial(torch.zeros(17, 64, **bf16), ranks.table, 0, dims,
                                         "hidden"), ValueError, "more than wide_rows"),
        (lambda: mailbox.publish_partial(hid, ranks.table[:1], 0, dims, "hidden"),
         ValueError, "table must have shape"),
    ]


@pytest.mark.parametrize("index", range(len(_bad_tail_calls())))
def test_tail_argument_errors_name_the_argument(index):
    call, error, message = _bad_tail_calls()[index]
    with pytest.raises(error, match=message):
        call()
