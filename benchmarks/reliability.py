"""Long-run and determinism checks on the GPU (issue 8): batch invariance, claim order,
CUDA-graph replays against eager, memory, the mailbox; and a tiny run for
compute-sanitizer.

    python benchmarks/reliability.py [--invariance] [--claim-order] [--replays 10000]
                                     [--refresh 100] [--check-every 500] [--experts 128]
                                     [--batch 65 [256 ...]]
    compute-sanitizer --tool memcheck|racecheck python benchmarks/reliability.py \
        --sanitize [--sanitize-batches 1 17 64]

The checks asked for run in this order, in one process, over one WideMoE built from a
stock layer at Kimi-K3's dims (H 7168, L 3584, I 3072, S 6144, K 16) with ``--experts``
experts (128 by default: a replay then takes milliseconds and the build seconds). The
experts' configs are tuned per E, so only 896, the production layer, runs the table's
(E = 128 runs the defaults; the MMAs' register race showed at 896 only:
benchmarks/NOTES.md, "Register-operand wait"): ``benchmarks/diagnostics/h200.sh check``
runs 896.

- ``--invariance``: row 7's output has the same bits alone, inside 65 rows and inside
  ``wide_rows`` (1024) rows, for the whole layer first; only if that differs (or with
  ``--stages``) the front GEMM, the shared expert and the tail alone, to name the stage
  where it starts.
- ``--claim-order``: the experts stage over the lists the route claimed, then over the
  same lists shuffled within every expert: identical bits (the atomic claims land in
  any order on a GPU); and 20 eager layer calls on one input: identical bits, with how
  many claim orders actually differed between calls.
- ``--replays N``: one forward captured in a CUDA graph, replayed N times; the static
  input gets fresh rows every ``--refresh`` replays; every ``--check-every`` replays the
  graph's output is compared bit for bit with an eager call and the mailbox checked
  all-empty; memory allocated must stay flat. Exits non-zero on the first difference,
  naming every stage whose output in the scratch differs between the two calls (the
  first named is where it starts) and whether a second eager call agrees with the first.

``--batch`` widths (65 by default): the claim-order check and the replays run at each.

With none of the three flags, ``--replays`` alone runs (its default 10000).
``--sanitize`` runs a few eager calls at the tiny dims (every kernel once per batch
width) for compute-sanitizer: keep it tiny under racecheck, which is slow.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import time

if "--dry-run" in sys.argv[1:]:  # before triton is imported: its interpreter runs the kernels
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from wide_moe_triton import LatentMoE, WideMoE, WideMoEConfig, mx  # noqa: E402
from wide_moe_triton.kernels import experts as experts_k  # noqa: E402
from wide_moe_triton.kernels import front as front_k  # noqa: E402
from wide_moe_triton.kernels import mailbox as mailbox_k  # noqa: E402
from wide_moe_triton.kernels import route as route_k  # noqa: E402
from bench_layer import capture_graph  # noqa: E402  (this folder is on sys.path)


def mailbox_empty(wide) -> bool:
    box, L = wide.scratch.mailbox, wide.cfg.latent
    return bool((box[:, :, :L] == mailbox_k.SENTINEL_BF16).all()) and bool(
        (box[:, :, L:].contiguous().view(torch.int32) == mailbox_k.SENTINEL_WORD).all())


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.int16), b.view(torch.int16))


def sanitize_run(batches) -> int:
    cfg = WideMoEConfig.tiny()
    stock = LatentMoE(cfg, seed=0, device="cuda")
    wide = WideMoE.from_module(stock)
    for b in batches:
        x = torch.randn(b, cfg.hidden, device="cuda").bfloat16()
        y = wide(x)
        ref = stock(x)
        err = ((y.float() - ref.float()).norm() / ref.float().norm()).item()
        print(f"sanitize b={b}: rel err {err:.2e}, mailbox empty {mailbox_empty(wide)}")
    wide.check_mailbox()
    torch.cuda.synchronize()
    return 0


def invariance_run(wide, stages: bool) -> bool:
    """Row 7 alone / in 65 / in wide_rows rows, the layer first, the stages if asked or
    if the layer differs."""
    cfg, widest = wide.cfg, wide.cfg.wide_rows
    gen = torch.Generator(device=wide.device).manual_seed(3)
    x = torch.randn(widest, cfg.hidden, generator=gen, device=wide.device).bfloat16()
    latent = torch.randn(widest, cfg.latent, generator=gen, device=wide.device).bfloat16()
    checks = {"layer": lambda rows: wide(x[rows])}
    dense = {"front GEMM": lambda rows: front_k.front_gemm(x[rows], wide.packed),
             "shared expert": lambda rows: wide.shared(x[rows]),
             "tail": lambda rows: wide.tail(latent[rows], torch.zeros_like(x[rows]))}
    same, t0 = True, time.time()
    for name, run in checks.items() if not stages else {**checks, **dense}.items():
        alone, in_65, in_all = run(slice(7, 8)), run(slice(0, 65))[7:8], run(slice(0, widest))[7:8]
        if name == "front GEMM":
            alone, in_65, in_all = (t.view(torch.int32) for t in (alone, in_65, in_all))
        equal = torch.equal(alone, in_65) and torch.equal(alone, in_all)
        same &= equal
        print(f"batch invariance at E={cfg.num_experts}, {name}: row 7 alone / in 65 / in "
              f"{widest} {'bitwise equal' if equal else 'DIFFER'} ({time.time() - t0:.0f} s)",
              flush=True)
        if name == "layer" and not equal and not stages:
            return invariance_run(wide, stages=True) and False
    return same


def shuffled_lists(lists, parity: int, seed: int):
    """A copy of ``lists`` whose pairs of parity ``parity`` are shuffled within each
    expert (entries past each count untouched)."""
    counts, pairs = lists.counts[parity], lists.pairs[parity]
    slots = torch.arange(pairs.shape[1], device=pairs.device)
    keys = torch.rand(pairs.shape, generator=torch.Generator(device=pairs.device).manual_seed(seed),
                      device=pairs.device)
    keys = torch.where(slots < counts[:, None], keys, 2.0 + slots)  # tails keep their place
    out = route_k.RoutingLists(lists.counts.clone(), lists.pairs.clone(), lists.generation)
    out.pairs[parity] = torch.gather(pairs, 1, keys.argsort(dim=1))
    return out


def claim_order_run(wide, b: int) -> bool:
    """The experts over claimed lists, then over the same lists shuffled: same bits; and
    repeated eager layer calls: same bits (reporting whether claim orders varied)."""
    cfg, dev = wide.cfg, wide.device
    gen = torch.Generator(device=dev).manual_seed(11)
    logits = torch.randn(b, cfg.num_experts, generator=gen, device=dev)
    latent = torch.randn(b, cfg.latent, generator=gen, device=dev).bfloat16()
    lists = route_k.RoutingLists.empty(cfg.num_experts, cfg.wide_rows, dev)
    route_k.route(logits, wide.bias, cfg.top_k, True, 1.0, lists=lists)
    q, qs = mx.quantize_mxfp8(latent)
    work = experts_k.make_workspace(b, cfg.top_k, cfg.latent, cfg.intermediate_per_rank, dev)

    def rows_over(ls):
        return experts_k.experts(q, qs, wide.experts, ls.counts, ls.pairs, ls.generation,
                                 cfg.top_k, cfg.beta, cfg.linear_beta, workspace=work).clone()
    first = rows_over(lists)
    ok = all(same_bits(first, rows_over(shuffled_lists(lists, 0, s))) for s in range(3))
    print(f"claim order: experts rows over claimed vs 3 shuffled lists (b={b}): "
          f"{'bitwise equal' if ok else 'DIFFER'}")
    x = torch.randn(b, cfg.hidden, generator=gen, device=dev).bfloat16()
    ref, orders, same = wide(x), set(), True
    for _ in range(20):
        same &= same_bits(wide(x), ref)
        parity = int(wide.scratch.lists.generation.item() - 1) & 1
        orders.add(wide.scratch.lists.pairs[parity].cpu().numpy().tobytes())
    print(f"claim order: 20 eager layer calls (b={b}) {'bitwise equal' if same else 'DIFFER'}; "
          f"{len(orders)} distinct claim orders seen")
    return ok and same


def stage_outputs(wide, b: int, out: torch.Tensor) -> dict:
    """Copies of what each stage of the last ``b``-row call left in the scratch, in call
    order (the routing lists are left out: their order within an expert is the claims'),
    and the layer's output ``out``."""
    s, K = wide.scratch, wide.cfg.top_k
    h = s.hidden
    stages = {"front GEMM": s.front[:b], "route ids": s.ids[:b], "route weights": s.weights[:b],
              "plan codes": s.plan[0][:b], "plan scales": s.plan[1][:b],
              "plan values": h.q_values[:b], "shared hidden": s.shared_hidden[:b],
              "experts hidden codes": h.h_codes[:b * K],
              "experts hidden scales": h.h_scales[:b * K],
              "experts hidden values": h.h_values[:b * K], "experts rows": s.rows[:b * K],
              "finalize": s.latent_out[:b], "output": out}
    return {name: t.clone() for name, t in stages.items()}


def first_difference(graph: dict, eager: dict) -> str:
    """Which stages' outputs differ between two ``stage_outputs`` (the first named first),
    with how many bytes of each."""
    differ = []
    for name, g in graph.items():
        a, e = g.contiguous().view(torch.uint8), eager[name].contiguous().view(torch.uint8)
        if not torch.equal(a, e):
            differ.append(f"{name} ({(a != e).sum().item()} of {a.numel()} bytes)")
    return ", ".join(differ) if differ else "none"


def replay_run(wide, stock, args, b: int) -> bool:
    """``args.replays`` replays of one graph of a ``b``-row call, checked against eager
    calls on the same input every ``args.check_every``; on a difference, the stages whose
    outputs differ."""
    cfg = wide.cfg
    gen = torch.Generator(device="cuda").manual_seed(7)
    fresh = lambda: torch.randn(b, cfg.hidden, generator=gen, device="cuda").bfloat16()  # noqa: E731
    static = fresh()
    ref = stock(static)
    eager = wide(static)
    err = ((eager.double() - ref.double()).norm() / ref.double().norm()).item()
    print(f"b={b}: eager vs stock: rel err {err:.2e}")
    if not err < 1e-2:
        return False
    graph, out = capture_graph(wide, static)
    torch.cuda.synchronize()
    start, checks, memory = time.time(), 0, []
    for i in range(1, args.replays + 1):
        if i % args.refresh == 0:
            static.copy_(fresh())
        graph.replay()
        if i % args.check_every == 0 or i == args.replays:
            torch.cuda.synchronize()
            memory.append(torch.cuda.memory_allocated())
            replayed = stage_outputs(wide, b, out)
            if not mailbox_empty(wide):
                print(f"b={b}, replay {i}: mailbox not empty after the call")
                return False
            expect = stage_outputs(wide, b, wide(static))
            if not same_bits(replayed["output"], expect["output"]):
                again = same_bits(wide(static), expect["output"])
                print(f"b={b}, replay {i}: graph output differs from eager; stages that "
                      f"differ: {first_difference(replayed, expect)}; a second eager call "
                      f"{'agrees with' if again else 'DIFFERS from'} the first")
                return False
            checks += 1
            del replayed, expect
    del graph, out
    wide.check_mailbox()
    flat = len(set(memory)) == 1
    print(f"b={b}: {args.replays} replays in {time.time() - start:.1f} s, {checks} bitwise "
          f"checks against eager passed; memory allocated at the checks: {memory[0]} .. "
          f"{memory[-1]} bytes ({'flat' if flat else 'GROWING'}); no mailbox error",
          flush=True)
    return flat


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--replays", type=int, default=None)
    p.add_argument("--refresh", type=int, default=100)
    p.add_argument("--check-every", type=int, default=500)
    p.add_argument("--batch", type=int, nargs="+", default=[65],
                   help="batch widths, each checked by --claim-order and --replays")
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--invariance", action="store_true")
    p.add_argument("--stages", action="store_true",
                   help="with --invariance: the dense stages too, even if the layer agrees")
    p.add_argument("--claim-order", action="store_true")
    p.add_argument("--sanitize", action="store_true")
    p.add_argument("--sanitize-batches", type=int, nargs="+", default=[1, 17, 64])
    p.add_argument("--dry-run", action="store_true",
                   help="--invariance/--claim-order at tiny dims on the CPU (interpreter)")
    args = p.parse_args(argv)
    if args.dry_run and (args.sanitize or args.replays):
        p.error("--dry-run takes --invariance and --claim-order only (no CUDA graphs)")
    if args.sanitize:
        if max(args.sanitize_batches) > WideMoEConfig.tiny().wide_rows:
            p.error("--sanitize-batches must be <= 64 (tiny dims' wide_rows)")
        return sanitize_run(args.sanitize_batches)
    if not (args.invariance or args.claim_order or args.replays):
        args.replays = 10000
    if args.replays is not None and (args.replays < 1 or args.refresh < 1 or args.check_every < 1):
        p.error("--replays, --refresh and --check-every must be positive")
    if min(args.batch) < 1:
        p.error("--batch must be positive")
    t0 = time.time()
    if args.dry_run:
        cfg = WideMoEConfig.tiny(wide_rows=128)
    else:
        cfg = WideMoEConfig.kimi_k3(tp=1).replace(num_experts=args.experts)
    if max(args.batch) > cfg.wide_rows:
        p.error(f"--batch must be <= wide_rows ({cfg.wide_rows})")
    stock = LatentMoE(cfg, seed=0, device="cpu" if args.dry_run else "cuda")
    wide = WideMoE.from_module(stock)
    print(f"built E={cfg.num_experts} in {time.time() - t0:.0f} s", flush=True)
    ok = True
    if args.invariance:
        ok &= invariance_run(wide, args.stages)
    if args.claim_order:
        for b in args.batch:
            ok &= claim_order_run(wide, b)
    if args.replays:
        for b in args.batch:
            ok &= replay_run(wide, stock, args, b)
    print(f"reliability: {'PASS' if ok else 'FAIL'} ({time.time() - t0:.0f} s)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
