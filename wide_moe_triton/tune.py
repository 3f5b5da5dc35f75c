"""``python -m wide_moe_triton.tune``: sweep every kernel's launch configs on this GPU and
write ``autotune_configs/<GPU name>.json``.

For each kernel, dims (TP rank-local shapes of Kimi-K3) and batch-width bucket it runs
each candidate through the kernel's own launch wrapper, checks the output against the
reference (a wrong config is never chosen), times it (``do_bench_cudagraph`` median) and
keeps the fastest. Keys that set a kernel's reduction order (``REDUCTION_KEYS``) are
chosen once per shape, at the smallest bucket, and held for the wider ones, so tuning
never makes a token's bits depend on its batch width. The dense linears that run on the
front GEMM (the shared expert's ``shared_gate_up`` and ``shared_down``, the tail's
``latent_up``) are tuned as kernels of their own, each at its own shapes. Progress goes
to a ``.partial``
file beside the output after every point: an interrupted sweep resumes where it was.

    python -m wide_moe_triton.tune --quick --tp 8       # over 5 minutes on an H200 (one TP)
    python -m wide_moe_triton.tune --tp 8 16 1 --batches 1 16 64 128 256 512 1024
"""

from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import random
import sys

import torch

from . import mx, reference, tuning
from .config import WideMoEConfig

BUCKETS = (1, 16, 64, 128, 256, 512, 1024)
QUICK_BUCKETS = (64, 256, 1024)


class Case:
    """One kernel at one shape and batch width: ``run(config)`` launches it and returns its
    output; ``ok(output)`` says whether that output is right. ``quick``: under --quick,
    try only this many of the default's neighbours (kernels that share another's space
    and so need fewer tries), instead of the neighbours and a random sample."""

    def __init__(self, kernel, shape, space, default, run, ok, reduction_keys=(), quick=None,
                 priors=()):
        self.kernel, self.shape, self.space, self.default = kernel, shape, space, default
        self.run, self.ok, self.reduction_keys = run, ok, reduction_keys
        self.quick = quick
        self.priors = [dict(p) for p in priors]  # always tried, with the neighbours


def _equal(ref):
    return lambda out: all(torch.equal(a, b) for a, b in zip(_tuple(out), _tuple(ref)))


def _close(ref, tol):
    def ok(out):
        a, b = out.double(), ref.double()
        return bool(torch.isfinite(a).all()) and ((a - b).norm() / b.norm()).item() < tol
    return ok


def _tuple(x):
    return x if isinstance(x, tuple) else (x,)


