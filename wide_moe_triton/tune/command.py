"""The command line of ``wide-moe-tune`` (``python -m wide_moe_triton.tune``): its help,
its arguments' checks, and the sweep's table and report written."""

from __future__ import annotations

import datetime
import json
import os
import pathlib
import time

import torch

from .. import cli, tuning
from . import engine, kernel_cases
from .engine import (BUCKETS, FINALISTS, QUICK_BUCKETS, QUICK_KERNEL_BUDGET, QUICK_REP_MS,
                     ROUNDS)
from .search import QUICK_REDUCTIONS
from .table import _base_table, gains_report, write_table


DESCRIPTION = f"""\
Find the fastest launch settings of the layer's GPU kernels on this GPU and save them
as a table that the layer reads from then on, on any machine with this GPU model.

For each kernel of the layer (routing the tokens to experts, the experts' two matrix
products, adding up each token's expert outputs, the norm, and the dense matrix products
of the router, the shared expert and the output projection), at the per-rank shapes of
Kimi-K3 for each tensor-parallel degree of --tp and at each batch width of --batches, it
tries launch settings (tile sizes, warps, pipeline stages, how a long sum is split),
checks each one's output against a reference computation (a setting that gives a wrong
answer is never kept), times those that pass, and keeps the fastest. At the end the
few fastest and the default are timed again side by side, several times over, and the
one with the least median time is kept (a GPU's clock drifts over a long sweep).

How long: with --quick (widths {" ".join(map(str, QUICK_BUCKETS))}, a few settings each)
--tp 8 16 1 took 160-230 s on an H200. Without --quick it tries every width of
{" ".join(map(str, BUCKETS))} and more settings each: longer (not measured). A progress
line (a bar with tqdm installed) shows the kernel and the width being tried;
--time-limit bounds the sweep; an interrupted sweep resumes where it stopped (from
<table>.partial.json).

Where it writes: <GPU name>.json in your tables' directory: $WIDE_MOE_CONFIG_DIR, else
$XDG_CACHE_HOME/wide_moe_triton, else ~/.cache/wide_moe_triton. The layer looks there
first, then among the tables the package ships (the H200's). --out writes elsewhere.
Beside the table, <GPU name>.md: each kept setting against the default, with their
times. A sweep of some kernels (--kernels) keeps the table's other entries (from the
table the layer reads now on this GPU, when your directory has none yet); a sweep of
every kernel writes the table anew.

No GPU: tuning times kernels on the GPU it tunes for, so it needs one. --dry-run runs
the whole sweep on the CPU instead, in Triton's interpreter at small dims, to see it
work: it checks every setting and times nothing that matters.

Errors are one line naming the argument or file: exit status 2 for a bad argument, 1
for a failure while tuning (--debug shows the traceback).

Examples:
  %(prog)s --quick --tp 8 16 1
  %(prog)s --tp 8 16 1 --batches 1 16 64 128 256 512 1024
  %(prog)s --quick --kernels front latent_up
  %(prog)s --dry-run --quick --tp 1 --batches 4 --kernels finalize
"""


