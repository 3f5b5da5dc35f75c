"""The forward path's host work and the policy for bad input: a forward checks its input
once, resolves no config again for a width it has seen and allocates nothing but its
output; WideMoE, LatentMoE,
SimulatedGroup and the ops refuse the same mistake with the same exception and a message
that names the accepted shape, take a non-contiguous input, an empty batch, and Inf
without numpy warnings (the interpreter's) reaching the caller."""

import pathlib
import sys
import warnings

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from conftest import DEVICE
from wide_moe_triton import LatentMoE, SimulatedGroup, WideMoE, WideMoEConfig, checks, ops
from wide_moe_triton import tuning

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "benchmarks"))
import host_overhead  # noqa: E402

CFG = WideMoEConfig.tiny(wide_rows=16)
H = CFG.hidden


@pytest.fixture(scope="module")
def stock():
    return LatentMoE(CFG, seed=0, device=DEVICE)


@pytest.fixture(scope="module")
def wide(stock):
    return WideMoE.from_module(stock)


def inputs(b, seed=0):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    return torch.randn(b, H, generator=g, device=DEVICE).bfloat16()


class Counter:
    """Counts the calls of ``owner.name``, made through ``owner`` or through any package
    module that imported it by name."""

    def __init__(self, mp, owner, name):
        self.calls, original = 0, getattr(owner, name)

        def counted(*args, **kwargs):
            self.calls += 1
            return original(*args, **kwargs)

        mp.setattr(owner, name, counted)
        for mod in list(sys.modules.values()):
            if getattr(mod, "__name__", "").startswith("wide_moe_triton") and \
                    getattr(mod, name, None) is original:
                mp.setattr(mod, name, counted)


# ----------------------------------------------------------------------------- host work

