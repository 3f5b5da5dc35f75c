"""What the profile mode's Nsight Compute pages say, a few lines a kernel.

    python benchmarks/diagnostics/ncu_summary.py OUT/wgmma_details.csv.gz \
        OUT/wgmma_source.csv.gz

For a details page (``ncu --page details --csv``): each kernel's duration, DRAM
throughput, issue rate, idle share, occupancy and L2 hit rate. For a source page
(``--page source --csv --print-source sass``): each kernel's warp stall reasons as
shares of all samples, then the SASS lines that drew the most samples and the reason
each stalled on most. A kernel profiled several times is shown once. What produced the
profile table of benchmarks/NOTES.md, "Exact decode instead of dot_scaled on Hopper".
"""

from __future__ import annotations

import collections
import csv
import gzip
import io
import sys

DETAILS = ("Duration", "DRAM Throughput", "Issued Warp Per Scheduler", "No Eligible",
           "Achieved Occupancy", "Registers Per Thread", "L2 Hit Rate")


def _text(path: str) -> str:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return f.read()


def details(path: str) -> None:
    """One line a kernel launch of a details page: the metrics of DETAILS."""
    metrics = collections.OrderedDict()
    for row in csv.DictReader(io.StringIO(_text(path))):
        key = (row["Kernel Name"][:48], row["Grid Size"], row["Block Size"])
        value = row["Metric Value"] + row["Metric Unit"]
        metrics.setdefault(key, {})[row["Metric Name"]] = value
    for (name, grid, block), m in metrics.items():
        shown = "; ".join(f"{k} {m[k]}" for k in DETAILS if k in m)
        print(f"{name} grid {grid} block {block}: {shown}")


def _kernels(text: str):
    """(kernel name, rows) of each kernel section of a source page."""
    for part in text.split('"Kernel Name",')[1:]:
        name, rest = part.split("\n", 1)
        yield name.strip('",'), list(csv.DictReader(io.StringIO(rest)))


def stalls(path: str, lines: int = 10) -> None:
    """Each kernel's stall reasons (share of all samples) and its most sampled lines."""
    seen = set()
    for name, rows in _kernels(_text(path)):
        if name in seen or not rows:
            continue
        seen.add(name)
        reasons = [c for c in rows[0] if c.startswith("stall_") and "Not Issued" not in c]
        count = lambda r, c: int(r[c] or 0)  # noqa: E731
        total = collections.Counter({c: sum(count(r, c) for r in rows) for c in reasons})
        samples = sum(total.values()) or 1
        print(f"{name[:60]}: {samples} samples; "
              + ", ".join(f"{c[6:]} {n / samples:.0%}" for c, n in total.most_common(8)))
        column = "Warp Stall Sampling (All Samples)"
        for r in sorted(rows, key=lambda r: -count(r, column))[:lines]:
            top = max(reasons, key=lambda c: count(r, c))
            sass = r["Source"].strip()[:64]
            print(f"  {count(r, column) / samples:6.1%}  {sass:64s} {top[6:]}")


def main(argv=None) -> int:
    paths = sys.argv[1:] if argv is None else argv
    if not paths:
        print(__doc__)
        return 2
    for path in paths:
        print(f"== {path}")
        (stalls if _is_source_page(path) else details)(path)
    return 0


def _is_source_page(path: str) -> bool:
    """Whether ``path`` holds a source page: its sections start with a kernel's name
    line, where a details page starts with its column header (whatever the file's name)."""
    return _text(path).startswith('"Kernel Name",')


if __name__ == "__main__":
    sys.exit(main())
