"""Long-run checks on the GPU: CUDA-graph replays against eager, memory, determinism.

    python benchmarks/reliability.py [--replays 10000] [--refresh 100] [--check-every 500]

Builds WideMoE over a stock layer of Kimi-K3's dims (fewer experts by default, so that a
replay takes milliseconds; ``--experts 896`` for the full layer), captures one forward
in a CUDA graph, and replays it ``--replays`` times. Every ``--refresh`` replays the
static input gets fresh rows; every ``--check-every`` replays the graph's output is
compared bit for bit with an eager call on the same input, and the mailbox is checked to
be all-empty between calls. Exits non-zero on the first difference.

``--sanitize`` instead runs a few eager calls at the tiny dims (for compute-sanitizer);
``--invariance`` checks that a row's output has the same bits alone, inside 65 rows and
inside 1024 rows (the tuned configs change tiles per batch width, never reductions): of
the front GEMM, the shared expert and the tail on their own, then of the layer, so that
a difference names the stage where it starts.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from wide_moe_triton import LatentMoE, WideMoE, WideMoEConfig  # noqa: E402
from wide_moe_triton.kernels import front as front_k  # noqa: E402
from wide_moe_triton.kernels import mailbox as mailbox_k  # noqa: E402
from bench_layer import capture_graph  # noqa: E402  (this folder is on sys.path)


def mailbox_empty(wide) -> bool:
    box, L = wide.scratch.mailbox, wide.cfg.latent
    return bool((box[:, :, :L] == mailbox_k.SENTINEL_BF16).all()) and bool(
        (box[:, :, L:].contiguous().view(torch.int32) == mailbox_k.SENTINEL_WORD).all())


def sanitize_run() -> int:
    cfg = WideMoEConfig.tiny()
    stock = LatentMoE(cfg, seed=0, device="cuda")
    wide = WideMoE.from_module(stock)
    for b in (1, 17, 64):
        x = torch.randn(b, cfg.hidden, device="cuda").bfloat16()
        y = wide(x)
        err = ((y.float() - stock(x).float()).norm() / stock(x).float().norm()).item()
        print(f"sanitize b={b}: rel err {err:.2e}, mailbox empty {mailbox_empty(wide)}")
    torch.cuda.synchronize()
    return 0


def invariance_run(experts: int) -> int:
    cfg = WideMoEConfig.kimi_k3(tp=1).replace(num_experts=experts)
    stock = LatentMoE(cfg, seed=0, device="cuda")
    wide = WideMoE.from_module(stock)
    x = torch.randn(1024, cfg.hidden, device="cuda").bfloat16()
    latent = torch.randn(1024, cfg.latent, device="cuda").bfloat16()
    # The dense stages on their own, then the layer: a difference names where it starts.
    stages = {"front GEMM": lambda rows: front_k.front_gemm(x[rows], wide.packed),
              "shared expert": lambda rows: wide.shared(x[rows]),
              "tail": lambda rows: wide.tail(latent[rows], torch.zeros_like(x[rows])),
              "layer": lambda rows: wide(x[rows])}
    same = True
    for name, run in stages.items():
        alone, in_65, in_all = run(slice(7, 8)), run(slice(0, 65))[7:8], run(slice(0, 1024))[7:8]
        equal = torch.equal(alone, in_65) and torch.equal(alone, in_all)
        same &= equal
        print(f"batch invariance at E={experts}, {name}: row 7 alone / in 65 / in 1024 "
              f"{'bitwise equal' if equal else 'DIFFER'}")
    return 0 if same else 1


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--replays", type=int, default=10000)
    p.add_argument("--refresh", type=int, default=100)
    p.add_argument("--check-every", type=int, default=500)
    p.add_argument("--batch", type=int, default=65)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--sanitize", action="store_true")
    p.add_argument("--invariance", action="store_true")
    args = p.parse_args(argv)
    if args.sanitize:
        return sanitize_run()
    if args.invariance:
        return invariance_run(args.experts)
    cfg = WideMoEConfig.kimi_k3(tp=1).replace(num_experts=args.experts)
    stock = LatentMoE(cfg, seed=0, device="cuda")
    wide = WideMoE.from_module(stock)
    gen = torch.Generator(device="cuda").manual_seed(7)
    fresh = lambda: torch.randn(args.batch, cfg.hidden, generator=gen, device="cuda").bfloat16()  # noqa: E731
    static = fresh()
    ref = stock(static)
    eager = wide(static)
    err = ((eager.double() - ref.double()).norm() / ref.double().norm()).item()
    print(f"eager vs stock: rel err {err:.2e}")
    if not err < 1e-2:
        return 1
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
            got = out.clone()
            if not mailbox_empty(wide):
                print(f"replay {i}: mailbox not empty after the call")
                return 1
            expect = wide(static)
            if not torch.equal(got, expect):
                bad = (got != expect).sum().item()
                print(f"replay {i}: graph output differs from eager in {bad} elements")
                return 1
            checks += 1
            del got, expect
    wide.check_mailbox()
    flat = len(set(memory)) == 1
    print(f"{args.replays} replays in {time.time() - start:.1f} s, {checks} bitwise checks "
          f"against eager passed; memory allocated at the checks: {memory[0]} .. "
          f"{memory[-1]} bytes ({'flat' if flat else 'GROWING'}); no mailbox error")
    return 0 if flat else 1


if __name__ == "__main__":
    sys.exit(main())
