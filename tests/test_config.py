"""WideMoEConfig.from_hf_config: a Hugging Face config's fields mapped to the layer's, and
the configs this layer cannot serve refused by field."""

import json
import math

import pytest
from hypothesis import given, settings, strategies as st

from conftest import examples
from wide_moe_triton import WideMoEConfig


def kimi_k3_text_config():
    """Kimi-K3's MoE fields as its config.json spells them (DESIGN.md, "Checkpoint")."""
    return {"hidden_size": 7168, "routed_expert_hidden_size": 3584, "num_experts": 896,
            "num_experts_per_token": 16, "moe_intermediate_size": 3072,
            "num_shared_experts": 2, "routed_scaling_factor": 2.827, "moe_renormalize": True,
            "moe_router_activation_func": "sigmoid", "use_grouped_topk": True,
            "num_expert_group": 1, "topk_group": 1, "hidden_act": "situ",
            "activation_situ_beta": 4.0, "activation_situ_linear_beta": 25.0,
            "rms_norm_eps": 1e-6, "latent_moe_use_norm": True, "first_k_dense_replace": 1,
            "moe_layer_freq": 1, "vocab_size": 163840}


def test_kimi_k3_fields(tmp_path):
    want = WideMoEConfig.kimi_k3(tp=8, wide_rows=512)
    nested = {"model_type": "kimi_k3", "text_config": kimi_k3_text_config(),
              "vision_config": {"hidden_size": 1152}}
    assert WideMoEConfig.from_hf_config(nested, tp=8, wide_rows=512) == want
    assert WideMoEConfig.from_hf_config(kimi_k3_text_config(), tp=8, wide_rows=512) == want
    (tmp_path / "config.json").write_text(json.dumps(nested))
    assert WideMoEConfig.from_hf_config(tmp_path, tp=8, wide_rows=512) == want
    assert WideMoEConfig.from_hf_config(tmp_path / "config.json", tp=8, wide_rows=512) == want


def test_no_linear_beta_and_plain_top_k():
    f = kimi_k3_text_config()
    f.update(activation_situ_linear_beta=None, use_grouped_topk=False, num_expert_group=8)
    cfg = WideMoEConfig.from_hf_config(f)
    assert cfg.linear_beta is None and cfg == WideMoEConfig.kimi_k3().replace(linear_beta=None)


@pytest.mark.parametrize("field,value", [
    ("moe_router_activation_func", "softmax"),
    ("num_expert_group", 8),
    ("topk_group", 4),
    ("hidden_act", "silu"),
    ("routed_expert_hidden_size", None),
    ("latent_moe_use_norm", False),
    ("num_shared_experts", 0),
    ("hidden_size", "7168"),
    ("moe_renormalize", 1),
])
def test_refused_by_field(field, value):
    f = kimi_k3_text_config()
    f[field] = value
    with pytest.raises(ValueError, match=f"{field} = {value!r}".replace("(", r"\(")):
        WideMoEConfig.from_hf_config({"text_config": f})


@pytest.mark.parametrize("field", ["hidden_size", "num_experts", "activation_situ_beta",
                                   "activation_situ_linear_beta", "hidden_act"])
def test_missing_field_named(field):
    f = kimi_k3_text_config()
    del f[field]
    with pytest.raises(ValueError, match=field):
        WideMoEConfig.from_hf_config(f)


def test_dims_this_tp_cannot_split():
    with pytest.raises(ValueError, match=r"hidden \(7168\) must be a multiple of 32 \* tp"):
        WideMoEConfig.from_hf_config(kimi_k3_text_config(), tp=3)


@given(experts=st.integers(1, 64), top_k=st.integers(1, 64), blocks=st.integers(1, 8),
       shared=st.integers(1, 3), scale=st.floats(0.5, 4), renormalize=st.booleans(),
       linear_beta=st.none() | st.floats(1, 50), tp=st.sampled_from([1, 2]))
