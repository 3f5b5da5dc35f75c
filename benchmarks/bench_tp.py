"""The whole layer, tensor-parallel over processes, timed per rank from CUDA graphs:

    torchrun --nproc-per-node 8 benchmarks/bench_tp.py [--batches 1 65 128 256 512 1024]
             [--all-reduce mailbox|nccl] [--replays 200] [--checkpoint DIR --layer N]
             [--no-stock] [--out results-tp8.md]

Each rank (GPU LOCAL_RANK, NCCL, the mailbox in symmetric memory) builds only its own
shard (Kimi-K3's dims drawn from --seed, or the checkpoint's slices), as the launcher
does (``wide_moe_triton.launch``, ``torchrun ... -m wide_moe_triton``), and compiles
every width's kernels before the first call (``WideMoE.warmup``). With --share-gpus on
a node with fewer GPUs than ranks, rank r runs on GPU LOCAL_RANK % G over gloo: the GPU
time-slices the ranks, so the table's times are not a multi-GPU node's (it says so).
At each width:

1. check: one eager call on every rank; every rank's output bits hashed and gathered
   (all equal), rank 0's against the stock layer at T = 1 on the CPU (relative error
   below 1e-2; ``--no-stock`` skips it: the stock path takes seconds a call there at
   these dims); a width that fails is reported, never timed;
2. capture one CUDA graph of the layer on every rank, replay it once and check the
   replay's output has the eager call's bits;
3. time: a barrier, then ``--replays`` replays between two CUDA events on every rank
   (the ranks replay in step: each replay's polls wait for its peers' words), the
   mailbox's error record read after; µs a call per rank, gathered.

Rank 0 prints one row a width (min, median and max over the ranks) and writes ``--out``
(markdown). ``--dry-run`` runs the same steps on the CPU at the tiny dims (gloo, shared
memory, Triton's interpreter) with one timed eager call in place of the graph: it checks
the script, its numbers mean nothing. It runs under torchrun (e.g. --nproc-per-node 2)
or alone (one rank).
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time

DRY = "--dry-run" in sys.argv[1:]
if DRY:  # before triton is imported: the kernels run in its interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from bench_layer import capture_graph  # noqa: E402  (benchmarks/bench_layer.py)
from wide_moe_triton import launch  # noqa: E402

GPU_BATCHES = [1, 65, 128, 256, 512, 1024]
LAUNCHER = f"torchrun --nproc-per-node {os.environ.get('WORLD_SIZE', '?')} "  # for the table


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tp", type=int, metavar="T",
                   help="must equal the world size torchrun started (default: it)")
    launch.add_layer_arguments(p)
    p.add_argument("--batches", type=int, nargs="+", metavar="B",
                   help=f"batch widths (default: {' '.join(map(str, GPU_BATCHES))}; dry run: "
                        "1 and wide_rows + 1)")
    p.add_argument("--replays", type=int, default=200, help="graph replays timed a width")
    p.add_argument("--no-stock", action="store_true",
                   help="skip rank 0's comparison with the stock layer")
    p.add_argument("--out", metavar="FILE", help="write rank 0's table here (markdown)")
    p.add_argument("--dry-run", action="store_true",
                   help="the CPU, the tiny dims, the interpreter: checks the script")
    if DRY:
        p.set_defaults(device="cpu")
    return p


def check_width(args, me, stock, wide, x) -> tuple[bool, str, torch.Tensor]:
    """Step 1 (every rank): (whether to time this width, what the check found, this
    rank's eager output)."""
    out, _ = launch.checked_call(wide, x)
    digests: list = [None] * me.world
    dist.all_gather_object(digests, launch.bits_digest(out), group=me.group)
    ok, found = len(set(digests)) == 1, "ranks: same bits" if len(set(digests)) == 1 else \
        "ranks: bits DIFFER"
    if me.rank == 0 and not args.no_stock:
        ref = stock(x.cpu())  # the whole layer lives on the CPU (launch.build_layer)
        err = ((out.cpu().float() - ref.float()).norm() / ref.float().norm()).item()
        ok, found = ok and err < launch.TOLERANCE, f"{found}; rel err vs stock {err:.1e}"
    verdict = [ok, found]
    dist.broadcast_object_list(verdict, src=0, group=me.group)
    return verdict[0], verdict[1], out


def time_width(args, me, wide, x, eager: torch.Tensor) -> tuple[float, bool]:
    """Steps 2 and 3: (µs a call on this rank, whether the graph's replay had the eager
    call's bits). Dry run: one eager call timed, no graph."""
    if me.device.type != "cuda":
        dist.barrier(group=me.group)
        start = time.perf_counter()
        out, _ = launch.checked_call(wide, x)
        return (time.perf_counter() - start) * 1e6, torch.equal(out, eager)
    # Every rank captures alike; the warm-up calls before the capture are collective.
    graph, out = capture_graph(wide, x)
    graph.replay()
    torch.cuda.synchronize()
    wide.check_mailbox()
    same = torch.equal(out.view(torch.int16), eager.view(torch.int16))
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    dist.barrier(group=me.group)
    torch.cuda.synchronize()
    begin.record()
    for _ in range(args.replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    wide.check_mailbox()
    return begin.elapsed_time(end) * 1e3 / args.replays, same


def run(args, me) -> int:
    if args.replays < 1:
        raise launch.Failed(launch.EXIT_USAGE, f"--replays must be positive, got {args.replays}")
    stock, wide = launch.build_layer(args, me, stock=not args.no_stock)
    cfg = wide.cfg
    batches = args.batches or ([1, cfg.wide_rows + 1] if DRY else GPU_BATCHES)
    wide.warmup(batches)  # no rank compiles inside a collective call
    lines = [launch.describe(me, cfg, args.all_reduce),
             f"{time.strftime('%Y-%m-%d')}, `{LAUNCHER}benchmarks/bench_tp.py "
             f"{' '.join(sys.argv[1:])}`", ""]
    if me.shared:
        lines += [f"Ranks share a GPU: {launch.SHARED_NOTE}.", ""]
    lines += ["| b | µs a call, fastest rank | median rank | slowest rank | check |",
              "| --- | --- | --- | --- | --- |"]
    if me.rank == 0:
        print("\n".join(lines), flush=True)
    status = launch.EXIT_OK
    for b in batches:
        x = launch.layer_input(args, cfg.hidden, b, me.device)
        ok, found, eager = check_width(args, me, stock, wide, x)
        if not ok:
            row = f"| {b} | not timed | | | {found} |"
            status = launch.EXIT_MISMATCH
        else:
            gathered: list = [None] * me.world
            dist.all_gather_object(gathered, time_width(args, me, wide, x, eager),
                                   group=me.group)
            us = sorted(u for u, _ in gathered)
            what = "graph" if me.device.type == "cuda" else "second call"
            replay = (f"{what} = eager" if all(s for _, s in gathered) else
                      f"{what} != eager on rank(s) " + str([r for r, (_, s) in
                                                             enumerate(gathered) if not s]))
            row = (f"| {b} | {us[0]:.1f} | {statistics.median(us):.1f} | {us[-1]:.1f} | "
                   f"{found}; {replay} |")
            if "!=" in replay:
                status = launch.EXIT_MISMATCH
        lines.append(row)
        if me.rank == 0:
            print(row, flush=True)
    memory = launch.peak_memory_line(me)
    if memory:
        lines += ["", memory]
        if me.rank == 0:
            print(memory, flush=True)
    if me.rank == 0 and args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")
    return status


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv=None) -> int:
    global LAUNCHER
    if not launch.under_torchrun():  # alone: a group of one rank
        LAUNCHER = "python "
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    return launch.run_as_rank(parser(), argv, run)


if __name__ == "__main__":
    sys.exit(main())
