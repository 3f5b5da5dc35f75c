"""Triton's interpreter computes as a GPU does on every Triton that pyproject admits
(``kernels/compat.py``: Triton 3.6's interpreter refuses a loop bound computed from a
program id, and lets a NaN win ``tl.maximum``). Kernels of their own, so that a failure
names the rule, not a stage."""

import os

import pytest
import torch
import triton
import triton.language as tl

import wide_moe_triton.kernels  # noqa: F401  (installs the definitions, as any use does)

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="Triton's interpreter only")


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


def test_a_loop_bound_from_the_program_id():
    out = torch.zeros(3, dtype=torch.int32)
    _loop_over_program_bounds[(3,)](out, 4, 10)
    assert out.tolist() == [sum(range(0, 4)), sum(range(4, 8)), sum(range(8, 10))]


def test_maximum_and_minimum_return_the_number_beside_a_nan():
    x = torch.tensor([float("nan"), 2.0, -float("inf"), float("nan")])
    out = torch.empty(8)
    _number_over_nan[(1,)](x, out, 4)
    inf = float("inf")
    assert out.tolist() == [-inf, 2.0, -inf, -inf, inf, 2.0, -inf, inf]
