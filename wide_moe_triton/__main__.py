"""The ``wide-moe`` command (``python -m wide_moe_triton``): run the layer beside the stock
path and print how far apart they are, a line per batch width; or a layer of a Kimi-K3
checkpoint (``--checkpoint``); ``wide-moe tables``: which tuned table this GPU gets
(``tables``)."""

from __future__ import annotations

import os
import sys
import time

from . import cli

CPU_BATCHES = [1, 16, 64]  # 64: the tiny config's widest step
GPU_BATCHES = [1, 65, 257, 1024]

DESCRIPTION = f"""\
Build the MoE layer twice over the same random weights: the stock PyTorch module
(LatentMoE, the definition) and WideMoE (the Triton kernels), send the same random
batches through both, and print for each batch width how far WideMoE's output is from
the stock one's. Exits 0 when every width's relative error is below 1e-2, 1 when one is
not or on bad data (a broken checkpoint), 2 on bad arguments; an error is one line
naming the argument or the file (--debug shows the traceback).

Without a GPU it runs the tiny config (hidden 256, 16 experts) and the kernels run in
Triton's interpreter, as Python on the CPU: under a minute on two cores. With a GPU it
runs the production dims (Kimi-K3, one rank) unless --tiny.

With --checkpoint DIR --layer N it runs that MoE layer of a Kimi-K3 checkpoint instead,
on unit-RMS rows times the layer's post-attention norm weight (its input's scale in the
model): the stock path over the whole layer, WideMoE over --tp simulated ranks, each
built from its own slices of the checkpoint (only rank R's with --rank R, the others
then cut from the whole layer); it prints the routing load too.

`wide-moe tables` prints this GPU's name, the tuned table it gets (yours, the shipped
one, another GPU's of its architecture as a fallback, or none) with its path, and how
many of the layer's launches that table covers; `wide-moe tables --help` for more.

Under torchrun the ranks are processes instead: `torchrun --nproc-per-node T -m
wide_moe_triton --tp T` runs each rank's own shard over the process group (gloo on a
CPU, NCCL on GPUs) and checks every rank's bits; under torchrun --help lists its options.

Columns:
  b           the batch width (rows); a batch wider than the layer's widest step
              (64 rows in the tiny config, 1024 in Kimi-K3's) runs in chunks
  stock s     seconds the stock PyTorch path took for the batch
  wide s      seconds WideMoE took; on a CPU that is Triton's interpreter running each
              kernel program as Python, thousands of times slower than the kernels on a
              GPU: it says nothing of their speed (benchmarks/bench_layer.py does)
  max |diff|  the largest elementwise difference between the two outputs
  rel err     ||wide - stock|| / ||stock|| over the batch
  bitwise     the share of output elements equal bit for bit (the two paths round at
              the same points and differ only in accumulation order)
"""


def parser() -> cli.Parser:
    """The command line of ``wide-moe`` (``python -m wide_moe_triton``)."""
    p = cli.Parser("wide_moe_triton", description=DESCRIPTION)
    p.add_argument("--tiny", action="store_true",
                   help="run the tiny config even on a GPU (default: the tiny config on "
                        "CPU, Kimi-K3's dims on a GPU)")
    p.add_argument("--batches", type=cli.positive_int, nargs="+", metavar="B",
                   help="batch widths to run (default: "
                        f"{' '.join(map(str, CPU_BATCHES))} on CPU, 1 5 64 with --checkpoint "
                        f"on CPU, {' '.join(map(str, GPU_BATCHES))} on a GPU)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the weights and inputs (default: 0)")
    p.add_argument("--checkpoint", metavar="DIR",
                   help="run a layer of this Kimi-K3 checkpoint directory, with --layer "
                        "(default: random weights)")
    p.add_argument("--layer", type=cli.natural_int, metavar="N",
                   help="the MoE layer of --checkpoint to run (default: none)")
    p.add_argument("--tp", type=cli.positive_int, default=1, metavar="T",
                   help="simulated tensor-parallel ranks for --checkpoint (default: 1)")
    p.add_argument("--rank", type=cli.natural_int, metavar="R",
                   help="load only this rank's shard from --checkpoint (default: every "
                        "rank's)")
    p.add_argument("--device", choices=("cpu", "cuda"),
                   help="--checkpoint's device (default: cuda where there is a GPU)")
    return p


