"""One MoE layer of a Kimi-K3 checkpoint, in the format vLLM reads it (DESIGN.md,
"Checkpoint"): ``*.safetensors`` shards with a ``model.safetensors.index.json`` weight
map, the layer's tensors under ``<prefix>N.mlp.`` (the prefix found, not assumed).

    stock = load_layer("ckpt", 5, tp=8, rank=3)   # LatentMoE holding rank 3's slices
    save_layer(stock_whole, "out", 5, shards=2)    # the same format, e.g. for fixtures

Each rank reads only its own slices, and host memory stays near that rank's bytes: a file
is closed again after every ``MAPPED_BYTES`` of it read (a safetensors slice is a view
of the file's mapping; its pages count as resident until the file is closed, and a
column slice touches every row of its tensor).

Every tensor's presence, dtype and shape are checked against the config before anything
is read; an E8M0 scale byte 0xFF (NaN) is refused as it is read. Errors are
``CheckpointError`` (a ValueError) naming the tensor, or the file where the file itself
is at fault (no directory, no ``config.json`` or one that is not JSON, an index or a
shard that is missing, truncated or not safetensors); nothing half-loaded is returned.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from . import layout
from .config import MX_BLOCK, WideMoEConfig, hf_text_config
from .mx import SCALE_NAN
from .reference import LatentMoE

INDEX = "model.safetensors.index.json"
CONFIG = "config.json"
DEFAULT_PREFIX = "language_model.model.layers."
MAPPED_BYTES = 16 << 20
# A tensor only latent-MoE layers have: where it is found, the layer is one of ours.
_MARKER = re.compile(r"^(.*?)(\d+)\.mlp\.routed_expert_norm\.weight$")
_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32,
           "F64": torch.float64, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16,
           "I32": torch.int32, "I64": torch.int64, "BOOL": torch.bool,
           "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


class CheckpointError(ValueError):
    """A checkpoint that does not hold the layer the config describes."""


def weight_map(path) -> dict[str, str]:
    """Tensor name -> shard file name: the index's map, or, without an index, the names
    in every ``*.safetensors`` file of ``path``."""
    path = checkpoint_dir(path)
    index = os.path.join(path, INDEX)
    if os.path.exists(index):
        return _index_map(index)
    files = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
    if not files:
        raise CheckpointError(f"{path}: neither {INDEX} nor *.safetensors files")
    names = {}
    for name in files:
        with _open(path, name) as f:
            names.update(dict.fromkeys(f.keys(), name))
    return names


def checkpoint_dir(path) -> str:
    """``path`` as a string, if it is a directory; else CheckpointError naming it."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise CheckpointError(f"{path}: no such directory")
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: not a directory (a checkpoint is a directory of "
                              f"{CONFIG} and *.safetensors shards)")
    return path


def read_config(path, wide_rows: int = 1024) -> WideMoEConfig:
    """The layer's config from the checkpoint directory ``path``'s ``config.json`` (the
    whole layer, tp = 1); CheckpointError naming the file where it is missing, not JSON
    or describes a layer this package cannot serve."""
    file = os.path.join(checkpoint_dir(path), CONFIG)
    if not os.path.isfile(file):
        raise CheckpointError(f"{file}: missing (a checkpoint directory holds the model's "
                              f"{CONFIG} beside its *.safetensors shards)")
    try:
        fields = hf_text_config(file)
    except (OSError, ValueError) as err:  # their messages name the file
        raise CheckpointError(str(err)) from None
    try:
        return WideMoEConfig.from_hf_config(fields, tp=1, wide_rows=wide_rows)
    except (TypeError, ValueError) as err:
        raise CheckpointError(f"{file}: {err}") from None


def _index_map(index: str) -> dict[str, str]:
    """The index file's weight map; CheckpointError naming it where it is not JSON or
    holds no map of tensor names to file names."""
    try:
        with open(index, "rb") as f:
            data = json.loads(f.read())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{index}: not readable as JSON ({err})") from None
    weights = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weights, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weights.items()):
        raise CheckpointError(f"{index}: \"weight_map\" must map tensor names to file "
                              f"names")
    return dict(weights)


