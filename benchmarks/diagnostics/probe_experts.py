"""The experts' launch configs on this GPU, up and down apart, checked then timed.

    python benchmarks/diagnostics/probe_experts.py [--tp 8] [--batches 65 256 1024]
        [--layouts wgmma wgmma_decode] [--no-untiled] [--top N] [--variant FILE]
        [--up JSON] [--down JSON] [--block-k-up N] [--block-k-down N]

What produced the experts tables of benchmarks/NOTES.md ("Weight layout" on). At rank-local Kimi-K3 dims
(experts drawn like ``LatentMoE``'s, a balanced routing) and each batch width, every
config of ``UP`` (then ``DOWN``) runs with the other launch at its reference config; it
is checked against ``reference.expert_rows`` on the first 16 tokens, then the launch is
timed alone (the other one stubbed out; CUDA-graph median). The best pair is then timed
together, and once more over the same weights untiled (row-major, lane order), which
isolates what the tiled "wgmma" layout buys. ``--variant FILE``: a copy of
``kernels/experts/tiles.py`` with other kernel bodies (e.g. ``git show
BRANCH:wide_moe_triton/kernels/experts/tiles.py > variant.py``); the best pair is
then checked and timed again with its kernels, each launch alone and together, in the
same run as the shipped ones. ``--up``/``--down``: JSON lists of configs probed instead
of a layout's lists (the first is the other launch's while one is probed), e.g.
``--up '[{"BLOCK_M": 32, "BLOCK_N": 64, "A_BF16": 1, "num_warps": 4, "num_stages": 3,
"maxnreg": 112}]'``; ``--block-k-up``/``--block-k-down``: weights prepared with other
reduction steps (``prepare_weights``). Floors: the bytes each launch must move over
the copy bandwidth measured at the start. Without a GPU it runs the tiny dims in Triton's
interpreter and times nothing (a check of the script itself).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import json
import pathlib
import sys

import torch
import triton

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))  # the repository

from wide_moe_triton import WideMoEConfig, mx, reference, tune  # noqa: E402
from wide_moe_triton.kernels import experts as ex  # noqa: E402
from wide_moe_triton.kernels import route as rk  # noqa: E402

DRY = not torch.cuda.is_available()


# Most promising first (``--top``): the shipped table's configs lead.
UP = ex.config_rows([
    (16, 64, 0, 4, 3, 128), (16, 64, 0, 4, 4, 128), (32, 128, 0, 8, 3, 128),
    (16, 128, 0, 8, 4, 128), (16, 128, 0, 4, 3, 0), (16, 128, 0, 8, 3, 128),
    (16, 128, 1, 8, 3, 128), (16, 64, 0, 4, 3, 96), (16, 256, 0, 8, 3, 168),
    (32, 64, 0, 4, 3, 128), (32, 128, 0, 4, 3, 0)])
DOWN = ex.config_rows([
    (16, 128, 0, 4, 3, 0), (16, 256, 0, 8, 3, 128), (32, 256, 0, 8, 3, 128),
    (16, 128, 0, 8, 3, 96), (16, 128, 0, 8, 3, 80), (16, 64, 0, 4, 3, 96),
    (16, 128, 0, 4, 3, 128), (16, 128, 1, 8, 3, 96), (32, 128, 0, 8, 3, 96)])
# The other launch's config while one is probed.
REF_UP = dict(BLOCK_M=16, BLOCK_N=64, A_BF16=0, num_warps=4, num_stages=3, maxnreg=128)
REF_DOWN = dict(BLOCK_M=16, BLOCK_N=128, A_BF16=0, num_warps=4, num_stages=3, maxnreg=0)
# The "wgmma_decode" layout (the kernels decode the weights to BF16 themselves; BF16
# activations only): its configs, probed over the same weights in that layout.
# Most promising first (``--top``).
# On Hopper the layout runs staged (experts.staged_dot), so its configs may also set
# experts.STAGED_KEYS: the shipped defaults lead, then the runners-up of NOTES, "Column
# tiles in the down launch".
UP_DECODE = [ex.DEFAULT_UP_STAGED, *ex.PRIORS_UP_STAGED, *(dict(c, MASK_ROWS=1) for c in
             ex.config_rows([(16, 64, 1, 4, 3, 128), (16, 64, 1, 4, 4, 96),
                             (16, 128, 1, 8, 3, 96), (32, 64, 1, 4, 3, 96)])),
             # wide batches (b = 512-1024) with whole-sector weight copies, and 32-pair
             # tiles that end in a 16-pair one (HALF_TILE; 64-pair tiles and 8-warp
             # 32 x 128 ones were 1.5-2x slower at b = 512-1024: NOTES, "Half tiles")
             # (the masked 32x64 r168 tile without HALF_TILE is a prior: NOTES, "SiTU
             # without division")
             *(dict(c, MASK_ROWS=m, HALF_TILE=h) for c, m, h in zip(ex.config_rows(
                 [(32, 64, 1, 4, 4, 168), (32, 64, 1, 4, 3, 168), (32, 64, 1, 4, 3, 168)]),
                 (0, 0, 1), (0, 1, 1))),
             # the table's tiles, weights by TMA (4% slower at b = 1024: NOTES, "TMA weight loads")
             *(dict(c, MASK_ROWS=1, TMA=1) for c in ex.config_rows(
                 [(32, 64, 1, 4, 3, 168), (16, 64, 1, 4, 3, 96), (16, 128, 1, 4, 3, 0),
                  (32, 64, 1, 4, 3, 128)]))]
# (Four programs a SM at maxnreg 120 or 112, no spill in the loop, were 4% slower at
# b = 1024 than the 168 of three: NOTES, "What limits the experts at b = 1024".)
DOWN_DECODE = [ex.DEFAULT_DOWN_STAGED, *ex.PRIORS_DOWN_STAGED, *(
    dict(c, MASK_ROWS=1, COLS=k) for c, k in zip(ex.config_rows(
        [(16, 128, 1, 4, 4, 128), (16, 128, 1, 4, 3, 96), (16, 64, 1, 4, 3, 96),
         (16, 128, 1, 8, 3, 128)]), (4, 4, 8, 4))),
    *(dict(c, MASK_ROWS=1, COLS=4, HALF_TILE=h) for c, h in zip(ex.config_rows(
        [(32, 128, 1, 4, 4, 168), (32, 128, 1, 4, 3, 168), (32, 128, 1, 4, 3, 128)]),
        (0, 1, 1)))]


def copy_bandwidth() -> float:
    """Bytes/s of a 2 GiB device copy, read + write (a nominal 4 TB/s in a dry run)."""
    if DRY:
        return 4e12
    a = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    ms = triton.testing.do_bench(lambda: b.copy_(a), return_mode="median")
    return 2 * a.numel() / (ms * 1e-3)


def timed_us(fn) -> float:
    if DRY:
        fn()
        return 1.0
    return triton.testing.do_bench_cudagraph(fn, rep=30, return_mode="median") * 1e3


@contextlib.contextmanager
def launching(up, down):
    """Within: ``ex.experts`` launches the kernel handles ``up`` and ``down`` (the
    wrapper, its checks and the weights stay the shipped ones)."""
    saved = ex._experts_up_kernel, ex._experts_down_kernel
    ex._experts_up_kernel, ex._experts_down_kernel = up, down
    try:
        yield
    finally:
        ex._experts_up_kernel, ex._experts_down_kernel = saved


def load_variant(path: str):
    """The module at ``path`` (a copy of kernels/experts/tiles.py), imported inside the
    experts package so that its relative imports resolve."""
    name = "wide_moe_triton.kernels.experts._probe_variant"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def time_variant(batch: "Batch", variant, up, down, weights) -> tuple[float, float, float]:
    """(up µs, down µs, together µs) of the pair (up, down) with ``variant``'s kernels,
    after checking its rows (rel. err. < 1e-2, as the configs are)."""
    with launching(variant._experts_up_kernel, variant._experts_down_kernel):
        err = batch.error(up, down, weights)
        if not err < 1e-2:
            raise AssertionError(f"variant: rel err {err:.2e}")
        times = (batch.time_launch("up", up, down, weights),
                 batch.time_launch("down", up, down, weights),
                 timed_us(lambda: batch.run(up, down, weights)))
    print(f"  variant: up {times[0]:.1f} + down {times[1]:.1f}, together {times[2]:.1f} us "
          f"(err {err:.1e})", flush=True)
    return times


def untiled(prepared: ex.ExpertWeights) -> ex.ExpertWeights:
    """The same weights in lane order but row-major (row_block 1)."""
    w13, w13_s, w2, w2_s = prepared.stock()
    return dataclasses.replace(prepared, w13=ex.lane_order(w13, prepared.block_k_up),
                               w13_scales=w13_s, w2=ex.lane_order(w2, prepared.block_k_down),
                               w2_scales=w2_s, row_block=1)


class Batch:
    """One batch width: its routing, plan, reference rows and the floors of both launches."""

    def __init__(self, cfg, weights, b, gen, copy_bw):
        dev = gen.device
        E, L, K, I = cfg.num_experts, cfg.latent, cfg.top_k, cfg.intermediate_per_rank
        self.cfg, self.w, self.b = cfg, weights, b
        logits = torch.randn(b, E, generator=gen, device=dev)
        bias = torch.randn(E, generator=gen, device=dev) * 1e-3  # a balanced load
        self.lists = rk.RoutingLists.empty(E, cfg.wide_rows, dev)
        ids, _ = rk.route(logits, bias, K, True, 1.0, lists=self.lists)
        self.ids = ids
        self.q, self.qs = mx.quantize_mxfp8(torch.randn(b, L, generator=gen, device=dev).bfloat16())
        self.sub = min(b, 16)
        self.ref = reference.expert_rows(self.q[:self.sub], self.qs[:self.sub], ids[:self.sub],
                                         *weights["stock"], cfg.beta, cfg.linear_beta)
        self.rows = torch.empty(b * K, L, dtype=torch.bfloat16, device=dev)
        self.work = ex.make_workspace(b, K, L, I, dev)
        self.touched = torch.unique(ids).numel()
        w13, w13_s, w2, w2_s = weights["stock"]
        hidden = b * K * I * 33 // 32  # MXFP8 codes and scales, written then read
        self.floor_us = {
            "up": (self.touched * (w13[0].numel() + w13_s[0].numel()) + self.q.numel()
                   + self.qs.numel() + hidden) / copy_bw * 1e6,
            "down": (self.touched * (w2[0].numel() + w2_s[0].numel()) + hidden
                     + self.rows.numel() * 2) / copy_bw * 1e6}

    def run(self, up, down, weights=None):
        cfg = self.cfg
        return ex.experts(self.q, self.qs, weights or self.w["prepared"], self.lists.counts,
                          self.lists.pairs, self.lists.generation, cfg.top_k, cfg.beta,
                          cfg.linear_beta, rows=self.rows, workspace=self.work,
                          config_up=up, config_down=down)

    def error(self, up, down, weights=None) -> float:
        """Relative error of the first tokens' rows against the reference (rows poisoned)."""
        self.rows.fill_(float("nan"))
        out = self.run(up, down, weights)[:self.sub * self.cfg.top_k].double()
        return ((out - self.ref.double()).norm() / self.ref.double().norm()).item()

    def time_launch(self, kind, up, down, weights=None) -> float:
        with ex.only_launch(kind):
            return timed_us(lambda: self.run(up, down, weights))


