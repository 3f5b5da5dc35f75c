"""The stock layer's invariants, and its agreement with a float64 recomputation."""

import pytest
import torch
from hypothesis import given, strategies as st

from wide_moe_triton import LatentMoE, WideMoEConfig, mx, reference

CFG = WideMoEConfig.tiny()


@pytest.fixture(scope="module")
def stock():
    return LatentMoE(CFG, seed=0)


def float64_layer(m: LatentMoE, x: torch.Tensor) -> torch.Tensor:
    """The layer in float64 with only the quantization points of the definition (the
    BF16 latent, the MXFP8 plan and hidden): every other rounding is left out."""
    cfg, d = m.cfg, torch.float64
    x = x.to(d)
    S = cfg.shared_intermediate
    gu = x @ m.shared_gate_up.to(d).t()
    shared = reference.situ(gu[:, :S], gu[:, S:], cfg.beta, cfg.linear_beta).to(d) \
        @ m.shared_down.to(d).t()
    logits = x @ m.gate_weight.to(d).t()
    scores = torch.sigmoid(logits)
    order = torch.sort(scores + m.e_score_correction_bias.to(d), dim=-1, descending=True,
                       stable=True).indices[:, :cfg.top_k]
    w = torch.gather(scores, 1, order)
    w = w / w.sum(-1, keepdim=True) * cfg.routed_scaling_factor
    latent = (x @ m.latent_down.to(d).t()).to(torch.bfloat16)
    q = mx.dequantize_mxfp8(*mx.quantize_mxfp8(latent)).to(d)
    out = torch.zeros(x.shape[0], cfg.latent, dtype=d)
    I = cfg.expert_intermediate
    for t in range(x.shape[0]):
        for k in range(cfg.top_k):
            e = order[t, k]
            w13 = mx.dequantize_mxfp4(m.w13[e], m.w13_scales[e]).to(d)
            gu = q[t] @ w13.t()
            h = beta_situ = reference.situ(gu[:I], gu[I:], cfg.beta, cfg.linear_beta)
            h = mx.dequantize_mxfp8(*mx.quantize_mxfp8(beta_situ[None]))[0].to(d)
            out[t] += w[t, k] * (h @ mx.dequantize_mxfp4(m.w2[e], m.w2_scales[e]).to(d).t())
    normed = out * torch.rsqrt(out.square().mean(-1, keepdim=True) + cfg.rms_eps) \
        * m.norm_weight.to(d)
    return shared + normed @ m.latent_up.to(d).t()


@given(b=st.integers(1, 12), seed=st.integers(0, 2 ** 16))
def test_stock_layer_matches_float64(stock, b, seed):
    x = torch.randn(b, CFG.hidden, generator=torch.Generator().manual_seed(seed)).bfloat16()
    y = stock(x)
    assert y.shape == (b, CFG.hidden) and y.dtype == torch.bfloat16
    ref = float64_layer(stock, x)
    err = (y.double() - ref).norm(dim=-1) / ref.norm(dim=-1)
    # BF16 roundings at five points, each ~2**-9 relative: well under 2%.
    assert err.max().item() < 2e-2, err


@given(b=st.integers(1, 40), seed=st.integers(0, 2 ** 16), renormalize=st.booleans(),
       scale=st.sampled_from([1.0, 2.5, 0.125]))
def test_route_weights_and_ids(b, seed, renormalize, scale):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(b, CFG.num_experts, generator=g) * 3
    bias = torch.randn(CFG.num_experts, generator=g) * 0.1
    ids, w = reference.route(logits, bias, CFG.top_k, renormalize, scale)
    assert ids.dtype == torch.int32 and w.dtype == torch.bfloat16
    assert ids.shape == w.shape == (b, CFG.top_k)
    # K distinct experts, the best K by biased score, in descending order.
    choice = torch.sigmoid(logits.double()) + bias.double()
    assert all(len(set(row)) == CFG.top_k for row in ids.tolist())
    picked = torch.gather(choice, 1, ids.long())
    rest = choice.scatter(1, ids.long(), -torch.inf)
    assert torch.all(picked[:, -1] >= rest.max(dim=1).values - 1e-6)
    assert torch.all(picked[:, :-1] >= picked[:, 1:] - 1e-6)
    total = w.double().sum(-1)
    if renormalize:  # K BF16 roundings of weights summing to scale
        assert torch.allclose(total, torch.full_like(total, scale), rtol=CFG.top_k * 2 ** -8)
    else:
        expect = torch.gather(torch.sigmoid(logits.double()), 1, ids.long()).sum(-1) * scale
        assert torch.allclose(total, expect, rtol=2 ** -8)


def test_route_ties_go_to_lower_ids_and_nan_ranks_last():
    logits = torch.zeros(2, CFG.num_experts)
    logits[1, 3] = float("nan")
    logits[1, 5] = 1.0
    ids, w = reference.route(logits, torch.zeros(CFG.num_experts), 4, True, 1.0)
    assert ids[0].tolist() == [0, 1, 2, 3]
    assert ids[1].tolist() == [5, 0, 1, 2]
    assert torch.isfinite(w.float()).all()


def test_finalize_is_one_rounding_of_an_fma_chain():
    rows = torch.randn(3 * 4, 64).bfloat16()
    w = torch.randn(3, 4).bfloat16()
    out = reference.finalize(rows, w)
    exact = (w.double()[:, :, None] * rows.double().reshape(3, 4, 64)).sum(1)
    # FP32 accumulation: within one BF16 rounding (plus FP32 noise) of the exact sum
    assert torch.all((out.double() - exact).abs() <= exact.abs() * 2 ** -8 + 1e-30)


def test_state_dict_round_trip():
    a, b = LatentMoE(CFG, seed=1), LatentMoE(CFG, seed=2)
    b.load_state_dict(a.state_dict())
    x = torch.randn(5, CFG.hidden).bfloat16()
    assert torch.equal(a(x), b(x))


def test_bad_input():
    m = LatentMoE(CFG, seed=0)
    with pytest.raises(TypeError, match="bfloat16"):
        m(torch.randn(2, CFG.hidden))
    with pytest.raises(ValueError, match=rf"\[b, {CFG.hidden}\]"):
        m(torch.randn(2, CFG.hidden + 32).bfloat16())


@pytest.mark.parametrize("field,value", [("latent", 100), ("top_k", 99), ("num_experts", 18),
                                         ("hidden", 0)])
def test_config_validation(field, value):
    with pytest.raises(ValueError, match=field):
        WideMoEConfig.tiny(tp=4).replace(**{field: value})
