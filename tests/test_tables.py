"""Which table a GPU gets, on a CPU with fake GPUs and fake tables: its own first, else the
nearest table of its compute capability (``tuning.nearest_table``) with one warning naming
it, ``$WIDE_MOE_TABLE`` over both; the ``wide-moe tables`` command that prints the
choice and its coverage; and a forward's host path, the same whether its configs came
from a table or from the defaults."""

import contextlib
import json
import pathlib
import sys
import tempfile
import warnings

import pytest
import torch
from hypothesis import given, settings, strategies as st

from conftest import DEVICE
from wide_moe_triton import LatentMoE, WideMoE, WideMoEConfig, tables, tuning
from wide_moe_triton import __main__ as layer_cli

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "benchmarks"))
import host_overhead  # noqa: E402

CAPABILITIES = ("8.0", "9.0", "10.0")


def table(gpu: str, header: dict | None, kernels: dict | None = None) -> dict:
    return {"gpu": gpu, "triton": "3.9.0", "date": "2026-12-07", **(header or {}),
            "kernels": kernels or {}}


@contextlib.contextmanager
def user_tables(files: dict, env: dict | None = None):
    """A fresh tables' directory holding ``files`` (file name -> table) as
    $WIDE_MOE_CONFIG_DIR, $WIDE_MOE_TABLE unset unless ``env`` sets it, the caches and the
    warnings' memory emptied before and after; yields the directory."""
    with tempfile.TemporaryDirectory() as where, pytest.MonkeyPatch.context() as mp:
        where = pathlib.Path(where)
        for name, content in files.items():
            (where / name).write_text(json.dumps(content))
        mp.setenv("WIDE_MOE_CONFIG_DIR", str(where))
        mp.delenv(tuning.TABLE_ENV, raising=False)
        for key, value in (env or {}).items():
            mp.setenv(key, value)
        mp.setattr(tuning, "_warned", set())
        _clear()
        try:
            yield where
        finally:
            _clear()


def _clear():
    tuning.clear_caches()


headers = st.fixed_dictionaries({
    "capability": st.sampled_from(CAPABILITIES), "sm_count": st.integers(16, 200),
    "memory_gb": st.floats(8, 200).map(lambda g: round(g, 1))})
devices = st.builds(lambda name, h: tuning.GpuInfo(name, h["capability"], h["sm_count"],
                                                   h["memory_gb"]),
                    st.sampled_from(["GPU A", "GPU B", "Fake GPU"]), headers)
table_sets = st.lists(st.tuples(st.sampled_from(["GPU A", "GPU B", "GPU C", "GPU D"]),
                                st.one_of(st.none(), headers)),
                      max_size=4, unique_by=lambda t: t[0])


def _all_candidates() -> list:
    return [(p, tuning.read_table(p)) for p in tuning.candidate_tables()]


@given(gpu=devices, files=table_sets)
@settings(max_examples=60, deadline=None)
def test_a_gpu_takes_its_own_table_else_the_nearest_of_its_capability(gpu, files):
    with user_tables({tuning.table_file(n): table(n, h) for n, h in files}) as where:
        choice = tuning.choose_table(gpu)
        own = where / tuning.table_file(gpu.name)
        if own.is_file():
            assert choice.source == "user" and choice.path == own
            return
        usable = [(p, h) for p, h in _all_candidates()
                  if h.get("capability") == gpu.capability and "sm_count" in h]
        if not usable:
            assert choice.source == "none" and choice.path is None
            return
        assert choice.source == "fallback"
        head = tuning.read_table(choice.path)
        assert head["capability"] == gpu.capability
        chosen = (abs(head["sm_count"] - gpu.sm_count), abs(head["memory_gb"] - gpu.memory_gb))
        for _, h in usable:  # none nearer: SMs first, then memory
            assert chosen <= (abs(h["sm_count"] - gpu.sm_count),
                              abs(h["memory_gb"] - gpu.memory_gb))


@given(gpu=devices, files=table_sets)
@settings(max_examples=20, deadline=None)
def test_without_its_capability_a_gpu_never_falls_back(gpu, files):
    with user_tables({tuning.table_file(n): table(n, h) for n, h in files}):
        choice = tuning.choose_table(gpu._replace(capability=None))
        assert choice.source in ("user", "none")


H100 = tuning.GpuInfo("NVIDIA H100 80GB HBM3", "9.0", 132, 85.0)
KERNELS = {"finalize": {"L256_K4": {"64": {"BLOCK_T": 2}}}}


def _patched_gpu(mp, gpu):
    mp.setattr(tuning, "gpu_info", lambda device=None: gpu)