def parser() -> cli.Parser:
    """The command line of ``wide-moe-tune`` (``python -m wide_moe_triton.tune``)."""
    p = cli.Parser("wide_moe_triton.tune", description=DESCRIPTION)
    p.add_argument("--tp", type=cli.positive_int, nargs="+", metavar="T",
                   help="tensor-parallel degrees (GPUs a layer is split over) whose per-GPU "
                        "shapes are tuned (default: 8 16 1; with --dry-run 1)")
    p.add_argument("--batches", type=cli.positive_int, nargs="+", metavar="B",
                   help="batch widths (tokens a step) to tune; a batch runs the settings "
                        "of the narrowest width at least as wide (default: "
                        f"{' '.join(map(str, BUCKETS))}; with --quick "
                        f"{' '.join(map(str, QUICK_BUCKETS))})")
    p.add_argument("--kernels", nargs="+", metavar="KERNEL", choices=kernel_cases.KERNELS,
                   help=f"tune only these kernels, keeping the table's other entries (names: "
                        f"{', '.join(kernel_cases.KERNELS)}) (default: every kernel, the "
                        f"table written anew)")
    p.add_argument("--experts-layout", metavar="LAYOUT",
                   help="how the experts' weights are laid out in memory for the tuned "
                        "kernels (one of wgmma_decode, wgmma, nk); each layout has its own "
                        "table entries (default: the one this GPU uses, wgmma_decode on "
                        "Hopper GPUs such as the H100 and H200, nk elsewhere)")
    p.add_argument("--quick", action="store_true",
                   help=f"a short sweep: widths {' '.join(map(str, QUICK_BUCKETS))}; the "
                        f"default, settings known to be good and their close variants (3 "
                        f"random settings more for the cheap kernels, {QUICK_REDUCTIONS} or "
                        f"more ways of splitting the sums of the dense products), "
                        f"{QUICK_REP_MS} ms a measurement, {QUICK_KERNEL_BUDGET} s a kernel "
                        f"at most (default: off)")
    p.add_argument("--candidates", type=cli.natural_int, metavar="N",
                   help="random settings to try at each point besides the close variants "
                        "of the best so far (default: every setting)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the random settings and the test data (default: 0)")
    p.add_argument("--fresh", action="store_true",
                   help="start over, ignoring what an interrupted sweep left in "
                        "<table>.partial.json (default: resume from it)")
    p.add_argument("--out", metavar="PATH",
                   help="the table to write (default: <GPU name>.json in your tables' "
                        "directory, see above); the report goes beside it as .md")
    p.add_argument("--workers", type=cli.positive_int,
                   default=min(16, len(os.sched_getaffinity(0))), metavar="N",
                   help="threads compiling settings ahead of timing them; 1 compiles each "
                        "when it is first timed (default: this machine's cores, at most "
                        "16: %(default)s)")
    p.add_argument("--time-limit", type=cli.positive_float, metavar="S",
                   help="start no kernel after S seconds and write the table of what is "
                        "done (default: no limit)")
    p.add_argument("--kernel-budget", type=cli.positive_float, metavar="S",
                   help=f"seconds of timing one kernel's settings may take (default: "
                        f"{QUICK_KERNEL_BUDGET} under --quick, else no limit)")
    p.add_argument("--finalists", type=cli.positive_int, default=FINALISTS, metavar="N",
                   help=f"how many of the fastest settings at each point are timed again "
                        f"beside the default at the end (default: {FINALISTS})")
    p.add_argument("--rounds", type=cli.positive_int, default=ROUNDS, metavar="N",
                   help=f"how many times that final timing runs, the settings taking turns; "
                        f"the least median time wins (default: {ROUNDS})")
    p.add_argument("--dry-run", action="store_true",
                   help="no GPU needed: the whole sweep at small dims in Triton's "
                        "interpreter on the CPU, to see it work; times nothing that "
                        "matters (default: off; writes dry-run.json in your tables' "
                        "directory unless --out)")
    return p


def main(argv=None) -> int:
    """The command: 0 once the table is written; an error is one line (``cli.run``): 2
    for a bad argument (no GPU without --dry-run included), 1 for a failure."""
    return cli.run("wide-moe-tune", parser(), _main, argv)


def _main(args, p: cli.Parser) -> int:
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"
    elif not torch.cuda.is_available():
        p.error("no CUDA GPU here, and tuning times the kernels on the GPU it tunes for; "
                "--dry-run runs the sweep on this CPU instead (Triton's interpreter, small "
                "dims, no timings that matter)")
    # Imported only now: kernels defined before --dry-run sets TRITON_INTERPRET would not
    # run in the interpreter.
    from ..kernels.experts import LAYOUTS
    if args.experts_layout is not None and args.experts_layout not in LAYOUTS:
        p.error(f"argument --experts-layout: must be one of {', '.join(LAYOUTS)}, got "
                f"{args.experts_layout!r}")
    args.tp = args.tp or ([1] if args.dry_run else [8, 16, 1])
    for tp in args.tp:
        try:
            engine.dims(args, tp)
        except ValueError as err:
            p.error(f"argument --tp: {tp} does not split the layer's dims ({err})")
    name = tuning.gpu_name()
    args.out = args.out or str(tuning.user_dir() / "dry-run.json" if args.dry_run
                               else tuning.table_path(name))
    if os.path.isdir(args.out):
        p.error(f"argument --out: {args.out} is a directory; give the table's file name")
    if args.kernels:  # the table it folds into, read now rather than after the sweep
        _base_table(pathlib.Path(args.out), name)
    args.batches = args.batches or list(QUICK_BUCKETS if args.quick else BUCKETS)
    if args.kernel_budget is None and args.quick:
        args.kernel_budget = QUICK_KERNEL_BUDGET
    args.stopped = False
    start = time.monotonic()
    done = engine.sweep(args)
    out = pathlib.Path(args.out)
    write_table(done, out, args)
    name = name or "interpreter (dry run)"
    report = gains_report(done, f"Tuned vs default launch configs, {name} "
                                f"({datetime.date.today().isoformat()}, "
                                f"`tune {json.loads(out.read_text())['sweep']}`)")
    out.with_suffix(".md").write_text(report)
    print("\n" + report + f"\nwrote {out.with_suffix('.md')}; sweep took "
          f"{time.monotonic() - start:.0f} s" + (" (stopped at the time limit)"
                                                  if args.stopped else ""))
    return 0
