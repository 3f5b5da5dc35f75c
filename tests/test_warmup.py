"""``WideMoE.warmup``: every width's launches run once over stand-in exchange buffers, so
the first call over a group compiles nothing, and the real buffers stay as they were."""

import pytest
import torch
from hypothesis import given, settings, strategies as st

from conftest import DEVICE
from test_module import assert_mailbox_empty
from wide_moe_triton import LatentMoE, SimulatedGroup, WideMoE, WideMoEConfig

CFG = WideMoEConfig.tiny(wide_rows=8)


def bits(t):
    return t.view(torch.int16)


@pytest.fixture(scope="module")
def layer():
    return WideMoE.from_module(LatentMoE(CFG, seed=0, device=DEVICE))


@given(widths=st.lists(st.integers(0, 40), max_size=5))
def test_call_widths_are_the_chunks_forward_makes(layer, widths):
    expected = set()
    for b in widths:
        chunks = [min(CFG.wide_rows, b - i) for i in range(0, b, CFG.wide_rows)]
        expected.update(chunks)
    assert layer._call_widths(widths) == sorted(expected)


@given(b=st.integers(1, 8), seed=st.integers(0, 2 ** 16))
@settings(max_examples=2)
def test_a_stand_in_call_leaves_the_ranks_buffers_as_they_were(b, seed):
    # Rank 1 of a simulated pair runs a whole call over its stand-in: it exchanges
    # nothing (its real mailbox, tail rows, call counter and error record stay fresh,
    # rank 0's too), its own polls find every word, and the pair's next call has the
    # bits of a pair that never warmed up.
    stock = LatentMoE(CFG, seed=seed % 3, device=DEVICE)
    group, fresh = SimulatedGroup(stock, 2), SimulatedGroup(stock, 2)
    x = torch.randn(b, CFG.hidden, generator=torch.Generator().manual_seed(seed))
    x = x.bfloat16().to(DEVICE)
    layer = group.ranks[1]
    stand_in = layer._stand_in()
    stand_in.scratch.publish_everything()
    out = stand_in._forward(x)
    assert torch.isfinite(out.float()).all()
    assert stand_in.scratch.error.tolist() == [0, 0]
    assert int(stand_in.scratch.lists.generation[0]) == 1
    for rank in group.ranks:
        assert_mailbox_empty(rank.scratch)
        assert int(rank.scratch.lists.generation[0]) == 0
        assert rank.scratch.error.tolist() == [0, 0]
    for got, want in zip(group(x), fresh(x)):
        assert torch.equal(bits(got), bits(want))


def test_warmup_builds_every_plan_and_refuses_a_bad_width():
    layer = WideMoE.from_module(LatentMoE(CFG, seed=0, device=DEVICE))
    layer.warmup([3, 17])
    assert sorted(layer._plans) == [1, 3, 8]
    with pytest.raises(ValueError, match="widths"):
        layer.warmup([-1])
