"""``WideScratch``: the buffers a model's ``WideMoE`` layers share at the widest batch (the
mailbox and tail rows every rank can address, the routing lists with their call counter,
every stage's output), built for one rank, for T simulated ranks in one process, or over
a process group (symmetric memory on GPUs, POSIX shared memory for CPU ranks)."""

from __future__ import annotations

import copy

import torch

from .checks import check_tensor
from .config import WideMoEConfig
from .kernels import experts as experts_k
from .kernels import front as front_k
from .kernels import mailbox as mailbox_k
from .kernels import route as route_k
from .kernels import shared as shared_k
from .kernels import tail as tail_k


class WideScratch:
    """Model-owned buffers at the widest batch: the mailbox (two parities), the routing
    lists with the device-side generation counter, and every stage's output.

    ``mailbox``, ``table``: this rank's mailbox buffer and the table of every rank's
    buffer pointers; ``tail``, ``tail_table``: the same for the tail rows of the
    all-reduces (T > 1; None where the all-reduces are NCCL's). Built by ``local`` (T = 1
    or CPU), ``simulated`` (T ranks in one process), or over a process group by
    ``for_group``: ``symmetric`` (CUDA, real symmetric memory) or ``shared_memory`` (CPU
    ranks as processes, POSIX shared memory; ``segments`` then holds the mappings and the
    peers' process ids)."""

    def __init__(self, cfg: WideMoEConfig, device, mailbox: torch.Tensor, table: torch.Tensor,
                 tail: torch.Tensor | None = None, tail_table: torch.Tensor | None = None,
                 segments=None):
        R, E, K, L = cfg.wide_rows, cfg.num_experts, cfg.top_k, cfg.latent
        dev = torch.device(device)
        self.cfg, self.device = cfg, dev
        self.mailbox, self.table = mailbox, table
        self.segments = segments
        self.tail, self.tail_table, self.tail_dims = tail, tail_table, None
        if tail is not None:
            self.tail_dims = mailbox_k.tail_dims(cfg)
            mailbox_k.check_tail("tail", tail, self.tail_dims)
            check_tensor("tail_table", tail_table, torch.int64, (cfg.tp,), tail.device)
        self.lists = route_k.RoutingLists.empty(E, R, dev)
        self.error = mailbox_k.new_error_record(dev)
        empty = lambda *s, dtype: torch.empty(*s, dtype=dtype, device=dev)  # noqa: E731
        self.front = empty(R, cfg.experts_per_rank + cfg.latent_per_rank, dtype=torch.float32)
        self.ids = empty(R, K, dtype=torch.int32)
        self.weights = empty(R, K, dtype=torch.bfloat16)
        self.plan = (empty(R, L, dtype=torch.uint8), empty(R, L // 32, dtype=torch.uint8))
        self.hidden = experts_k.make_workspace(R, K, L, cfg.intermediate_per_rank, dev)
        self.rows = empty(R * K, L, dtype=torch.bfloat16)
        self.latent_out = empty(R, L, dtype=torch.bfloat16)
        self.normed = empty(R, L, dtype=torch.bfloat16)
        self.shared_hidden = empty(R, cfg.shared_per_rank, dtype=torch.bfloat16)
        # Split-K partials of the GEMMs, one buffer per stream that runs them (they may
        # run concurrently), each sized once for every width (graph-safe).
        n_front = cfg.experts_per_rank + cfg.latent_per_rank
        workspace = lambda numel: empty(max(1, numel), dtype=torch.float32)  # noqa: E731
        self.front_workspace = workspace(
            front_k.max_workspace_numel(R, n_front, cfg.hidden, dev))
        self.shared_workspace = workspace(
            shared_k.max_workspace_numel(R, cfg.shared_per_rank, cfg.hidden, dev))
        self.tail_workspace = workspace(front_k.max_workspace_numel(
            R, cfg.hidden_per_rank, cfg.latent, dev, tail_k.KERNEL_UP))
        if dev.type == "cuda":
            high = torch.cuda.Stream.priority_range()[1]
            self.side = torch.cuda.Stream(device=dev)
            self.chain = torch.cuda.Stream(device=dev, priority=high)
            self.events = [torch.cuda.Event() for _ in range(3)]

    @classmethod
    def local(cls, cfg: WideMoEConfig, device) -> "WideScratch":
        """One rank (T = 1): a plain device buffer is the whole mailbox."""
        box = mailbox_k.empty_mailbox(cfg, device)
        return cls(cfg, device, box, mailbox_k.mailbox_table([box]))

    @classmethod
    def simulated(cls, cfg: WideMoEConfig, device) -> list["WideScratch"]:
        """T ranks in one process: T local buffers (mailbox and tail rows), every rank's
        tables naming all of them."""
        boxes = [mailbox_k.empty_mailbox(cfg, device) for _ in range(cfg.tp)]
        table = mailbox_k.mailbox_table(boxes)
        tails = [mailbox_k.empty_tail(cfg, device) for _ in range(cfg.tp)]
        tail_table = mailbox_k.tail_table(tails)
        return [cls(cfg, device, box, table, tail, tail_table)
                for box, tail in zip(boxes, tails)]

    @classmethod
    def for_group(cls, cfg: WideMoEConfig, device, group, tail: bool = True) -> "WideScratch":
        """The buffers of one rank of ``group`` (collective: every rank calls it), in the
        memory its device's ranks share: ``symmetric`` on a GPU, ``shared_memory`` on the
        CPU. ``tail``: whether to make the tail rows (the mailbox's all-reduces)."""
        if torch.device(device).type == "cpu":
            return cls.shared_memory(cfg, group, tail)
        return cls.symmetric(cfg, device, group, tail)

    @classmethod
    def shared_memory(cls, cfg: WideMoEConfig, group, tail: bool = True) -> "WideScratch":
        """CPU ranks as processes of one host over ``group`` (gloo): each rank's mailbox
        and tail rows in POSIX shared memory, every peer's mapped here and reached through
        this process's pointer tables (``processes.SharedSegments``); armed, then a
        barrier, so no peer publishes into a buffer not yet armed. Collective."""
        import torch.distributed as dist

        from .processes import SharedSegments

        world = dist.get_world_size(group)
        if world != cfg.tp:
            raise ValueError(f"cfg.tp is {cfg.tp} but the group has {world} ranks")
        dims = mailbox_k.mailbox_dims(cfg)
        shapes = {"mailbox": (2, dims.wide_rows, dims.columns)}
        if tail:
            t = mailbox_k.tail_dims(cfg)
            shapes["tail"] = (t.wide_rows, t.world, t.columns)
        segments = SharedSegments(group, shapes)
        mailbox_k.arm_mailbox(segments.local["mailbox"], cfg.latent)
        if tail:
            mailbox_k.arm_tail(segments.local["tail"])
        dist.barrier(group=group)  # every peer armed before anyone publishes
        return cls(cfg, "cpu", segments.local["mailbox"], segments.table["mailbox"],
                   segments.local.get("tail"), segments.table.get("tail"), segments=segments)

    @classmethod
    def symmetric(cls, cfg: WideMoEConfig, device, group, tail: bool = True) -> "WideScratch":
        """Real symmetric memory over ``group`` (NCCL, one GPU a rank): each rank's buffers
        (the mailbox, and the tail rows unless ``tail`` is False) are reachable by every
        peer; multicast is never used, publish stores to each peer."""
        import torch.distributed as dist
        import torch.distributed._symmetric_memory as symm_mem

        if torch.device(device).type != "cuda":
            raise ValueError(f"symmetric memory needs a CUDA device, got {device}; CPU "
                             "ranks share memory through WideScratch.shared_memory")

        name = (group.group_name if hasattr(group, "group_name")
                else dist.group.WORLD.group_name)

        def shared_buffer(shape, arm):
            buffer = arm(symm_mem.empty(shape, dtype=torch.int16, device=device))
            handle = symm_mem.rendezvous(buffer, name)
            return buffer, torch.tensor(list(handle.buffer_ptrs), dtype=torch.int64,
                                        device=device)

        dims = mailbox_k.mailbox_dims(cfg)
        box, table = shared_buffer((2, dims.wide_rows, dims.columns),
                                   lambda b: mailbox_k.arm_mailbox(b, cfg.latent))
        tail_rows = tail_ptrs = None
        if tail:
            t = mailbox_k.tail_dims(cfg)
            tail_rows, tail_ptrs = shared_buffer((t.wide_rows, t.world, t.columns),
                                                 mailbox_k.arm_tail)
        torch.cuda.synchronize(device)
        dist.barrier(group=group)  # every peer armed before anyone publishes
        return cls(cfg, device, box, table, tail_rows, tail_ptrs)

    def rearm(self) -> None:
        """Back to a fresh scratch's state after a poll timed out: both parities of this
        rank's mailbox and its tail rows empty, the error record clear, the call counter
        and the routing lists' counts at zero (a call that raised part way left ranks
        one call apart). Every rank must do it, with no call in flight, before the next."""
        mailbox_k.arm_mailbox(self.mailbox, self.cfg.latent)
        if self.tail is not None:
            mailbox_k.arm_tail(self.tail)
        self.error.zero_()
        self.lists.generation.zero_()
        self.lists.counts.zero_()

    def stand_in(self) -> "WideScratch":
        """A copy of this scratch whose exchange buffers are local stand-ins (``WideMoE.
        warmup``): a mailbox and tail rows of the same shapes, which the tables name for
        every rank, with a fresh call counter, routing lists and error record; the other
        buffers, the streams and the events are this scratch's (no call runs meanwhile).
        ``publish_everything`` fills the stand-ins as if every rank had published."""
        other = copy.copy(self)
        other.mailbox = torch.zeros_like(self.mailbox)
        other.table = mailbox_k.mailbox_table([other.mailbox] * self.cfg.tp)
        if self.tail is not None:
            other.tail = torch.zeros_like(self.tail)
            other.tail_table = mailbox_k.tail_table([other.tail] * self.cfg.tp)
        other.lists = route_k.RoutingLists.empty(self.cfg.num_experts, self.cfg.wide_rows,
                                                 self.device)
        other.error = mailbox_k.new_error_record(self.device)
        other.segments = None
        return other

    def publish_everything(self) -> None:
        """Every word of the mailbox and the tail rows published as +0 (a stand-in's: the
        polls of a call then find every peer's words at once)."""
        self.mailbox.zero_()
        if self.tail is not None:
            self.tail.zero_()

    def gone(self, ranks) -> list[int]:
        """Those of ``ranks`` whose process is known to have exited (shared memory only:
        ranks in processes of this host); [] where that cannot be known."""
        return [] if self.segments is None else self.segments.gone(ranks)
