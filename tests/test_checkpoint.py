"""One MoE layer of a Kimi-K3 checkpoint: loaded per rank (each rank's slices exactly),
written and read back bit for bit, run through WideMoE, and refused where broken.

The fixtures are written here straight from the checkpoint's naming (DESIGN.md,
"Checkpoint") with safetensors, not through ``save_layer``, so a naming mistake the
loader and the writer shared would still show."""

import json
import re

import pytest
import torch
from hypothesis import given, settings, strategies as st
from safetensors.torch import save_file

from conftest import DEVICE
from test_module import assert_close_to_stock, plan_flips
from wide_moe_triton import LatentMoE, SimulatedGroup, WideMoE, WideMoEConfig
from wide_moe_triton import __main__ as cli
from wide_moe_triton import checkpoint, reference, sharding
from wide_moe_triton.checkpoint import CheckpointError

# Smaller than tiny (the interpreter's cost), yet T = 4 still splits every dim into
# whole MX blocks and every stage of the layer runs.
CFG = WideMoEConfig.tiny().replace(hidden=128, latent=128, num_experts=8, top_k=2)
LAYER = 3
PREFIX = "language_model.model.layers."


def text_config(cfg=CFG):
    return {"hidden_size": cfg.hidden, "routed_expert_hidden_size": cfg.latent,
            "num_experts": cfg.num_experts, "num_experts_per_token": cfg.top_k,
            "moe_intermediate_size": cfg.expert_intermediate,
            "num_shared_experts": cfg.shared_intermediate // cfg.expert_intermediate,
            "routed_scaling_factor": cfg.routed_scaling_factor,
            "moe_renormalize": cfg.renormalize, "moe_router_activation_func": "sigmoid",
            "use_grouped_topk": True, "num_expert_group": 1, "topk_group": 1,
            "hidden_act": "situ", "activation_situ_beta": cfg.beta,
            "activation_situ_linear_beta": cfg.linear_beta, "rms_norm_eps": cfg.rms_eps,
            "latent_moe_use_norm": True, "first_k_dense_replace": 1, "moe_layer_freq": 1}


def raw_layer(seed, cfg=CFG):
    """The layer's tensors by their names under ``mlp.``: BF16 dense weights near unit
    activations, random E2M1 bytes (every code, both nibbles) with E8M0 scales 2^-7..2^-5
    (elements of RMS 0.02-0.09, near the 1/sqrt(128) of a unit-preserving linear)."""
    g = torch.Generator().manual_seed(seed)
    H, L, E, I, S = (cfg.hidden, cfg.latent, cfg.num_experts, cfg.expert_intermediate,
                     cfg.shared_intermediate)

    def bf16(*shape, std, mean=0.0):
        return (torch.randn(*shape, generator=g) * std + mean).bfloat16()

    def codes(*shape):
        return torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)

    def scales(*shape):
        return torch.randint(120, 123, shape, generator=g, dtype=torch.uint8)

    t = {"gate.weight": bf16(E, H, std=H ** -0.5),
         "gate.e_score_correction_bias": torch.randn(E, generator=g) * 0.05,
         "shared_experts.gate_proj.weight": bf16(S, H, std=H ** -0.5),
         "shared_experts.up_proj.weight": bf16(S, H, std=H ** -0.5),
         "shared_experts.down_proj.weight": bf16(H, S, std=S ** -0.5),
         "routed_expert_down_proj.weight": bf16(L, H, std=H ** -0.5),
         "routed_expert_norm.weight": bf16(L, std=0.1, mean=1.0),
         "routed_expert_up_proj.weight": bf16(H, L, std=L ** -0.5)}
    for j in range(E):
        for w in ("w1", "w3"):
            t[f"experts.{j}.{w}.weight_packed"] = codes(I, L // 2)
            t[f"experts.{j}.{w}.weight_scale"] = scales(I, L // 32)
        t[f"experts.{j}.w2.weight_packed"] = codes(L, I // 2)
        t[f"experts.{j}.w2.weight_scale"] = scales(L, I // 32)
    return t


def write_checkpoint(path, layer_tensors, config=None, layer=LAYER):
    """A two-file checkpoint with its index: the layer's tensors (the experts in the
    second file), a dense layer 0 and the layer's own norm and attention weights."""
    H = CFG.hidden
    first = {f"{PREFIX}0.mlp.gate_proj.weight": torch.zeros(64, H).bfloat16(),
             f"{PREFIX}{layer}.self_attn.o_proj.weight": torch.zeros(H, 64).bfloat16(),
             f"{PREFIX}{layer}.post_attention_layernorm.weight": torch.ones(H).bfloat16(),
             "language_model.lm_head.weight": torch.zeros(8, H).bfloat16()}
    second = {}
    for name, t in layer_tensors.items():
        (second if name.startswith("experts.") else first)[f"{PREFIX}{layer}.mlp.{name}"] = t
    weight_map = {}
    for file, tensors in (("model-00001-of-00002.safetensors", first),
                          ("model-00002-of-00002.safetensors", second)):
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / file))
        weight_map.update(dict.fromkeys(tensors, file))
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map}))
    (path / "config.json").write_text(json.dumps(
        {"model_type": "kimi_k3", "text_config": config or text_config()}))
    return path