def test_the_fallback_warns_once_naming_the_table_it_takes():
    files = {"NVIDIA_H200.json": table("NVIDIA H200", {"capability": "9.0", "sm_count": 132,
                                                      "memory_gb": 141.0}, KERNELS)}
    with user_tables(files) as where, pytest.MonkeyPatch.context() as mp:
        _patched_gpu(mp, H100)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(3):
                got = tuning.config_for("finalize", "L256_K4", 5, {"BLOCK_T": 1, "num_warps": 2})
                assert got == {"BLOCK_T": 2, "num_warps": 2}
                tuning.config_for("rms_norm", "L256", 1, {"BLOCK_T": 1})
        said = [str(w.message) for w in caught]
        taking = [s for s in said if "taking" in s]
        assert len(taking) == 1, said
        assert str(where / "NVIDIA_H200.json") in taking[0] and "NVIDIA H100" in taking[0]
        # the entry the fallback table lacks: one warning of its own, naming the table
        missing = [s for s in said if "no tuned config for rms_norm" in s]
        assert len(missing) == 1 and str(where / "NVIDIA_H200.json") in missing[0]


def test_the_variable_chooses_none_own_or_a_file():
    h200 = table("NVIDIA H200", {"capability": "9.0", "sm_count": 132, "memory_gb": 141.0},
                 KERNELS)
    files = {"NVIDIA_H200.json": h200, "elsewhere.json": table("X", None, KERNELS)}
    for value, source in (("none", "none"), ("own", "none"), ("", "fallback")):
        with user_tables(files, {tuning.TABLE_ENV: value}):
            assert tuning.choose_table(H100).source == source, value
    with user_tables(files) as where:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv(tuning.TABLE_ENV, str(where / "elsewhere.json"))
            choice = tuning.choose_table(H100)
            assert (choice.source, choice.path) == ("given", where / "elsewhere.json")
            mp.setenv(tuning.TABLE_ENV, str(where / "missing.json"))
            with pytest.raises(ValueError, match="WIDE_MOE_TABLE=.*missing.json: no such file"):
                tuning.choose_table(H100)


def test_the_shipped_h200_table_states_its_gpu():
    head = tuning.read_table(tuning.SHIPPED / "NVIDIA_H200.json")
    assert (head["capability"], head["sm_count"], head["memory_gb"]) == ("9.0", 132, 141.0)


def test_a_table_with_a_bad_header_field_is_refused_by_name():
    bad = table("X", {"capability": "9.0", "sm_count": "many", "memory_gb": 80.0})
    with user_tables({"X.json": bad}) as where:
        with pytest.raises(ValueError, match=r"X.json: field 'sm_count' must be a positive"):
            tuning.read_table(where / "X.json")


# ----------------------------------------------------------------------------- the command

def run_tables(capsys, *argv):
    status = layer_cli.main(["tables", *argv])
    out, err = capsys.readouterr()
    return status, out, err


def test_wide_moe_help_names_the_command():
    assert "`wide-moe tables`" in layer_cli.parser().format_help()


def test_on_a_cpu_the_command_says_there_is_no_gpu(capsys):
    status, out, _ = run_tables(capsys)
    assert status == 0 and out.startswith("no GPU here")


def test_the_command_names_the_gpu_its_table_and_its_coverage(capsys):
    with user_tables({}):
        status, out, err = run_tables(capsys, "--gpu-name", H100.name, "--capability", "9.0",
                                      "--sms", "132", "--memory-gb", "85", "--tp", "8")
        assert status == 0, err
        lines = out.splitlines()
        assert lines[0] == "GPU: NVIDIA H100 80GB HBM3 (compute capability 9.0, 132 SMs, 85 GB)"
        assert lines[1].startswith(f"table: fallback, {tuning.SHIPPED / 'NVIDIA_H200.json'}")
        assert "TP8" in lines[2] and "the table answers" in lines[2]
        status, out, _ = run_tables(capsys, "--gpu-name", "Some GPU", "--tp", "1")
        assert status == 0 and "table: none" in out and "run the default" in out


def test_the_shipped_table_answers_every_tp_it_was_tuned_for(capsys):
    """The H200's own table at TP16 and TP1 (buffers sized by its split-K entries):
    every launch it was swept for answered, only the publish launch (never swept) and
    the RMSNorm's wider widths (one layout for all) left to the defaults."""
    with user_tables({}):
        status, out, err = run_tables(capsys, "--gpu-name", "NVIDIA H200", "--tp", "16", "1")
    assert status == 0, err
    assert f"table: shipped, {tuning.SHIPPED / 'NVIDIA_H200.json'}" in out
    for line in out.splitlines():
        if line.startswith("  ") and not line.split()[0] in ("publish", "rms_norm"):
            assert "default" not in line, line


