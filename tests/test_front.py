"""The front GEMM (x @ packed.T, FP32) and pack_front."""

import pytest
import torch
from hypothesis import given, strategies as st

from conftest import DEVICE, forbid_launches, poison
from gemm_cases import (LAYOUTS, REDUCTIONS, assert_row_alone_equals_in_batch,
                        draw_row_and_configs, error_bound, make_inputs)
from wide_moe_triton import LatentMoE, WideMoEConfig, reference
from wide_moe_triton.kernels import front
from wide_moe_triton.kernels.front import front_gemm, pack_front

# (N, H): the tiny layer's TP4 rank (16/4 + 256/4 rounded to the brief's 16 + 64), an
# N that is not a multiple of 8, and an H that is not a multiple of BLOCK_K 64.
SHAPES = [(80, 256), (37, 256), (72, 96)]


def run(x, packed, config, **kwargs):
    out = poison(torch.empty(x.shape[0], packed.shape[0], dtype=torch.float32, device=DEVICE))
    result = front_gemm(x, packed, out=out, config=config, **kwargs)
    assert result is out
    return out


@given(b=st.integers(1, 64), shape=st.sampled_from(SHAPES),
       layout=st.sampled_from(LAYOUTS), reduction=st.sampled_from(REDUCTIONS),
       seed=st.integers(0, 2 ** 16))
def test_front_matches_float64_and_mm_f32(b, shape, layout, reduction, seed):
    N, H = shape
    x, packed = make_inputs(b, N, H, seed)
    out = run(x, packed, {**layout, **reduction})
    exact = x.double() @ packed.double().t()
    err = (out.double() - exact).abs()
    bound = error_bound(x, packed)
    assert torch.isfinite(out).all(), "unwritten (NaN-poisoned) or non-finite outputs"
    assert (err <= bound).all(), f"max excess {(err - bound).max().item():.3g}"
    # FP32 accumulation, not a BF16 (~1e-3) or TF32-like rounding. 1e-5, not 1e-6:
    # tensor cores truncate their sums, so their error is biased (~1e-6 at H = 256).
    assert (err.norm() / exact.norm()).item() < 1e-5
    ref = reference.mm_f32(x, packed)
    assert ((out.double() - ref.double()).abs() <= 2 * bound).all()


@given(b=st.integers(1, 40), shape=st.sampled_from(SHAPES), seed=st.integers(0, 2 ** 16))
def test_split_modes_agree_and_reproduce(b, shape, seed):
    N, H = shape
    x, packed = make_inputs(b, N, H, seed)
    base = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=32, num_warps=4, num_stages=3)
    no_split = {**base, "SPLIT_K": 1, "SPLIT_GRID": 0}
    grid = {**base, "SPLIT_K": 4, "SPLIT_GRID": 1}
    in_program = {**base, "SPLIT_K": 4, "SPLIT_GRID": 0}
    pairs = {**grid, "GROUP": 2}
    results = {}
    for name, cfg in (("no_split", no_split), ("grid", grid), ("in_program", in_program),
                      ("pairs", pairs)):
        first, second = run(x, packed, cfg), run(x, packed, cfg)
        assert torch.equal(first.view(torch.int32), second.view(torch.int32)), name
        results[name] = first
    # The same segments added in the same order, in one program or across programs.
    assert torch.equal(results["grid"].view(torch.int32), results["in_program"].view(torch.int32))
    assert torch.equal(results["grid"].view(torch.int32), results["pairs"].view(torch.int32))
    diff = (results["grid"].double() - results["no_split"].double()).abs()
    assert (diff <= 2 * error_bound(x, packed)).all()


def tree_sum(parts):
    """The bottom-up pairwise tree of the module docstring, in FP32 (torch's adds)."""
    while len(parts) > 1:
        pairs = [parts[i] + parts[i + 1] for i in range(0, len(parts) - 1, 2)]
        parts = pairs + parts[len(pairs) * 2:]
    return parts[0]


