"""``wide-moe tables`` (``python -m wide_moe_triton.tables``): which tuned table a GPU gets
and how much of the layer it covers.

Prints the GPU's name, the table it gets (``tuning.choose_table``: the user's own, the
shipped one, another GPU's as a fallback, or none, with its path), and, for each
``--tp``, how many of the layer's table lookups that table answers: every launch config
the layer's launch plans look up at every batch width they serve, counted by
(kernel, shape, width). The lookups are the ones ``WideMoE``'s ``LaunchPlan`` makes,
recorded while plans of a Kimi-K3 rank are built over weights on the meta device (no
memory, no values), so the count follows the layer's code."""

from __future__ import annotations

import collections
import sys

from . import cli, tuning

DESCRIPTION = """\
Print the name of this machine's GPU, the tuned table its launches read (your own in
your tables' directory, the one the package ships, another GPU's of the same
architecture taken as a fallback, or none: every kernel's default), the table's path,
and how many of the layer's launch-config lookups at Kimi-K3's dims that table answers,
for each tensor-parallel size. A table is <GPU name>.json, spaces replaced by
underscores. On a machine without a GPU it says so; --gpu-name asks for any GPU by name.

Environment: WIDE_MOE_CONFIG_DIR (your tables' directory), WIDE_MOE_TABLE (none: no
table; own: no fallback; a path: that table).
"""


def parser(prog: str | None = None) -> cli.Parser:
    """The command line of ``wide-moe tables`` (``prog``: its name as invoked, when it
    runs as a subcommand of ``wide-moe``)."""
    p = cli.Parser("wide_moe_triton.tables", description=DESCRIPTION)
    p.prog = prog or p.prog
    p.add_argument("--gpu-name", metavar="NAME",
                   help='the GPU to report for, as torch names it (e.g. "NVIDIA H100 80GB '
                        'HBM3"; default: this machine\'s GPU)')
    p.add_argument("--capability", metavar="X.Y",
                   help="--gpu-name's compute capability, for the fallback (default: "
                        "this machine's GPU's, else unknown: no fallback)")
    p.add_argument("--sms", type=cli.positive_int, metavar="N",
                   help="--gpu-name's SM count, for the fallback (default: as --capability)")
    p.add_argument("--memory-gb", type=cli.positive_float, metavar="GB",
                   help="--gpu-name's memory in GB, for the fallback (default: as "
                        "--capability)")
    p.add_argument("--tp", type=cli.positive_int, nargs="+", default=[8, 16, 1], metavar="T",
                   help="tensor-parallel sizes to count the lookups of (default: 8 16 1)")
    return p


def main(argv=None, prog: str | None = None) -> int:
    """The command; its exit status (0, or 2 on bad arguments: ``cli.run``)."""
    p = parser(prog)
    return cli.run(p.prog, p, _main, argv)


def _main(args, p: cli.Parser) -> int:
    gpu = _gpu(args, p)
    if gpu is None:
        print("no GPU here (torch sees no CUDA device); --gpu-name NAME reports for a GPU "
              "by name")
        return 0
    print(f"GPU: {describe(gpu)}")
    choice = tuning.choose_table(gpu)
    print(f"table: {choice.source}" + (f", {choice.path}" if choice.path else "") +
          f" ({choice.why})")
    for tp in args.tp:
        print(report(coverage(gpu, tp), tp))
    return 0


def _gpu(args, p: cli.Parser) -> tuning.GpuInfo | None:
    """The GPU asked about: ``--gpu-name`` with the properties given (this machine's
    where it is that GPU), else this machine's, else None."""
    here = tuning.gpu_info()
    if args.gpu_name is None:
        if any(v is not None for v in (args.capability, args.sms, args.memory_gb)):
            p.error("--capability, --sms and --memory-gb go with --gpu-name")
        return here
    if args.capability is not None and not tuning.is_capability(args.capability):
        p.error(f"argument --capability: must be major.minor, e.g. 9.0, got "
                f"{args.capability!r}")
    known = here if here is not None and here.name == args.gpu_name else \
        tuning.GpuInfo(args.gpu_name)
    return tuning.GpuInfo(args.gpu_name, args.capability or known.capability,
                          args.sms or known.sm_count, args.memory_gb or known.memory_gb)



