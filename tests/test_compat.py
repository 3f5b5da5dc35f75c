"""Triton's interpreter computes as a GPU does on every Triton that pyproject admits
(``kernels/compat.py``: Triton 3.6's interpreter refuses a loop bound computed from a
program id, and lets a NaN win ``tl.maximum``). Kernels of their own, so that a failure
names the rule, not a stage.

Each test first gives the interpreter Triton 3.6's own definitions (copied from 3.6's
``triton/runtime/interpreter.py``) and sees the kernel fail, then installs compat's and
sees it pass: so the tests can fail on any Triton, the 3.9 of CI included, whose
interpreter already computes as a GPU does. ``pytest.MonkeyPatch.context`` restores
Triton's definitions after every example (a function-scoped fixture would span all of
hypothesis' examples)."""

import math
import os

import numpy as np
import pytest
import torch
import triton
import triton.language as tl
from hypothesis import given, strategies as st

import wide_moe_triton.kernels  # noqa: F401  (installs the definitions, as any use does)
from wide_moe_triton.kernels.compat import match_interpreter_to_triton_3_9

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="Triton's interpreter only")


def _as_triton_3_6(mp: pytest.MonkeyPatch) -> None:
    """Triton 3.6's ``tensor.__index__`` and ``maxnumf``/``minnumf``, over whatever the
    interpreter holds now."""
    from triton.runtime import interpreter

    patch_lang_tensor = interpreter._patch_lang_tensor

    def patch_lang_tensor_3_6(tensor, scope):
        patch_lang_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data))

    mp.setattr(interpreter, "_patch_lang_tensor", patch_lang_tensor_3_6)
    builder = interpreter.InterpreterBuilder
    mp.setattr(builder, "create_maxnumf",
               lambda self, lhs, rhs: self.binary_op(lhs, rhs, np.maximum))
    mp.setattr(builder, "create_minnumf",
               lambda self, lhs, rhs: self.binary_op(lhs, rhs, np.minimum))


@triton.jit
def _loop_over_program_bounds(out_ptr, n, last):
    lo = tl.program_id(0) * n
    hi = tl.minimum(lo + n, last)
    total = 0
    for i in range(lo, hi):
        total += i
    tl.store(out_ptr + tl.program_id(0), total)


@triton.jit
def _number_over_nan(x_ptr, out_ptr, N: tl.constexpr):
    x = tl.load(x_ptr + tl.arange(0, N))
    tl.store(out_ptr + tl.arange(0, N), tl.maximum(x, -float("inf")))
    tl.store(out_ptr + N + tl.arange(0, N), tl.minimum(x, float("inf")))


@given(programs=st.integers(1, 4), n=st.integers(1, 5), short=st.integers(0, 4))
def test_a_loop_bound_from_the_program_id(programs, n, short):
    last = max(programs * n - short, 0)

    def run():
        out = torch.zeros(programs, dtype=torch.int32)
        _loop_over_program_bounds[(programs,)](out, n, last)
        return out.tolist()

    want = [sum(range(p * n, min(p * n + n, last))) for p in range(programs)]
    with pytest.MonkeyPatch.context() as mp:
        _as_triton_3_6(mp)
        # The interpreter wraps the TypeError in its own error, keeping the message.
        with pytest.raises(Exception, match="only 0-dimensional arrays"):
            run()
        match_interpreter_to_triton_3_9()
        assert run() == want


_VALUES = st.sampled_from([float("nan"), 2.0, -1.5, 0.0, float("inf"), -float("inf")])


@given(x=st.lists(_VALUES, min_size=4, max_size=4), nan_at=st.integers(0, 3))
def test_maximum_and_minimum_return_the_number_beside_a_nan(x, nan_at):
    x[nan_at] = float("nan")
    inf = float("inf")
    want = ([-inf if math.isnan(v) else v for v in x]
            + [inf if math.isnan(v) else v for v in x])

    def run():
        out = torch.empty(8)
        _number_over_nan[(1,)](torch.tensor(x), out, 4)
        return out.tolist()

    with pytest.MonkeyPatch.context() as mp:
        _as_triton_3_6(mp)
        got = run()
        assert math.isnan(got[nan_at]) and math.isnan(got[4 + nan_at])
        match_interpreter_to_triton_3_9()
        assert run() == want


def test_a_missing_name_or_a_failing_probe_warns_naming_it():
    from types import SimpleNamespace

    from wide_moe_triton.kernels import compat

    class Builder:  # maxnumf/minnumf whose probe raises
        def binary_op(self, lhs, rhs, fn):
            raise ValueError("no probe here")

        create_maxnumf = create_minnumf = (
            lambda self, lhs, rhs: self.binary_op(lhs, rhs, np.maximum))

    probed = Builder.__dict__["create_maxnumf"]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(compat, "_warned", set())
        with pytest.warns(RuntimeWarning, match="has no _LangPatchScope"):
            compat._index_of_one_element_arrays(SimpleNamespace(_patch_lang_tensor=print))
        with pytest.warns(RuntimeWarning, match="has no InterpreterBuilder;"):
            compat._number_wins_over_nan(SimpleNamespace())
        with pytest.warns(RuntimeWarning, match="ValueError: no probe here"):
            compat._number_wins_over_nan(SimpleNamespace(
                InterpreterBuilder=Builder, TensorHandle=lambda data, dtype: data))
        assert Builder.__dict__["create_maxnumf"] is probed  # unknown: left as it is
