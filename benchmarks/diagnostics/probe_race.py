"""Whether the experts give the same bits on the same input however they are run: the
probe that found the MMAs' register-operand race (benchmarks/NOTES.md, "Register-operand
wait"; fixed by ``experts._settled``). Exits 1 if any run differs.

    python benchmarks/diagnostics/probe_race.py [--experts 896] [--batch 256 ...] [--runs 30]
        [--layer]

Without ``--layer``: the experts stage alone over one routing, with the table's config
at each width and variants of it, run eagerly, eagerly beside cuBLAS GEMMs on another
stream, replayed from a CUDA graph, and beside the shared expert (eagerly and in one
graph with it); each run's hidden codes and rows (poisoned before it) against the first
eager call's. The race showed only in the last: the MMAs read their register operand
late when another kernel's programs share the SM.

``--layer``: the whole layer's graph against eager calls on the same inputs, stage by
stage (``reliability.stage_outputs``), as is and with one thing changed at a time (the
shared expert on the routed chain's stream, no dependent launches, the up launch at
maxnreg 96, no half tiles in the down launch); where it differs, which hidden columns,
pairs and experts, and by how much.
"""

from __future__ import annotations

import argparse
import contextlib
import pathlib
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))  # the repository
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # benchmarks/

from bench_layer import capture_graph  # noqa: E402  (benchmarks/ is on sys.path)
from wide_moe_triton import LatentMoE, WideMoE, WideMoEConfig, mx, tuning  # noqa: E402
from wide_moe_triton.kernels import experts as experts_k  # noqa: E402
from wide_moe_triton.kernels import finalize as finalize_k  # noqa: E402
from wide_moe_triton.kernels import route as route_k  # noqa: E402


def table_configs(wide, b: int) -> tuple[dict, dict]:
    """(up, down) launch configs the layer takes at batch width b."""
    cfg, dev = wide.cfg, wide.device
    tune = experts_k.tuning(wide.experts.layout, dev)
    key = experts_k.shape_key(cfg.latent, cfg.intermediate_per_rank,
                              cfg.num_experts) + tune.suffix
    return (tuning.config_for(experts_k.KERNEL_UP, key, b, tune.default_up, dev),
            tuning.config_for(experts_k.KERNEL_DOWN, key, b, tune.default_down, dev))


class StageRun:
    """One routing of b tokens and the experts stage over it, with buffers to poison and
    snapshot."""

    def __init__(self, wide, b: int):
        cfg, dev = wide.cfg, wide.device
        gen = torch.Generator(device=dev).manual_seed(11)
        logits = torch.randn(b, cfg.num_experts, generator=gen, device=dev)
        latent = torch.randn(b, cfg.latent, generator=gen, device=dev).bfloat16()
        self.lists = route_k.RoutingLists.empty(cfg.num_experts, cfg.wide_rows, dev)
        route_k.route(logits, wide.bias, cfg.top_k, True, 1.0, lists=self.lists)
        self.plan = mx.quantize_mxfp8(latent)
        self.work = experts_k.make_workspace(b, cfg.top_k, cfg.latent,
                                             cfg.intermediate_per_rank, dev)
        self.rows = torch.empty(b * cfg.top_k, cfg.latent, dtype=torch.bfloat16, device=dev)
        self.x = torch.randn(b, cfg.hidden, generator=gen, device=dev).bfloat16()
        self.wide, self.b = wide, b

    def call(self, up: dict, down: dict) -> None:
        cfg, ls = self.wide.cfg, self.lists
        experts_k.experts(*self.plan, self.wide.experts, ls.counts, ls.pairs, ls.generation,
                          cfg.top_k, cfg.beta, cfg.linear_beta, rows=self.rows,
                          workspace=self.work, config_up=up, config_down=down)

    def poison(self) -> None:
        self.work.h_codes.fill_(0x7F)
        self.rows.fill_(float("nan"))

    def snapshot(self) -> tuple[torch.Tensor, torch.Tensor]:
        torch.cuda.synchronize()
        return (self.work.h_codes[:self.b * self.wide.cfg.top_k].clone(),
                self.rows.view(torch.int16).clone())


def stage_ways(run: StageRun, up: dict, down: dict) -> dict:
    """name -> a function that runs the stage once that way."""
    side, other = torch.cuda.Stream(), torch.cuda.Stream()
    load = torch.randn(8192, 8192, device=run.wide.device, dtype=torch.bfloat16)

    def beside_gemms():
        torch.cuda.synchronize()
        with torch.cuda.stream(other):
            for _ in range(3):
                load @ load
        run.call(up, down)

    def beside_shared():
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            run.wide.shared(run.x)
        run.call(up, down)
        torch.cuda.current_stream().wait_stream(side)
    alone, _ = capture_graph(run.call, up, down, warmups=1)
    together, _ = capture_graph(beside_shared, warmups=1)
    return {"eager": lambda: run.call(up, down), "eager beside GEMMs": beside_gemms,
            "graph": alone.replay, "eager beside the shared expert": beside_shared,
            "graph beside the shared expert": together.replay}


