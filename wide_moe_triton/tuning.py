"""Per-GPU, per-batch-width launch configs for every kernel.

Each kernel file declares a ``DEFAULT`` config (block sizes, ``num_warps``,
``num_stages``, …) and a ``SPACE`` of candidates, and asks ``config_for`` at launch. A
GPU's table is ``<GPU name>.json`` (spaces replaced by ``_``), looked up by name
(``find_table``) first in the user's directory (``user_dir``: ``$WIDE_MOE_CONFIG_DIR``,
else ``$XDG_CACHE_HOME/wide_moe_triton``, else ``~/.cache/wide_moe_triton``), where
``python -m wide_moe_triton.tune`` writes, then among the tables the package ships
(``wide_moe_triton/autotune_configs/``, package data read through ``importlib.resources``,
so an installed wheel has them); the first found is the table, whole. Their layout::

    {"gpu": "NVIDIA H200", "triton": "3.6.0", "date": "2026-12-02",
     "kernels": {KERNEL: {SHAPE: {BUCKET: {config}}}}}

SHAPE is the kernel's own key of the dims that change its best config (e.g.
``"L3584_I384"``); BUCKET a batch width: a call of ``rows`` rows takes the smallest
bucket >= rows (the largest if none is). A missing GPU file, kernel, shape or bucket
falls back to the kernel's default with one warning per (kernel, shape); a malformed file
is an error naming the file and the field.

A table is read once per process, and ``WideMoE`` resolves each launch of a batch width
once (its ``LaunchPlan``): changing the file on disk after start-up is not supported (a
new process reads it).
"""

from __future__ import annotations

import functools
import importlib.resources
import json
import os
import pathlib
import warnings

# The tables the package ships (a Traversable: a directory of the installed package).
SHIPPED = importlib.resources.files(__package__) / "autotune_configs"

_warned: set = set()
_overrides: dict = {}


def gpu_name(device=None) -> str | None:
    """The CUDA device's marketing name (nvidia-ml-py first, then torch), or None on CPU
    (and in Triton's interpreter)."""
    import torch

    if os.environ.get("TRITON_INTERPRET") == "1" or not torch.cuda.is_available():
        return None
    if device is not None and torch.device(device).type != "cuda":
        return None
    index = torch.device(device).index if device is not None else None
    return _device_name(torch.cuda.current_device() if index is None else index)


@functools.lru_cache(maxsize=None)
def _device_name(index: int) -> str:
    # Cached: launch wrappers ask on every call, and NVML costs microseconds a query.
    import torch

    try:
        import pynvml

        pynvml.nvmlInit()
        name = pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(index))
        return name.decode() if isinstance(name, bytes) else name
    except Exception:  # NVML absent or not permitted: torch knows the name too
        return torch.cuda.get_device_name(index)


def user_dir() -> pathlib.Path:
    """Where a user's own tables go and are searched first: ``$WIDE_MOE_CONFIG_DIR``,
    else ``$XDG_CACHE_HOME/wide_moe_triton``, else ``~/.cache/wide_moe_triton``."""
    given = os.environ.get("WIDE_MOE_CONFIG_DIR")
    if given:
        return pathlib.Path(given)
    cache = os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache"
    return pathlib.Path(cache) / "wide_moe_triton"


def table_file(name: str) -> str:
    """The file name of GPU ``name``'s table."""
    return name.replace(" ", "_").replace("/", "_") + ".json"


def table_path(name: str) -> pathlib.Path:
    """Where the tuner writes GPU ``name``'s table: in ``user_dir()``."""
    return user_dir() / table_file(name)


def find_table(name: str):
    """GPU ``name``'s table file: the user's (``table_path``) if there is one, else the
    shipped one, else None (a path, or the package's Traversable)."""
    for path in (table_path(name), SHIPPED / table_file(name)):
        if path.is_file():
            return path
    return None


def _check_table(path: pathlib.Path, table) -> dict:
    def bad(field, why):
        raise ValueError(f"{path}: field {field!r} {why}")

    if not isinstance(table, dict):
        bad("<root>", "must be an object")
    for field in ("gpu", "triton", "date"):
        if not isinstance(table.get(field), str):
            bad(field, "must be a string")
    kernels = table.get("kernels")
    if not isinstance(kernels, dict):
        bad("kernels", "must be an object")
    for kernel, shapes in kernels.items():
        if not isinstance(shapes, dict):
            bad(f"kernels.{kernel}", "must be an object of shapes")
        for shape, buckets in shapes.items():
            if not isinstance(buckets, dict):
                bad(f"kernels.{kernel}.{shape}", "must be an object of buckets")
            for bucket, config in buckets.items():
                where = f"kernels.{kernel}.{shape}.{bucket}"
                if not bucket.isdigit():
                    bad(where, "bucket must be a batch width (digits)")
                if not isinstance(config, dict) or not all(
                        isinstance(v, int) and not isinstance(v, bool) for v in config.values()):
                    bad(where, "must be an object of integer launch parameters")
    return table


@functools.lru_cache(maxsize=None)
def load_table(name: str | None) -> dict | None:
    """The parsed table of GPU ``name`` (``find_table``'s), or None when there is none."""
    if name is None:
        return None
    path = find_table(name)
    if path is None:
        return None
    try:
        table = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not valid JSON ({err})") from None
    return _check_table(path, table)


def bucket_for(rows: int, buckets) -> str:
    widths = sorted(int(b) for b in buckets)
    return str(next((w for w in widths if w >= rows), widths[-1]))


def config_for(kernel: str, shape: str, rows: int, default: dict, device=None,
               given: dict | None = None) -> dict:
    """The launch config of ``kernel`` at dims key ``shape`` for a batch of ``rows``:
    ``given`` (a caller's config, keys it leaves out from ``default``) when not None,
    else the tuned table's entry over ``default``."""
    if given is not None:
        return {**default, **given}
    forced = _overrides.get(kernel)
    if forced is not None:
        return dict(forced)
    name = gpu_name(device)
    table = load_table(name)
    found = (table or {}).get("kernels", {}).get(kernel, {}).get(shape)
    if found:
        config = dict(default)
        config.update(found[bucket_for(rows, found)])
        return config
    if name is not None and (kernel, shape) not in _warned:
        _warned.add((kernel, shape))
        where = (f"no {table_file(name)} in {user_dir()} or the shipped tables"
                 if table is None else f"{find_table(name)} has no [{kernel}][{shape}]")
        warnings.warn(f"wide_moe_triton: no tuned config for {kernel} at {shape} on {name} "
                      f"({where}); using the default {default}. Run "
                      f"`wide-moe-tune` on this GPU.", stacklevel=3)
    return dict(default)


class override:
    """Context manager forcing one kernel's config (what the tuner uses to time each
    candidate through the real launch wrapper)."""

    def __init__(self, kernel: str, config: dict):
        self.kernel, self.config = kernel, config

    def __enter__(self):
        self.saved = _overrides.get(self.kernel)
        _overrides[self.kernel] = dict(self.config)

    def __exit__(self, *exc):
        if self.saved is None:
            _overrides.pop(self.kernel, None)
        else:
            _overrides[self.kernel] = self.saved