def _check(args, p: cli.Parser) -> None:
    """Refuse (``p.error``, exit 2) the arguments that cannot go together or name no
    checkpoint directory, before anything is loaded."""
    if (args.checkpoint is None) != (args.layer is None):
        p.error("--checkpoint and --layer go together")
    if args.checkpoint is None and (args.rank is not None or args.tp != 1 or args.device):
        p.error("--tp, --rank and --device go with --checkpoint")
    if args.rank is not None and not args.rank < args.tp:
        p.error(f"argument --rank: must be in [0, --tp = {args.tp}), got {args.rank}")
    if args.checkpoint is not None:
        if not os.path.exists(args.checkpoint):
            p.error(f"argument --checkpoint: {args.checkpoint}: no such directory")
        if not os.path.isdir(args.checkpoint):
            p.error(f"argument --checkpoint: {args.checkpoint} is not a directory; give "
                    f"the checkpoint's directory (its config.json and *.safetensors)")
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            p.error("argument --device: cuda, but torch sees no CUDA GPU here")


def main(argv=None) -> int:
    """The command: its exit status (0 when WideMoE matches the stock path; 1 on a
    mismatch or bad data, 2 on bad arguments, each error one line: ``cli.run``). Under
    torchrun (its variables set) every rank runs the tensor-parallel launcher instead
    (``launch.main``, the same exit statuses and 3 for a failed peer)."""
    from . import launch

    args = sys.argv[1:] if argv is None else list(argv)
    if args[:1] == ["tables"]:  # the which-table subcommand
        from . import tables

        return tables.main(args[1:], prog=f"{cli.invoked_name('wide_moe_triton')} tables")
    if launch.under_torchrun():  # a rank of torchrun: tensor parallelism over processes
        return launch.main(argv)
    return cli.run("wide-moe", parser(), _main, argv)


def _main(args, p: cli.Parser) -> int:
    _check(args, p)
    if args.checkpoint is not None:
        return run_checkpoint(args)
    import torch

    cuda = torch.cuda.is_available()
    if not cuda:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from wide_moe_triton import LatentMoE, WideMoE, WideMoEConfig

    tiny = args.tiny or not cuda
    cfg = WideMoEConfig.tiny() if tiny else WideMoEConfig.kimi_k3(tp=1)
    batches = args.batches or (CPU_BATCHES if tiny else GPU_BATCHES)
    device = "cuda" if cuda else "cpu"
    where = torch.cuda.get_device_name() if cuda else "CPU, kernels in Triton's interpreter"
    print(f"wide_moe_triton on {where}: {'tiny' if tiny else 'Kimi-K3'} dims {_dims(cfg)}",
          flush=True)
    stock = LatentMoE(cfg, seed=args.seed, device=device)
    wide = WideMoE.from_module(stock)
    gen = torch.Generator(device=device).manual_seed(args.seed + 1)
    inputs = (torch.randn(b, cfg.hidden, generator=gen, device=device).bfloat16()
              for b in batches)
    return _compare(stock, wide, inputs, cuda)