def rank_slice(name, t, rank, world):
    """Rank ``rank`` of ``world``'s slice of checkpoint tensor ``name`` (DESIGN.md): rows
    of the router, the latent-down, the latent-up (output columns), w1/w3 and the shared
    gate/up; columns of w2 and the shared down; the bias and the norm whole."""
    if name in ("gate.e_score_correction_bias", "routed_expert_norm.weight"):
        return t
    dim = 1 if name.endswith(("w2.weight_packed", "w2.weight_scale", "down_proj.weight")) \
        and name != "routed_expert_down_proj.weight" else 0
    n = t.shape[dim] // world
    return t.narrow(dim, rank * n, n)


def bits(t):
    return t.contiguous().view(torch.uint8)


def assert_same_bits(a, b, what):
    assert a.dtype == b.dtype and a.shape == b.shape, (what, a.dtype, b.dtype, a.shape, b.shape)
    assert torch.equal(bits(a.cpu()), bits(b.cpu())), what


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("ckpt"), raw_layer(seed=7))


@given(world=st.sampled_from([1, 2, 4]), seed=st.integers(0, 2 ** 16))
@settings(max_examples=4)
def test_each_rank_holds_its_slices(tmp_path_factory, world, seed):
    raw = raw_layer(seed)
    path = write_checkpoint(tmp_path_factory.mktemp("ckpt"), raw)
    whole = checkpoint.load_layer(path, LAYER)
    # The whole layer in the stock layouts: w13[j] is w1 then w3, shared gate then up.
    assert_same_bits(whole.w13, torch.stack([torch.cat([raw[f"experts.{j}.w1.weight_packed"],
                                                        raw[f"experts.{j}.w3.weight_packed"]])
                                             for j in range(CFG.num_experts)]), "w13")
    assert_same_bits(whole.w2_scales, torch.stack([raw[f"experts.{j}.w2.weight_scale"]
                                                   for j in range(CFG.num_experts)]), "w2s")
    assert_same_bits(whole.shared_gate_up, torch.cat([raw["shared_experts.gate_proj.weight"],
                                                      raw["shared_experts.up_proj.weight"]]),
                     "shared_gate_up")
    assert_same_bits(whole.latent_up, raw["routed_expert_up_proj.weight"], "latent_up")
    for r in range(world):
        part = checkpoint.load_layer(path, LAYER, tp=world, rank=r)
        assert (part.rank, part.world, part.cfg) == (r, world, CFG.replace(tp=world, wide_rows=1024))
        state = part.state_dict()
        assert list(state) == list(raw)
        for name, t in raw.items():
            assert_same_bits(state[name], rank_slice(name, t, r, world), name)
        # ... and equals the T = 1 module's slice as WideMoE cuts it.
        cut = sharding.shard(whole, r, world)
        held = sharding.shard(part, r, world)
        for field in ("gate_weight", "latent_down", "bias", "w13", "w13_scales", "w2",
                      "w2_scales", "norm_weight", "latent_up", "shared_gate_up", "shared_down"):
            assert_same_bits(getattr(held, field), getattr(cut, field), field)
        if world > 1:
            with pytest.raises(ValueError, match=f"rank {r} of {world}'s shard"):
                part(torch.zeros(1, CFG.hidden).bfloat16())


@pytest.mark.parametrize("world", [1, 2, 4])
@given(b=st.integers(1, 12), seed=st.integers(0, 2 ** 16))
@settings(max_examples=1)
def test_wide_over_loaded_ranks_equals_stock(ckpt, world, b, seed):
    stock = checkpoint.load_layer(ckpt, LAYER, device=DEVICE)
    if world == 1:
        wide = WideMoE.from_checkpoint(ckpt, LAYER, device=DEVICE)
        scratch = wide.scratch
    else:
        group = SimulatedGroup([checkpoint.load_layer(ckpt, LAYER, tp=world, rank=r,
                                                      device=DEVICE) for r in range(world)])
        wide = lambda x: group(x)[0]  # noqa: E731
        scratch = group.ranks[0].scratch
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    x = checkpoint.layer_inputs(ckpt, LAYER, b, generator=g, device=DEVICE)
    assert_close_to_stock(wide(x), stock(x), plan_flips(stock, x, scratch))