@given(widths=st.lists(st.integers(1, 2 * CFG.wide_rows + 3), min_size=1, max_size=4))
@settings(max_examples=10)
def test_a_forward_checks_once_and_resolves_nothing_it_resolved_before(wide, widths):
    # Launches stubbed: the count of checks and config look-ups is the host's alone.
    with host_overhead.stubbed_launches() as launches, pytest.MonkeyPatch.context() as mp:
        checked = Counter(mp, checks, "check_tensor")
        configs = Counter(mp, tuning, "config_for")
        allocated = {name: Counter(mp, torch, name)
                     for name in ("empty", "zeros", "empty_like", "zeros_like")}
        first = []
        for b in widths:
            launches[0] = 0
            wide(inputs(b))
            first.append(launches[0])
        for b, launched in zip(widths, first):
            x = inputs(b)
            checked.calls = configs.calls = launches[0] = 0
            for counter in allocated.values():
                counter.calls = 0
            wide(x)
            assert checked.calls <= 3, (b, checked.calls)
            assert configs.calls == 0, (b, configs.calls)
            # One new tensor a chunk, the shared expert's output (it becomes the result).
            assert sum(c.calls for c in allocated.values()) == -(-b // CFG.wide_rows)
            assert launches[0] == launched > 0  # the plan's launches, every one of them


def test_a_plan_is_resolved_once_per_width_and_used_by_every_call(wide):
    with host_overhead.stubbed_launches():
        first = wide.plan(5)
        wide(inputs(5))
        assert wide.plan(5) is first
        assert wide.plan(6) is not first
        with pytest.raises(ValueError, match=f"1 to wide_rows = {CFG.wide_rows}"):
            wide.plan(CFG.wide_rows + 1)


# ----------------------------------------------------------------------------- bad input

BAD = [
    (lambda x: "not a tensor", TypeError, "x must be a torch.Tensor"),
    (lambda x: x.float(), TypeError, "x must be torch.bfloat16"),
    (lambda x: x[None], ValueError, rf"x must have shape \[b, {H}\], got \[1, 3, {H}\]"),
    (lambda x: x[:, :-32], ValueError, rf"x must have shape \[b, {H}\]"),
    (lambda x: x[0], ValueError, rf"x must have shape \[b, {H}\]"),
]


@pytest.mark.parametrize("bad, error, match", BAD)
def test_every_layer_refuses_bad_input_alike(stock, wide, bad, error, match):
    x = inputs(3)
    group = SimulatedGroup(stock, 2)
    for layer in (wide, stock, group, wide.shared, wide.publish):
        with pytest.raises(error, match=match):
            layer(bad(x))


def _op_calls():
    """{op: (a call of it with its first checked argument replaced, that argument's
    dtype, a shape it refuses)}."""
    b, L, K, N = 2, 64, 2, 32
    bf16 = lambda *s: torch.zeros(*s, dtype=torch.bfloat16, device=DEVICE)  # noqa: E731
    three_d = (1, 2, 64)
    return {
        "front_gemm": (lambda a: ops.front_gemm(a, bf16(N, H)), torch.bfloat16, three_d),
        "linear": (lambda a: ops.linear(a, bf16(N, H)), torch.bfloat16, three_d),
        "rms_norm": (lambda a: ops.rms_norm(a, bf16(L), 1e-6), torch.bfloat16, three_d),
        "finalize": (lambda a: ops.finalize(bf16(b * K, L), a), torch.bfloat16, three_d),
        "route": (lambda a: ops.route(a, torch.zeros(16, device=DEVICE), 4, True, 1.0),
                  torch.float32, three_d),
        "quantize_mxfp8": (lambda a: ops.quantize_mxfp8(a), torch.bfloat16, ()),
        "add_up_projection": (lambda a: ops.add_up_projection(a, bf16(N, L), bf16(b, N)),
                              torch.bfloat16, three_d),
        "shared_expert": (lambda a: ops.shared_expert(a, bf16(2 * N, H), bf16(H, N), 4.0,
                                                      None), torch.bfloat16, three_d),
    }


@pytest.mark.parametrize("op", sorted(_op_calls()))
def test_every_op_refuses_alike(op):
    call, dtype, refused = _op_calls()[op]
    with pytest.raises(TypeError, match="must be a torch.Tensor"):
        call("nope")
    with pytest.raises(TypeError, match="must be torch"):
        call(torch.zeros(2, 64, dtype=torch.float16, device=DEVICE))
    with pytest.raises(ValueError, match=r"must have shape \[[.a-z]"):
        call(torch.zeros(refused, dtype=dtype, device=DEVICE))


# ----------------------------------------------------------------------------- accepted

@given(b=st.integers(1, 6), step=st.integers(2, 3), seed=st.integers(0, 2 ** 16))
@settings(max_examples=2)
def test_non_contiguous_input_gives_the_contiguous_bits(stock, wide, b, step, seed):
    x = inputs(b, seed).repeat_interleave(step, dim=1)[:, ::step]  # strided columns
    assert not x.is_contiguous() and torch.equal(x, inputs(b, seed))
    assert torch.equal(wide(x).view(torch.int16), wide(x.contiguous()).view(torch.int16))
    assert torch.equal(stock(x).view(torch.int16), stock(x.contiguous()).view(torch.int16))


def test_empty_batch_everywhere(stock, wide):
    for layer in (stock, wide):
        out = layer(inputs(0))
        assert out.shape == (0, H) and out.dtype == torch.bfloat16
    assert [o.shape for o in SimulatedGroup(stock, 2)(inputs(0))] == [(0, H)] * 2


@pytest.mark.parametrize("value", [float("inf"), -float("inf")])
def test_inf_input_warns_nothing_and_leaves_numpy_alone(wide, value):
    x = inputs(3, 7)
    # The same calls on finite input first: a GPU without a tuned config for these tiny
    # shapes warns once per kernel and shape (tuning.config_for), which is not what this
    # test is about; the checked calls below then warn only if Inf makes them.
    wide(x)
    ops.rms_norm(x, torch.ones(H, dtype=torch.bfloat16, device=DEVICE), 1e-6)
    ops.quantize_mxfp8(x)
    x[1, 5] = value
    before = np.geterr()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any warning fails the test
        out = wide(x)
        ops.rms_norm(x, torch.ones(H, dtype=torch.bfloat16, device=DEVICE), 1e-6)
        ops.quantize_mxfp8(x)
    assert not torch.isfinite(out[1].float()).all()
    assert np.geterr() == before
    # Scoped: the caller's own numpy arithmetic still warns as numpy's settings say.
    with pytest.warns(RuntimeWarning):
        np.array([np.inf]) - np.array([np.inf])