def _open(path: str, file: str):
    """``safe_open`` of shard ``file`` of ``path``; CheckpointError naming the file where
    it is missing, cannot be read or is not safetensors (truncated, another format)."""
    full = os.path.join(path, file)
    if not os.path.exists(full):
        raise CheckpointError(f"{full}: missing (the checkpoint's {INDEX} names it)")
    try:
        return safe_open(full, "pt")
    except (SafetensorError, OSError) as err:
        raise CheckpointError(f"{full}: not a readable safetensors file ({err})") from None


def moe_layers(names, prefix: str | None = None) -> dict[str, list[int]]:
    """Prefix (the part of a name before the layer number) -> the latent-MoE layers
    found under it, of tensor names ``names``."""
    found: dict[str, list[int]] = {}
    for name in names:
        m = _MARKER.match(name)
        if m and (prefix is None or m.group(1) == prefix):
            found.setdefault(m.group(1), []).append(int(m.group(2)))
    return {p: sorted(layers) for p, layers in found.items()}


def layer_prefix(path, names, layer: int, prefix: str | None = None) -> str:
    """The name prefix of MoE layer ``layer``'s tensors (``<prefix><layer>.mlp.``)."""
    found = moe_layers(names, prefix)
    if not found:
        where = f" under prefix {prefix!r}" if prefix is not None else ""
        raise CheckpointError(f"{path}: no latent-MoE layer{where} (no tensor named "
                              f"'<prefix>N.mlp.routed_expert_norm.weight')")
    if len(found) > 1:
        raise CheckpointError(f"{path}: latent-MoE layers under several prefixes "
                              f"{sorted(found)}: pass prefix= to pick one")
    (prefix, layers), = found.items()
    if layer not in layers:
        raise CheckpointError(
            f"{path}: no MoE layer {layer} (no tensor "
            f"{prefix}{layer}.mlp.routed_expert_norm.weight); its MoE layers are "
            f"{_ranges(layers)}")
    return f"{prefix}{layer}.mlp."


def load_layer(path, layer: int, *, tp: int = 1, rank: int = 0,
               device: str | torch.device = "cpu", wide_rows: int = 1024,
               prefix: str | None = None) -> LatentMoE:
    """The stock ``LatentMoE`` of MoE layer ``layer`` of the checkpoint in ``path``,
    holding rank ``rank`` of ``tp``'s slices on ``device`` (the whole layer at tp = 1):
    its ``state_dict()`` holds exactly that rank's slices under the checkpoint's names.
    Only that rank's slices are read. ``prefix``: the names' part before the layer
    number, where the checkpoint holds latent-MoE layers under several."""
    path = checkpoint_dir(path)
    if not 0 <= rank < tp:
        raise ValueError(f"rank must be in [0, {tp}), got {rank}")
    cfg = read_config(path, wide_rows)
    names = weight_map(path)
    base = layer_prefix(path, names, layer, prefix)
    entries = layout.entries(cfg, 1)
    check_layer(path, names, base, entries)
    cfg = _split(cfg, tp, base)
    world_entries = layout.entries(cfg, tp)
    shapes = layout.buffers(cfg, tp)
    device = torch.device(device)
    bufs = {name: torch.empty(shape, dtype=dtype, device=device)
            for name, (shape, dtype) in shapes.items()}
    for file, pieces in _read_batches(names, base, entries, world_entries, rank, tp):
        with _open(path, file) as f:
            for piece in pieces:
                src = f.get_slice(piece.key)[piece.src]
                if piece.scales:
                    _check_scales(piece, src)
                piece.entry.view(bufs)[piece.dst].copy_(src)
                del src  # the view holds the file's mapping
    return LatentMoE(cfg, weights=bufs, rank=rank, world=tp)