def probe_launch(batch: Batch, kind: str, space, refs=(None, None),
                 weights=None) -> tuple[float, dict]:
    """(µs, config) of the fastest correct config of the ``kind`` launch (the other
    launch at ``refs``' config, default REF_UP/REF_DOWN), over ``weights`` (default the
    "wgmma" ones)."""
    ref_up, ref_down = refs[0] or REF_UP, refs[1] or REF_DOWN
    results = []
    for config in space:
        up, down = (config, ref_down) if kind == "up" else (ref_up, config)
        try:
            err = batch.error(up, down, weights)
            if not err < 1e-2:
                print(f"  {kind} {config}: WRONG, rel err {err:.2e}", flush=True)
                continue
            us = batch.time_launch(kind, up, down, weights)
        except Exception as exc:  # a config that does not compile is reported and skipped
            print(f"  {kind} {config}: FAILED {type(exc).__name__}: {str(exc)[:200]}", flush=True)
            continue
        results.append((us, config))
        print(f"  {kind} {config}: {us:8.1f} us  {batch.floor_us[kind] / us:6.1%} of copy bw  "
              f"err {err:.1e}", flush=True)
    return min(results, key=lambda r: r[0])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tp", type=int, default=8)
    p.add_argument("--batches", type=int, nargs="+", default=[65, 256, 1024])
    p.add_argument("--layouts", nargs="+", default=["wgmma"],
                   choices=["wgmma", "wgmma_decode"],
                   help="weight layouts to probe (each with its config list)")
    p.add_argument("--no-untiled", action="store_true",
                   help="skip timing the untiled (row-major) weights")
    p.add_argument("--top", type=int, default=0,
                   help="probe only the first N configs of each list (0: all)")
    p.add_argument("--variant", metavar="FILE",
                   help="a copy of kernels/experts/tiles.py whose kernels time the best pair "
                        "again")
    p.add_argument("--up", type=json.loads, metavar="JSON",
                   help="a JSON list of up configs, probed instead of the layout's list")
    p.add_argument("--down", type=json.loads, metavar="JSON",
                   help="a JSON list of down configs, probed instead of the layout's list")
    p.add_argument("--block-k-up", type=int, help="the up weights' reduction step")
    p.add_argument("--block-k-down", type=int, help="the down weights' reduction step")
    args = p.parse_args(argv)
    for name in ("up", "down"):
        given = getattr(args, name)
        if given is not None and not (isinstance(given, list) and given
                                      and all(isinstance(c, dict) for c in given)):
            p.error(f"--{name} must be a non-empty JSON list of config objects")
    variant = load_variant(args.variant) if args.variant else None
    top = (lambda configs: configs[:args.top]) if args.top else (lambda configs: configs)
    copy_bw = copy_bandwidth()
    print(f"copy {copy_bw / 1e12:.2f} TB/s", flush=True)
    cfg = WideMoEConfig.tiny(tp=1) if DRY else WideMoEConfig.kimi_k3(tp=args.tp)
    if DRY:  # the tiny dims hold fewer tokens than the default widths
        args.batches = sorted({min(b, cfg.wide_rows) for b in args.batches})
    gen = torch.Generator(device="cpu" if DRY else "cuda").manual_seed(args.tp)
    # "wgmma" explicitly: the generator's default layout is "wgmma_decode" on Hopper
    weights = tune.random_expert_weights(cfg, gen, layout="wgmma")
    weights["stock"] = (weights["w13"], weights["w13_scales"], weights["w2"],
                        weights["w2_scales"])
    steps = dict(block_k_up=args.block_k_up, block_k_down=args.block_k_down)
    if args.block_k_up or args.block_k_down:
        weights["prepared"] = ex.prepare_weights(*weights["stock"], layout="wgmma", **steps)
    row_major = None if args.no_untiled else untiled(weights["prepared"])

    def lists(ups, downs):  # a layout's lists, or the command line's
        ups, downs = args.up or top(ups), args.down or top(downs)
        return ups, downs, (ups[0], downs[0])
    by_layout = {"wgmma": (weights["prepared"], *lists(UP, DOWN))}
    if "wgmma_decode" in args.layouts:
        decoded = ex.prepare_weights(*weights["stock"], layout="wgmma_decode", **steps)
        by_layout["wgmma_decode"] = (decoded, *lists(UP_DECODE, DOWN_DECODE))
    summary = []
    for b in args.batches:
        batch = Batch(cfg, weights, b, gen, copy_bw)
        floor = sum(batch.floor_us.values())
        print(f"\n== b={b}, {batch.touched} experts touched: floor up {batch.floor_us['up']:.0f}"
              f" us, down {batch.floor_us['down']:.0f} us", flush=True)
        for layout in args.layouts:
            w, ups, downs, refs = by_layout[layout]
            print(f" -- layout {layout}", flush=True)
            best_up = probe_launch(batch, "up", ups, refs, w)
            best_down = probe_launch(batch, "down", downs, refs, w)
            both = timed_us(lambda: batch.run(best_up[1], best_down[1], w))
            flat = float("nan")
            if row_major is not None and layout == "wgmma":
                flat = timed_us(lambda: batch.run(best_up[1], best_down[1], row_major))
                print(f"  untiled {flat:.1f} us (err "
                      f"{batch.error(best_up[1], best_down[1], row_major):.1e})")
            print(f"  best {layout}: up {best_up[0]:.1f} + down {best_down[0]:.1f}, together "
                  f"{both:.1f} us ({floor / both:.1%} of copy bw)", flush=True)
            other = "-"
            if variant is not None:
                v_up, v_down, v_both = time_variant(batch, variant, best_up[1], best_down[1], w)
                other = (f"{v_up:.0f} + {v_down:.0f} = {v_both:.0f} (shipped {best_up[0]:.0f}"
                         f" + {best_down[0]:.0f})")
            summary.append((b, batch.touched, layout, floor, both, flat, other, best_up[1],
                            best_down[1]))
    print("\n| b | touched | layout | floor µs | best µs | of copy bw | untiled µs | variant µs "
          "| up | down |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for b, touched, layout, floor, both, flat, other, up, down in summary:
        print(f"| {b} | {touched} | {layout} | {floor:.0f} | {both:.0f} | {floor / both:.0%} "
              f"| {flat:.0f} | {other} | {up} | {down} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
