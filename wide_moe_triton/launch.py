"""Tensor parallelism over processes: the layer run by T ranks that ``torchrun`` starts,

    torchrun --nproc-per-node T -m wide_moe_triton --tp T [--checkpoint DIR --layer N]

(``python -m wide_moe_triton`` hands over here when torchrun's variables are set). Each
rank joins the process group (gloo on a CPU, the kernels in Triton's interpreter; NCCL
on GPUs, one a rank: GPU ``LOCAL_RANK``; gloo where ``--share-gpus`` puts several ranks
on one GPU), builds only its own shard (its blocks of the random layer of the seed,
``reference.random_shard``, or the checkpoint's slices) over the shared mailbox (shared
memory on the CPU, symmetric memory on GPUs), compiles every width's kernels
(``WideMoE.warmup``) and runs the layer at several batch widths, one wider than
``wide_rows``. Rank 0 compares each output with the stock layer at T = 1, held and run
on the CPU; every rank's output bits are hashed and gathered, so the table rank 0
prints says whether all ranks hold the same bits.

Exit codes, the same on every rank where the cause is shared: 0 every width matched on
every rank; 1 a result differs (from the stock layer, or between ranks) or the data is
bad (a broken checkpoint); 2 bad arguments (``--tp`` is not the world size, no GPU for a
local rank, ranks given different layers); 3 a peer failed (the mailbox timed out or
found a rank's process gone, the process group broke): a launcher may restart the job.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import hashlib
import os
import sys
import time

EXIT_OK, EXIT_MISMATCH, EXIT_USAGE, EXIT_PEER = 0, 1, 2, 3
TOLERANCE = 1e-2          # relative error against the stock layer that passes
GROUP_TIMEOUT_S = 600     # a collective that waits longer than this fails the run
SHARED_NOTE = ("the GPU time-slices the ranks: their bits are the product's, their times "
               "are not a multi-GPU node's")

DESCRIPTION = """\
Run the MoE layer tensor-parallel over the processes torchrun starts (one a GPU, or
CPU processes for testing), compare it with the stock layer at T = 1 on rank 0, check
that every rank holds the same output bits, and print one table (rank 0).

    torchrun --nproc-per-node T -m wide_moe_triton --tp T [--checkpoint DIR --layer N]

On a CPU the ranks join over gloo and share the mailbox through POSIX shared memory
(/dev/shm); the kernels run in Triton's interpreter, at the tiny dims unless
--checkpoint. On GPUs they join over NCCL, GPU LOCAL_RANK each, the mailbox in
symmetric memory, at Kimi-K3's dims unless --tiny.

Fewer GPUs than ranks on a node (testing): with --share-gpus rank r runs on GPU
LOCAL_RANK % G of the node's G, the ranks join over gloo (NCCL does not run two ranks
on one GPU) and symmetric memory lets them share a device
(TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1). The GPU time-slices the processes: the
bits are the product's, the times are not a multi-GPU node's. --all-reduce nccl is
refused there (the tail would run over gloo through the host, which a CUDA graph
cannot capture). Without --share-gpus such a node is refused, naming the flag.

