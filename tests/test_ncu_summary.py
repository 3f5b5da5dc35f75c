"""benchmarks/diagnostics/ncu_summary.py reads Nsight Compute's CSV pages as the profile mode
writes them: drawn stall samples in, the right shares and lines out."""

import contextlib
import gzip
import io
import pathlib
import sys

from hypothesis import given, settings, strategies as st

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "diagnostics"))
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
    # Told apart from a details page by what it holds, not by its name.
    path = tmp_path_factory.mktemp("ncu") / "profile.csv.gz"
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


DETAIL_HEADER = ["ID", "Process ID", "Process Name", "Host Name", "Kernel Name", "Context",
                 "Stream", "Block Size", "Grid Size", "Device", "CC", "Section Name",
                 "Metric Name", "Metric Unit", "Metric Value"]


def details_page(kernels) -> str:
    """A details page as ``ncu --page details --csv`` writes it: a header, then one row a
    (kernel launch, metric)."""
    out = [",".join(f'"{h}"' for h in DETAIL_HEADER)]
    for i, (name, duration, dram) in enumerate(kernels):
        for metric, unit, value in (("Duration", "us", duration),
                                    ("DRAM Throughput", "%", dram)):
            row = [str(i), "1", "python", "host", name, "1", "7", "(128, 1, 1)",
                   f"({i + 1}, 6, 1)", "0", "9.0", "Speed Of Light", metric, unit, value]
            out.append(",".join(f'"{v}"' for v in row))
    return "\n".join(out) + "\n"


metric = st.decimals(min_value=0, max_value=10000, places=2).map(str)


@settings(max_examples=20)
@given(kernels=st.lists(st.tuples(st.sampled_from(["kern_a", "kern_b"]), metric, metric),
                        min_size=1, max_size=4))
def test_details_one_line_a_launch(tmp_path_factory, kernels):
    """Each launch of a details page is one line with its own metrics, whatever the file
    is called (a page named like a source page included)."""
    path = tmp_path_factory.mktemp("ncu") / "x_source.csv"
    path.write_text(details_page(kernels))
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert ncu_summary.main([str(path)]) == 0
    lines = [ln for ln in buf.getvalue().splitlines() if " grid " in ln]
    assert len(lines) == len(kernels)
    for i, (line, (name, duration, dram)) in enumerate(zip(lines, kernels)):
        assert line.startswith(f"{name} grid ({i + 1}, 6, 1) block (128, 1, 1):")
        assert f"Duration {duration}us" in line and f"DRAM Throughput {dram}%" in line
