"""One experts call and one matmul_ogs call at TP8, for Nsight Compute to read side by side.

    PYTHONPATH=.peers ncu --clock-control none --set full \
        -k regex:"experts_(up|down)|matmul_ogs" -o OUT/experts \
        python benchmarks/diagnostics/profile_experts.py [--b 256] [--layout wgmma]

Runs ``ex.experts`` once at the shipped table's configs for batch width b (balanced
routing, as probe_experts.py draws it) and then, when ``triton_kernels`` is importable,
the matmul_ogs peer's two GEMMs once over the same experts, routing built beforehand
(benchmarks/peers.py). Each output is checked (rows against ``reference.expert_rows`` on
the first tokens; the peer by ``peers.check_matmul_ogs``) so that a profile is never of
a wrong kernel. Without a GPU it runs the tiny dims in Triton's interpreter (a check of
the script). `bash benchmarks/diagnostics/h200.sh profile` runs it under ncu in both
Hopper layouts and writes the pages as CSV (benchmarks/NOTES.md, "Exact decode instead of
dot_scaled on Hopper", has what it showed on 2026-12-03).
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))  # the repository
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # benchmarks/: peers

from wide_moe_triton import WideMoEConfig, tune  # noqa: E402
from wide_moe_triton.kernels import experts as ex  # noqa: E402

import probe_experts  # noqa: E402  (its Batch: routing, plan, reference rows)

DRY = not torch.cuda.is_available()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--b", type=int, default=256)
    p.add_argument("--layout", default="wgmma", choices=ex.LAYOUTS)
    args = p.parse_args(argv)
    cfg = WideMoEConfig.tiny(tp=1) if DRY else WideMoEConfig.kimi_k3(tp=8)
    gen = torch.Generator(device="cpu" if DRY else "cuda").manual_seed(8)
    weights = tune.random_expert_weights(cfg, gen, args.layout)
    weights["stock"] = (weights["w13"], weights["w13_scales"], weights["w2"],
                        weights["w2_scales"])
    batch = probe_experts.Batch(cfg, weights, args.b, gen, copy_bw=4e12)
    # No configs given: the table's for b in this layout (its defaults where there is none).
    err = batch.error(None, None)
    print(f"experts b={args.b} layout {args.layout}: rel err {err:.1e} "
          f"({batch.touched} experts touched)", flush=True)
    if not err < 1e-2:
        print("experts WRONG: the profile is not of a correct kernel")
        return 1
    try:
        import peers
        ogs = peers.MatmulOgsExperts(*weights["stock"])
    except Exception as exc:  # no triton_kernels here: our kernels alone
        print(f"matmul_ogs not run: {type(exc).__name__}: {str(exc)[:200]}")
        return 0
    latent = torch.randn(args.b, cfg.latent, generator=gen, device=gen.device).bfloat16()
    ids = batch.ids
    w = torch.rand(ids.shape, generator=gen, device=gen.device).bfloat16()
    chk = peers.check_matmul_ogs(ogs, latent, ids, w, *weights["stock"], min(args.b, 16))
    print(f"matmul_ogs: {chk}", flush=True)
    ogs.gemms(latent, ogs.route(ids, w))
    torch.cuda.synchronize()
    return 0 if chk.ok else 1


if __name__ == "__main__":
    sys.exit(main())
