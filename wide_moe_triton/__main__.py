"""``python -m wide_moe_triton``: build a layer, run a few batch widths through the stock
path and through WideMoE, and print how far apart they are and how long each took.

On CPU it uses the tiny config in Triton's interpreter; with a GPU, the production dims
(Kimi-K3, T = 1) unless ``--tiny``."""

from __future__ import annotations

import argparse
import os
import sys
import time


def _parse(argv):
    p = argparse.ArgumentParser(prog="python -m wide_moe_triton", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="the tiny config even on a GPU")
    p.add_argument("--batches", type=int, nargs="+", help="batch widths to run")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def _timed(fn, x, cuda):
    import torch

    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    y = fn(x)
    if cuda:
        torch.cuda.synchronize()
    return y, time.perf_counter() - start


def main(argv=None) -> int:
    args = _parse(argv)
    import torch

    cuda = torch.cuda.is_available()
    if not cuda:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from wide_moe_triton import LatentMoE, WideMoE, WideMoEConfig

    tiny = args.tiny or not cuda
    cfg = WideMoEConfig.tiny() if tiny else WideMoEConfig.kimi_k3(tp=1)
    batches = args.batches or ([1, 5, 64, 70] if tiny else [1, 65, 257, 1024])
    device = "cuda" if cuda else "cpu"
    where = torch.cuda.get_device_name() if cuda else "CPU, Triton interpreter"
    print(f"wide_moe_triton on {where}: {'tiny' if tiny else 'Kimi-K3'} dims "
          f"H={cfg.hidden} L={cfg.latent} E={cfg.num_experts} K={cfg.top_k} "
          f"I={cfg.expert_intermediate} S={cfg.shared_intermediate}")
    stock = LatentMoE(cfg, seed=args.seed, device=device)
    wide = WideMoE.from_module(stock)
    gen = torch.Generator(device=device).manual_seed(args.seed + 1)
    print(f"{'b':>6} {'stock s':>9} {'wide s':>9} {'max |diff|':>11} {'rel err':>9} "
          f"{'bitwise':>8}")
    worst = 0.0
    for b in batches:
        x = torch.randn(b, cfg.hidden, generator=gen, device=device).bfloat16()
        wide(x)  # compile / warm up
        ref, t_stock = _timed(stock, x, cuda)
        out, t_wide = _timed(wide, x, cuda)
        diff = (out.float() - ref.float())
        rel = (diff.norm() / ref.float().norm()).item()
        equal = (out == ref).float().mean().item()
        worst = max(worst, rel)
        print(f"{b:>6} {t_stock:>9.4f} {t_wide:>9.4f} {diff.abs().max().item():>11.3e} "
              f"{rel:>9.2e} {equal:>7.1%}")
    ok = worst < 1e-2
    print("OK: WideMoE matches the stock path" if ok else
          f"MISMATCH: relative error {worst:.2e} exceeds 1e-2")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
