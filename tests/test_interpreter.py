"""The test harness's change to Triton's interpreter (conftest.patch_language_once_per_
launch) computes what the interpreter computes without it: the whole layer's bits, with
the language's builtins restored after each launch, for far fewer of Triton's scans."""

import os

import pytest
import torch
from hypothesis import given, settings, strategies as st

from wide_moe_triton import LatentMoE, WideMoE, WideMoEConfig

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="a change to Triton's interpreter only")

CFG = WideMoEConfig.tiny(wide_rows=32)


@pytest.fixture(scope="module")
def layer():
    return WideMoE.from_module(LatentMoE(CFG, seed=3))


def forward(layer, x, harness: bool):
    """The layer's output, with the harness's ``_patch_lang`` or with Triton's own, and
    how many times Triton's own ran."""
    from triton.runtime import interpreter

    ours = interpreter._patch_lang
    triton_own = ours.original
    calls = [0]

    def counted(fn):
        calls[0] += 1
        return triton_own(fn)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ours, "original", counted)
        mp.setattr(interpreter, "_patch_lang", ours if harness else counted)
        out = layer(x)
    return out, calls[0]


@given(b=st.integers(1, CFG.wide_rows), seed=st.integers(0, 2 ** 16))
@settings(max_examples=2)
def test_harness_interpreter_gives_the_same_bits(layer, b, seed):
    import triton.language as tl

    builtins = {name: getattr(tl, name) for name in ("load", "store", "dot", "where")}
    x = torch.randn(b, CFG.hidden, generator=torch.Generator().manual_seed(seed)).bfloat16()
    plain, plain_scans = forward(layer, x, harness=False)
    once, once_scans = forward(layer, x, harness=True)
    assert torch.equal(once.view(torch.int16), plain.view(torch.int16))
    # at least one scan a launch, and far fewer than one a helper call
    assert 0 < once_scans < plain_scans / 4, (once_scans, plain_scans)
    assert {name: getattr(tl, name) for name in builtins} == builtins
