"""Host memory while loading one MoE layer from a checkpoint: peak RSS against the bytes
the rank reads.

Writes a synthetic checkpoint at Kimi-K3's production dims with few experts (``save_layer``
of a random ``LatentMoE``, E = 32 by default) into a temporary directory, then loads the
whole layer (TP1) and rank 3 of TP8, each in a fresh process, and prints for each: the
bytes of its slices, the peak resident set above the process's resident set before the
load (VmHWM reset through /proc/self/clear_refs), and the time.

    python benchmarks/checkpoint_memory.py                  # E = 32, TP1 and TP8 rank 3
    python benchmarks/checkpoint_memory.py --keep DIR      # leave (or reuse) it in DIR
    python benchmarks/checkpoint_memory.py --mapped-bytes 1099511627776  # one opening a file
    python benchmarks/checkpoint_memory.py --make DIR --device cuda   # only write one

Needs no GPU (``--device cuda`` only draws the random weights there).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

LAYER = 5


def status() -> dict[str, int]:
    """VmRSS, VmHWM (peak), RssAnon and RssFile of this process, in bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
                out[key] = int(value.split()[0]) * 1024
    return out


def synthetic_layer(cfg, seed: int, device: str):
    """A whole ``LatentMoE`` of cheap random weights: uniform E2M1 bytes (every code)
    with E8M0 scales 2^-8 and 2^-7 (elements of RMS 0.011-0.023, about 1/sqrt(L) and
    1/sqrt(I) at production dims), BF16 dense weights of the same scale as
    ``LatentMoE``'s own draw (which quantizes FP32 draws: minutes on a CPU)."""
    import torch

    from wide_moe_triton import LatentMoE, layout

    gen = torch.Generator(device=device).manual_seed(seed)
    weights = {}
    for name, (shape, dtype) in layout.buffers(cfg).items():
        if dtype == torch.uint8 and name.endswith("_scales"):
            t = torch.randint(119, 121, shape, generator=gen, device=device, dtype=dtype)
        elif dtype == torch.uint8:
            t = torch.randint(0, 256, shape, generator=gen, device=device, dtype=dtype)
        else:
            fan_in = shape[-1] if len(shape) > 1 else None
            t = torch.randn(shape, generator=gen, device=device)
            t = t * fan_in ** -0.5 if fan_in else (1 + 0.1 * t if name == "norm_weight"
                                                   else 0.05 * t)
        weights[name] = t.to(dtype)
    return LatentMoE(cfg, weights=weights)


def make(path: str, experts: int, device: str, shards: int) -> None:
    """A synthetic production-dims checkpoint of layer ``LAYER`` in ``path``."""
    from wide_moe_triton import WideMoEConfig, checkpoint

    cfg = WideMoEConfig.kimi_k3().replace(num_experts=experts)
    checkpoint.save_layer(synthetic_layer(cfg, 0, device), path, LAYER, shards=shards)


def measure(path: str, tp: int, rank: int, mapped_bytes: int) -> dict:
    """Load rank ``rank`` of ``tp`` from ``path`` in this process and report its memory."""
    from wide_moe_triton import checkpoint

    checkpoint.MAPPED_BYTES = mapped_bytes
    before = status()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current resident set
    start = time.perf_counter()
    module = checkpoint.load_layer(path, LAYER, tp=tp, rank=rank)
    seconds = time.perf_counter() - start
    after = status()
    return {"tp": tp, "rank": rank, "bytes": sum(t.nbytes for t in module.buffers()),
            "peak_above": after["VmHWM"] - before["VmRSS"],
            "held_above": after["VmRSS"] - before["VmRSS"], "seconds": seconds}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--shards", type=int, default=4, help="safetensors files written")
    p.add_argument("--device", default="cpu", help="where the random layer is drawn")
    p.add_argument("--keep", metavar="DIR", help="write the checkpoint here and keep it")
    p.add_argument("--make", metavar="DIR", help="only write the checkpoint here")
    p.add_argument("--mapped-bytes", type=int, default=None,
                   help="bytes of a file touched before the loader reopens it (default: "
                        "checkpoint.MAPPED_BYTES)")
    p.add_argument("--measure", metavar="DIR", help=argparse.SUPPRESS)
    p.add_argument("--tp", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.mapped_bytes is None:
        from wide_moe_triton import checkpoint

        args.mapped_bytes = checkpoint.MAPPED_BYTES
    if args.measure:
        print(json.dumps(measure(args.measure, args.tp, args.rank, args.mapped_bytes)))
        return 0
    if args.make:
        make(args.make, args.experts, args.device, args.shards)
        print(f"wrote layer {LAYER} to {args.make}")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        path = args.keep or tmp
        start = time.perf_counter()
        if not os.path.exists(os.path.join(path, "model.safetensors.index.json")):
            make(path, args.experts, args.device, args.shards)
            print(f"synthetic Kimi-K3 layer {LAYER}, E = {args.experts}, {args.shards} "
                  f"files, written in {time.perf_counter() - start:.0f} s")
        print(f"loading {path} layer {LAYER}, a file reopened every "
              f"{args.mapped_bytes / 2**20:g} MiB touched")
        print(f"{'load':>12} {'bytes read':>12} {'peak RSS above':>15} {'ratio':>6} "
              f"{'held after':>11} {'s':>5}")
        for tp, rank in ((1, 0), (8, 3)):
            out = subprocess.run([sys.executable, __file__, "--measure", path, "--tp", str(tp),
                                  "--rank", str(rank), "--mapped-bytes",
                                  str(args.mapped_bytes)], check=True, capture_output=True,
                                 text=True, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
            r = json.loads(out.stdout.strip().splitlines()[-1])
            mib = lambda n: f"{n / 2**20:.0f} MiB"  # noqa: E731
            print(f"{f'TP{tp} rank {rank}':>12} {mib(r['bytes']):>12} "
                  f"{mib(r['peak_above']):>15} {r['peak_above'] / r['bytes']:>6.2f} "
                  f"{mib(r['held_above']):>11} {r['seconds']:>5.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
