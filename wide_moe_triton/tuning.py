"""Per-GPU, per-batch-width launch configs for every kernel.

Each kernel file declares a ``DEFAULT`` config (block sizes, ``num_warps``,
``num_stages``, …) and a ``SPACE`` of candidates, and asks ``config_for`` at launch. A
GPU's table is ``<GPU name>.json`` (spaces and slashes replaced by ``_``: ``table_file``),
looked up by name (``find_table``) first in the user's directory (``user_dir``:
``$WIDE_MOE_CONFIG_DIR``, else ``$XDG_CACHE_HOME/wide_moe_triton``, else
``~/.cache/wide_moe_triton``), where ``python -m wide_moe_triton.tune`` writes, then among
the tables the package ships (``SHIPPED``: the top-level ``autotune_configs/`` of a
checkout, which a wheel and an editable install carry as ``wide_moe_triton/
autotune_configs/``); the first found is the table, whole. A GPU with neither takes the
nearest table of its architecture (``nearest_table`` states the rule), with one warning
naming it. ``$WIDE_MOE_TABLE`` overrides the choice: ``none`` (every kernel's default),
``own`` (the GPU's own table or the defaults, never another GPU's), or a table's path
(that file, whatever the GPU). ``choose_table`` makes the choice; ``python -m
wide_moe_triton.tables`` (``wide-moe tables``) prints it. Their layout::

    {"gpu": "NVIDIA H200", "triton": "3.6.0", "date": "2026-12-02",
     "capability": "9.0", "sm_count": 132, "memory_gb": 141.0,
     "kernels": {KERNEL: {SHAPE: {BUCKET: {config}}}}}

(``capability``, ``sm_count``, ``memory_gb``: the GPU's, ``device_properties``; what a
fallback is chosen by. A table without them is never another GPU's fallback.)

SHAPE is the kernel's own key of the dims that change its best config (e.g.
``"L3584_I384"``); BUCKET a batch width: a call of ``rows`` rows takes the smallest
bucket >= rows (the largest if none is). A missing kernel, shape or bucket falls back to
the kernel's default with one warning per (kernel, shape); a malformed file is an error
naming the file and the field.

A table is read once per process, and ``WideMoE`` resolves each launch of a batch width
once (its ``LaunchPlan``): changing the file on disk after start-up is not supported (a
new process reads it). A default config and a table's entry cost a forward the same:
both are resolved into the plan, and no lookup or warning happens per call.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.resources
import json
import os
import pathlib
import warnings
from typing import NamedTuple

# ``$WIDE_MOE_TABLE``: "none", "own", or a table's path (see the module docstring).
TABLE_ENV = "WIDE_MOE_TABLE"
HEADER_FIELDS = ("capability", "sm_count", "memory_gb")


def shipped_dir():
    """The tables the package ships: the top-level ``autotune_configs/`` of the checkout
    this module runs from (a checkout on the path, or an editable install), else the
    installed package's ``wide_moe_triton/autotune_configs`` (a wheel's files). A path,
    or a Traversable; either has ``/``, ``is_file`` and ``iterdir``."""
    root = pathlib.Path(__file__).resolve().parent.parent
    if (root / "pyproject.toml").is_file() and (root / "autotune_configs").is_dir():
        return root / "autotune_configs"
    return importlib.resources.files(f"{__package__}.autotune_configs")


SHIPPED = shipped_dir()

_warned: set = set()
_overrides: dict = {}


def gpu_name(device=None) -> str | None:
    """The CUDA device's marketing name (nvidia-ml-py first, then torch), or None on CPU
    (and in Triton's interpreter)."""
    index = _cuda_index(device)
    return None if index is None else _device_name(index)


def _cuda_index(device) -> int | None:
    """The index of CUDA device ``device`` (None: the current one), or None on CPU and in
    Triton's interpreter."""
    import torch

    if os.environ.get("TRITON_INTERPRET") == "1" or not torch.cuda.is_available():
        return None
    if device is not None and torch.device(device).type != "cuda":
        return None
    index = torch.device(device).index if device is not None else None
    return torch.cuda.current_device() if index is None else index


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


class GpuInfo(NamedTuple):
    """What a table is chosen by: the GPU's name (its own table's file), and the
    properties a fallback is matched on (None where unknown: no fallback then)."""
    name: str
    capability: str | None = None   # "major.minor", e.g. "9.0" for every Hopper GPU
    sm_count: int | None = None
    memory_gb: float | None = None  # decimal GB (10^9 bytes)


def gpu_info(device=None) -> GpuInfo | None:
    """The CUDA device's ``GpuInfo`` (name as ``gpu_name``, properties from
    ``torch.cuda.get_device_properties``), or None on CPU and in Triton's interpreter."""
    index = _cuda_index(device)
    return None if index is None else _gpu_info(index)


@functools.lru_cache(maxsize=None)
def _gpu_info(index: int) -> GpuInfo:
    # Cached: the tail's launches look their configs up at every call across ranks.
    return GpuInfo(_device_name(index), **dict(_properties(index)))


def device_properties(device=None) -> dict:
    """The fields a table's header holds about the CUDA device (``HEADER_FIELDS``, which
    the tuner writes beside "gpu"): compute capability, SM count, memory in GB; {} on
    CPU and in Triton's interpreter."""
    index = _cuda_index(device)
    return {} if index is None else dict(_properties(index))


@functools.lru_cache(maxsize=None)
def _properties(index: int) -> tuple:
    import torch

    p = torch.cuda.get_device_properties(index)
    return (("capability", f"{p.major}.{p.minor}"), ("sm_count", p.multi_processor_count),
            ("memory_gb", round(p.total_memory / 1e9, 1)))


def is_capability(text: str) -> bool:
    """Whether ``text`` is a compute capability as a table's header holds it: "major.minor"
    in digits (e.g. "9.0")."""
    major, dot, minor = text.partition(".")
    return bool(dot) and major.isdigit() and minor.isdigit()


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
    if "capability" in table and not (isinstance(table["capability"], str) and
                                      is_capability(table["capability"])):
        bad("capability", 'must be a compute capability as a string, e.g. "9.0"')
    for field in ("sm_count", "memory_gb"):
        value = table.get(field)
        if field in table and (isinstance(value, bool) or not isinstance(value, (int, float))
                               or value <= 0):
            bad(field, "must be a positive number")
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
    return None if path is None else read_table(path)


@functools.lru_cache(maxsize=None)
def read_table(path) -> dict:
    """The parsed, checked table in file ``path`` (read once per path)."""
    try:
        table = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not valid JSON ({err})") from None
    return _check_table(path, table)


class TableChoice(NamedTuple):
    """The table a GPU gets: ``source`` is "given" ($WIDE_MOE_TABLE names a file), "user"
    (its own, in ``user_dir``), "shipped" (its own, shipped), "fallback" (another GPU's,
    ``nearest_table``) or "none" (every kernel's default); ``path`` the file (None for
    "none"); ``why`` a phrase for messages."""
    source: str
    path: object
    why: str


def choose_table(gpu: GpuInfo) -> TableChoice:
    """The table GPU ``gpu`` gets, in order: ``$WIDE_MOE_TABLE`` ("none": no table; a
    path: that file), its own (``find_table``: the user's, then the shipped one), then,
    unless ``$WIDE_MOE_TABLE`` is "own", the nearest table of its architecture among the
    user's and the shipped ones (``nearest_table``); else none."""
    forced = os.environ.get(TABLE_ENV, "").strip()
    if forced.lower() == "none":
        return TableChoice("none", None, f"{TABLE_ENV}=none")
    if forced and forced.lower() != "own":
        path = pathlib.Path(forced).expanduser()
        if not path.is_file():
            raise ValueError(f"{TABLE_ENV}={forced}: no such file; give a table's path, "
                             f"'own' or 'none'")
        return TableChoice("given", path, f"{TABLE_ENV}={forced}")
    own = find_table(gpu.name)
    if own is not None:
        source = "user" if own == table_path(gpu.name) else "shipped"
        return TableChoice(source, own, f"{gpu.name}'s own table")
    nearest = None if forced.lower() == "own" else nearest_table(gpu, candidate_tables())
    if nearest is not None:
        return TableChoice("fallback", nearest, _fallback_why(gpu, nearest))
    why = (f"{TABLE_ENV}=own" if forced else "no table of the same compute capability"
           if gpu.capability is not None else "its compute capability unknown")
    return TableChoice("none", None, f"no {table_file(gpu.name)} in {user_dir()} or the "
                                     f"shipped tables, and no fallback ({why})")


def _fallback_why(gpu: GpuInfo, path) -> str:
    head = read_table(path)
    return (f"{gpu.name} has no table of its own; the nearest of compute capability "
            f"{gpu.capability} is {head['gpu']}'s ({head['sm_count']} SMs against "
            f"{gpu.sm_count}, {head['memory_gb']} GB against {gpu.memory_gb})")


def candidate_tables() -> list:
    """Every table a fallback may take (paths, sorted by file name): the user's
    directory's, and the shipped ones whose file name the user's directory does not
    hold."""
    found = {}
    for where in (SHIPPED, user_dir()):
        if where.is_dir():
            found.update({f.name: f for f in where.iterdir()
                          if f.name.endswith(".json") and not f.name.endswith(".partial.json")
                          and f.is_file()})
    return [found[n] for n in sorted(found)]


def nearest_table(gpu: GpuInfo, paths) -> object | None:
    """The fallback rule: of ``paths``' tables whose header gives ``HEADER_FIELDS``, those
    of the same compute capability as ``gpu`` (the same architecture: the same
    instructions and the same registers and shared memory a SM, which decide which configs
    compile and run well), the one nearest in SM count (what sizes the grids: split-K
    segments and tiles a wave), then in memory size (standing in for the memory system),
    then the first by file name. None when ``gpu``'s capability is unknown or no table
    matches it.

    Why a sibling's table rather than the defaults: the layer serves 65 to 1024 rows, and
    there, on an H100 80GB HBM3 (132 SMs, as the H200), the H200's table was no slower
    than the defaults (the whole layer as a CUDA graph at E = 64, where only the entries
    keyed by E = 64 applied: 838 against 843 µs at b = 65, 9507 against 10121 at
    b = 1024), though slower at b = 1 (382 against 314;
    ``benchmarks/results/2026-12-06-H100-tables-host.md``)."""
    if gpu.capability is None:
        return None
    same = [(p, read_table(p)) for p in paths]
    same = [(p, h) for p, h in same if all(h.get(f) is not None for f in HEADER_FIELDS)
            and h["capability"] == gpu.capability]
    if not same:
        return None

    def distance(item):
        path, head = item
        return (abs(head["sm_count"] - (gpu.sm_count or 0)),
                abs(head["memory_gb"] - (gpu.memory_gb or 0.0)), path.name)

    return min(same, key=distance)[0]


def active_table(gpu: GpuInfo | None, warn: bool = True) -> tuple[TableChoice | None,
                                                                   dict | None]:
    """(the choice, the parsed table) for ``gpu`` (None: no GPU, no table); a fallback
    warns once (``warn``), naming the table it takes."""
    if gpu is None:
        return None, None
    choice = _chosen(gpu, os.environ.get(TABLE_ENV, ""), str(user_dir()))
    key = ("fallback", gpu.name, str(choice.path))
    if warn and choice.source == "fallback" and key not in _warned:
        _warned.add(key)
        warnings.warn(f"wide_moe_triton: {choice.why}: taking {choice.path}. Set "
                      f"{TABLE_ENV}=own to run the defaults instead, or run `wide-moe-tune` "
                      f"on this GPU.", stacklevel=4)
    return choice, None if choice.path is None else read_table(choice.path)


@functools.lru_cache(maxsize=None)
def _chosen(gpu: GpuInfo, forced: str, where: str) -> TableChoice:
    # Once per (GPU, $WIDE_MOE_TABLE, user's directory): lookups made at every call (the
    # tail's, across ranks) cost no file-system walk.
    return choose_table(gpu)


def clear_caches() -> None:
    """Forget every table read and choice made (tests, benchmarks that switch tables;
    a layer's plans keep what they resolved)."""
    for cached in (load_table, read_table, _chosen):
        cached.cache_clear()


def bucket_for(rows: int, buckets) -> str:
    widths = sorted(int(b) for b in buckets)
    return str(next((w for w in widths if w >= rows), widths[-1]))


class Lookup(NamedTuple):
    """One table lookup of ``config_for``: whether the table answered it."""
    kernel: str
    shape: str
    rows: int
    bucket: str | None  # the table's bucket that answered, None for the default
    covered: bool
    default: dict       # the kernel's default at this lookup


# Within ``recording``: the GPU config_for answers for, and the lookups it made.
_recording: list = []


@contextlib.contextmanager
def recording(gpu: GpuInfo | None):
    """Within: ``config_for`` answers as on ``gpu`` whatever the device (None: no GPU),
    warns nothing, and appends each table lookup (``Lookup``) to the list it yields."""
    lookups: list = []
    _recording.append((gpu, lookups))
    try:
        yield lookups
    finally:
        _recording.pop()


def config_for(kernel: str, shape: str, rows: int, default: dict, device=None,
               given: dict | None = None) -> dict:
    """The launch config of ``kernel`` at dims key ``shape`` for a batch of ``rows``:
    ``given`` (a caller's config, keys it leaves out from ``default``) when not None,
    else the chosen table's entry (``choose_table``) over ``default``."""
    if given is not None:
        return {**default, **given}
    forced = _overrides.get(kernel)
    if forced is not None:
        return dict(forced)
    gpu, lookups = _recording[-1] if _recording else (gpu_info(device), None)
    choice, table = active_table(gpu, warn=lookups is None)
    found = (table or {}).get("kernels", {}).get(kernel, {}).get(shape)
    bucket = bucket_for(rows, found) if found else None
    if lookups is not None:
        lookups.append(Lookup(kernel, shape, rows, bucket, bool(found), dict(default)))
    if found:
        return {**default, **found[bucket]}
    if lookups is None and gpu is not None and (kernel, shape) not in _warned:
        _warned.add((kernel, shape))
        where = choice.why if choice.path is None else f"{choice.path} has no [{kernel}][{shape}]"
        warnings.warn(f"wide_moe_triton: no tuned config for {kernel} at {shape} on {gpu.name} "
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
