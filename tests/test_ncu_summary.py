"""benchmarks/ncu_summary.py reads Nsight Compute's CSV pages as the profile mode
writes them: drawn stall samples in, the right shares and lines out."""

import contextlib
import gzip
import io
import pathlib
import sys

from hypothesis import given, settings, strategies as st

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "benchmarks"))
import ncu_summary  # noqa: E402

REASONS = ["stall_barrier", "stall_long_sb", "stall_math"]


def source_page(kernels) -> str:
    """A source page: per kernel, its name line, a header, one row a SASS line."""
    header = ["Address", "Source", "Warp Stall Sampling (All Samples)", *REASONS,
              *(f"{r} (Not Issued)" for r in REASONS)]
    out = []
    for name, lines in kernels:
        out.append(f'"Kernel Name","{name}",')
        out.append(",".join(f'"{h}"' for h in header))
        for i, counts in enumerate(lines):
            row = [f"0x{i:x}", f"INSTR{i} R{i}", str(sum(counts)), *map(str, counts),
                   *("0" for _ in REASONS)]
            out.append(",".join(f'"{v}"' for v in row))
    return "\n".join(out) + "\n"


line_counts = st.lists(st.tuples(*(st.integers(0, 50) for _ in REASONS)), min_size=1,
                       max_size=6).filter(lambda ls: sum(map(sum, ls)) > 0)


@settings(max_examples=20)
@given(first=line_counts, second=line_counts)
def test_stall_shares_and_top_lines(tmp_path_factory, first, second):
    path = tmp_path_factory.mktemp("ncu") / "x_source.csv.gz"
    with gzip.open(path, "wt") as f:  # the first kernel profiled twice: shown once
        f.write(source_page([("kern_a", first), ("kern_b", second), ("kern_a", second)]))
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert ncu_summary.main([str(path)]) == 0
    text = buf.getvalue()
    assert text.count("kern_a:") == 1 and text.count("kern_b:") == 1
    block = text.split("kern_a:")[1].split("kern_b:")[0]
    total = sum(map(sum, first))
    assert f"{total} samples" in block
    for j, reason in enumerate(REASONS):
        share = sum(c[j] for c in first) / total
        if share:
            assert f"{reason[6:]} {share:.0%}" in block
    # The most sampled SASS line comes first, with the reason it stalled on most.
    best = max(range(len(first)), key=lambda i: (sum(first[i]), -i))
    lines = [ln for ln in block.splitlines() if "INSTR" in ln]
    assert f"INSTR{best} " in lines[0]
    assert lines[0].split()[-1] == REASONS[max(range(3), key=lambda j: first[best][j])][6:]
