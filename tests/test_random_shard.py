"""``reference.random_shard``: a rank draws only its own slices of a random layer, and
those are the whole layer's slices, for every T."""

import pytest
import torch
from hypothesis import given, settings, strategies as st

from wide_moe_triton import WideMoEConfig, reference
from wide_moe_triton.sharding import shard

# Every T in (1, 2, 4, 8) admits these dims (I and S multiples of 32 * 8).
CFG = WideMoEConfig(hidden=256, latent=256, num_experts=16, top_k=4, expert_intermediate=256,
                    shared_intermediate=256)


@pytest.fixture(scope="module")
def whole():
    return {seed: reference.random_shard(CFG, seed) for seed in (0, 1)}


@given(world=st.sampled_from([1, 2, 4, 8]), data=st.data(), seed=st.sampled_from([0, 1]))
@settings(max_examples=8)
def test_a_rank_draws_the_whole_layers_slices(whole, world, data, seed):
    rank = data.draw(st.integers(0, world - 1), label="rank")
    mine = reference.random_shard(CFG, seed, rank, world)
    assert (mine.rank, mine.world, mine.whole) == (rank, world, world == 1)
    expected = shard(whole[seed], rank, world)
    got = shard(mine, rank, world)
    for name in ("gate_weight", "latent_down", "bias", "w13", "w13_scales", "w2",
                 "w2_scales", "norm_weight", "latent_up", "shared_gate_up", "shared_down"):
        a, b = getattr(got, name), getattr(expected, name)
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert torch.equal(a.view(torch.uint8) if a.dtype != torch.float32 else a,
                           b.view(torch.uint8) if b.dtype != torch.float32 else b), name


def test_seeds_draw_other_weights_and_the_layer_is_usable(whole):
    # Another seed, other weights; the whole layer runs (finite, unit-scale outputs).
    assert not torch.equal(whole[0].w13, whole[1].w13)
    assert not torch.equal(whole[0].gate_weight.view(torch.int16),
                           whole[1].gate_weight.view(torch.int16))
    x = torch.randn(3, CFG.hidden, generator=torch.Generator().manual_seed(0)).bfloat16()
    y = whole[0](x).float()
    assert torch.isfinite(y).all() and 0.1 < y.std() < 10


def test_bad_rank_is_refused_by_name():
    with pytest.raises(ValueError, match="rank must be in"):
        reference.random_shard(CFG, 0, 2, 2)
    with pytest.raises(ValueError, match="multiple of 32 \\* tp"):
        reference.random_shard(WideMoEConfig.tiny(), 0, 0, 8)
