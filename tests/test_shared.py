"""The shared expert on the front GEMM: ``linear`` (BF16 out), ``linear_situ`` (gate/up
and SiTU in one pass) and the stage ``shared_expert``, against float64 math, the stock
path, and themselves at other batch widths."""

import pytest
import torch
from hypothesis import given, strategies as st

from conftest import DEVICE, forbid_launches, poison
from gemm_cases import (LAYOUTS, REDUCTIONS, U32, assert_mostly_equal, assert_one_rounding,
                        assert_row_alone_equals_in_batch, draw_row_and_configs, error_bound,
                        make_inputs)
from wide_moe_triton import reference
from wide_moe_triton.kernels import front, shared
from wide_moe_triton.kernels.front import linear, linear_situ

BETA, LINEAR_BETA = 4.0, 25.0
# (N, H): the tiny layer's gate/up (2S = 256 rows over H 256) and down (H 256 rows over
# S 128), its TP4 gate/up (64 over 256), a down whose H (96) is not a multiple of
# BLOCK_K 64, and an odd N (plain linears only).
SHAPES = [(256, 256), (256, 128), (64, 256), (72, 96)]
ODD_SHAPES = [(37, 256)]
SITU_SLACK = 16 * U32  # Triton's FP32 SiTU is within a few ulps of the exact function


def situ64(g, u):
    u = LINEAR_BETA * torch.tanh(u / LINEAR_BETA)
    return BETA * torch.tanh(g / BETA) * torch.sigmoid(g) * u


def out_buffer(b, n, spare_rows=3):
    """A poisoned BF16 [b, n] view of a larger poisoned buffer: what is written shows,
    and so does anything written past row b."""
    big = poison(torch.empty(b + spare_rows, n, dtype=torch.bfloat16, device=DEVICE))
    return big, big[:b]


def assert_only_rows_written(big, b):
    assert not torch.isnan(big[:b].float()).any(), "an output was left unwritten"
    assert torch.isnan(big[b:].float()).all(), "a row past b was written"


def run_linear(x, w, config):
    big, out = out_buffer(x.shape[0], w.shape[0])
    assert linear(x, w, out=out, config=config) is out
    assert_only_rows_written(big, x.shape[0])
    return out


def run_situ(x, pairs, config):
    big, out = out_buffer(x.shape[0], pairs.shape[0] // 2)
    assert linear_situ(x, pairs, BETA, LINEAR_BETA, out=out, config=config) is out
    assert_only_rows_written(big, x.shape[0])
    return out


# ------------------------------------------------------------------------- linear (BF16)

@given(b=st.integers(1, 64), shape=st.sampled_from(SHAPES + ODD_SHAPES),
       layout=st.sampled_from(LAYOUTS), reduction=st.sampled_from(REDUCTIONS),
       seed=st.integers(0, 2 ** 16))
def test_linear_is_one_rounding_of_float64_and_matches_f_linear(b, shape, layout, reduction,
                                                                seed):
    N, H = shape
    x, w = make_inputs(b, N, H, seed)
    out = run_linear(x, w, {**layout, **reduction})
    exact = x.double() @ w.double().t()
    assert_one_rounding(out, exact, error_bound(x, w))
    # The stock path's BF16 linear meets the same contract, so the two agree bit for bit
    # except where their FP32 orders straddle a rounding boundary.
    ref = torch.nn.functional.linear(x, w)
    assert_one_rounding(ref, exact, error_bound(x, w))
    assert_mostly_equal(out, ref)


@given(b=st.integers(1, 40), shape=st.sampled_from(SHAPES), seed=st.integers(0, 2 ** 16))
def test_split_modes_agree_for_every_epilogue(b, shape, seed):
    # The split-grid path applies the epilogue in the reduction kernel, the in-program
    # path in the GEMM program: the same sums must come out as the same bits.
    N, H = shape
    x, w = make_inputs(b, N, H, seed)
    base = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=32, SPLIT_K=4, num_warps=4, num_stages=3)
    grid, in_program = {**base, "SPLIT_GRID": 1}, {**base, "SPLIT_GRID": 0}
    for run in (run_linear, run_situ):
        a, c = run(x, w, grid), run(x, w, in_program)
        assert torch.equal(a.view(torch.int16), c.view(torch.int16)), run.__name__
    residual = torch.randn(b, N, device=DEVICE).bfloat16()
    sums = []
    for cfg in (grid, in_program):
        acc = residual.clone()
        linear(x, w, out=acc, accumulate=True, config=cfg)
        sums.append(acc.view(torch.int16))
    assert torch.equal(*sums)


