"""What the tests of the front GEMM and of the linears built on it share: launch
layouts, reduction orders, operands and the float64 bounds the results must meet."""

import torch
from hypothesis import strategies as st

from conftest import DEVICE

U32 = 2.0 ** -24  # FP32 unit roundoff

# Small tiles keep the interpreter quick while every shape spans several programs.
# BLOCK_K 32 over H 256 is 8 K blocks: SPLIT_K 3 gives ragged segments (3, 3, 2).
LAYOUTS = [
    dict(BLOCK_M=16, BLOCK_N=64, SPLIT_GRID=1, num_warps=4, num_stages=3),
    dict(BLOCK_M=64, BLOCK_N=128, SPLIT_GRID=0, num_warps=8, num_stages=4),
    dict(BLOCK_M=32, BLOCK_N=64, SPLIT_GRID=1, num_warps=4, num_stages=2),
    dict(BLOCK_M=16, BLOCK_N=128, SPLIT_GRID=0, num_warps=4, num_stages=3),
]
REDUCTIONS = [dict(BLOCK_K=32, SPLIT_K=1), dict(BLOCK_K=32, SPLIT_K=3),
              dict(BLOCK_K=64, SPLIT_K=2), dict(BLOCK_K=32, SPLIT_K=8)]


def make_inputs(b, N, H, seed):
    """x BF16 [b, H] of unit scale and weights BF16 [N, H] scaled so x @ w.T is too."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(b, H, generator=gen).to(torch.bfloat16)
    packed = (torch.randn(N, H, generator=gen) * H ** -0.5).to(torch.bfloat16)
    return x.to(DEVICE), packed.to(DEVICE)


def draw_row_and_configs(data, b, reduction):
    """(a row of b, its config alone, the batch's config): two drawn layouts around one
    reduction order, as the tuned table gives a shape at two batch widths."""
    row = data.draw(st.integers(0, b - 1), label="row")
    alone = {**data.draw(st.sampled_from(LAYOUTS), label="alone_layout"), **reduction}
    wide = {**data.draw(st.sampled_from(LAYOUTS), label="wide_layout"), **reduction}
    return row, alone, wide


def assert_row_alone_equals_in_batch(run, x, w, row, alone_config, wide_config):
    """``run(x, w, config)`` gives row ``row`` the same bits alone under ``alone_config``
    as inside the whole batch under ``wide_config``."""
    alone = run(x[row:row + 1].contiguous(), w, alone_config)
    wide = run(x, w, wide_config)[row:row + 1]
    bits = torch.int32 if alone.dtype == torch.float32 else torch.int16
    assert torch.equal(alone.view(bits), wide.view(bits))


def error_bound(x, packed):
    """Any FP32 summation order of H exact products errs by at most (H-1)u sum|terms|
    (plus the segment adds, well inside the factor H used here)."""
    H = x.shape[1]
    return H * U32 * (x.double().abs() @ packed.double().abs().t())


def assert_one_rounding(out: torch.Tensor, exact: torch.Tensor, slack: torch.Tensor):
    """``out`` (BF16) is what one rounding to nearest even of some FP32 number within
    ``slack`` of ``exact`` (float64) gives: rounding is monotone, so it lies between the
    roundings of the interval's ends (each through FP32, as the kernel's value is)."""
    lo = (exact - slack).float().to(torch.bfloat16)
    hi = (exact + slack).float().to(torch.bfloat16)
    o = out.double()
    bad = ~((lo.double() <= o) & (o <= hi.double()))
    assert not bad.any(), (f"{int(bad.sum())} values outside one rounding of the exact "
                           f"result, e.g. {o[bad][:4].tolist()} not in "
                           f"[{lo.double()[bad][:4].tolist()}, {hi.double()[bad][:4].tolist()}]")


def assert_mostly_equal(out: torch.Tensor, ref: torch.Tensor, at_least: float = 0.99):
    """Two one-rounding BF16 results of the same sums in other FP32 orders: bitwise equal
    except where the orders moved a sum across a rounding boundary, which is rare (the
    bound itself is ``assert_one_rounding``'s)."""
    equal = (out.view(torch.int16) == ref.view(torch.int16)).double().mean().item()
    assert equal >= at_least, f"only {equal:.2%} bitwise equal"