Each rank draws and holds only its own shard (reference.random_shard, or the
checkpoint's slices); the whole stock layer, for rank 0's comparison, is held on the
CPU (drawn on rank 0's GPU a block at a time) and runs there: at Kimi-K3's dims that
takes seconds a width (--no-stock skips it; --experts N fewer experts). Before the
first call every rank compiles every width's kernels (WideMoE.warmup), so no rank
compiles inside a collective call. On GPUs each rank's peak memory
(torch.cuda.max_memory_allocated) is printed last.

Columns: b the batch width; stock s the stock layer's seconds (rank 0, T = 1); wide s
the slowest rank's seconds (on a CPU the interpreter's, not a GPU's); max |diff| and rel
err against the stock layer; bitwise the share of elements equal to the stock layer's
bit for bit; ranks "same bits" when every rank's output hashes alike.

Exit codes: 0 all matched; 1 a result differs or the data is bad; 2 bad arguments
(e.g. --tp is not torchrun's world size); 3 a peer failed or timed out (restartable).
"""


def under_torchrun(env=None) -> bool:
    """Whether this process is a rank that torchrun (or another env:// launcher) started:
    RANK and WORLD_SIZE are set."""
    env = os.environ if env is None else env
    return "RANK" in env and "WORLD_SIZE" in env


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="torchrun --nproc-per-node T -m wide_moe_triton",
                                description=DESCRIPTION,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tp", type=int, required=True, metavar="T",
                   help="tensor-parallel ranks: must equal the world size torchrun started")
    add_layer_arguments(p)
    p.add_argument("--batches", type=int, nargs="+", metavar="B",
                   help="batch widths (default: 1 16 wide_rows+1 on a CPU, 1 65 257 "
                        "wide_rows wide_rows+1 on GPUs)")
    p.add_argument("--all-ranks", action="store_true",
                   help="every rank prints its own line a width (default: rank 0 only)")
    p.add_argument("--no-stock", action="store_true",
                   help="skip rank 0's comparison with the stock layer (on the CPU: "
                        "seconds a width at Kimi-K3's dims); the ranks' bits are still "
                        "compared")
    return p


def add_layer_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments that say which layer the ranks build and where (``build_layer``);
    shared with ``benchmarks/bench_tp.py``."""
    p.add_argument("--checkpoint", metavar="DIR",
                   help="a Kimi-K3 checkpoint directory, with --layer (default: random "
                        "weights drawn from --seed)")
    p.add_argument("--layer", type=int, metavar="N", help="the MoE layer of --checkpoint")
    p.add_argument("--wide-rows", type=int, metavar="R",
                   help="the widest call; wider batches run in chunks (default: 64 for "
                        "the tiny dims, else 1024)")
    p.add_argument("--seed", type=int, default=0, help="seed of weights and inputs (0)")
    p.add_argument("--all-reduce", choices=("mailbox", "nccl"), default="mailbox",
                   help="the tail's all-reduces: over the mailbox in rank order (default), "
                        "or the process group's (NCCL; gloo's on a CPU; refused with "
                        "--share-gpus)")
    p.add_argument("--poll-timeout", type=float, metavar="S",
                   help="seconds a rank waits for a peer's words before every waiting "
                        "rank fails naming it (default: 60 on a CPU, where the host "
                        "waits; 10 on GPUs, where each poll reads the GPU's clock)")
    p.add_argument("--tiny", action="store_true", help="the tiny dims on GPUs too")
    p.add_argument("--experts", type=int, metavar="N",
                   help="random weights with N routed experts instead of the dims' own "
                        "(e.g. Kimi-K3's dims on a GPU too small for 896 experts a rank "
                        "set); N a multiple of T, at least top-k")
    p.add_argument("--share-gpus", action="store_true",
                   help="on a node with fewer GPUs than ranks, put rank r on GPU "
                        "LOCAL_RANK %% G, joined over gloo (testing: the GPU time-slices "
                        "the ranks, so only bits mean anything)")
    p.add_argument("--device", choices=("cpu", "cuda"),
                   help="default: cuda where there is a GPU, else cpu")


class Failed(Exception):
    """A failure reported with an exit code (``EXIT_*``)."""

    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = code


def _say_error(rank: int, world: int, message: str) -> None:
    first = str(message).strip().splitlines()[0] if str(message).strip() else repr(message)
    print(f"wide-moe: error: rank {rank} of {world}: {first}", file=sys.stderr, flush=True)


@dataclasses.dataclass
class Rank:
    """This process's place: ``rank`` of ``world`` (``local`` on its node), its device and
    the process group it joined."""

    rank: int
    world: int
    local: int
    device: object
    group: object
    shared: bool = False   # ranks share this rank's GPU (gloo, overlapping devices)


def _ranks_from_env() -> tuple[int, int, int]:
    """(rank, world size, local rank) from torchrun's variables."""
    try:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local = int(os.environ.get("LOCAL_RANK", rank))
    except ValueError as e:
        raise Failed(EXIT_USAGE, f"torchrun's RANK/WORLD_SIZE/LOCAL_RANK are not ints: {e}")
    if not 0 <= rank < world:
        raise Failed(EXIT_USAGE, f"RANK {rank} is not in [0, WORLD_SIZE {world})")
    return rank, world, local


def check_layer_arguments(p: argparse.ArgumentParser, args, world: int) -> None:
    """``p.error`` (exit 2) on arguments of ``add_layer_arguments`` that cannot go
    together; ``Failed`` (exit 2) where ``--tp`` is given and is not the world size."""
    if (args.checkpoint is None) != (args.layer is None):
        p.error("--checkpoint and --layer go together")
    if getattr(args, "batches", None) is not None and min(args.batches) < 1:
        p.error(f"--batches must be positive, got {min(args.batches)}")
    if args.wide_rows is not None and args.wide_rows < 1:
        p.error(f"--wide-rows must be positive, got {args.wide_rows}")
    if args.poll_timeout is not None and not 0 < args.poll_timeout < float("inf"):
        p.error(f"--poll-timeout must be a positive number of seconds, got {args.poll_timeout}")
    if args.experts is not None and args.checkpoint is not None:
        p.error("--experts draws random weights: it does not go with --checkpoint")
    if args.experts is not None and args.experts < 1:
        p.error(f"--experts must be positive, got {args.experts}")
    if args.share_gpus and args.device == "cpu":
        p.error("--share-gpus places ranks on GPUs; CPU ranks (--device cpu) share the "
                "host already")
    if args.tp is not None and args.tp != world:
        raise Failed(EXIT_USAGE, f"--tp {args.tp} does not match the {world} processes torchrun "
                                 f"started (WORLD_SIZE): run torchrun --nproc-per-node "
                                 f"{args.tp}, or pass --tp {world}")


def main(argv=None) -> int:
    """One rank's run of the check; the exit code (see the module's docstring)."""
    return run_as_rank(parser(), argv, _run)


def run_as_rank(p: argparse.ArgumentParser, argv, body) -> int:
    """Parse ``argv`` with ``p`` (``add_layer_arguments``' and ``--tp``), join the process
    group as torchrun's rank, and return ``body(args, Rank)``'s exit code; a failure is
    one line on stderr, ``wide-moe: error: rank R of T: ...``, and its exit code."""
    rank, world = os.environ.get("RANK", "?"), os.environ.get("WORLD_SIZE", "?")
    try:
        rank, world, local = _ranks_from_env()
        args = p.parse_args(argv)
        check_layer_arguments(p, args, world)
        me = _join(args, rank, world, local)
        try:
            code = body(args, me)
        except Failed:
            raise
        except ValueError as e:  # the ranks disagree on the layer, or a bad checkpoint
            from .checkpoint import CheckpointError

            raise Failed(EXIT_MISMATCH if isinstance(e, CheckpointError) else EXIT_USAGE,
                         str(e))
        except (RuntimeError, OSError) as e:  # a mailbox timeout, a dead peer, a broken group
            raise Failed(EXIT_PEER, str(e))
        import torch.distributed as dist

        dist.destroy_process_group()
        return code
    except Failed as e:
        _say_error(rank, world, str(e))
        return e.code
    except KeyboardInterrupt:
        return 130


def _device(args, local: int) -> tuple:
    """(this rank's device, whether ranks share its GPU): GPU ``local``, or with
    ``--share-gpus`` on a node with fewer GPUs than ranks GPU ``local % G``; or the CPU."""
    import torch

    kind = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if kind == "cpu":
        # Before triton is first imported: the kernels then run in the interpreter.
        os.environ.setdefault("TRITON_INTERPRET", "1")
        return torch.device("cpu"), False
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    here = int(os.environ.get("LOCAL_WORLD_SIZE", local + 1))
    shared = bool(args.share_gpus) and 0 < gpus < max(here, local + 1)
    if not shared and local >= gpus:
        raise Failed(EXIT_USAGE, f"local rank {local} needs GPU {local}, but this node has "
                                 f"{gpus} (start at most that many processes a node, pass "
                                 "--share-gpus to run several ranks on one GPU for "
                                 "testing, or --device cpu)")
    if shared and args.all_reduce == "nccl":
        raise Failed(EXIT_USAGE, "--all-reduce nccl does not go with --share-gpus: NCCL does "
                                 "not run two ranks on one GPU, and over gloo the tail "
                                 "would pass through the host, which a CUDA graph cannot "
                                 "capture; use --all-reduce mailbox")
    index = local % gpus if shared else local
    torch.cuda.set_device(index)
    return torch.device("cuda", index), shared


def _join(args, rank: int, world: int, local: int) -> Rank:
    """This rank's device (``_device``) and the process group it joins: NCCL on GPUs of
    their own, gloo on the CPU and where ranks share a GPU."""
    import torch.distributed as dist

    device, shared = _device(args, local)
    if shared:
        # Before symmetric memory is first touched: several ranks' buffers on one device.
        os.environ["TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES"] = "1"
    elif device.type == "cuda":
        # NVLink multicast (NVLS) is not assumed anywhere: keep NCCL off it too.
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    timeout = datetime.timedelta(seconds=GROUP_TIMEOUT_S)
    try:
        if device.type == "cuda" and not shared:
            dist.init_process_group("nccl", timeout=timeout, device_id=device)
        else:
            dist.init_process_group("gloo", timeout=timeout)
    except Exception as e:  # the rendezvous itself failed
        raise Failed(EXIT_PEER, f"could not join the process group: {e}")
    return Rank(rank, world, local, device, dist.group.WORLD, shared)


def _default_batches(cuda: bool, wide_rows: int) -> list[int]:
    widths = [1, 65, 257, wide_rows, wide_rows + 1] if cuda else [1, 16, wide_rows + 1]
    return sorted(set(widths))


def build_layer(args, me: Rank, stock: bool = True):
    """(the whole stock layer on the CPU on rank 0 when ``stock``, else None; this rank's
    ``WideMoE``): from ``--checkpoint``'s slices of this rank, or this rank's shard of
    the random layer of ``--seed`` (``reference.random_shard``: the tiny dims on a CPU
    or with ``--tiny``, else Kimi-K3's; ``--experts``). A rank holds only its own shard
    on its device; the whole layer, drawn on rank 0's device a block at a time, lives
    on the CPU. Collective."""
    import torch

    from . import WideMoE, WideMoEConfig, checkpoint, reference

    common = dict(all_reduce=args.all_reduce, poll_timeout=args.poll_timeout)
    whole = stock and me.rank == 0
    cpu = torch.device("cpu")
    if args.checkpoint is not None:
        wide_rows = args.wide_rows or 1024
        wide = WideMoE.from_checkpoint(args.checkpoint, args.layer, me.group,
                                       device=me.device, wide_rows=wide_rows, **common)
        return (checkpoint.load_layer(args.checkpoint, args.layer, device=cpu,
                                      wide_rows=wide_rows) if whole else None), wide
    tiny = args.tiny or me.device.type == "cpu"
    wide_rows = args.wide_rows or (64 if tiny else 1024)
    cfg = (WideMoEConfig.tiny(wide_rows=wide_rows) if tiny
           else WideMoEConfig.kimi_k3(wide_rows=wide_rows))
    if args.experts is not None:
        cfg = cfg.replace(num_experts=args.experts)
    mine = reference.random_shard(cfg, args.seed, me.rank, me.world, device=me.device)
    wide = WideMoE.from_module(mine, me.group, **common)
    del mine  # WideMoE holds its own layouts of the weights
    return (reference.random_shard(cfg, args.seed, device=cpu, draw_device=me.device)
            if whole else None), wide


def peak_memory_line(me: Rank) -> str | None:
    """Every rank's ``torch.cuda.max_memory_allocated`` on its GPU, gathered (GPUs only;
    collective): one line for rank 0 to print, None on a CPU."""
    import torch
    import torch.distributed as dist

    if me.device.type != "cuda":
        return None
    peaks: list = [None] * me.world
    dist.all_gather_object(peaks, torch.cuda.max_memory_allocated(me.device), group=me.group)
    return "GPU memory, max allocated a rank (GiB): " + ", ".join(
        f"r{r} {b / 2 ** 30:.2f}" for r, b in enumerate(peaks))


def layer_input(args, hidden: int, b: int, device):
    """The same BF16 [b, hidden] input on every rank, drawn on the CPU from the seed (at
    the scale of the checkpoint layer's input with ``--checkpoint``)."""
    import torch

    gen = torch.Generator().manual_seed(args.seed + b)
    if args.checkpoint is not None:
        from . import checkpoint

        return checkpoint.layer_inputs(args.checkpoint, args.layer, b, generator=gen).to(device)
    return torch.randn(b, hidden, generator=gen).bfloat16().to(device)


def bits_digest(t) -> str:
    """sha256 of a tensor's bytes (its bits, on the host)."""
    import torch

    return hashlib.sha256(t.detach().contiguous().cpu().view(torch.uint8).numpy()
                          .tobytes()).hexdigest()


def describe(me: Rank, cfg, all_reduce: str) -> str:
    """One line: the ranks, their devices, the all-reduce and the layer's dims."""
    import torch

    if me.shared:
        gpus = torch.cuda.device_count()
        where = (f"{gpus} x {torch.cuda.get_device_name(me.device)} shared by the ranks "
                 f"(gloo, symmetric memory on overlapping devices; {SHARED_NOTE})")
    elif me.device.type == "cuda":
        where = f"{me.world} x {torch.cuda.get_device_name(me.device)} (NCCL)"
    elif me.world == 1:
        where = "1 CPU process (kernels in Triton's interpreter)"
    else:
        where = (f"{me.world} CPU processes (gloo, shared memory; kernels in Triton's "
                 "interpreter)")
    return (f"wide_moe_triton, T = {me.world} on {where}: all-reduce {all_reduce}, "
            f"H={cfg.hidden} L={cfg.latent} E={cfg.num_experts} K={cfg.top_k} "
            f"I={cfg.expert_intermediate} S={cfg.shared_intermediate} wide_rows={cfg.wide_rows}")


def timed(fn, x, cuda: bool):
    """``fn(x)`` and its seconds; on a GPU the clock starts and stops at a sync, so the
    time is the kernels', not their launches'."""
    import torch

    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    y = fn(x)
    if cuda:
        torch.cuda.synchronize()
    return y, time.perf_counter() - start


def checked_call(wide, x):
    """One collective call of the layer and its seconds; on a GPU the mailbox's error
    record is read after it (a sync; on a CPU every call checks it)."""
    cuda = x.is_cuda
    out, seconds = timed(wide, x, cuda)
    if cuda:
        wide.check_mailbox()
    return out, seconds


def _run(args, me: Rank) -> int:
    import torch
    import torch.distributed as dist

    cuda = me.device.type == "cuda"
    stock, wide = build_layer(args, me, stock=not args.no_stock)
    cfg = wide.cfg
    batches = args.batches or _default_batches(cuda, cfg.wide_rows)
    wide.warmup(batches)  # every width's kernels compiled on every rank, then a barrier
    if me.rank == 0:
        print(describe(me, cfg, args.all_reduce), flush=True)
        print(f"{'b':>6} {'stock s':>9} {'wide s':>9} {'max |diff|':>11} {'rel err':>9} "
              f"{'bitwise':>8}  ranks", flush=True)
    ok = True
    for b in batches:
        x = layer_input(args, cfg.hidden, b, me.device)
        # The stock layer on the CPU, before the call: no rank waits inside a call.
        ref, t_stock = timed(stock, x.cpu(), False) if stock is not None else (None, 0.0)
        dist.barrier(group=me.group)  # every rank starts the call together
        out, seconds = checked_call(wide, x)
        gathered: list = [None] * me.world
        dist.all_gather_object(gathered, (bits_digest(out), seconds), group=me.group)
        same = len({h for h, _ in gathered}) == 1
        if args.all_ranks:  # one write a line: the ranks share the terminal
            sys.stdout.write(f"rank {me.rank}: b = {b} {seconds:.4f} s, output sha256 "
                             f"{gathered[me.rank][0][:16]}\n")
            sys.stdout.flush()
        if me.rank == 0:
            ranks = "same bits" if same else "DIFFER: " + " ".join(
                f"r{r}:{h[:8]}" for r, (h, _) in enumerate(gathered))
            slowest = max(s for _, s in gathered)
            if ref is None:
                print(f"{b:>6} {'-':>9} {slowest:>9.4f} {'-':>11} {'-':>9} {'-':>8}  {ranks}",
                      flush=True)
            else:
                out = out.cpu()
                diff = out.float() - ref.float()
                rel = (diff.norm() / ref.float().norm()).item()
                equal = (out.view(torch.int16) == ref.view(torch.int16)).float().mean().item()
                print(f"{b:>6} {t_stock:>9.4f} {slowest:>9.4f} {diff.abs().max().item():>11.3e} "
                      f"{rel:>9.2e} {equal:>7.1%}  {ranks}", flush=True)
                ok = ok and rel < TOLERANCE
        ok = ok and same
    memory = peak_memory_line(me)
    # Rank 0's verdict on the stock comparison, for every rank's exit code.
    verdict = [ok]
    dist.broadcast_object_list(verdict, src=0, group=me.group)
    ok = ok and verdict[0]
    if me.rank == 0:
        if memory:
            print(memory, flush=True)
        checked = "match the stock layer" if stock is not None else "(stock comparison skipped)"
        print(f"OK: the {me.world} ranks hold the same bits and {checked}" if ok
              else "MISMATCH: see the rows above", flush=True)
    return EXIT_OK if ok else EXIT_MISMATCH