def test_coverage_counts_the_plans_lookups_against_the_table():
    """Every lookup of the plans at the tiny dims, answered by a table holding exactly
    those lookups' entries, and by no table."""
    cfg = WideMoEConfig.tiny(wide_rows=16)
    gpu = tuning.GpuInfo("Fake GPU", "9.0", 132, 85.0)
    layer = tables.planning_layer(cfg, gpu)
    with tuning.recording(gpu) as none:
        for b in range(1, 17):
            layer.plan(b)
    assert none and not any(look.covered for look in none)
    with user_tables({tuning.table_file(gpu.name): table(gpu.name, None, kernels_of(none))}):
        layer = tables.planning_layer(cfg, gpu)
        with tuning.recording(gpu) as all_:
            for b in range(1, 17):
                layer.plan(b)
    assert len(all_) == len(none) and all(look.covered for look in all_)


def kernels_of(lookups) -> dict:
    """A table's kernels holding each lookup's default at a bucket of its own width."""
    kernels: dict = {}
    for look in lookups:
        kernels.setdefault(look.kernel, {}).setdefault(look.shape, {})[str(look.rows)] = \
            look.default
    return kernels


# ----------------------------------------------------------------------------- host path

CFG = WideMoEConfig.tiny(wide_rows=16)


@pytest.fixture(scope="module")
def stock():
    return LatentMoE(CFG, seed=0, device=DEVICE)


def _forwards(stock, gpu, widths, calls):
    """A fresh layer on ``gpu`` (faked), its first forward at each width, then ``calls``
    more: (config_for calls and warnings of the first forwards, of the later ones, the
    plans' launch arguments by width)."""
    counts = {"config_for": 0, "warn": 0}
    with host_overhead.stubbed_launches(), pytest.MonkeyPatch.context() as mp:
        _patched_gpu(mp, gpu)
        original, warn = tuning.config_for, warnings.warn

        def counted_config(*args, **kwargs):
            counts["config_for"] += 1
            return original(*args, **kwargs)

        def counted_warn(*args, **kwargs):
            counts["warn"] += 1
            return warn(*args, **kwargs)

        for mod in list(sys.modules.values()):
            if getattr(mod, "__name__", "").startswith("wide_moe_triton") and \
                    getattr(mod, "config_for", None) is original:
                mp.setattr(mod, "config_for", counted_config)
        mp.setattr(warnings, "warn", counted_warn)
        wide = WideMoE.from_module(stock)
        xs = {b: torch.randn(b, CFG.hidden, device=DEVICE).bfloat16() for b in widths}
        for b in widths:
            wide(xs[b])
        first = dict(counts)
        counts.update(config_for=0, warn=0)
        for _ in range(calls):
            for b in widths:
                wide(xs[b])
        later = dict(counts)
        plans = {b: _launch_args(wide.plan(b)) for b in widths}
    return first, later, plans


def _launch_args(plan) -> str:
    # What each launch is given, tensors by shape: equal strings, equal launches.
    return repr({k: _shapes(v) for k, v in sorted(vars(plan).items())})


def _shapes(v):
    if isinstance(v, torch.Tensor):
        return ("tensor", tuple(v.shape), v.dtype)
    if isinstance(v, dict):
        return {k: _shapes(x) for k, x in sorted(v.items())}
    if isinstance(v, (tuple, list)):
        return type(v)(_shapes(x) for x in v) if not hasattr(v, "_fields") else \
            (type(v).__name__, tuple(_shapes(x) for x in v))
    return v


@pytest.mark.filterwarnings("ignore:wide_moe_triton. no tuned config")
@given(widths=st.lists(st.integers(1, CFG.wide_rows), min_size=1, max_size=3, unique=True),
       calls=st.integers(1, 3))
@settings(max_examples=5, deadline=None)
def test_a_forward_costs_the_host_the_same_with_a_table_or_the_defaults(stock, widths, calls):
    """A table whose entries are the defaults, against no table: the same lookups once
    per width (none after), one warning per (kernel, shape) only without the table, at the
    first width only, and the same launches, argument for argument."""
    gpu = tuning.GpuInfo("Fake GPU", "9.0", 132, 85.0)
    layer = tables.planning_layer(CFG, gpu)
    with tuning.recording(gpu) as lookups:
        for b in range(1, CFG.wide_rows + 1):
            layer.plan(b)
    files = {tuning.table_file(gpu.name): table(gpu.name, None, kernels_of(lookups))}
    with user_tables(files, {tuning.TABLE_ENV: "own"}):
        tabled = _forwards(stock, gpu, widths, calls)
    with user_tables({}, {tuning.TABLE_ENV: "none"}):
        default = _forwards(stock, gpu, widths, calls)
    (first_t, later_t, plans_t), (first_d, later_d, plans_d) = tabled, default
    assert later_t == later_d == {"config_for": 0, "warn": 0}
    assert first_t["config_for"] == first_d["config_for"] > 0
    assert first_t["warn"] == 0
    assert first_d["warn"] == len({(look.kernel, look.shape) for look in lookups})
    assert plans_t == plans_d