def cases(cfg: WideMoEConfig, b: int, gen: torch.Generator, weights: dict):
    """Every kernel's case at rank-local dims ``cfg`` (cfg.tp = T) and batch width b."""
    from .kernels import experts as ek, finalize as fk, front as frk, plan as pk
    from .kernels import route as rk, tail as tk

    dev = gen.device
    H, L, E, K = cfg.hidden, cfg.latent, cfg.num_experts, cfg.top_k
    I = cfg.intermediate_per_rank
    N = cfg.experts_per_rank + cfg.latent_per_rank
    rnd = lambda *s: torch.randn(*s, generator=gen, device=dev)  # noqa: E731

    x = rnd(b, H).bfloat16()
    packed = (rnd(N, H) * H ** -0.5).bfloat16()
    front_out = torch.empty(b, N, device=dev)
    yield Case(frk.KERNEL, frk.shape_key(N, H), frk.SPACE, frk.default_config(N, H, b),
               lambda c: frk.front_gemm(x, packed, out=front_out, config=c),
               _close(x.double() @ packed.double().t(), 1e-5), frk.REDUCTION_KEYS)

    logits, bias = rnd(b, E), rnd(E) * 1e-3  # a balanced load, as after training
    lists = rk.RoutingLists.empty(E, max(b, 1), dev)
    ids_ref = reference.route(logits, bias, K, True, cfg.routed_scaling_factor)

    def route(c):
        lists.counts.zero_()
        return rk.route(logits, bias, K, True, cfg.routed_scaling_factor, lists=lists, config=c)
    yield Case(rk.KERNEL, rk.shape_key(E, K), rk.SPACE, rk.DEFAULT, route, _equal(ids_ref))

    latent = rnd(b, L).bfloat16()
    plan_ref = mx.quantize_mxfp8(latent)
    yield Case(pk.KERNEL, pk.shape_key(L), pk.SPACE, pk.DEFAULT,
               lambda c: pk.quantize_mxfp8(latent, config=c), _equal(plan_ref))

    def route_plan(c):  # the layer's launch: route, claims and plan together
        lists.counts.zero_()
        return rk.route_and_plan(logits, latent, bias, K, True, cfg.routed_scaling_factor,
                                 lists=lists, config=c)
    yield Case(rk.KERNEL_PLAN, rk.shape_key(E, K, L), rk.SPACE_PLAN, rk.DEFAULT_PLAN,
               route_plan, _equal((*ids_ref, *plan_ref)))

    ids, _ = ids_ref
    q, qs = plan_ref
    lists = rk.RoutingLists.empty(E, max(b, 1), dev)
    rk.route(logits, bias, K, True, 1.0, lists=lists)
    w = weights
    sub = min(b, 16)
    ref_rows = reference.expert_rows(q[:sub], qs[:sub], ids[:sub], w["w13"], w["w13_scales"],
                                     w["w2"], w["w2_scales"], cfg.beta, cfg.linear_beta)
    rows = torch.empty(b * K, L, dtype=torch.bfloat16, device=dev)
    ws = ek.make_workspace(b, K, L, I, dev)

    def experts(up, down):
        return ek.experts(q, qs, w["prepared"], lists.counts, lists.pairs, lists.generation, K,
                          cfg.beta, cfg.linear_beta, rows=rows, workspace=ws,
                          config_up=up, config_down=down)

    ok_rows = lambda out: _close(ref_rows, 1e-2)(out[:sub * K])  # noqa: E731
    key = ek.shape_key(L, I, E)
    yield Case(ek.KERNEL_UP, key, ek.SPACE_UP, ek.DEFAULT_UP,
               lambda c: experts(c, ek.DEFAULT_DOWN), ok_rows, priors=ek.PRIORS_UP)
    yield Case(ek.KERNEL_DOWN, key, ek.SPACE_DOWN, ek.DEFAULT_DOWN,
               lambda c: experts(ek.DEFAULT_UP, c), ok_rows, priors=ek.PRIORS_DOWN)

    expanded = rnd(b * K, L).bfloat16()
    wts = (rnd(b, K) * 0.2).bfloat16()
    yield Case(fk.KERNEL, fk.shape_key(L, K), fk.SPACE, fk.DEFAULT,
               lambda c: fk.finalize(expanded, wts, config=c),
               _equal(reference.finalize(expanded, wts)))

    norm_w = (1 + 0.1 * rnd(L)).bfloat16()
    yield Case(tk.KERNEL, tk.shape_key(L), tk.SPACE, tk.DEFAULT,
               lambda c: tk.rms_norm(latent, norm_w, cfg.rms_eps, config=c),
               _close(reference.rms_norm(latent, norm_w, cfg.rms_eps), 2 ** -8))

    yield from linear_cases(cfg, b, x, rnd)


# Neighbours of the default config tried per point by --quick for the linears that run
# on the front GEMM: 3 kernels x 3 TP shapes x 3 buckets x (1 + 2) runs. Estimated (not
# yet timed) at about a minute on an H200: ~40 compiles of ~1 s (the constexprs do not
# include N or H, so the TP shapes share them) and 81 timings of ~0.25 s.
QUICK_LINEAR = 2


def linear_cases(cfg: WideMoEConfig, b: int, x: torch.Tensor, rnd):
    """The dense linears on the front GEMM, each under its own tuning name and shape: the
    shared expert's gate/up with SiTU and its down, and the tail's up-projection."""
    from .kernels import front as frk, shared as sk, tail as tk

    dev = x.device
    H, L, S, Hr = cfg.hidden, cfg.latent, cfg.shared_per_rank, cfg.hidden_per_rank
    bf16 = torch.bfloat16

    def case(kernel, N, K, run, expected):
        return Case(kernel, frk.shape_key(N, K), frk.SPACE, frk.default_config(N, K, b), run,
                    _close(expected, 1e-2), frk.REDUCTION_KEYS, quick=QUICK_LINEAR)

    gate_up = (rnd(2 * S, H) * H ** -0.5).to(bf16)
    pairs = sk.interleave_gate_up(gate_up)
    gu = (x.double() @ gate_up.double().t()).float().to(bf16)
    hidden = torch.empty(b, S, dtype=bf16, device=dev)
    yield case(sk.KERNEL_GATE_UP, 2 * S, H,
               lambda c: frk.linear_situ(x, pairs, cfg.beta, cfg.linear_beta, out=hidden,
                                         kernel=sk.KERNEL_GATE_UP, config=c),
               reference.situ(gu[:, :S], gu[:, S:], cfg.beta, cfg.linear_beta))

    h, down = rnd(b, S).to(bf16), (rnd(H, S) * S ** -0.5).to(bf16)
    shared_out = torch.empty(b, H, dtype=bf16, device=dev)
    yield case(sk.KERNEL_DOWN, H, S,
               lambda c: frk.linear(h, down, out=shared_out, kernel=sk.KERNEL_DOWN, config=c),
               h.double() @ down.double().t())

    # As in the layer: this rank's columns of a [b, H] shared partial, added into in
    # place, so each run starts from a copy of the same partial (a copy every config pays).
    normed, up = rnd(b, L).to(bf16), (rnd(Hr, L) * L ** -0.5).to(bf16)
    start, partial = rnd(b, Hr).to(bf16), torch.empty(b, H, dtype=bf16, device=dev)
    cols = partial[:, :Hr]

    def up_projection(c):
        cols.copy_(start)
        return tk.add_up_projection(normed, up, cols, config=c)
    yield case(tk.KERNEL_UP, Hr, L, up_projection,
               start.double() + normed.double() @ up.double().t())


