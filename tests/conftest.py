"""Tests run the kernels on the GPU when there is one, else in Triton's interpreter."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402


def patch_language_once_per_launch() -> None:
    """Make Triton's interpreter patch ``triton.language`` once per kernel launch instead
    of again at every call of a ``@triton.jit`` helper inside the kernel.

    The interpreter (Triton 3.9, ``runtime/interpreter.py``) swaps the language's builtins
    for interpreted ones when a launch starts and swaps them back when it ends; it also
    calls ``_patch_lang`` at each device-function call, which scans the modules with
    ``inspect.getmembers`` and finds nothing left to swap when the launch has swapped the
    same modules already. The kernels call helpers in their inner loops (the MX decode,
    the bit casts, Triton's own ``tl.max``), so those scans took about a third of a
    layer's forward in the interpreter (cProfile, tiny dims). Here a helper's call skips
    the scan when the launch in progress has patched every language module the helper's
    globals hold: the same builtins run, the same bits come out
    (tests/test_interpreter.py). Triton's own function stays at
    ``_patch_lang.original``."""
    from triton.runtime import interpreter

    original = getattr(interpreter, "_patch_lang", None)
    if original is None or not hasattr(interpreter, "_LangPatchScope"):
        return   # another Triton's interpreter: left as it is, slower
    active: list[set] = []   # the language modules each launch in progress patched

    def languages(fn) -> set:
        return {v for v in fn.__globals__.values()
                if v is interpreter.tl or v is interpreter.tl.core}

    def patch_lang(fn):
        wanted = languages(fn)
        if active and wanted <= active[-1]:
            return interpreter._LangPatchScope()   # nothing to swap, nothing to restore
        scope = patch_lang.original(fn)
        if not hasattr(scope, "restore"):
            return scope   # launches that restore nothing: nothing to track
        if active:
            # a helper whose globals reach a module its kernel's did not (Triton's own
            # tl.max, tl.zeros: triton.language.core): Triton never restores a helper's
            # patches, so that module stays patched for the rest of the launch
            active[-1] |= wanted
            return scope
        active.append(wanted)
        restore = scope.restore

        def restore_and_close():
            active.pop()
            restore()

        scope.restore = restore_and_close
        return scope

    patch_lang.original = original
    interpreter._patch_lang = patch_lang


if os.environ.get("TRITON_INTERPRET") == "1":
    patch_language_once_per_launch()

# The interpreter runs a kernel in seconds, not microseconds: few, well-chosen examples.
settings.register_profile(
    "ci", max_examples=12, deadline=None, derandomize=False, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("gpu", max_examples=60, deadline=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow])
# The GPU check (benchmarks/diagnostics/h200.sh tests): every test, few examples, the
# same ones every run. On a GPU the cost is compiling, not running: each example that
# draws a new shape, dtype or launch config compiles new kernels (seconds each; the
# experts' minutes in all), so fewer examples means fewer compiles, and derandomized
# examples hit Triton's on-disk cache on a second run.
settings.register_profile(
    "gpu-check", max_examples=4, deadline=None, derandomize=True, database=None,
    print_blob=True, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
# While working, in the interpreter: a few fresh examples a test, the quick tier
# (HYPOTHESIS_PROFILE=dev pytest -m "not slow"); CI runs the "ci" profile, every test.
settings.register_profile(
    "dev", max_examples=3, deadline=None, derandomize=False, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
# A deeper search than CI's, in the interpreter (HYPOTHESIS_PROFILE=deep pytest -n auto):
# four times its examples where a test takes the profile's count, fresh ones each run
# (10 minutes on 2 cores; the costliest tests fix their own counts).
settings.register_profile(
    "deep", max_examples=48, deadline=None, derandomize=False, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE",
                                     "gpu" if torch.cuda.is_available() else "ci"))
QUICK = os.environ.get("HYPOTHESIS_PROFILE") in ("gpu-check", "dev")


def examples(at_least: int) -> int:
    """A test's example count: the profile's, raised to ``at_least`` for tests whose
    inputs space needs more (routing ties, mailbox parities), except in the quick GPU
    check and the quick tier ("dev"), where every test runs the profile's few."""
    return settings().max_examples if QUICK else max(settings().max_examples, at_least)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture
def device():
    return DEVICE


def poison(t: torch.Tensor) -> torch.Tensor:
    """Fill an output buffer with a pattern no kernel writes (NaN for floats, 0xA5 in
    every byte of integers: the tuning sweep's ``tune.poison``), so that unwritten
    elements show."""
    from wide_moe_triton import tune

    tune.poison(t)
    return t


def forbid_launches(monkeypatch, module, *kernels: str) -> None:
    """Replace ``module``'s Triton kernels named ``kernels`` by stand-ins that fail the
    test if launched (for calls that must launch nothing, e.g. an empty batch)."""
    class NoLaunch:
        def __getitem__(self, grid):
            raise AssertionError("a kernel was launched for an empty batch")

    for name in kernels:
        monkeypatch.setattr(module, name, NoLaunch())


def pytest_collection_modifyitems(config, items):
    """On a GPU the suite's time is compiling, and the tests marked slow compile the most:
    they start first, so that a run bounded in time (``h200.sh tests``) does not end with
    one of them running alone on one worker while the others sit idle."""
    if DEVICE.type == "cuda":
        items.sort(key=lambda item: item.get_closest_marker("slow") is None)


def pytest_runtest_logreport(report):
    """With WIDE_MOE_TEST_TIMES=FILE, each test phase that took over a second is appended
    to FILE as it ends (seconds, phase, outcome, test): a run killed at its time limit
    still says where its time went, which ``--durations`` prints only at the end."""
    path = os.environ.get("WIDE_MOE_TEST_TIMES")
    # under pytest-xdist the controller gets every worker's reports too: it alone writes
    if path and report.duration > 1.0 and "PYTEST_XDIST_WORKER" not in os.environ:
        with open(path, "a") as f:
            f.write(f"{report.duration:.1f}\t{report.when}\t{report.outcome}\t"
                    f"{report.nodeid}\n")