# ------------------------------------------------------------------------- linear_situ

@given(b=st.integers(1, 64), shape=st.sampled_from(SHAPES), layout=st.sampled_from(LAYOUTS),
       reduction=st.sampled_from(REDUCTIONS), seed=st.integers(0, 2 ** 16))
def test_linear_situ_rounds_where_the_stock_path_does(b, shape, layout, reduction, seed):
    N, H = shape
    x, pairs = make_inputs(b, N, H, seed)
    cfg = {**layout, **reduction}
    h = run_situ(x, pairs, cfg)
    # The gate and up values SiTU saw: the same GEMM with a plain BF16 epilogue (same
    # sums, one rounding each), themselves one rounding of the float64 products.
    gu = run_linear(x, pairs, cfg)
    assert_one_rounding(gu, x.double() @ pairs.double().t(), error_bound(x, pairs))
    g, u = gu[:, 0::2].double(), gu[:, 1::2].double()
    # Then SiTU in FP32 (a few ulps from the exact function) rounded once to BF16.
    exact = situ64(g, u)
    assert_one_rounding(h, exact, SITU_SLACK * exact.abs() + 2.0 ** -149)
    # The stock path's SiTU (torch FP32) on the same BF16 gate and up agrees bit for bit
    # but where the two FP32 evaluations straddle a rounding boundary.
    ref = reference.situ(gu[:, 0::2], gu[:, 1::2], BETA, LINEAR_BETA).to(torch.bfloat16)
    assert_mostly_equal(h, ref)


@pytest.mark.parametrize("linear_beta", [None, 0.5])
def test_linear_situ_linear_beta(linear_beta):
    # No clamp of u, and a tight one that saturates most of u: both in the stock order.
    x, pairs = make_inputs(24, 64, 256, seed=4)
    cfg = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, SPLIT_K=2, SPLIT_GRID=1, num_warps=4,
               num_stages=3)
    h = linear_situ(x, pairs, BETA, linear_beta, config=cfg)
    gu = linear(x, pairs, config=cfg)
    g, u = gu[:, 0::2].double(), gu[:, 1::2].double()
    if linear_beta is not None:
        u = linear_beta * torch.tanh(u / linear_beta)
    exact = BETA * torch.tanh(g / BETA) * torch.sigmoid(g) * u
    assert_one_rounding(h, exact, SITU_SLACK * exact.abs() + 2.0 ** -149)


def test_interleave_gate_up_pairs_rows():
    gate_up = torch.arange(8 * 3, dtype=torch.float32).reshape(8, 3).bfloat16()
    pairs = shared.interleave_gate_up(gate_up)
    assert pairs.is_contiguous() and pairs.shape == gate_up.shape
    assert torch.equal(pairs[0::2], gate_up[:4]) and torch.equal(pairs[1::2], gate_up[4:])


# ------------------------------------------------------------------------- the stage

