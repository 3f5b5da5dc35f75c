"""What the dependent launch of finalize (``kernels/pdl.py``) saves on this GPU.

    python benchmarks/diagnostics/probe_pdl.py [--batches 65 128 1024]

For each batch width, finalize at TP8 dims (L 3584, K 16, its tuned config) launched
plainly and as a dependent, each timed three ways (CUDA-graph medians, µs): alone (a
graph of finalize calls, as ``bench_layer.py`` times it), and added after a producer
kernel that rewrites ``rows`` (graph of producer + finalize minus the producer alone),
once with a producer that lets its dependents start as its programs start and once with
one that does not. Every variant is first checked bitwise against
``reference.finalize`` right after the producer, so a dependent that read ``rows`` too
early shows. Needs a CUDA GPU (the interpreter runs no dependent launch).
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))  # the repository
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from probe_front import bench, copy_bandwidth  # noqa: E402
from wide_moe_triton import reference  # noqa: E402
from wide_moe_triton.kernels import finalize as fin  # noqa: E402
from wide_moe_triton.kernels.pdl import allow_dependent_launch  # noqa: E402

L, K = 3584, 16
_PLAIN = fin.dependent_launch


@triton.jit
def _rewrite(src_ptr, dst_ptr, n, BLOCK: tl.constexpr, TRIGGER: tl.constexpr):
    """dst = src + 1 (int16), BLOCK elements a program; TRIGGER: dependents may start."""
    allow_dependent_launch(TRIGGER)
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    tl.store(dst_ptr + i, tl.load(src_ptr + i, mask=i < n) + 1, mask=i < n)


def probe(b: int, gen: torch.Generator, bw: float) -> list[tuple]:
    rows = torch.randn(b * K, L, generator=gen, device="cuda").bfloat16()
    src = rows.view(torch.int16) - 1  # the producer writes rows' own bits back
    weights = torch.rand(b, K, generator=gen, device="cuda").bfloat16()
    ref = reference.finalize(rows, weights)
    out = torch.empty(b, L, dtype=torch.bfloat16, device="cuda")
    floor = (rows.numel() + weights.numel() + b * L) * 2 / bw * 1e6
    n = rows.numel()
    found = []
    for dependent in (False, True):
        fin.dependent_launch = _PLAIN if dependent else (lambda device: False)
        try:
            run = lambda: fin.finalize(rows, weights, out=out)  # noqa: E731
            alone = bench(run)
            for trigger in (False, True):
                def produce():
                    _rewrite[(triton.cdiv(n, 4096),)](src, rows.view(torch.int16), n,
                                                      BLOCK=4096, TRIGGER=trigger)
                out.fill_(float("nan"))
                produce()
                run()
                ok = torch.equal(out.view(torch.int16), ref.view(torch.int16))
                added = bench(lambda: (produce(), run())) - bench(produce)
                found.append((b, dependent, trigger, ok, alone, added, floor))
                print(f"b={b} dependent={dependent} producer triggers={trigger}: bitwise {ok}, "
                      f"alone {alone:.2f} us, added after the producer {added:.2f} us "
                      f"(floor {floor:.2f})", flush=True)
        finally:
            fin.dependent_launch = _PLAIN
    return found


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batches", type=int, nargs="+", default=[65, 128, 1024])
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("probe_pdl needs a CUDA GPU", file=sys.stderr)
        return 2
    bw = copy_bandwidth()
    gen = torch.Generator(device="cuda").manual_seed(0)
    print(f"# {torch.cuda.get_device_name()}; copy {bw / 1e12:.2f} TB/s; dependent launch "
          f"{'on' if _PLAIN(torch.device('cuda')) else 'not available'} here")
    found = [row for b in args.batches for row in probe(b, gen, bw)]
    print("\n| b | launch | producer triggers | bitwise | alone µs | added after the producer "
          "µs | floor µs |")
    print("|---|---|---|---|---|---|---|")
    for b, dependent, trigger, ok, alone, added, floor in found:
        print(f"| {b} | {'dependent' if dependent else 'plain'} | {'yes' if trigger else 'no'} "
              f"| {ok} | {alone:.2f} | {added:.2f} | {floor:.2f} |")
    return 0 if all(row[3] for row in found) else 1


if __name__ == "__main__":
    sys.exit(main())
