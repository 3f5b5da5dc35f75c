"""``WideMoE``: the drop-in replacement of ``LatentMoE``, wiring the Triton stages.

One call (docs/design.md), per rank r of T:

    side stream   shared = shared_expert_r(x)                       (BF16 partial [b, H],
                                                                     kernels/shared)
    front stream  front = x @ packed_r.T                            (FP32, kernels/front)
                  publish front into every rank's mailbox row       (kernels/mailbox)
                  ids, weights = route(polled logits) + list claims (kernels/route,
                  plan = mxfp8(polled latent)                        one launch with the plan)
                  rows = experts(plan, lists)                       (kernels/experts)
                  latent_out = finalize(rows, weights); generation += 1
    main stream   latent = all_reduce(latent_out); normed = rms_norm(latent)
                  shared[:, cols_r] += normed @ up_r.T; all_reduce(shared)   (kernels/tail)

Buffers live in a ``WideScratch`` sized at ``wide_rows`` and shared by every layer of a
model (layers run one after another on the same streams, so one set serves them all).

Batch invariance, by construction: a token's output bits do not depend on the batch it
comes in. Every stage's reduction order is fixed per shape, never per batch width: the
dense linears (front GEMM, the shared expert's two linears, the tail's up-projection)
all run on the front GEMM, whose BLOCK_K/SPLIT_K come from the smallest bucket of their
own tuning entry, and no stage calls a BLAS kernel (whose choice depends on the batch).
That covers one rank (T = 1) and ``SimulatedGroup``. Across real ranks the two
all-reduces are NCCL's, whose algorithm (and with it the order in which the ranks'
partials are added) may change with the message size: not covered.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from . import reference
from .checks import check_tensor
from .config import WideMoEConfig
from .kernels import experts as experts_k
from .kernels import finalize as finalize_k
from .kernels import front as front_k
from .kernels import mailbox as mailbox_k
from .kernels import route as route_k
from .kernels import shared as shared_k
from .kernels import tail as tail_k
from .sharding import RankShard, shard


class WideScratch:
    """Model-owned buffers at the widest batch: the mailbox (two parities), the routing
    lists with the device-side generation counter, and every stage's output.

    ``mailboxes``: this rank's mailbox buffer and the table of every rank's buffer
    pointers; built by ``local`` (T = 1 or CPU), ``simulated`` (T ranks in one process)
    or ``symmetric`` (real symmetric memory over a process group)."""

    def __init__(self, cfg: WideMoEConfig, device, mailbox: torch.Tensor, table: torch.Tensor):
        R, E, K, L = cfg.wide_rows, cfg.num_experts, cfg.top_k, cfg.latent
        dev = torch.device(device)
        self.cfg, self.device = cfg, dev
        self.mailbox, self.table = mailbox, table
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
        """T ranks in one process: T local buffers, every rank's table naming all of them."""
        boxes = [mailbox_k.empty_mailbox(cfg, device) for _ in range(cfg.tp)]
        table = mailbox_k.mailbox_table(boxes)
        return [cls(cfg, device, box, table) for box in boxes]

    @classmethod
    def symmetric(cls, cfg: WideMoEConfig, device, group) -> "WideScratch":
        """Real symmetric memory over ``group`` (NCCL, one GPU a rank): each rank's buffer
        is reachable by every peer; multicast is never used, publish stores to each peer."""
        import torch.distributed as dist
        import torch.distributed._symmetric_memory as symm_mem

        dims = mailbox_k.mailbox_dims(cfg)
        box = symm_mem.empty((2, dims.wide_rows, dims.columns), dtype=torch.int16,
                             device=device)
        mailbox_k.arm_mailbox(box, cfg.latent)
        handle = symm_mem.rendezvous(box, group.group_name if hasattr(group, "group_name")
                                     else dist.group.WORLD.group_name)
        table = torch.tensor(list(handle.buffer_ptrs), dtype=torch.int64, device=device)
        torch.cuda.synchronize(device)
        dist.barrier(group=group)  # every peer armed before anyone publishes
        return cls(cfg, device, box, table)

    def rearm(self) -> None:
        """Empty both parities of this rank's mailbox and clear the error record (after a
        poll timed out; every rank must do it, with no call in flight)."""
        mailbox_k.arm_mailbox(self.mailbox, self.cfg.latent)
        self.error.zero_()