def check_layer(path, names: dict[str, str], base: str, entries) -> None:
    """Raise ``CheckpointError`` naming the first tensor of the layer under ``base`` that
    is missing, or whose dtype or shape is not the config's (``entries``: the whole
    layer's), or whose scale count does not match its packed bytes."""
    meta = _metadata(path, names, [base + e.name for e in entries])
    for e in entries:
        key = base + e.name
        if key not in meta:
            raise CheckpointError(f"{path}: missing tensor {key} (expected {e.dtype} "
                                  f"{list(e.shape)})")
        dtype, shape = meta[key]
        if dtype != e.dtype:
            raise CheckpointError(f"{key}: dtype {dtype}, expected {e.dtype}")
        if e.name.endswith(".weight_scale"):
            packed = meta.get(key.replace(".weight_scale", ".weight_packed"))
            if packed is not None and (len(shape) != 2 or len(packed[1]) != 2 or
                                       list(shape) != [packed[1][0], packed[1][1] * 2 // MX_BLOCK]):
                raise CheckpointError(
                    f"{key}: {list(shape)} scales for weight_packed {list(packed[1])}: one "
                    f"E8M0 byte per {MX_BLOCK // 2} packed bytes ({MX_BLOCK} E2M1 codes) "
                    f"makes [{packed[1][0]}, {packed[1][-1] * 2 // MX_BLOCK}]")
        if tuple(shape) != e.shape:
            raise CheckpointError(f"{key}: shape {list(shape)}, expected {list(e.shape)} "
                                  f"from the config")


def save_layer(module: LatentMoE, path, layer: int, *, shards: int = 1,
               prefix: str = DEFAULT_PREFIX) -> list[str]:
    """Write the whole layer ``module`` as MoE layer ``layer`` of a checkpoint in the
    directory ``path``: ``shards`` safetensors files of about equal size, the index, and
    a ``config.json`` (``text_config``) describing the layer. Returns the files' names."""
    if not module.whole:
        raise ValueError(f"save_layer writes a whole layer; this module holds rank "
                         f"{module.rank} of {module.world}'s shard")
    path = os.fspath(path)
    if os.path.exists(os.path.join(path, INDEX)):
        raise FileExistsError(f"{path} already holds a checkpoint ({INDEX})")
    os.makedirs(path, exist_ok=True)
    tensors = {f"{prefix}{layer}.mlp.{k}": v for k, v in module.state_dict().items()}
    groups = _split_evenly(list(tensors), [t.nbytes for t in tensors.values()], shards)
    files, weight_map = [], {}
    for i, keys in enumerate(groups):
        name = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        save_file({k: tensors[k].contiguous().cpu() for k in keys}, os.path.join(path, name),
                  metadata={"format": "pt"})
        files.append(name)
        weight_map.update(dict.fromkeys(keys, name))
    total = sum(t.nbytes for t in tensors.values())
    with open(os.path.join(path, INDEX), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
    text = module.cfg.hf_config()
    text.update(num_hidden_layers=layer + 1, first_k_dense_replace=0, moe_layer_freq=1)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({"text_config": text}, f, indent=1)
    return files


def layer_inputs(path, layer: int, b: int, *, generator: torch.Generator,
                 device: str | torch.device = "cpu", prefix: str | None = None) -> torch.Tensor:
    """BF16 [b, H] rows at the scale of the layer's input in the model: the MoE's input
    is the post-attention RMSNorm's output, so unit-RMS rows times that norm's weight
    (``<prefix>N.post_attention_layernorm.weight``) where the checkpoint has it, else
    unit-RMS rows."""
    path = checkpoint_dir(path)
    hidden = read_config(path).hidden
    names = weight_map(path)
    base = layer_prefix(path, names, layer, prefix)
    x = torch.randn(b, hidden, generator=generator, device=device)
    x = x * torch.rsqrt(x.square().mean(dim=-1, keepdim=True))
    key = base[:-len("mlp.")] + "post_attention_layernorm.weight"
    if key in names:
        with _open(path, names[key]) as f:
            x = x * f.get_tensor(key).float().to(device)
    return x.to(torch.bfloat16)


# -- reading ---------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _Piece:
    """A run of whole-tensor rows of one rank's slice: ``src`` indexes the checkpoint's
    tensor ``key``, ``dst`` the rank's slice of ``entry``; ``mapped`` bytes of the file
    are touched to read it."""

    key: str
    entry: layout.Entry
    src: tuple[slice, ...]
    dst: tuple[slice, ...]
    mapped: int

    @property
    def scales(self) -> bool:
        return self.entry.name.endswith(".weight_scale")


def _pieces(key: str, whole: layout.Entry, entry: layout.Entry, rank: int, world: int):
    """``entry``'s slice for rank ``rank`` in runs of rows of at most ``MAPPED_BYTES``
    of the file each (a column slice touches its rows whole)."""
    src = entry.rank_slice(rank, world)
    row_bytes = whole.dtype.itemsize * (
        int(torch.Size(whole.shape[1:]).numel()) if len(whole.shape) > 1 else 1)
    if len(whole.shape) == 1:
        yield _Piece(key, entry, src, (slice(None),), row_bytes * (src[0].stop - src[0].start))
        return
    rows = src[0]
    step = max(1, MAPPED_BYTES // row_bytes)
    for a in range(rows.start, rows.stop, step):
        b = min(a + step, rows.stop)
        yield _Piece(key, entry, (slice(a, b),) + src[1:],
                     (slice(a - rows.start, b - rows.start),), row_bytes * (b - a))


def _read_batches(names, base, whole_entries, entries, rank, world):
    """(file, pieces) to read with one opening of the file each, every batch touching at
    most ``MAPPED_BYTES`` of it (or one piece, if larger)."""
    batch, batch_file, mapped = [], None, 0
    for whole, entry in zip(whole_entries, entries):
        key = base + entry.name
        for piece in _pieces(key, whole, entry, rank, world):
            file = names[key]
            if batch and (file != batch_file or mapped + piece.mapped > MAPPED_BYTES):
                yield batch_file, batch
                batch, mapped = [], 0
            batch.append(piece)
            batch_file, mapped = file, mapped + piece.mapped
    if batch:
        yield batch_file, batch


def _check_scales(piece: _Piece, src: torch.Tensor) -> None:
    bad = src == SCALE_NAN
    if bad.any():
        at = [int(i) + s.start for i, s in zip(bad.nonzero()[0], piece.src)]
        raise CheckpointError(f"{piece.key}: E8M0 scale byte 0xFF (NaN) at {at}")


def _metadata(path, names: dict[str, str], keys) -> dict[str, tuple]:
    """Key -> (dtype, shape) of those of ``keys`` the checkpoint holds (read from the
    files' headers, no data)."""
    by_file: dict[str, list[str]] = {}
    for key in keys:
        if key in names:
            by_file.setdefault(names[key], []).append(key)
    meta = {}
    for file, wanted in by_file.items():
        with _open(path, file) as f:
            held = set(f.keys())
            for key in wanted:
                if key in held:
                    s = f.get_slice(key)
                    meta[key] = (_DTYPES.get(s.get_dtype(), s.get_dtype()),
                                 tuple(s.get_shape()))
    return meta


def _split(cfg: WideMoEConfig, tp: int, base: str) -> WideMoEConfig:
    """``cfg`` at tp = ``tp``, refused naming the tensor where a rank's slice of the
    experts is not whole MX blocks."""
    inter = cfg.expert_intermediate
    if inter % (MX_BLOCK * tp):
        raise CheckpointError(
            f"{base}experts.0.w2.weight_packed: I = {inter} (rows of w1/w3, columns of w2) "
            f"over tp = {tp} is {inter / tp:g} a rank, not a multiple of {MX_BLOCK} (one "
            f"E8M0 scale per {MX_BLOCK} codes)")
    try:
        return cfg.replace(tp=tp)
    except ValueError as err:
        raise CheckpointError(f"{base}*: this layer cannot be split over tp = {tp}: "
                              f"{err}") from None


def _split_evenly(keys: list[str], sizes: list[int], parts: int) -> list[list[str]]:
    """``keys`` in order, cut into at most ``parts`` runs of about equal total size."""
    if parts < 1:
        raise ValueError(f"shards must be >= 1, got {parts}")
    total, groups, acc = sum(sizes), [[]], 0
    for key, size in zip(keys, sizes):
        if groups[-1] and acc >= total * len(groups) / parts:
            groups.append([])
        groups[-1].append(key)
        acc += size
    return groups


def _ranges(layers: list[int]) -> str:
    """'1-3, 5' for [1, 2, 3, 5]."""
    runs, start = [], layers[0]
    for a, b in zip(layers, layers[1:] + [None]):
        if b != a + 1:
            runs.append(f"{start}" if start == a else f"{start}-{a}")
            start = b
    return ", ".join(runs)