def stage_runs(wide, args) -> bool:
    """The stage alone, every way, every variant; True if every run gave the first's bits."""
    same = True
    for b in args.batch:
        run, (up, down) = StageRun(wide, b), table_configs(wide, b)
        print(f"b={b}: up {up}; down {down}", flush=True)
        variants = {"table": up, "maxnreg 96": dict(up, maxnreg=96),
                    "maxnreg 128": dict(up, maxnreg=128),
                    "MASK_ROWS 0": dict(up, MASK_ROWS=0), "stages 4": dict(up, num_stages=4)}
        for name, config in variants.items():
            t0 = time.time()
            run.poison()
            run.call(config, down)
            first = run.snapshot()
            counts = {}
            for way, once in stage_ways(run, config, down).items():
                differ = 0
                for _ in range(args.runs):
                    run.poison()
                    once()
                    hidden, rows = run.snapshot()
                    differ += not (torch.equal(hidden, first[0]) and torch.equal(rows, first[1]))
                counts[way] = differ
                same &= differ == 0
            print(f"  {name:12s} runs differing from the first call (of {args.runs}): "
                  + ", ".join(f"{way} {n}" for way, n in counts.items())
                  + f" ({time.time() - t0:.0f} s)", flush=True)
    return same


def describe(replayed: dict, eager: dict, ids: torch.Tensor) -> None:
    """Where the hidden codes differ: which pairs (their tokens and experts), which
    64-column groups, and by how much the BF16 hidden values differ there."""
    diff = replayed["experts hidden codes"] != eager["experts hidden codes"]
    pairs = diff.any(dim=1).nonzero()[:, 0]
    groups = sorted(set((diff.any(dim=0).nonzero()[:, 0] // 64).tolist()))
    gv, ev = replayed["experts hidden values"].float(), eager["experts hidden values"].float()
    rel = ((gv - ev).abs() / ev.abs().clamp_min(1e-30))[diff]
    print(f"    {pairs.numel()} pairs differ, first {pairs[:12].tolist()}; their experts "
          f"{sorted(set(ids.reshape(-1)[pairs].tolist()))[:12]}, tokens "
          f"{sorted(set((pairs // ids.shape[1]).tolist()))[:12]}\n"
          f"    64-column groups {groups}; differing elements a pair "
          f"{diff.sum(dim=1)[pairs][:12].tolist()}; relative difference of the values: "
          f"median {rel.median().item():.3g}, max {rel.max().item():.3g}", flush=True)


@contextlib.contextmanager
def shared_on_chain(wide):
    """The shared expert on the routed chain's stream: nothing runs beside the experts."""
    s = wide.scratch
    saved, s.side = s.side, s.chain
    try:
        yield
    finally:
        s.side = saved


@contextlib.contextmanager
def no_dependent_launches():
    saved = finalize_k.dependent_launch, experts_k.dependent_launch
    finalize_k.dependent_launch = experts_k.dependent_launch = lambda device: False
    try:
        yield
    finally:
        finalize_k.dependent_launch, experts_k.dependent_launch = saved


def layer_runs(wide, args) -> bool:
    """For each width and variation: a graph of the layer replayed on ``args.runs``
    inputs, each compared stage by stage with an eager call on the same input; True if
    every one agreed."""
    from reliability import first_difference, stage_outputs

    cfg, same = wide.cfg, True
    for b in args.batch:
        up, down = table_configs(wide, b)
        variations = {
            "as is": contextlib.nullcontext,
            "shared expert on the chain stream": lambda: shared_on_chain(wide),
            "no PDL": no_dependent_launches,
            "up maxnreg 96": lambda: tuning.override(experts_k.KERNEL_UP, dict(up, maxnreg=96)),
            "down HALF_TILE 0": lambda: tuning.override(experts_k.KERNEL_DOWN,
                                                        dict(down, HALF_TILE=0)),
        }
        gen = torch.Generator(device=wide.device).manual_seed(7)
        fresh = lambda: torch.randn(b, cfg.hidden, generator=gen,  # noqa: E731
                                    device=wide.device).bfloat16()
        for name, context in variations.items():
            t0, differ, firsts = time.time(), 0, set()
            with context():
                static = fresh()
                graph, out = capture_graph(wide, static)
                for _ in range(args.runs):
                    static.copy_(fresh())
                    graph.replay()
                    torch.cuda.synchronize()
                    replayed = stage_outputs(wide, b, out)
                    eager = stage_outputs(wide, b, wide(static))
                    if not torch.equal(replayed["output"].view(torch.int16),
                                       eager["output"].view(torch.int16)):
                        differ += 1
                        firsts.add(first_difference(replayed, eager).split(" (")[0])
                        if differ == 1:
                            describe(replayed, eager, wide.scratch.ids[:b])
                del graph, out
            same &= differ == 0
            print(f"b={b} {name:34s}: graph != eager on {differ}/{args.runs} inputs; first "
                  f"stage differing: {sorted(firsts) or '-'} ({time.time() - t0:.0f} s)",
                  flush=True)
    return same


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--experts", type=int, default=896)
    p.add_argument("--batch", type=int, nargs="+", default=[256])
    p.add_argument("--runs", type=int, default=30)
    p.add_argument("--layer", action="store_true",
                   help="the whole layer's graph against eager, under variations")
    args = p.parse_args(argv)
    if args.runs < 1 or min(args.batch) < 1:
        p.error("--runs and --batch must be positive")
    cfg = WideMoEConfig.kimi_k3(tp=1).replace(num_experts=args.experts)
    if max(args.batch) > cfg.wide_rows:
        p.error(f"--batch must be <= wide_rows ({cfg.wide_rows})")
    wide = WideMoE.from_module(LatentMoE(cfg, seed=0, device="cuda"))
    same = layer_runs(wide, args) if args.layer else stage_runs(wide, args)
    print(f"probe_race: {'every run agreed' if same else 'RUNS DIFFER'}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