def random_expert_weights(cfg: WideMoEConfig, gen: torch.Generator) -> dict:
    """Rank-local MXFP4 experts drawn like ``LatentMoE``'s, without building the layer."""
    from .kernels import experts as ek

    dev = gen.device
    E, L, I = cfg.num_experts, cfg.latent, cfg.intermediate_per_rank
    parts: dict = {"w13": [], "w13_scales": [], "w2": [], "w2_scales": []}
    for start in range(0, E, 64):
        n = min(64, E - start)
        p, s = mx.quantize_mxfp4(torch.randn(n, 2 * I, L, generator=gen, device=dev) * L ** -0.5)
        parts["w13"].append(p), parts["w13_scales"].append(s)
        p, s = mx.quantize_mxfp4(torch.randn(n, L, I, generator=gen, device=dev) * I ** -0.5)
        parts["w2"].append(p), parts["w2_scales"].append(s)
    w = {k: torch.cat(v) for k, v in parts.items()}
    w["prepared"] = ek.prepare_weights(w["w13"], w["w13_scales"], w["w2"], w["w2_scales"])
    return w


def time_config(case: Case, config: dict) -> float | None:
    """Median µs of ``case`` under ``config``, or None when it fails or is wrong."""
    import time

    import triton

    cuda = torch.cuda.is_available()
    try:
        out = case.run(config)
        if cuda:
            torch.cuda.synchronize()
        if not case.ok(out):
            return None
        if not cuda:  # --dry-run in the interpreter: checks, and a token wall time
            start = time.perf_counter()
            case.run(config)
            return (time.perf_counter() - start) * 1e6
        return triton.testing.do_bench_cudagraph(lambda: case.run(config), rep=20,
                                                 return_mode="median") * 1e3
    except Exception:  # a candidate that does not compile or launch is skipped
        if cuda:
            torch.cuda.synchronize()
        return None


def sweep(args) -> dict:
    out = pathlib.Path(args.out)
    partial = out.with_suffix(".partial.json")
    done = json.loads(partial.read_text()) if partial.exists() and not args.fresh else {}
    try:
        from tqdm import tqdm
    except ImportError:  # the bar is optional; progress still prints
        tqdm = None
    points = [(tp, b) for tp in args.tp for b in args.batches]
    bar = tqdm(total=len(points), unit="point") if tqdm else None
    for tp in args.tp:
        cfg = WideMoEConfig.tiny(tp=tp) if args.dry_run else WideMoEConfig.kimi_k3(tp=tp)
        gen = torch.Generator(device="cpu" if args.dry_run else "cuda").manual_seed(tp)
        weights = random_expert_weights(cfg, gen)
        for b in sorted(args.batches):
            for case in cases(cfg, b, gen, weights):
                if args.kernels and case.kernel not in args.kernels:
                    continue
                slot = done.setdefault(case.kernel, {}).setdefault(case.shape, {})
                if str(b) in slot:
                    continue
                if bar:
                    bar.set_description(f"tp{tp} b={b} {case.kernel}")
                else:
                    print(f"tp{tp} b={b} {case.kernel}", flush=True)
                slot[str(b)] = best_config(case, slot, args.candidates, args.seed,
                                           case.quick if args.quick else None)
                partial.parent.mkdir(parents=True, exist_ok=True)
                partial.write_text(json.dumps(done, indent=1))
            if bar:
                bar.update(1)
        del weights
        if not args.dry_run:
            torch.cuda.empty_cache()
    if bar:
        bar.close()
    return done