@given(b=st.integers(1, 24), split_k=st.sampled_from([3, 6, 8]), seed=st.integers(0, 2 ** 16))
def test_segments_add_as_a_binary_tree(b, split_k, seed):
    # Each segment's sum, run alone on its slice of K, then added in the tree's order by
    # torch, is what every grouping of the segments into programs gives, bit for bit.
    N, H, block_k = 37, 256, 32
    x, packed = make_inputs(b, N, H, seed)
    per = -(-(H // block_k) // split_k) * block_k  # columns a segment
    one = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=block_k, SPLIT_K=1, SPLIT_GRID=0, num_warps=4,
               num_stages=3)
    segments = [run(x[:, k:k + per].contiguous(), packed[:, k:k + per].contiguous(), one)
                for k in range(0, H, per)]
    expected = tree_sum(segments).view(torch.int32)
    for grid, group in ((0, 1), (1, 1), (1, 2), (1, 4)):
        cfg = {**one, "SPLIT_K": split_k, "SPLIT_GRID": grid, "GROUP": group}
        assert torch.equal(run(x, packed, cfg).view(torch.int32), expected), (grid, group)


@given(b=st.integers(2, 64), data=st.data(), shape=st.sampled_from(SHAPES),
       reduction=st.sampled_from(REDUCTIONS), seed=st.integers(0, 2 ** 16))
def test_batch_invariance(b, data, shape, reduction, seed):
    N, H = shape
    x, packed = make_inputs(b, N, H, seed)
    row, alone_cfg, wide_cfg = draw_row_and_configs(data, b, reduction)
    assert_row_alone_equals_in_batch(run, x, packed, row, alone_cfg, wide_cfg)


@given(b=st.integers(2, 64), data=st.data(), seed=st.integers(0, 2 ** 16))
def test_batch_invariance_default_configs(b, data, seed):
    # Through the wrapper's own config choice, which differs between 1 row and b rows.
    x, packed = make_inputs(b, 80, 256, seed)
    row = data.draw(st.integers(0, b - 1), label="row")
    alone = front_gemm(x[row:row + 1].contiguous(), packed)
    wide = front_gemm(x, packed)
    assert torch.equal(alone.view(torch.int32), wide[row:row + 1].view(torch.int32))


def test_launch_config_takes_reduction_from_smallest_bucket(monkeypatch):
    # A table whose buckets disagree on BLOCK_K/SPLIT_K must not make rows depend on b.
    def fake_config_for(kernel, shape, rows, default, device=None):
        assert kernel == front.KERNEL and shape == front.shape_key(560, 7168)
        small = rows <= 16
        return {**default, "BLOCK_M": 16 if small else 128, "SPLIT_GRID": int(small),
                "BLOCK_K": 64 if small else 128, "SPLIT_K": 14 if small else 2}

    monkeypatch.setattr(front, "config_for", fake_config_for)
    one, wide = front.launch_config(560, 7168, 1), front.launch_config(560, 7168, 1024)
    assert (one["BLOCK_K"], one["SPLIT_K"]) == (wide["BLOCK_K"], wide["SPLIT_K"]) == (64, 14)
    assert (one["BLOCK_M"], wide["BLOCK_M"]) == (16, 128)


def test_default_config_reduction_is_per_shape():
    for N, H in ((560, 7168), (4480, 7168), (80, 256)):
        orders = {tuple(front.default_config(N, H, b)[k] for k in front.REDUCTION_KEYS)
                  for b in (1, 7, 64, 65, 512, 1024)}
        assert len(orders) == 1, (N, H, orders)
    # The production TP8 shape gets split-K at small batches (9 N tiles alone idle an H200).
    assert front.default_config(560, 7168, 1)["SPLIT_GRID"] == 1
    assert front.default_config(560, 7168, 1)["SPLIT_K"] > 1


@pytest.fixture(scope="module")
def stock():
    return LatentMoE(WideMoEConfig.tiny(), seed=3)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_pack_front_slices_and_concatenates(stock, world):
    gate, down = stock.gate_weight.to(DEVICE), stock.latent_down.to(DEVICE)
    E, L = gate.shape[0], down.shape[0]
    e, l = E // world, L // world
    cfg = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=32, SPLIT_K=2, SPLIT_GRID=1, num_warps=4,
               num_stages=3)
    x, _ = make_inputs(5, 1, gate.shape[1], seed=world)
    full = run(x, pack_front(gate, down, 0, 1), cfg)
    logits, latents = [], []
    for rank in range(world):
        packed = pack_front(gate, down, rank, world)
        assert packed.dtype == torch.bfloat16 and packed.is_contiguous()
        assert torch.equal(packed[:e], gate[rank * e:(rank + 1) * e])
        assert torch.equal(packed[e:], down[rank * l:(rank + 1) * l])
        assert packed.shape == (e + l, gate.shape[1])
        out = run(x, packed, cfg)
        logits.append(out[:, :e])
        latents.append(out[:, e:])
    # Each rank's columns are exactly the matching columns of the one-rank front.
    assert torch.equal(torch.cat(logits, 1).view(torch.int32), full[:, :E].view(torch.int32))
    assert torch.equal(torch.cat(latents, 1).view(torch.int32), full[:, E:].view(torch.int32))


def test_workspace_argument():
    x, packed = make_inputs(9, 80, 256, seed=1)
    cfg = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=32, SPLIT_K=3, SPLIT_GRID=1, num_warps=4,
               num_stages=3)
    need = front.workspace_numel(9, 80, 256, cfg)
    assert need == 3 * 9 * 80
    assert front.workspace_numel(9, 80, 256, {**cfg, "SPLIT_GRID": 0}) == 0
    mine = poison(torch.empty(need + 7, dtype=torch.float32, device=DEVICE))
    shared = run(x, packed, cfg)
    given_ws = run(x, packed, cfg, workspace=mine)
    assert torch.equal(shared.view(torch.int32), given_ws.view(torch.int32))
    assert not torch.isnan(mine[:need]).any(), "the partials went elsewhere"
    # Sized once for the widest batch, it serves every narrower call of the default path.
    ws = torch.empty(front.max_workspace_numel(64, 560, 7168), dtype=torch.float32)
    for rows in (1, 16, 64):
        cfg_b = front.launch_config(560, 7168, rows)
        assert front.workspace_numel(rows, 560, 7168, cfg_b) <= ws.numel()
    with pytest.raises(ValueError, match="workspace must hold at least"):
        run(x, packed, cfg, workspace=mine[:need - 1])
    with pytest.raises(TypeError, match="workspace"):
        run(x, packed, cfg, workspace=mine.to(torch.float64))


