"""benchmarks/bench_layer.py's graph check: "= eager" exactly when the graph's output has
the eager call's bits; otherwise the count of differing elements and rows, the largest
difference and whether two eager calls agree, each as drawn here."""

import pathlib
import sys

import torch
from hypothesis import given, settings, strategies as st

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "benchmarks"))
import bench_layer  # noqa: E402


def _bump(t: torch.Tensor, flat: list[int]) -> torch.Tensor:
    """A copy of BF16 ``t`` with the last mantissa bit of each flat index flipped (the
    smallest change of the value, never to NaN from a finite normal value)."""
    out = t.clone()
    bits = out.view(torch.int16).view(-1)
    for i in flat:
        bits[i] ^= 1
    return out


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 9), cols=st.integers(1, 17), seed=st.integers(0, 2**31 - 1),
       data=st.data(), eager_differs=st.booleans())
def test_graph_check_counts_what_differs(rows, cols, seed, data, eager_differs):
    gen = torch.Generator().manual_seed(seed)
    eager = (torch.rand(rows, cols, generator=gen) + 0.5).bfloat16()  # finite, normal
    n = rows * cols
    flat = data.draw(st.lists(st.integers(0, n - 1), unique=True, max_size=n))
    replayed = _bump(eager, flat)
    again = _bump(eager, [data.draw(st.integers(0, n - 1))]) if eager_differs else eager.clone()
    calls = []
    got = bench_layer.graph_check(replayed, eager, lambda: calls.append(1) or again)
    assert len(calls) == (1 if flat else 0)  # the second eager call only where needed
    if not flat:
        assert got == "= eager"
        return
    touched_rows = len({i // cols for i in flat})
    delta = (replayed.float() - eager.float()).abs().max().item()
    assert got.startswith(f"!= eager ({len(flat)} of {n} elements in {touched_rows} rows, ")
    assert f"max |diff| {delta:.2e}" in got and delta > 0
    assert got.endswith(f"two eager calls {'differ' if eager_differs else 'equal'})")