def describe(gpu: tuning.GpuInfo) -> str:
    known = [f"compute capability {gpu.capability}" if gpu.capability else None,
             f"{gpu.sm_count} SMs" if gpu.sm_count else None,
             f"{gpu.memory_gb:g} GB" if gpu.memory_gb else None]
    known = [k for k in known if k]
    return gpu.name + (f" ({', '.join(known)})" if known else " (properties unknown)")


def coverage(gpu: tuning.GpuInfo, tp: int, widths=None) -> list:
    """The table lookups (``tuning.Lookup``) of the launch plans of rank 0 of a Kimi-K3
    layer at ``tp`` ranks for every batch width in ``widths`` (default 1 to wide_rows),
    as on ``gpu``; distinct by (kernel, shape, width)."""
    from .config import WideMoEConfig

    cfg = WideMoEConfig.kimi_k3(tp=tp)
    layer = planning_layer(cfg, gpu)
    seen = {}
    with tuning.recording(gpu) as lookups:
        for b in widths or range(1, cfg.wide_rows + 1):
            layer.plan(b)
    for look in lookups:
        seen.setdefault((look.kernel, look.shape, look.rows), look)
    return list(seen.values())


def planning_layer(cfg, gpu: tuning.GpuInfo):
    """A ``WideMoE`` of rank 0 of ``cfg.tp`` whose weights and buffers are on the meta
    device (shapes only): what its ``plan(b)`` looks up is what a real layer's does. Its
    experts' weight layout is ``gpu``'s (Hopper's, or the others' where the capability
    says another architecture)."""
    import torch

    from . import layout
    from .kernels.experts import layout as experts_layout
    from .kernels.experts import prepare_weights
    from .module import WideMoE
    from .scratch import WideScratch
    from .reference import LatentMoE
    from .sharding import shard

    # Built as on ``gpu`` (its buffers sized by that GPU's table, as a real layer's),
    # the lookups of the construction left out: they are no launch's.
    with tuning.recording(gpu):
        buffers = {name: torch.empty(shape, dtype=dtype, device="meta")
                   for name, (shape, dtype) in layout.buffers(cfg, cfg.tp).items()}
        stock = LatentMoE(cfg, weights=buffers, rank=0, world=cfg.tp)
        scratch = (WideScratch.simulated(cfg, "meta")[0] if cfg.tp > 1
                   else WideScratch.local(cfg, "meta"))
        weights = shard(stock, 0, cfg.tp)
        layer = WideMoE(cfg, weights, scratch)
        hopper = gpu.capability is None or gpu.capability.split(".")[0] == str(
            experts_layout.HOPPER)
        if not hopper:
            layer.experts = prepare_weights(weights.w13, weights.w13_scales, weights.w2,
                                            weights.w2_scales, layout="nk")
    return layer


def report(lookups: list, tp: int) -> str:
    """Lines of ``coverage``'s lookups: the total answered by the table, then one line a
    (kernel, shape): widths answered / widths looked up, the table's buckets used."""
    by_shape = collections.defaultdict(list)
    for look in lookups:
        by_shape[(look.kernel, look.shape)].append(look)
    covered = sum(look.covered for look in lookups)
    widths = max(look.rows for look in lookups)
    lines = [f"TP{tp} (Kimi-K3 rank-local shapes, widths 1-{widths}): the table answers "
             f"{covered} of {len(lookups)} lookups (kernel, shape, width); "
             f"{len(lookups) - covered} run the default"]
    for (kernel, shape), looks in sorted(by_shape.items()):
        hit = [look for look in looks if look.covered]
        buckets = sorted({int(look.bucket) for look in hit})
        lines.append(f"  {kernel:15} {shape:26} {len(hit):5} of {len(looks):5}" +
                     (f"  buckets {' '.join(map(str, buckets))}" if buckets else "  default"))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