def test_empty_batch_launches_nothing(monkeypatch):
    forbid_launches(monkeypatch, front, "_front_kernel", "_front_reduce_kernel")
    x = torch.empty(0, 256, dtype=torch.bfloat16, device=DEVICE)
    packed = torch.zeros(80, 256, dtype=torch.bfloat16, device=DEVICE)
    out = front_gemm(x, packed)
    assert out.shape == (0, 80) and out.dtype == torch.float32


def _bad_calls():
    bf16 = dict(dtype=torch.bfloat16, device=DEVICE)
    x, w = torch.zeros(4, 64, **bf16), torch.zeros(80, 64, **bf16)
    gate, down = torch.zeros(16, 64, **bf16), torch.zeros(64, 64, **bf16)
    meta = torch.zeros(80, 64, dtype=torch.bfloat16, device="meta")
    good = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=32, SPLIT_K=1, SPLIT_GRID=0, num_warps=4,
                num_stages=3)
    return [
        (lambda: front_gemm(x.float(), w), TypeError, "x must be torch.bfloat16"),
        (lambda: front_gemm(x[0], w), ValueError, "x must have shape"),
        (lambda: front_gemm(torch.zeros(64, 4, **bf16).t(), w), ValueError, "x must be contiguous"),
        (lambda: front_gemm(x, w.half()), TypeError, "packed must be torch.bfloat16"),
        (lambda: front_gemm(x, w[:, :32]), ValueError, "packed must have shape"),
        (lambda: front_gemm(x, meta), ValueError, "packed must be on"),
        (lambda: front_gemm(x, w, out=torch.zeros(4, 81, device=DEVICE)), ValueError,
         "out must have shape"),
        (lambda: front_gemm(x, w, out=torch.zeros(4, 80, **bf16)), TypeError, "out must be"),
        (lambda: front_gemm(x[:, :0], w[:, :0]), ValueError, "x must have at least one column"),
        (lambda: front_gemm(x, w, config={**good, "BLOCK_N": 32}), ValueError, "BLOCK_N"),
        (lambda: front_gemm(x, w, config={**good, "num_warps": 2}), ValueError, "num_warps"),
        (lambda: front_gemm(x, w, config={**good, "BLOCK_K": 48}), ValueError, "BLOCK_K"),
        (lambda: front_gemm(x, w, config={**good, "GROUP": 3}), ValueError, "GROUP"),
        (lambda: front_gemm(torch.zeros(4, 256, **bf16), torch.zeros(80, 256, **bf16),
                            config={**good, "BLOCK_K": 16, "SPLIT_K": 16}),
         ValueError, "at most 8 segments"),
        (lambda: pack_front(gate.float(), down, 0, 1), TypeError, "gate_weight"),
        (lambda: pack_front(gate, down[:, :32], 0, 1), ValueError, "latent_down must have shape"),
        (lambda: pack_front(gate, down, 2, 2), ValueError, "rank must be"),
        (lambda: pack_front(gate, down, -1, 2), ValueError, "rank must be"),
        (lambda: pack_front(gate, down, 0, 0), ValueError, "world must be"),
        (lambda: pack_front(gate[:15], down, 0, 2), ValueError, "gate_weight's rows"),
        (lambda: pack_front(gate, down[:62], 0, 4), ValueError, "latent_down's rows"),
    ]


@pytest.mark.parametrize("index", range(len(_bad_calls())))
def test_argument_errors_name_the_argument(index):
    call, error, message = _bad_calls()[index]
    with pytest.raises(error, match=message):
        call()


@pytest.mark.parametrize("tp", [1, 8, 16])
def test_default_configs_launch_at_production_shapes(tp):
    # The untuned defaults (what a GPU without a table runs) must be launchable at every
    # width: the reduction keys of b = 1 with the program split of b, as launch_config
    # combines them, never more segments in one program than it can hold.
    cfg = WideMoEConfig.kimi_k3(tp=tp)
    shapes = [(cfg.experts_per_rank + cfg.latent_per_rank, cfg.hidden),
              (2 * cfg.shared_per_rank, cfg.hidden), (cfg.hidden, cfg.shared_per_rank),
              (cfg.hidden // tp, cfg.latent)]
    for N, H in shapes:
        order = front.default_config(N, H, 1)
        for b in (1, 16, 64, 65, 128, 256, 512, 1024):
            c = {**front.default_config(N, H, b), **{k: order[k] for k in front.REDUCTION_KEYS}}
            _, _, segments = front._split_plan(H, c)
            front._group_plan(segments, c)  # raises past the program's tree levels