@given(b=st.integers(1, 64), world=st.sampled_from([1, 2, 4]), seed=st.integers(0, 2 ** 16))
def test_shared_expert_matches_the_stock_shared_expert(b, world, seed):
    H, S = 256, 128 // world  # the tiny layer's rank shard
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(b, H, generator=gen).bfloat16().to(DEVICE)
    gate_up = (torch.randn(2 * S, H, generator=gen) * H ** -0.5).bfloat16().to(DEVICE)
    down = (torch.randn(H, S, generator=gen) * S ** -0.5).bfloat16().to(DEVICE)
    big_h, hidden = out_buffer(b, S)
    big, out = out_buffer(b, H)
    result = shared.shared_expert(x, shared.interleave_gate_up(gate_up), down, BETA,
                                  LINEAR_BETA, hidden=hidden, out=out)
    assert result is out
    assert_only_rows_written(big_h, b)
    assert_only_rows_written(big, b)
    # The hidden is the stock path's (its BF16 gate/up linears, its FP32 SiTU, one
    # rounding) up to rare one-step flips; the output is one rounding of the kernel's
    # own hidden times down, as the stock BF16 linear of that hidden is.
    gu = torch.nn.functional.linear(x, gate_up)
    ref_hidden = reference.situ(gu[:, :S], gu[:, S:], BETA, LINEAR_BETA).to(torch.bfloat16)
    assert_mostly_equal(hidden, ref_hidden, at_least=0.98)
    exact = hidden.double() @ down.double().t()
    assert_one_rounding(out, exact, error_bound(hidden, down))
    assert_mostly_equal(out, torch.nn.functional.linear(hidden, down))
    ref = reference.shared_expert(x, gate_up, down, BETA, LINEAR_BETA)
    err = (out.double() - ref.double()).norm(dim=-1) / ref.double().norm(dim=-1)
    assert err.max().item() < 1e-2


# ------------------------------------------------------------------------- invariance

@given(b=st.integers(2, 64), data=st.data(), shape=st.sampled_from(SHAPES),
       reduction=st.sampled_from(REDUCTIONS), seed=st.integers(0, 2 ** 16))
def test_batch_invariance_of_each_epilogue(b, data, shape, reduction, seed):
    N, H = shape
    x, w = make_inputs(b, N, H, seed)
    row, alone_cfg, wide_cfg = draw_row_and_configs(data, b, reduction)
    for run in (run_linear, run_situ):
        assert_row_alone_equals_in_batch(run, x, w, row, alone_cfg, wide_cfg)


@given(b=st.integers(2, 64), data=st.data(), seed=st.integers(0, 2 ** 16))
def test_batch_invariance_of_the_stage_with_its_own_configs(b, data, seed):
    # Through the stage's tuning entries (launch_config), whose tiles differ between one
    # row and b rows.
    x, pairs = make_inputs(b, 256, 256, seed)
    down = make_inputs(1, 256, 128, seed + 1)[1]
    row = data.draw(st.integers(0, b - 1), label="row")
    alone = shared.shared_expert(x[row:row + 1].contiguous(), pairs, down, BETA, LINEAR_BETA)
    wide = shared.shared_expert(x, pairs, down, BETA, LINEAR_BETA)
    assert torch.equal(alone.view(torch.int16), wide[row:row + 1].view(torch.int16))


def test_workspace_serves_every_width_and_is_used():
    S, H = 768, 7168  # the TP8 shard, untuned defaults: the gate/up splits K
    numel = shared.max_workspace_numel(1024, S, H)
    assert numel > 0
    for rows in (1, 16, 64, 65, 1024):
        for N, K, kernel in ((2 * S, H, shared.KERNEL_GATE_UP), (H, S, shared.KERNEL_DOWN)):
            cfg = front.launch_config(N, K, rows, kernel=kernel)
            assert front.workspace_numel(rows, N, K, cfg) <= numel
    x, pairs = make_inputs(9, 256, 256, seed=2)
    down = make_inputs(1, 256, 128, seed=3)[1]
    cfg = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=32, SPLIT_K=4, SPLIT_GRID=1, num_warps=4,
               num_stages=3)
    mine = poison(torch.empty(4 * 9 * 256, dtype=torch.float32, device=DEVICE))
    got = shared.shared_expert(x, pairs, down, BETA, LINEAR_BETA, workspace=mine,
                               config_gate_up=cfg, config_down=cfg)
    assert not torch.isnan(mine).any(), "the partials went elsewhere"
    again = shared.shared_expert(x, pairs, down, BETA, LINEAR_BETA, config_gate_up=cfg,
                                 config_down=cfg)
    assert torch.equal(got.view(torch.int16), again.view(torch.int16))