@given(shards=st.integers(1, 4), seed=st.integers(0, 2 ** 16),
       experts=st.sampled_from([4, 8]), linear_beta=st.sampled_from([None, 25.0]))
@settings(max_examples=4)
def test_save_load_round_trip(tmp_path_factory, shards, seed, experts, linear_beta):
    cfg = CFG.replace(num_experts=experts, top_k=2, linear_beta=linear_beta)
    module = LatentMoE(cfg, seed=seed)
    path = tmp_path_factory.mktemp("saved")
    files = checkpoint.save_layer(module, path, LAYER, shards=shards)
    assert len(files) == 1 if shards == 1 else 1 < len(files) <= shards
    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(index) == {f"{PREFIX}{LAYER}.mlp.{k}" for k in module.state_dict()}
    loaded = checkpoint.load_layer(path, LAYER, wide_rows=cfg.wide_rows)
    assert loaded.cfg == cfg
    for (name, a), (name_b, b) in zip(module.state_dict().items(),
                                      loaded.state_dict().items()):
        assert name == name_b
        assert_same_bits(b, a, name)
    part = checkpoint.load_layer(path, LAYER, tp=2, rank=1)
    for name, t in part.state_dict().items():
        assert_same_bits(t, rank_slice(name, module.state_dict()[name], 1, 2), name)


def test_state_dict_speaks_checkpoint_names():
    module = LatentMoE(CFG, seed=1)
    raw = raw_layer(seed=2)
    state = module.state_dict()
    assert list(state) == list(raw)
    for name, t in raw.items():
        assert (state[name].dtype, state[name].shape) == (t.dtype, t.shape), name
    module.load_state_dict(raw)
    for name, t in raw.items():
        assert_same_bits(module.state_dict()[name], t, name)
    # A refused state dict leaves every buffer as it was.
    before = {k: v.clone() for k, v in module.state_dict().items()}
    other = raw_layer(seed=3)
    other["experts.1.w2.weight_scale"] = other["experts.1.w2.weight_scale"][:, :-1]
    with pytest.raises(RuntimeError, match=r"experts\.1\.w2\.weight_scale"):
        module.load_state_dict(other)
    del other["experts.1.w2.weight_scale"]
    with pytest.raises(RuntimeError, match=r"experts\.1\.w2\.weight_scale"):
        module.load_state_dict(other)
    for name, t in before.items():
        assert_same_bits(module.state_dict()[name], t, name)


def _drop(name):
    def edit(raw, config):
        del raw[name]
    return edit


def _reshape(name, shape):
    def edit(raw, config):
        raw[name] = torch.zeros(shape, dtype=raw[name].dtype)
    return edit


def _retype(name, dtype):
    def edit(raw, config):
        raw[name] = raw[name].to(dtype)
    return edit


def _nan_scale(name, at):
    def edit(raw, config):
        raw[name][at] = 0xFF
    return edit


def _config(**fields):
    def edit(raw, config):
        config.update(fields)
    return edit


