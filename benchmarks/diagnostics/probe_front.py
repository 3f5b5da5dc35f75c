"""Front GEMM and finalize launch configs at TP8 on this GPU: checked, then timed.

    python benchmarks/diagnostics/probe_front.py [--batches 65 128 256 512 1024]
        [--keys 128/4 128/7] [--skip-finalize]

Front (N560_H7168, x [b, 7168] @ packed[560, 7168].T, FP32 out): for each reduction key
(BLOCK_K, SPLIT_K) a short list of layouts (tiles, SPLIT_GRID, GROUP, warps, stages)
fitted to the batch width. Every config is first checked: its output is bitwise equal
to the key's first config at that width, and row 0 equals the key's row 0 at the first
width (batch invariance across layouts and widths), and within 1e-5 of float64 (keys
that cut H into the same segments are also compared with each other, bit for bit: does
BLOCK_K alone change the sums on this GPU?). Then it is timed with CUDA-graph medians
over 16 rotating copies of the weights (as ``bench_layer.py`` times its torch.mm row:
``torch.mm(x, w.t(), out_dtype=float32)``, 8 MB of weights that must not sit in L2).
Finalize (L3584_K16): configs of its SPACE, each bitwise-checked against
``reference.finalize``, beside its floor (bytes over the copy bandwidth measured at the
start) and a device copy moving as many bytes. The last table: per reduction key, the
best front time per b and the worst ratio to torch.mm over the b's (the keys are fixed
across b); then finalize's best per b over its floor.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

import torch
import triton

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))  # the repository

from wide_moe_triton import reference  # noqa: E402
from wide_moe_triton.kernels import finalize as fin  # noqa: E402
from wide_moe_triton.kernels import front  # noqa: E402

N, H = 560, 7168  # TP8 rank: 896/8 router rows + 3584/8 latent rows, hidden 7168
L, K = 3584, 16
KEYS = [(128, 1), (128, 2), (128, 4), (128, 8)]


def layouts(b: int) -> list[dict]:
    """Tiles and program splits worth timing at batch width b (BM batch rows, BN weight
    rows a program)."""
    def lay(bm, bn, grid, group, warps, stages):
        return dict(BLOCK_M=bm, BLOCK_N=bn, SPLIT_GRID=grid, GROUP=group, num_warps=warps,
                    num_stages=stages)
    if b <= 128:
        return [lay(32, 64, 1, 1, 4, 4), lay(64, 64, 1, 1, 4, 4), lay(64, 64, 1, 2, 4, 4),
                lay(64, 64, 0, 1, 4, 4)]
    if b <= 256:
        return [lay(64, 64, 1, 1, 4, 4), lay(64, 64, 1, 2, 4, 4), lay(128, 64, 1, 1, 4, 4),
                lay(64, 64, 0, 1, 4, 4)]
    # 256-row batch tiles (two stages fit): x, re-read from L2 once a weight tile, is the
    # bulk of the L2 traffic at b = 1024 (14.7 MB times cdiv(560, BLOCK_N)); slower on
    # the H200 all the same (NOTES: Front split-K).
    return [lay(128, 64, 1, 1, 4, 4), lay(128, 64, 1, 2, 4, 4), lay(128, 64, 0, 1, 8, 4),
            lay(128, 128, 1, 1, 8, 3), lay(128, 128, 1, 2, 8, 3), lay(128, 128, 0, 1, 8, 3),
            lay(64, 64, 0, 1, 4, 4), lay(256, 64, 1, 1, 4, 2), lay(256, 64, 1, 2, 4, 2),
            lay(256, 128, 1, 1, 8, 2), lay(256, 128, 0, 1, 8, 2),
            # two programs a SM (at most 113 KB of pipeline each)
            lay(128, 64, 1, 1, 4, 2), lay(128, 64, 1, 2, 4, 2), lay(128, 64, 1, 2, 8, 2),
            lay(64, 64, 1, 1, 4, 3), lay(64, 64, 1, 2, 4, 3), lay(64, 128, 1, 2, 8, 2),
            lay(64, 64, 1, 1, 4, 2), lay(64, 64, 1, 2, 4, 2), lay(64, 64, 1, 4, 4, 2),
            lay(128, 64, 1, 4, 4, 2), lay(128, 64, 0, 1, 4, 2), lay(128, 128, 1, 2, 8, 2)]


def effective(cfg: dict) -> tuple:
    """What the launch actually runs (configs that differ only in unused keys coincide)."""
    _, _, segments = front._split_plan(H, cfg)
    levels, parts = front._group_plan(segments, cfg)
    return (cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["num_warps"], cfg["num_stages"], levels, parts)


def valid(cfg: dict) -> bool:
    _, _, segments = front._split_plan(H, cfg)
    group = (triton.next_power_of_2(segments) if not cfg["SPLIT_GRID"]
             else min(cfg["GROUP"], triton.next_power_of_2(segments)))
    tiles = 1 + (group.bit_length() - 1 if segments > 1 else 0)
    regs = cfg["BLOCK_M"] * cfg["BLOCK_N"] // (32 * cfg["num_warps"])
    return group <= 8 and tiles * regs <= 192


def bench(fn) -> float:
    """Median µs of one call, replayed from a CUDA graph (launch overhead left out)."""
    return triton.testing.do_bench_cudagraph(fn, rep=20, return_mode="median") * 1e3


def copy_bandwidth() -> float:
    a = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    c = torch.empty_like(a)
    ms = triton.testing.do_bench(lambda: c.copy_(a), return_mode="median")
    return 2 * a.numel() / (ms * 1e-3)


def probe_front(batches, gen) -> tuple[dict, dict]:
    """({(key, b): (best µs, its config)}, {b: torch.mm µs})."""
    packed = (torch.randn(N, H, generator=gen, device="cuda") * H ** -0.5).bfloat16()
    copies = [packed.clone() for _ in range(16)]
    # Every width's x is a prefix of one draw, so that row 0 is the same input at each b.
    x_all = torch.randn(max(batches), H, generator=gen, device="cuda").bfloat16()
    xs = {b: x_all[:b].contiguous() for b in batches}
    ws = torch.empty(8 * max(batches) * N, dtype=torch.float32, device="cuda")
    best, mm = {}, {}
    for b in batches:
        x = xs[b]
        it = iter(range(1 << 60))
        mm[b] = bench(lambda: torch.mm(x, copies[next(it) % 16].t(), out_dtype=torch.float32))
        exact = x.double() @ packed.double().t()
        for key in KEYS:
            seen, first = set(), None
            for lay in layouts(b):
                cfg = {**front.DEFAULT, **lay, "BLOCK_K": key[0], "SPLIT_K": key[1]}
                if not valid(cfg) or effective(cfg) in seen:
                    continue
                seen.add(effective(cfg))
                out = front.front_gemm(x, packed, config=cfg, workspace=ws)
                err = ((out.double() - exact).norm() / exact.norm()).item()
                bits = out.view(torch.int32)
                same = first is None or torch.equal(bits, first)
                first = bits if first is None else first
                firsts.setdefault((key, b), bits)
                row0 = row0_of.setdefault(key, bits[0].clone())
                if not (same and torch.equal(bits[0], row0) and err < 1e-5):
                    print(f"!! front b={b} key={key} {lay}: same-as-key-first={same} "
                          f"row0-invariant={torch.equal(bits[0], row0)} err={err:.1e}: not timed")
                    continue
                o = torch.empty_like(out)
                us = bench(lambda: front.front_gemm(x, copies[next(it) % 16], out=o, config=cfg,
                                                    workspace=ws))
                print(f"front b={b:5d} K{key[0]}/S{key[1]} BM{cfg['BLOCK_M']:3d} "
                      f"BN{cfg['BLOCK_N']:3d} grid{cfg['SPLIT_GRID']} G{cfg['GROUP']} "
                      f"w{cfg['num_warps']} st{cfg['num_stages']} {effective(cfg)[4:]}: "
                      f"{us:7.2f} us  (torch.mm {mm[b]:.2f}, {us / mm[b]:.2f}x)", flush=True)
                if (key, b) not in best or us < best[key, b][0]:
                    best[key, b] = (us, cfg)
    same_segments(batches)
    return best, mm


row0_of: dict = {}
firsts: dict = {}  # {(key, b): the bits of the key's first config at width b}


def same_segments(batches) -> None:
    """Whether keys that cut H into the same segments (equal SPLIT_K, each segment a
    whole number of either key's blocks) give the same bits: if so, BLOCK_K need not be
    a reduction key on this GPU (wgmma sums a segment 16 elements at a time either way)."""
    for (k1, s1), (k2, s2) in ((a, c) for a in KEYS for c in KEYS if a < c):
        if s1 != s2 or H % (s1 * max(k1, k2)):
            continue
        same = [torch.equal(firsts[(k1, s1), b], firsts[(k2, s2), b]) for b in batches
                if ((k1, s1), b) in firsts and ((k2, s2), b) in firsts]
        print(f"BLOCK_K {k1} and {k2} at SPLIT_K {s1}: bits equal at {sum(same)} of "
              f"{len(same)} widths", flush=True)


def finalize_configs(b: int) -> list[dict]:
    if b <= 128:
        return [c for c in fin.SPACE if c["num_warps"] >= 2]
    return [c for c in fin.SPACE if c["BLOCK_T"] == 1 and c["num_warps"] in (4, 8)]


def probe_finalize(batches, gen, bw) -> dict:
    """{b: (best µs, config, floor µs, µs of a copy moving as many bytes)}."""
    best = {}
    for b in batches:
        rows = torch.randn(b * K, L, generator=gen, device="cuda").bfloat16()
        weights = torch.rand(b, K, generator=gen, device="cuda").bfloat16()
        ref = reference.finalize(rows, weights)
        floor = (rows.numel() + weights.numel() + b * L) * 2 / bw * 1e6
        out = torch.empty(b, L, dtype=torch.bfloat16, device="cuda")
        for cfg in finalize_configs(b):
            out.fill_(float("nan"))
            fin.finalize(rows, weights, out=out, config=cfg)
            if not torch.equal(out.view(torch.int16), ref.view(torch.int16)):
                print(f"!! finalize b={b} {cfg}: not bitwise: not timed")
                continue
            us = bench(lambda: fin.finalize(rows, weights, out=out, config=cfg))
            if b not in best or us < best[b][0]:
                best[b] = (us, cfg, floor)
        # A copy that moves as many bytes (half read, half written): how near its floor
        # a transfer this small gets at all.
        src = torch.empty(int(floor * bw * 1e-6) // 2, dtype=torch.uint8, device="cuda")
        dst = torch.empty_like(src)
        copy_us = bench(lambda: dst.copy_(src))
        best[b] = (*best[b], copy_us)
        print(f"finalize b={b:5d} best {best[b][0]:.2f} us {best[b][1]} floor {floor:.2f} us; "
              f"a copy of as many bytes {copy_us:.2f} us", flush=True)
    return best


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batches", type=int, nargs="+", default=[65, 128, 256, 512, 1024])
    p.add_argument("--skip-finalize", action="store_true")
    p.add_argument("--keys", nargs="+", default=[f"{k}/{s}" for k, s in KEYS],
                   help="reduction keys BLOCK_K/SPLIT_K to probe (default: %(default)s)")
    args = p.parse_args(argv)
    KEYS[:] = [tuple(int(v) for v in key.split("/")) for key in args.keys]
    start = time.time()
    gen = torch.Generator(device="cuda").manual_seed(7)
    bw = copy_bandwidth()
    print(f"# {torch.cuda.get_device_name()}; torch {torch.__version__}, triton "
          f"{triton.__version__}; copy {bw / 1e12:.2f} TB/s", flush=True)
    best, mm = probe_front(args.batches, gen)
    fbest = {} if args.skip_finalize else probe_finalize(args.batches, gen, bw)

    print(f"\n## front N{N}_H{H}: best µs per b (ratio to torch.mm), per reduction key")
    print("| BLOCK_K/SPLIT_K | " + " | ".join(f"b={b}" for b in args.batches)
          + " | worst ratio |")
    print("|---" * (len(args.batches) + 2) + "|")
    for key in KEYS:
        cells, worst = [], 0.0
        for b in args.batches:
            if (key, b) in best:
                us = best[key, b][0]
                worst = max(worst, us / mm[b])
                cells.append(f"{us:.1f} ({us / mm[b]:.2f}x)")
            else:
                cells.append("—")
                worst = float("inf")
        print(f"| {key[0]}/{key[1]} | " + " | ".join(cells) + f" | {worst:.2f}x |")
    print("| torch.mm | " + " | ".join(f"{mm[b]:.1f}" for b in args.batches) + " | |")
    print("\nbest layout per (key, b):")
    for (key, b), (us, cfg) in sorted(best.items()):
        print(f"  {key[0]}/{key[1]} b={b}: {us:.1f} us {cfg}")
    if fbest:
        print("\n## finalize L3584_K16: best µs per b (of floor)")
        print("| b | µs | floor µs | of floor | copy of as many bytes, µs (of floor) | config |")
        print("|---|---|---|---|---|---|")
        for b, (us, cfg, floor, copy_us) in sorted(fbest.items()):
            print(f"| {b} | {us:.2f} | {floor:.2f} | {us / floor:.2f}x | {copy_us:.2f} "
                  f"({copy_us / floor:.2f}x) | {cfg} |")
    print(f"\n# {time.time() - start:.0f} s")


if __name__ == "__main__":
    main()