class WideMoE(nn.Module):
    """The latent-MoE layer as Triton kernels, over one rank's shard of a ``LatentMoE``.

    ``forward(x)``: x [b, H] BF16 on the module's device -> [b, H] BF16, the same function
    as the stock module (only accumulation orders differ). Any b: 0 returns an empty
    tensor, b > wide_rows runs in chunks of wide_rows.

    NaN policy: a token whose logits hold NaN routes as if those were -inf (ids always in
    [0, E)); NaN in x makes that token's output NaN and leaves every other token exact.

    Mailbox timeouts: a poll gives up after ``spin_limit`` rounds and records the missing
    ranks on the device. On CPU every forward raises on it; on a GPU reading the record
    is a sync, so ``check_mailbox()`` is left to the caller (e.g. once a step).
    """

    def __init__(self, cfg: WideMoEConfig, weights: RankShard, scratch: WideScratch,
                 group=None, spin_limit: int = mailbox_k.DEFAULT_SPIN_LIMIT):
        super().__init__()
        self.cfg, self.rank, self.world = cfg, weights.rank, weights.world
        self.group, self.scratch, self.spin_limit = group, scratch, spin_limit
        self.device = scratch.device
        self.register_buffer("packed", front_k.pack_front(
            weights.gate_weight, weights.latent_down, 0, 1))
        self.register_buffer("bias", weights.bias)
        self.experts = experts_k.prepare_weights(weights.w13, weights.w13_scales, weights.w2,
                                                 weights.w2_scales)
        self.register_buffer("norm_weight", weights.norm_weight)
        self.register_buffer("latent_up", weights.latent_up)
        # The shared gate and up rows interleaved (row 2j gate j, 2j+1 up j): the layout
        # whose output tiles hold both inputs of each SiTU (kernels/shared.py).
        self.register_buffer("shared_pairs", shared_k.interleave_gate_up(
            weights.shared_gate_up))
        self.register_buffer("shared_down", weights.shared_down)
        self.columns = slice(self.rank * cfg.hidden_per_rank,
                             (self.rank + 1) * cfg.hidden_per_rank)

    @classmethod
    def from_module(cls, stock: reference.LatentMoE, group=None, *,
                    scratch: WideScratch | None = None, device=None) -> "WideMoE":
        """A ``WideMoE`` over ``stock``'s weights, sharded for ``group`` (a
        ``torch.distributed`` process group; None = one rank): sliced out of a whole
        layer, or taken as it is where ``stock`` holds this rank's shard (``checkpoint.
        load_layer``). ``scratch``: the model's shared buffers (one per model, made here if
        None)."""
        rank, world = _rank_world(group)
        device = torch.device(device) if device is not None else stock.gate_weight.device
        cfg = stock.cfg.replace(tp=world)
        if scratch is None:
            scratch = (WideScratch.local(cfg, device) if world == 1
                       else WideScratch.symmetric(cfg, device, group))
        _check_scratch(scratch, cfg, device)
        return cls(cfg, _to(shard(stock, rank, world), device), scratch, group=group)

    @classmethod
    def from_checkpoint(cls, path, layer: int, group=None, *, scratch: WideScratch | None = None,
                        device=None, wide_rows: int = 1024, prefix: str | None = None
                        ) -> "WideMoE":
        """A ``WideMoE`` of MoE layer ``layer`` of the checkpoint in ``path`` (see
        ``checkpoint``), sharded for ``group`` (None = one rank): this rank reads only
        its own slices. ``device``: default the current CUDA device, else the CPU."""
        from . import checkpoint

        rank, world = _rank_world(group)
        if device is None:
            device = (torch.device("cuda", torch.cuda.current_device())
                      if torch.cuda.is_available() else torch.device("cpu"))
        stock = checkpoint.load_layer(path, layer, tp=world, rank=rank, device=device,
                                      wide_rows=wide_rows, prefix=prefix)
        # The weights' device names its index ("cuda" -> "cuda:0"), as inputs' devices do.
        return cls.from_module(stock, group, scratch=scratch, device=stock.gate_weight.device)

    # -- the stages, in call order; ``SimulatedGroup`` runs them rank by rank ----------

    def _check_input(self, x) -> None:
        check_tensor("x", x, torch.bfloat16, (None, self.cfg.hidden))
        if x.device != self.device:
            raise ValueError(f"x is on {x.device} but this WideMoE lives on {self.device}")

    def publish(self, x: torch.Tensor) -> None:
        """Front GEMM of this rank's rows and publish into every rank's mailbox."""
        s, b = self.scratch, x.shape[0]
        front = s.front[:b]
        front_k.front_gemm(x, self.packed, out=front, workspace=s.front_workspace)
        mailbox_k.publish(front, s.table, self.rank, self.world, s.lists.generation,
                          self.cfg.latent, self.cfg.num_experts, wide_rows=self.cfg.wide_rows)

    def routed(self, b: int) -> torch.Tensor:
        """Poll, route, plan, experts and finalize: this rank's partial latent [b, L]."""
        s, cfg = self.scratch, self.cfg
        poll = dict(latent=cfg.latent, world=self.world, error=s.error,
                    spin_limit=self.spin_limit)
        ids, weights, q, q_scales = route_k.route_and_plan_mailbox(
            s.mailbox, s.lists.generation, b, self.bias, cfg.top_k, cfg.renormalize,
            cfg.routed_scaling_factor, lists=s.lists, ids=s.ids[:b], weights=s.weights[:b],
            out=(s.plan[0][:b], s.plan[1][:b]), **poll)
        rows = experts_k.experts(q, q_scales, self.experts, s.lists.counts, s.lists.pairs,
                                 s.lists.generation, cfg.top_k, cfg.beta, cfg.linear_beta,
                                 rows=s.rows[:b * cfg.top_k], workspace=s.hidden)
        return finalize_k.finalize(rows, weights, out=s.latent_out[:b],
                                   generation=s.lists.generation)

    def shared(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's partial of the shared experts, BF16 [b, H] (a new tensor: the tail
        adds into it and it becomes the layer's output)."""
        s, b = self.scratch, x.shape[0]
        out = torch.empty(b, self.cfg.hidden, dtype=torch.bfloat16, device=x.device)
        return shared_k.shared_expert(x, self.shared_pairs, self.shared_down, self.cfg.beta,
                                      self.cfg.linear_beta, hidden=s.shared_hidden[:b],
                                      out=out, workspace=s.shared_workspace)

    def tail(self, latent: torch.Tensor, shared: torch.Tensor) -> torch.Tensor:
        """RMSNorm of the all-reduced latent, this rank's up-projection columns added into
        its shared partial (in place, FP32 accumulation, one rounding): the partial
        hidden rows [b, H]."""
        normed = tail_k.rms_norm(latent, self.norm_weight, self.cfg.rms_eps)
        tail_k.add_up_projection(normed, self.latent_up, shared[:, self.columns],
                                 workspace=self.scratch.tail_workspace)
        return shared

    def _all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        if self.group is not None and self.world > 1:
            import torch.distributed as dist

            dist.all_reduce(t, group=self.group)
        return t

    def check_mailbox(self) -> None:
        """Raise if a poll of the mailbox timed out (a device sync); see ``rearm``."""
        mailbox_k.check_mailbox_error(self.scratch.error,
                                      f"rank {self.rank} of {self.world}")

    # -- forward ----------------------------------------------------------------------

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [b, H] BF16 -> [b, H] BF16 (all-reduced over the group)."""
        self._check_input(x)
        if self.world > 1 and self.group is None:
            raise RuntimeError("this WideMoE is one rank of a simulated group: run it "
                               "through SimulatedGroup")
        x = x.contiguous()
        rows = self.cfg.wide_rows
        if x.shape[0] == 0:
            return torch.empty(0, self.cfg.hidden, dtype=torch.bfloat16, device=self.device)
        if x.shape[0] > rows:
            return torch.cat([self._forward(x[i:i + rows]) for i in range(0, x.shape[0], rows)])
        return self._forward(x)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        b = x.shape[0]
        if not x.is_cuda:
            shared = self.shared(x)
            self.publish(x)
            latent = self.routed(b)
            self.check_mailbox()
            return self._all_reduce(self.tail(self._all_reduce(latent), shared))
        s = self.scratch
        fork, shared_done, chain_done = s.events
        main = torch.cuda.current_stream(self.device)
        fork.record(main)
        with torch.cuda.stream(s.side):
            s.side.wait_event(fork)
            shared = self.shared(x)
            shared_done.record(s.side)
        with torch.cuda.stream(s.chain):
            s.chain.wait_event(fork)
            self.publish(x)
            latent = self.routed(b)
            chain_done.record(s.chain)
        main.wait_event(chain_done)
        main.wait_event(shared_done)
        shared.record_stream(main)
        x.record_stream(s.side)
        x.record_stream(s.chain)
        return self._all_reduce(self.tail(self._all_reduce(latent), shared))


class SimulatedGroup:
    """T ranks of ``WideMoE`` in one process over T local mailboxes (tests, CPU): every
    stage runs rank by rank, so each rank's polls find its peers' data already there.
    The all-reduces are FP32 sums of the BF16 partials in rank order, rounded once.

    ``stock``: the whole layer, sliced into ``world`` ranks; or one ``LatentMoE`` a rank
    (``world`` = their count), each the whole layer or that rank's shard."""

    def __init__(self, stock, world: int | None = None, device=None,
                 spin_limit: int = mailbox_k.DEFAULT_SPIN_LIMIT):
        per_rank = list(stock) if isinstance(stock, (list, tuple)) else [stock] * (world or 0)
        if not per_rank or (world is not None and world != len(per_rank)):
            raise ValueError(f"SimulatedGroup needs a whole layer and world >= 1, or one "
                             f"LatentMoE a rank; got world = {world} for {len(per_rank)}")
        world = len(per_rank)
        device = (torch.device(device) if device is not None
                  else per_rank[0].gate_weight.device)
        cfg = per_rank[0].cfg.replace(tp=world)
        for r, m in enumerate(per_rank):
            if m.cfg.replace(tp=world) != cfg:
                raise ValueError(f"rank {r}'s layer is {m.cfg}, rank 0's {per_rank[0].cfg}")
        scratches = WideScratch.simulated(cfg, device)
        self.cfg = cfg
        self.ranks = [WideMoE(cfg, _to(shard(m, r, world), device), scratches[r],
                              spin_limit=spin_limit) for r, m in enumerate(per_rank)]

    @staticmethod
    def _reduce(parts: list[torch.Tensor]) -> torch.Tensor:
        total = parts[0].float()
        for p in parts[1:]:
            total = total + p.float()
        return total.to(torch.bfloat16)

    def __call__(self, x: torch.Tensor, skip_publish: set[int] = frozenset()) -> list:
        """Every rank's output for x (each rank sees the same x); ``skip_publish`` names
        ranks that fail to publish (to test the poll timeout)."""
        for m in self.ranks:
            m._check_input(x)
        b = x.shape[0]
        shared = [m.shared(x) for m in self.ranks]
        for m in self.ranks:
            if m.rank not in skip_publish:
                m.publish(x)
        latent = self._reduce([m.routed(b).clone() for m in self.ranks])
        hidden = self._reduce([m.tail(latent.clone(), s) for m, s in zip(self.ranks, shared)])
        return [hidden.clone() for _ in self.ranks]


def _rank_world(group) -> tuple[int, int]:
    """(rank, world size) of a process group; (0, 1) for None."""
    if group is None:
        return 0, 1
    import torch.distributed as dist

    return dist.get_rank(group), dist.get_world_size(group)


def _check_scratch(scratch: WideScratch, cfg: WideMoEConfig, device) -> None:
    if scratch.cfg != cfg:
        raise ValueError(f"scratch was made for {scratch.cfg}, this layer is {cfg}")
    if scratch.device != torch.device(device):
        raise ValueError(f"scratch is on {scratch.device}, the layer on {device}")


def _to(weights: RankShard, device) -> RankShard:
    import dataclasses

    moved = {f.name: getattr(weights, f.name) for f in dataclasses.fields(weights)}
    for name, value in moved.items():
        if isinstance(value, torch.Tensor):
            moved[name] = value.to(device)
    return RankShard(**moved)