H, L, I = CFG.hidden, CFG.latent, CFG.expert_intermediate
BROKEN = {
    "missing tensor": (_drop("experts.5.w3.weight_scale"), {},
                       r"missing tensor .*3\.mlp\.experts\.5\.w3\.weight_scale"),
    "missing layer": (_drop("gate.weight"), {"layer": 4}, r"no MoE layer 4 .*MoE layers are 3"),
    "dense layer": (_drop("gate.weight"), {"layer": 0}, r"no MoE layer 0"),
    "shape": (_reshape("routed_expert_up_proj.weight", (H, L - 32)), {},
              rf"routed_expert_up_proj\.weight: shape \[{H}, {L - 32}\], expected "
              rf"\[{H}, {L}\]"),
    "dtype": (_retype("gate.e_score_correction_bias", torch.bfloat16), {},
              r"gate\.e_score_correction_bias: dtype torch\.bfloat16, expected torch\.float32"),
    "packed dtype": (_retype("experts.0.w1.weight_packed", torch.int8), {},
                     r"experts\.0\.w1\.weight_packed: dtype torch\.int8"),
    "scale count": (_reshape("experts.2.w2.weight_scale", (L, I // 32 - 1)), {},
                    rf"experts\.2\.w2\.weight_scale: \[{L}, 3\] scales for weight_packed "
                    rf"\[{L}, 64\]"),
    "config disagrees": (_config(hidden_size=512), {},
                         rf"gate\.weight: shape \[8, {H}\], expected \[8, 512\]"),
    "I/T": (lambda raw, config: None, {"tp": 8},
            r"experts\.0\.w2\.weight_packed: I = 128 .* over tp = 8 is 16 a rank, not a "
            r"multiple of 32"),
    "NaN scale, w1 rows": (_nan_scale("experts.3.w1.weight_scale", (70, 2)),
                           {"tp": 2, "rank": 1},
                           r"experts\.3\.w1\.weight_scale: E8M0 scale byte 0xFF \(NaN\) at "
                           r"\[70, 2\]"),
    "NaN scale, w2 columns": (_nan_scale("experts.7.w2.weight_scale", (100, 3)),
                              {"tp": 2, "rank": 1},
                              r"experts\.7\.w2\.weight_scale: E8M0 scale byte 0xFF \(NaN\) "
                              r"at \[100, 3\]"),
    "softmax router": (_config(moe_router_activation_func="softmax"), {},
                       r"moe_router_activation_func = 'softmax'"),
}


@pytest.mark.parametrize("case", list(BROKEN))
def test_broken_checkpoint_named(tmp_path, case):
    edit, load_args, message = BROKEN[case]
    raw, config = raw_layer(seed=5), text_config()
    edit(raw, config)
    path = write_checkpoint(tmp_path, raw, config)
    load_args = {"layer": LAYER, **load_args}
    with pytest.raises(ValueError, match=message):
        checkpoint.load_layer(path, load_args.pop("layer"), **load_args)


def test_nan_scale_of_another_rank_is_not_read(tmp_path):
    raw = raw_layer(seed=5)
    raw["experts.3.w1.weight_scale"][70, 2] = 0xFF
    path = write_checkpoint(tmp_path, raw)
    part = checkpoint.load_layer(path, LAYER, tp=2, rank=0)  # rows 0-63 only
    assert not (part.w13_scales == 0xFF).any()


def test_index_naming_an_absent_file(tmp_path):
    path = write_checkpoint(tmp_path, raw_layer(seed=5))
    (path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model-00002-of-00002.safetensors"):
        checkpoint.load_layer(path, LAYER)


# Files at fault, each named: (edit of a written checkpoint directory, the file's name
# in it, what the message says). The first shard holds the layer's dense weights and the
# norm before it, which every entry point reads.
SHARD = "model-00001-of-00002.safetensors"


def _remove(name):
    return lambda path: (path / name).unlink()


def _write(name, text):
    return lambda path: (path / name).write_bytes(text)


def _truncate(name, cut):
    def edit(path):
        data = (path / name).read_bytes()
        (path / name).write_bytes(data[:len(data) - cut] if cut else data[:5])
    return edit


def _index_to(file):
    def edit(path):
        index = json.loads((path / checkpoint.INDEX).read_text())
        index["weight_map"] = {k: file for k in index["weight_map"]}
        (path / checkpoint.INDEX).write_text(json.dumps(index))
    return edit


def _config_field(name, value):
    def edit(path):
        config = json.loads((path / "config.json").read_text())
        config["text_config"][name] = value
        (path / "config.json").write_text(json.dumps(config))
    return edit


BROKEN_FILES = {
    "no config.json": (_remove("config.json"), "config.json", "missing"),
    "config.json not JSON": (_write("config.json", b'{"text_config": {'), "config.json",
                             "not JSON"),
    "config.json a list": (_write("config.json", b"[]"), "config.json", "JSON list"),
    "config.json NaN eps": (_config_field("rms_norm_eps", float("nan")), "config.json",
                            "rms_norm_eps = nan: must be a finite number > 0"),
    "index not JSON": (_write(checkpoint.INDEX, b"weight_map"), checkpoint.INDEX,
                       "not readable as JSON"),
    "index without a map": (_write(checkpoint.INDEX, b'{"metadata": {}}'), checkpoint.INDEX,
                            "weight_map"),
    "index naming a missing shard": (_index_to("model-00009.safetensors"),
                                     "model-00009.safetensors", "missing"),
    "truncated shard": (_truncate(SHARD, 100), SHARD, "not a readable safetensors file"),
    "shard cut in its header": (_truncate(SHARD, 0), SHARD, "not a readable safetensors"),
    "shard not safetensors": (_write(SHARD, b"PK\x03\x04 a zip, say" * 8), SHARD,
                              "not a readable safetensors file"),
}
ENTRY_POINTS = {"load_layer": lambda path: checkpoint.load_layer(path, LAYER),
                "layer_inputs": lambda path: checkpoint.layer_inputs(
                    path, LAYER, 2, generator=torch.Generator().manual_seed(0))}


@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
@pytest.mark.parametrize("case", list(BROKEN_FILES))
def test_broken_file_named(tmp_path, case, entry):
    edit, name, message = BROKEN_FILES[case]
    path = write_checkpoint(tmp_path, raw_layer(seed=5))
    edit(path)
    with pytest.raises(CheckpointError, match=re.escape(f"{path / name}") + ".*" +
                       re.escape(message)):
        ENTRY_POINTS[entry](path)


@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
def test_no_directory_named(tmp_path, entry):
    with pytest.raises(CheckpointError, match=f"^{tmp_path / 'none'}: no such directory"):
        ENTRY_POINTS[entry](tmp_path / "none")
    (tmp_path / "file").write_text("{}")
    with pytest.raises(CheckpointError, match=f"^{tmp_path / 'file'}: not a directory"):
        ENTRY_POINTS[entry](tmp_path / "file")
    with pytest.raises(CheckpointError, match=f"^{tmp_path / 'config.json'}: missing"):
        ENTRY_POINTS[entry](tmp_path)  # an existing directory without a checkpoint


def test_shard_without_an_index_named(tmp_path):
    """Without an index every *.safetensors file is read for its names: one that is not
    safetensors is named."""
    path = write_checkpoint(tmp_path, raw_layer(seed=5))
    (path / checkpoint.INDEX).unlink()
    (path / "zz.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(CheckpointError, match=re.escape(f"{path / 'zz.safetensors'}: not a "
                                                        f"readable safetensors file")):
        checkpoint.weight_map(path)


def test_several_moe_prefixes_need_one_named(tmp_path):
    raw = raw_layer(seed=5)
    path = write_checkpoint(tmp_path, raw)
    extra = {f"mtp.layers.{LAYER}.mlp.{k}": v.contiguous() for k, v in raw.items()}
    save_file(extra, str(path / "mtp.safetensors"))
    index = json.loads((path / "model.safetensors.index.json").read_text())
    index["weight_map"].update(dict.fromkeys(extra, "mtp.safetensors"))
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="several prefixes"):
        checkpoint.load_layer(path, LAYER)
    part = checkpoint.load_layer(path, LAYER, prefix="mtp.layers.")
    assert_same_bits(part.gate_weight, raw["gate.weight"], "gate.weight")


def test_save_layer_refuses_a_shard(tmp_path, ckpt):
    part = checkpoint.load_layer(ckpt, LAYER, tp=2, rank=0)
    with pytest.raises(ValueError, match="rank 0 of 2's shard"):
        checkpoint.save_layer(part, tmp_path, LAYER)


def test_main_command_on_a_checkpoint(ckpt, capsys):
    assert cli.main(["--checkpoint", str(ckpt), "--layer", str(LAYER), "--batches", "3"]) == 0
    out = capsys.readouterr().out
    assert "OK: WideMoE matches the stock path" in out
    # The routing load of those 3 tokens, as the stock router picks them.
    stock = checkpoint.load_layer(ckpt, LAYER)
    g = torch.Generator(device=DEVICE).manual_seed(1)
    x = checkpoint.layer_inputs(ckpt, LAYER, 3, generator=g, device=DEVICE)
    ids, _ = reference.route(reference.mm_f32(x.cpu(), stock.gate_weight),
                             stock.e_score_correction_bias, CFG.top_k, True,
                             CFG.routed_scaling_factor)
    touched = len(torch.unique(ids))
    assert f"experts touched {touched} of {CFG.num_experts}" in out


def test_shards_go_to_their_own_ranks(ckpt):
    parts = [checkpoint.load_layer(ckpt, LAYER, tp=2, rank=r, device=DEVICE) for r in range(2)]
    with pytest.raises(ValueError, match="holds rank 1 of 2's shard, not rank 0 of 2's"):
        SimulatedGroup(parts[::-1])
    with pytest.raises(ValueError, match="holds rank 0 of 2's shard, not rank 0 of 1's"):
        WideMoE.from_module(parts[0])
    with pytest.raises(ValueError, match="world = 3 for 2"):
        SimulatedGroup(parts, 3)
    whole = checkpoint.load_layer(ckpt, LAYER, device=DEVICE)
    mixed = SimulatedGroup([parts[0], whole])  # rank 1 cut from the whole layer
    assert torch.equal(mixed.ranks[1].shared_down, parts[1].shared_down)