def test_empty_batch_launches_nothing(monkeypatch):
    forbid_launches(monkeypatch, front, "_front_kernel", "_front_reduce_kernel")
    x = torch.empty(0, 256, dtype=torch.bfloat16, device=DEVICE)
    pairs, down = make_inputs(1, 256, 256, 0)[1], make_inputs(1, 256, 128, 0)[1]
    out = shared.shared_expert(x, pairs, down, BETA, LINEAR_BETA)
    assert out.shape == (0, 256) and out.dtype == torch.bfloat16


# ------------------------------------------------------------------------- errors

def _bad_calls():
    bf16 = dict(dtype=torch.bfloat16, device=DEVICE)
    x, w = torch.zeros(4, 64, **bf16), torch.zeros(80, 64, **bf16)
    down = torch.zeros(64, 40, **bf16)
    wide = torch.zeros(4, 160, **bf16)
    return [
        (lambda: linear(x.float(), w), TypeError, "x must be torch.bfloat16"),
        (lambda: linear(x, w[:, :32]), ValueError, "weight must have shape"),
        (lambda: linear(x, w.half()), TypeError, "weight must be torch.bfloat16"),
        (lambda: linear(x, w, out=torch.zeros(4, 80, device=DEVICE)), TypeError,
         "out must be torch.bfloat16"),
        (lambda: linear(x, w, out=torch.zeros(4, 81, **bf16)), ValueError,
         "out must have shape"),
        (lambda: linear(x, w, out=wide[:, ::2]), ValueError, "out must have adjacent columns"),
        (lambda: linear(x, w, accumulate=True), ValueError, "out must be given"),
        (lambda: linear(x, w, config=dict(BLOCK_N=32)), ValueError, "BLOCK_N"),
        (lambda: linear_situ(x, w[:79], BETA, LINEAR_BETA), ValueError,
         "gate_up must have an even number of rows"),
        (lambda: linear_situ(x, w, 0.0, LINEAR_BETA), ValueError, "beta must be"),
        (lambda: linear_situ(x, w, float("inf"), LINEAR_BETA), ValueError, "beta must be"),
        (lambda: linear_situ(x, w, BETA, -1.0), ValueError, "linear_beta must be"),
        (lambda: linear_situ(x, w, BETA, LINEAR_BETA, out=torch.zeros(4, 80, **bf16)),
         ValueError, "out must have shape"),
        (lambda: linear_situ(x, w.float(), BETA, LINEAR_BETA), TypeError, "gate_up must be"),
        (lambda: shared.shared_expert(x, w, down[:, :39], BETA, LINEAR_BETA), ValueError,
         "down must have shape"),
        (lambda: shared.shared_expert(x, w[:, :32], down, BETA, LINEAR_BETA), ValueError,
         "gate_up_pairs must have shape"),
        (lambda: shared.shared_expert(x, w, down.float(), BETA, LINEAR_BETA), TypeError,
         "down must be torch.bfloat16"),
        (lambda: shared.shared_expert(x, w, down, BETA, LINEAR_BETA,
                                      hidden=torch.zeros(4, 41, **bf16)),
         ValueError, "hidden must have shape"),
        (lambda: shared.interleave_gate_up(w[:79]), ValueError,
         "gate_up must have an even number of rows"),
        (lambda: shared.interleave_gate_up(w.float()), TypeError, "gate_up must be"),
    ]


@pytest.mark.parametrize("index", range(len(_bad_calls())))
def test_argument_errors_name_the_argument(index):
    call, error, message = _bad_calls()[index]
    with pytest.raises(error, match=message):
        call()