def _compare(stock, wide, inputs, cuda) -> int:
    """Print, for each input, both paths' times and how far apart their outputs are;
    0 if every relative error is below 1e-2, else 1."""
    if not cuda:
        print("wide s is the interpreter's time, not a GPU's (--help explains the columns)")
    from .launch import timed

    print(f"{'b':>6} {'stock s':>9} {'wide s':>9} {'max |diff|':>11} {'rel err':>9} "
          f"{'bitwise':>8}", flush=True)
    worst = 0.0
    for x in inputs:
        b = x.shape[0]
        if cuda:
            wide(x)  # compiles the kernels of this width; the interpreter compiles nothing
        ref, t_stock = timed(stock, x, cuda)
        out, t_wide = timed(wide, x, cuda)
        diff = (out.float() - ref.float())
        rel = (diff.norm() / ref.float().norm()).item()
        equal = (out == ref).float().mean().item()
        worst = max(worst, rel)
        print(f"{b:>6} {t_stock:>9.4f} {t_wide:>9.4f} {diff.abs().max().item():>11.3e} "
              f"{rel:>9.2e} {equal:>7.1%}", flush=True)
    ok = worst < 1e-2
    print("OK: WideMoE matches the stock path" if ok else
          f"MISMATCH: relative error {worst:.2e} exceeds 1e-2")
    return 0 if ok else 1


def run_checkpoint(args) -> int:
    """``--checkpoint DIR --layer N``: the checkpoint's layer through both paths."""
    import torch

    cuda = (args.device or ("cuda" if torch.cuda.is_available() else "cpu")) == "cuda"
    if not cuda:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from wide_moe_triton import SimulatedGroup, WideMoE, checkpoint, reference

    device = "cuda" if cuda else "cpu"
    start = time.perf_counter()
    stock = checkpoint.load_layer(args.checkpoint, args.layer, device=device)
    loaded = f"whole layer {_nbytes(stock) / 2**20:.0f} MiB in {time.perf_counter() - start:.1f} s"
    cfg, T = stock.cfg, args.tp
    if T == 1:
        wide = WideMoE.from_module(stock)
    else:
        per_rank = []
        for r in range(T):
            if args.rank not in (None, r):
                per_rank.append(stock)
                continue
            start = time.perf_counter()
            per_rank.append(checkpoint.load_layer(args.checkpoint, args.layer, tp=T, rank=r,
                                                  device=device))
            loaded += (f"; rank {r} of {T} {_nbytes(per_rank[-1]) / 2**20:.0f} MiB in "
                       f"{time.perf_counter() - start:.1f} s")
        group = SimulatedGroup(per_rank)
        wide = lambda x: group(x)[0]  # noqa: E731  (every rank's output is the same)
    where = torch.cuda.get_device_name() if cuda else "CPU, kernels in Triton's interpreter"
    print(f"wide_moe_triton on {where}: {args.checkpoint} layer {args.layer}, T = {T}: "
          f"{_dims(cfg)}", flush=True)
    print(f"loaded: {loaded}")
    batches = args.batches or (GPU_BATCHES if cuda else [1, 5, 64])
    gen = torch.Generator(device=device).manual_seed(args.seed + 1)
    inputs = [checkpoint.layer_inputs(args.checkpoint, args.layer, b, generator=gen,
                                      device=device) for b in batches]
    status = _compare(stock, wide, inputs, cuda)
    x = inputs[batches.index(max(batches))]
    ids, _ = reference.route(reference.mm_f32(x, stock.gate_weight),
                             stock.e_score_correction_bias, cfg.top_k, cfg.renormalize,
                             cfg.routed_scaling_factor)
    load = torch.bincount(ids.flatten().long(), minlength=cfg.num_experts)
    print(f"routing of b = {x.shape[0]} (top-{cfg.top_k}): tokens per expert min "
          f"{load.min().item()} / median {load.median().item()} / max {load.max().item()}, "
          f"experts touched {(load > 0).sum().item()} of {cfg.num_experts}")
    return status


def _dims(cfg) -> str:
    return (f"H={cfg.hidden} L={cfg.latent} E={cfg.num_experts} K={cfg.top_k} "
            f"I={cfg.expert_intermediate} S={cfg.shared_intermediate}")


def _nbytes(module) -> int:
    return sum(t.nbytes for t in module.buffers())


if __name__ == "__main__":
    sys.exit(main())