def test_hf_config_round_trip(experts, top_k, blocks, shared, scale, renormalize,
                              linear_beta, tp):
    inter = 64 * blocks
    cfg = WideMoEConfig(hidden=128, latent=64 * (blocks % 3 + 1), num_experts=2 * experts,
                        top_k=min(top_k, 2 * experts), expert_intermediate=inter,
                        shared_intermediate=inter * shared, routed_scaling_factor=scale,
                        renormalize=renormalize, linear_beta=linear_beta, tp=tp, wide_rows=32)
    text = json.loads(json.dumps(cfg.hf_config()))  # as a config.json holds it
    assert WideMoEConfig.from_hf_config(text, tp=tp, wide_rows=32) == cfg


# -- the float fields: finite and > 0, named when not ----------------------------------

NAN, INF = float("nan"), float("inf")
# Each WideMoEConfig float field and the config.json field it is read from (DESIGN.md,
# "Checkpoint").
HF_NAMES = {"routed_scaling_factor": "routed_scaling_factor", "beta": "activation_situ_beta",
            "linear_beta": "activation_situ_linear_beta", "rms_eps": "rms_norm_eps"}
FLOAT_VALUES = (st.sampled_from([NAN, INF, -INF, 0.0, -0.0, -1.0, -1e-300, 5e-324, 1e308])
                | st.floats(allow_nan=True, allow_infinity=True)
                | st.floats(1e-9, 1e3) | st.integers(-3, 3))


def in_domain(value) -> bool:
    """A scale, a SiTU clamp or an epsilon: a finite number above zero."""
    return math.isfinite(value) and value > 0


@settings(max_examples=examples(200))  # no kernel runs: many examples cost little
@given(field=st.sampled_from(list(HF_NAMES)), value=FLOAT_VALUES)
def test_float_fields_finite_and_positive(field, value):
    base = WideMoEConfig.tiny()
    if in_domain(value):
        assert getattr(base.replace(**{field: value}), field) == value
    else:
        with pytest.raises(ValueError, match=rf"^WideMoEConfig\.{field} must be a finite "
                                             rf"number > 0, got"):
            base.replace(**{field: value})
    # The same value in a config.json (Python's json writes NaN and Infinity, and reads
    # them back).
    name = HF_NAMES[field]
    text = json.loads(json.dumps({"text_config": {**kimi_k3_text_config(), name: value}}))
    if in_domain(value):
        assert getattr(WideMoEConfig.from_hf_config(text), field) == value
    else:
        with pytest.raises(ValueError, match=rf"^config field {name} = .*must be a finite "
                                             rf"number > 0"):
            WideMoEConfig.from_hf_config(text)


@pytest.mark.parametrize("field", list(HF_NAMES))
@pytest.mark.parametrize("value", ["4.0", True, None, [1.0]])
def test_float_fields_refuse_what_is_not_a_number(field, value):
    if value is None and field == "linear_beta":  # no clamp of the up input
        assert WideMoEConfig.tiny().replace(linear_beta=None).linear_beta is None
        return
    with pytest.raises(TypeError, match=rf"^WideMoEConfig\.{field} must be a number"):
        WideMoEConfig.tiny().replace(**{field: value})
    name = HF_NAMES[field]
    with pytest.raises(ValueError, match=rf"^config field {name} = .*expected int or float"):
        WideMoEConfig.from_hf_config({**kimi_k3_text_config(), name: value})


@pytest.mark.parametrize("text, why", [("{'hidden_size': 7168,", "not JSON"),
                                       ("[1, 2]", "holds a JSON list"),
                                       ("\xff\xfe", "not JSON")])
def test_config_file_that_is_not_a_json_object_named(tmp_path, text, why):
    path = tmp_path / "config.json"
    path.write_bytes(text.encode("latin-1"))
    with pytest.raises(ValueError, match=f"^{path}: {why}"):
        WideMoEConfig.from_hf_config(tmp_path)