def best_config(case: Case, chosen: dict, candidates: int | None, seed: int,
                quick: int | None = None) -> dict:
    """The fastest correct config of ``case``, holding the reduction keys already chosen
    at a smaller bucket of the same shape. ``quick``: try only that many of the
    default's neighbours."""
    space = [dict(c) for c in case.space]
    held = None
    if case.reduction_keys and chosen:
        first = chosen[min(chosen, key=int)]
        held = {k: first[k] for k in case.reduction_keys}
        space = [c for c in space if all(c[k] == v for k, v in held.items())]
    default = dict(case.default)
    if held:
        default.update(held)
    near = [c for c in space if sum(c.get(k) != v for k, v in default.items()) == 1]
    near += [p for p in case.priors if p in space and p not in near]
    if quick is not None:
        space = random.Random(seed).sample(near, min(quick, len(near)))
    elif candidates and len(space) > candidates:
        # The default's neighbours (one key changed) always, then a random sample: a
        # coordinate step around a sane point finds most of the gain in few compiles.
        rest = [c for c in space if c not in near]
        space = near + random.Random(seed).sample(rest, min(candidates, len(rest)))
    best, best_us = dict(default), time_config(case, default)
    if best_us is None:
        raise RuntimeError(f"{case.kernel} at {case.shape}: the default config fails its check")
    default_us = best_us
    for config in space:
        us = time_config(case, config)
        if us is not None and us < best_us:
            best, best_us = config, us
    best["_us"], best["_default_us"] = round(best_us, 2), round(default_us, 2)
    return best


def write_table(done: dict, path: pathlib.Path) -> None:
    import triton

    name = tuning.gpu_name() or "interpreter (dry run)"
    kernels = {k: {s: {b: {n: v for n, v in c.items() if not n.startswith("_")}
                       for b, c in buckets.items()} for s, buckets in shapes.items()}
               for k, shapes in done.items()}
    timings = {k: {s: {b: {"tuned": c.get("_us"), "default": c.get("_default_us")}
                       for b, c in buckets.items()}
                   for s, buckets in shapes.items()} for k, shapes in done.items()}
    table = {"gpu": name, "triton": triton.__version__, "torch": torch.__version__,
             "date": datetime.date.today().isoformat(),
             "dims": "Kimi-K3 (H 7168, L 3584, E 896, K 16, I 3072) rank-local shapes",
             "kernels": kernels, "timings_us": timings}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(table, indent=1) + "\n")
    print(f"wrote {path}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m wide_moe_triton.tune", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tp", type=int, nargs="+", default=[8, 16, 1])
    p.add_argument("--batches", type=int, nargs="+")
    p.add_argument("--kernels", nargs="+", help="only these kernels (default: all)")
    p.add_argument("--quick", action="store_true",
                   help=f"buckets {QUICK_BUCKETS}; the default's neighbours and 3 random "
                        f"candidates ({QUICK_LINEAR} neighbours for the linears on the front GEMM)")
    p.add_argument("--candidates", type=int, help="candidates a point (random sample)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--fresh", action="store_true", help="ignore a .partial file")
    p.add_argument("--out", help="output JSON (default autotune_configs/<GPU>.json)")
    p.add_argument("--dry-run", action="store_true",
                   help="tiny dims in Triton's interpreter: exercise the sweep, time nothing")
    args = p.parse_args(argv)
    if args.dry_run:
        import os

        os.environ["TRITON_INTERPRET"] = "1"
        args.out = args.out or "autotune_configs/dry-run.json"
    elif not torch.cuda.is_available():
        print("tune needs a CUDA GPU (configs are per GPU)", file=sys.stderr)
        return 2
    args.batches = args.batches or list(QUICK_BUCKETS if args.quick else BUCKETS)
    if args.quick and args.candidates is None:
        args.candidates = 3
    args.out = args.out or str(tuning.table_path(tuning.gpu_name()))
    done = sweep(args)
    write_table(done, pathlib.Path(args.out))
    print_gains(done)
    return 0


def print_gains(done: dict) -> None:
    """The tuned config against the default at every point of the sweep."""
    print("\n| kernel | shape | b | default µs | tuned µs | gain |")
    print("|---|---|---|---|---|---|")
    for kernel, shapes in done.items():
        for shape, buckets in shapes.items():
            for b in sorted(buckets, key=int):
                c = buckets[b]
                print(f"| {kernel} | {shape} | {b} | {c['_default_us']:.1f} | {c['_us']:.1f} "
                      f"| {c['_default_us'] / c['_us']:.2f}x |")


if __name__ == "__main__":
    sys.exit(main())
