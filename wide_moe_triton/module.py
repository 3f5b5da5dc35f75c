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
    main stream   publish latent_out into every rank's tail rows        (kernels/mailbox)
                  normed = rms_norm(Σ_s latent_s), polled, one launch  (kernels/tail)
                  shared[:, cols_r] += normed @ up_r.T
                  publish shared; shared = Σ_s shared_s, polled

Buffers live in a ``WideScratch`` (scratch.py) sized at ``wide_rows`` and shared by every layer of a
model (layers run one after another on the same streams, so one set serves them all).

Batch invariance, by construction: a token's output bits do not depend on the batch it
comes in. Every stage's reduction order is fixed per shape, never per batch width: the
dense linears (front GEMM, the shared expert's two linears, the tail's up-projection)
all run on the front GEMM, whose BLOCK_K/SPLIT_K come from the smallest bucket of their
own tuning entry, and no stage calls a BLAS kernel (whose choice depends on the batch).
The RMSNorm's sum of squares runs with one launch layout per L (kernels/tail). Across
ranks, the two all-reduces run over the tail rows of the mailbox (``all_reduce=
"mailbox"``, the default): each rank sums the T partials in FP32 in rank order and rounds
once, so every rank holds the same bits at every batch width, and T = 1 skips them (the
sum of one partial is itself). ``all_reduce="nccl"`` (``torch.distributed.all_reduce``)
stays for comparison and for a scratch without tail rows: NCCL's algorithm, and with it
the order in which the ranks' partials are added, may change with the message size, so
there a token's bits may depend on the batch width.
"""

from __future__ import annotations

import copy
import warnings

import torch
from torch import nn

from . import kernels, reference
from .checks import check_input
from .config import WideMoEConfig
from .kernels import experts as experts_k
from .kernels import finalize as finalize_k
from .kernels import front as front_k
from .kernels import mailbox as mailbox_k
from .kernels import route as route_k
from .kernels import shared as shared_k
from .kernels import tail as tail_k
from .scratch import WideScratch
from .sharding import RankShard, shard

ALL_REDUCES = ("mailbox", "nccl")  # the tail's all-reduces (``WideMoE``)
# CPU ranks as processes: how long a rank waits for its peers' words before it raises
# naming them. A healthy peer lags by at most its share of one call in Triton's
# interpreter (seconds at the tiny dims); this leaves room for a loaded machine.
DEFAULT_HOST_WAIT_S = 60.0


class WideMoE(nn.Module):
    """The latent-MoE layer as Triton kernels, over one rank's shard of a ``LatentMoE``.

    ``forward(x)``: x [b, H] BF16 on the module's device -> [b, H] BF16, the same function
    as the stock module (only accumulation orders differ). Any b: 0 returns an empty
    tensor, b > wide_rows runs in chunks of wide_rows.

    NaN policy: a token whose logits hold NaN routes as if those were -inf (ids always in
    [0, E)); NaN in x makes that token's output NaN and leaves every other token exact.

    Mailbox timeouts: a poll (the front's or the tail's) gives up after ``poll_timeout``
    seconds on the GPU's clock (None: ``mailbox.DEFAULT_POLL_TIMEOUT_S``, 10 s) or
    ``spin_limit`` rounds, and records the missing ranks on the device; once one has
    timed out, the call's later polls do not wait. On CPU every forward raises on it; on
    a GPU reading the record is a sync, so ``check_mailbox()`` is left to the caller
    (e.g. once a step). CPU ranks as processes (``poll_timeout`` set on a CPU): before
    each polling launch the host waits for the peers' words at most that long, or until a
    missing peer's process is found gone, and raises naming the missing ranks
    (``mailbox.await_published``): Triton's interpreter cannot read a clock in a kernel,
    and a poll round there takes milliseconds. Compile every width before the first call
    over a group with ``warmup``: a rank compiling inside a call keeps its peers waiting.

    ``all_reduce``: "mailbox" (the tail's all-reduces over the scratch's tail rows, fixed
    rank order: every rank holds the same bits at every batch width) or "nccl"
    (``torch.distributed.all_reduce``); at T = 1 there is nothing to reduce either way.
    """

    def __init__(self, cfg: WideMoEConfig, weights: RankShard, scratch: WideScratch,
                 group=None, spin_limit: int = mailbox_k.DEFAULT_SPIN_LIMIT,
                 all_reduce: str = "mailbox", poll_timeout: float | None = None):
        super().__init__()
        if all_reduce not in ALL_REDUCES:
            raise ValueError(f"all_reduce must be one of {ALL_REDUCES}, got {all_reduce!r}")
        timeout_ns = mailbox_k.poll_timeout_ns(poll_timeout)  # refuses a bad one by name
        if all_reduce == "mailbox" and weights.world > 1 and scratch.tail is None:
            raise ValueError("all_reduce='mailbox' needs a scratch with tail rows (made by "
                             "WideScratch.for_group or .simulated); this one has none")
        kernels.check_device(scratch.device)
        self.cfg, self.rank, self.world = cfg, weights.rank, weights.world
        self.group, self.scratch, self.spin_limit = group, scratch, spin_limit
        self.all_reduce, self.poll_timeout = all_reduce, poll_timeout
        # CPU ranks wait on the host (the interpreter's polls cannot read a clock); a
        # GPU's polls wait in the kernels, ``timeout_ns`` each at most.
        self.host_waits = poll_timeout is not None and scratch.device.type == "cpu"
        self.timeout_ns = timeout_ns
        # The exchange over the tail rows: only across ranks (at T = 1 the sums are the
        # partials themselves, and the tail is the plain RMSNorm).
        self.mailbox_tail = all_reduce == "mailbox" and self.world > 1
        self.device = scratch.device
        self.register_buffer("packed", front_k.pack_front(
            weights.gate_weight, weights.latent_down, 0, 1))
        self.register_buffer("bias", weights.bias)
        # One LaunchPlan a batch width, built on the first call of that width.
        self._plans: dict[int, LaunchPlan] = {}
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
        self._context = f"rank {self.rank} of {self.world}"

    @classmethod
    def from_module(cls, stock: reference.LatentMoE, group=None, *,
                    scratch: WideScratch | None = None, device=None,
                    all_reduce: str | None = None,
                    poll_timeout: float | None = None) -> "WideMoE":
        """A ``WideMoE`` over ``stock``'s weights, sharded for ``group`` (a
        ``torch.distributed`` process group; None = one rank): sliced out of a whole
        layer, or taken as it is where ``stock`` holds this rank's shard (``checkpoint.
        load_layer``). ``scratch``: the model's shared buffers (one per model, made here if
        None: ``WideScratch.for_group``, symmetric memory on a GPU, shared memory on the
        CPU). ``all_reduce``: "mailbox" or "nccl" (see the class); None: "mailbox" unless
        ``scratch`` was made without tail rows (then "nccl", with a warning).
        ``poll_timeout``: seconds (see the class); None: ``DEFAULT_HOST_WAIT_S`` (60 s of
        host waits) for CPU ranks of a group, else the kernels' own bound
        (``mailbox.DEFAULT_POLL_TIMEOUT_S``, 10 s on a GPU's clock).

        Over a group this is collective: every rank checks that its peers build the same
        layer (``processes.agree``: the config, the all-reduce, the weights every rank
        holds alike) before any buffer is made, and raises naming the field if not."""
        return cls._build(stock, group, scratch=scratch, device=device,
                          all_reduce=all_reduce, poll_timeout=poll_timeout, layer=None)

    @classmethod
    def _build(cls, stock, group, *, scratch, device, all_reduce, poll_timeout,
               layer) -> "WideMoE":
        rank, world = _rank_world(group)
        device = torch.device(device) if device is not None else stock.gate_weight.device
        cfg = stock.cfg.replace(tp=world)
        if all_reduce is None:
            all_reduce = "mailbox"
            if world > 1 and scratch is not None and scratch.tail is None:
                all_reduce = "nccl"
                warnings.warn("wide_moe_triton: the scratch has no tail rows, so the tail's "
                              "all-reduces run on NCCL (a token's bits may then depend on "
                              "the batch width)", stacklevel=3)
        weights = shard(stock, rank, world)
        if world > 1:
            from . import processes

            processes.agree(group, processes.identity(cfg, weights, all_reduce=all_reduce,
                                                      device=device, layer=layer))
        if scratch is None:
            scratch = (WideScratch.local(cfg, device) if world == 1 else WideScratch.for_group(
                cfg, device, group, tail=all_reduce != "nccl"))
        _check_scratch(scratch, cfg, device)
        if poll_timeout is None and world > 1 and device.type == "cpu":
            poll_timeout = DEFAULT_HOST_WAIT_S
        return cls(cfg, _to(weights, device), scratch, group=group, all_reduce=all_reduce,
                   poll_timeout=poll_timeout)

    @classmethod
    def from_checkpoint(cls, path, layer: int, group=None, *, scratch: WideScratch | None = None,
                        device=None, wide_rows: int = 1024, prefix: str | None = None,
                        all_reduce: str | None = None,
                        poll_timeout: float | None = None) -> "WideMoE":
        """A ``WideMoE`` of MoE layer ``layer`` of the checkpoint in ``path`` (see
        ``checkpoint``), sharded for ``group`` (None = one rank): this rank reads only
        its own slices. ``device``: default the current CUDA device, else the CPU.
        ``all_reduce``, ``poll_timeout``: as ``from_module``, which this is, collective
        over a group; the ranks also check that they load the same ``layer``."""
        from . import checkpoint

        rank, world = _rank_world(group)
        if device is None:
            device = (torch.device("cuda", torch.cuda.current_device())
                      if torch.cuda.is_available() else torch.device("cpu"))
        stock = checkpoint.load_layer(path, layer, tp=world, rank=rank, device=device,
                                      wide_rows=wide_rows, prefix=prefix)
        # The weights' device names its index ("cuda" -> "cuda:0"), as inputs' devices do.
        return cls._build(stock, group, scratch=scratch, device=stock.gate_weight.device,
                          all_reduce=all_reduce, poll_timeout=poll_timeout, layer=layer)

    @property
    def experts(self) -> experts_k.ExpertWeights:
        """The routed experts' weights (``experts.prepare_weights``)."""
        return self._experts

    @experts.setter
    def experts(self, weights: experts_k.ExpertWeights) -> None:
        # The launch plans bind the weights: new weights, new plans.
        self._experts = weights
        self._plans.clear()

    # -- the stages, in call order; ``SimulatedGroup`` runs them rank by rank ----------
    # Each public stage checks its arguments and runs its ``_stage`` twin, which takes
    # checked tensors and the ``LaunchPlan`` of their batch width (what ``forward`` calls).

    def plan(self, b: int) -> "LaunchPlan":
        """The ``LaunchPlan`` of a call of ``b`` rows (1 <= b <= wide_rows), built on first
        use and kept: the tuned table is read once, a change on disk after that is not
        seen."""
        plan = self._plans.get(b)
        if plan is None:
            if isinstance(b, bool) or not isinstance(b, int) or not 1 <= b <= self.cfg.wide_rows:
                raise ValueError(f"a stage of this layer takes 1 to wide_rows = "
                                 f"{self.cfg.wide_rows} rows, got {b!r}")
            plan = self._plans[b] = LaunchPlan(self, b)
        return plan

    def _checked(self, x) -> tuple[torch.Tensor, "LaunchPlan"]:
        x = check_input(x, self.cfg.hidden, self.device)
        return x, self.plan(x.shape[0])

    def publish(self, x: torch.Tensor) -> None:
        """Front GEMM of this rank's rows and publish into every rank's mailbox."""
        x, plan = self._checked(x)
        self._publish(plan, x)

    def _publish(self, plan: "LaunchPlan", x: torch.Tensor) -> None:
        s = self.scratch
        front_k.launch(plan.front, x, self.packed, plan.front_out, s.front_workspace)
        mailbox_k.launch_publish(plan.publish, plan.front_out, s.table, s.lists.generation)

    def routed(self, b: int) -> torch.Tensor:
        """Poll, route, plan, experts and finalize: this rank's partial latent [b, L]."""
        return self._routed(self.plan(b))

    def _routed(self, plan: "LaunchPlan") -> torch.Tensor:
        s = self.scratch
        if self.host_waits:
            parity = int(s.lists.generation[0]) & 1
            self._await(lambda: mailbox_k.missing_in_mailbox(
                s.mailbox, parity, plan.b, self.cfg.latent, self.world), parity)
        route_k.launch(plan.route)
        ids, weights, q, q_scales = plan.routed
        lists = s.lists
        rows = experts_k.launch(plan.experts, q, q_scales, lists.counts, lists.pairs,
                                lists.generation, plan.rows, s.hidden)
        return finalize_k.launch(plan.finalize, rows, weights, plan.latent_out,
                                 s.lists.generation)

    def shared(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's partial of the shared experts, BF16 [b, H] (a new tensor: the tail
        adds into it and it becomes the layer's output)."""
        x, plan = self._checked(x)
        return self._shared(plan, x)

    def _shared(self, plan: "LaunchPlan", x: torch.Tensor) -> torch.Tensor:
        out = torch.empty(plan.b, self.cfg.hidden, dtype=torch.bfloat16, device=x.device)
        return shared_k.launch(plan.shared, x, self.shared_pairs, self.shared_down,
                               plan.shared_hidden, out, self.scratch.shared_workspace)

    def tail(self, latent: torch.Tensor, shared: torch.Tensor) -> torch.Tensor:
        """The tail of this rank's partials: latent [b, L] and shared [b, H] -> the layer's
        output [b, H] (in ``shared``). The stages below, in order."""
        self.publish_latent(latent)
        self.norm_up(latent, shared)
        self.publish_hidden(shared)
        return self.reduce_hidden(shared)

    def _tail(self, plan: "LaunchPlan", latent: torch.Tensor,
              shared: torch.Tensor) -> torch.Tensor:
        """``tail`` of checked partials of ``plan``'s width: at T = 1 (nothing to reduce)
        from the plan's launches, across ranks through the stages below."""
        if self.world > 1:
            return self.tail(latent, shared)
        normed = tail_k.launch_norm(plan.norm, latent, self.norm_weight, plan.normed)
        return front_k.launch(plan.up, normed, self.latent_up, shared, self.scratch.tail_workspace)

    def publish_latent(self, latent: torch.Tensor) -> None:
        """Start the latent's all-reduce: publish this rank's partial into every rank's
        tail rows (mailbox), or all-reduce it in place (NCCL)."""
        if self.mailbox_tail:
            s = self.scratch
            mailbox_k.publish_partial(latent, s.tail_table, self.rank, s.tail_dims, "latent")
        else:
            self._nccl(latent)

    def norm_up(self, latent: torch.Tensor, shared: torch.Tensor) -> torch.Tensor:
        """RMSNorm of the all-reduced latent (mailbox: polled, summed and normalized in
        one launch, into ``latent``), this rank's up-projection columns added into its
        shared partial (in place, FP32 accumulation, one rounding): the partial hidden
        rows [b, H]."""
        s, cfg = self.scratch, self.cfg
        if self.mailbox_tail:
            self._await_tail(latent.shape[0], "latent")
            normed = tail_k.all_reduce_rms_norm(
                s.tail, s.tail_dims, latent.shape[0], self.norm_weight, cfg.rms_eps,
                out=latent, error=s.error, spin_limit=self.spin_limit,
                poll_timeout=self.timeout_ns / 1e9)
        else:
            normed = tail_k.rms_norm(latent, self.norm_weight, cfg.rms_eps)
        tail_k.add_up_projection(normed, self.latent_up, shared[:, self.columns],
                                 workspace=s.tail_workspace)
        return shared

    def publish_hidden(self, shared: torch.Tensor) -> None:
        """Start the hidden rows' all-reduce (mailbox; NCCL's runs in ``reduce_hidden``)."""
        if self.mailbox_tail:
            s = self.scratch
            mailbox_k.publish_partial(shared, s.tail_table, self.rank, s.tail_dims, "hidden")

    def reduce_hidden(self, shared: torch.Tensor) -> torch.Tensor:
        """The all-reduced hidden rows, in ``shared``: the layer's output."""
        if self.mailbox_tail:
            s = self.scratch
            self._await_tail(shared.shape[0], "hidden")
            return tail_k.all_reduce(s.tail, s.tail_dims, shared.shape[0], out=shared,
                                     error=s.error, spin_limit=self.spin_limit,
                                     poll_timeout=self.timeout_ns / 1e9)
        return self._nccl(shared)

    def _await_tail(self, b: int, which: str) -> None:
        if self.host_waits:
            s = self.scratch
            self._await(lambda: mailbox_k.missing_in_tail(s.tail, s.tail_dims, b, which),
                        mailbox_k.tail_region(s.tail_dims, which).place)

    def _await(self, missing, place: int) -> None:
        """Wait on the host for the words a polling launch will read (``poll_timeout``
        set: CPU ranks as processes); raise naming the missing ranks if they do not come
        in time or a missing rank's process is gone."""
        s = self.scratch
        dead = mailbox_k.await_published(missing, s.error, place, self.poll_timeout, s.gone)
        if dead is None:
            return
        why = (f"waited {self.poll_timeout:g} s" if not dead else "; ".join(
            f"rank {r}'s process {s.segments.pids[r]} has exited" for r in dead))
        mailbox_k.raise_if_set(s.error, f"{self._context} ({why})")

    def _nccl(self, t: torch.Tensor) -> torch.Tensor:
        if self.group is not None and self.world > 1:
            import torch.distributed as dist

            dist.all_reduce(t, group=self.group)
        return t

    def check_mailbox(self) -> None:
        """Raise if a poll of the mailbox timed out (a device sync); see ``rearm``."""
        mailbox_k.check_mailbox_error(self.scratch.error,
                                      f"rank {self.rank} of {self.world}")

    def warmup(self, widths) -> None:
        """Compile every launch of a call of each batch width in ``widths`` on this rank,
        then, over a group, a barrier (collective: every rank calls it, before its first
        call). A width wider than ``wide_rows`` warms its chunks' widths.

        Each width's launches run once over a stand-in of this rank's exchange buffers: a
        local mailbox and local tail rows whose every word is already published (+0),
        named for every rank by the tables, with their own call counter, routing lists
        and error record. So no launch reads or writes a peer's memory, no poll waits,
        and the real buffers are left as they were; the kernels see the same argument
        types, sizes and alignments as in the real call, so that call finds them
        compiled. In Triton's interpreter nothing compiles: only the launch plans are
        built."""
        b_list = self._call_widths(widths)
        for b in b_list:
            self.plan(b)
        if self.device.type == "cuda":
            stand_in = self._stand_in()
            for b in b_list:
                stand_in.scratch.publish_everything()
                stand_in._forward(torch.zeros(b, self.cfg.hidden, dtype=torch.bfloat16,
                                              device=self.device))
            torch.cuda.synchronize(self.device)
        if self.group is not None and self.world > 1:
            import torch.distributed as dist

            dist.barrier(group=self.group)

    def _call_widths(self, widths) -> list[int]:
        """The widths of the calls ``forward`` makes for batches of ``widths`` rows."""
        rows, out = self.cfg.wide_rows, set()
        for b in widths:
            if isinstance(b, bool) or not isinstance(b, int) or b < 0:
                raise ValueError(f"widths must be batch widths (ints >= 0), got {b!r}")
            out.update(w for w in (min(b, rows), b % rows if b > rows else 0) if w)
        return sorted(out)

    def _stand_in(self) -> "WideMoE":
        """This layer over ``WideScratch.stand_in`` buffers, outside any group: its calls
        exchange nothing (``warmup``)."""
        stand_in = copy.copy(self)
        stand_in.scratch = self.scratch.stand_in()
        stand_in.group, stand_in.host_waits = None, False
        stand_in._plans = {}
        return stand_in

    # -- forward ----------------------------------------------------------------------

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [b, H] BF16 -> [b, H] BF16 (all-reduced over the group). The one check of
        ``x`` is here (a non-contiguous x is copied); the stages behind it take it as
        checked."""
        x = check_input(x, self.cfg.hidden, self.device)
        if self.world > 1 and self.group is None:
            raise RuntimeError("this WideMoE is one rank of a simulated group: run it "
                               "through SimulatedGroup")
        b, rows = x.shape[0], self.cfg.wide_rows
        if b == 0:
            return torch.empty(0, self.cfg.hidden, dtype=torch.bfloat16, device=self.device)
        if b > rows:
            return torch.cat([self._forward(x[i:i + rows]) for i in range(0, b, rows)])
        return self._forward(x)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        plan = self._plans.get(x.shape[0]) or self.plan(x.shape[0])
        if not x.is_cuda:
            shared = self._shared(plan, x)
            self._publish(plan, x)
            out = self._tail(plan, self._routed(plan), shared)
            mailbox_k.raise_if_set(self.scratch.error, self._context)
            return out
        s = self.scratch
        fork, shared_done, chain_done = s.events
        main = torch.cuda.current_stream(self.device)
        fork.record(main)
        with torch.cuda.stream(s.side):
            s.side.wait_event(fork)
            shared = self._shared(plan, x)
            shared_done.record(s.side)
        with torch.cuda.stream(s.chain):
            s.chain.wait_event(fork)
            self._publish(plan, x)
            latent = self._routed(plan)
            chain_done.record(s.chain)
        main.wait_event(chain_done)
        main.wait_event(shared_done)
        shared.record_stream(main)
        x.record_stream(s.side)
        x.record_stream(s.chain)
        return self._tail(plan, latent, shared)


class LaunchPlan:
    """Everything one forward of ``b`` rows launches with, resolved once per (layer, b):
    each kernel's tuned config merged with its defaults, its grid and its constant
    arguments, the scratch's views at ``b`` rows, all checked here against the layer's
    weights and buffers, so that a forward only looks its plan up and launches."""

    def __init__(self, layer: "WideMoE", b: int):
        cfg, s, device = layer.cfg, layer.scratch, layer.device
        L, K = cfg.latent, cfg.top_k
        self.b = b
        self.shared = shared_k.resolve(b, cfg.shared_per_rank, cfg.hidden, cfg.beta,
                                       cfg.linear_beta, device)
        self.shared_hidden = s.shared_hidden[:b]
        self.front_out = s.front[:b]
        self.front = front_k.resolve(b, self.front_out.shape[1], cfg.hidden, front_k.EPI_F32,
                                     front_k.KERNEL, device)
        self.publish = mailbox_k.resolve_publish(b, layer.rank, layer.world, L,
                                                 cfg.num_experts, cfg.wide_rows, device)
        self.route, self.routed = route_k.resolve_route_and_plan_mailbox(
            s.mailbox, s.lists.generation, b, layer.bias, K, cfg.renormalize,
            cfg.routed_scaling_factor, latent=L, world=layer.world, error=s.error,
            spin_limit=layer.spin_limit, poll_timeout=layer.timeout_ns / 1e9,
            lists=s.lists, ids=s.ids[:b],
            weights=s.weights[:b], out=(s.plan[0][:b], s.plan[1][:b]))
        self.rows = s.rows[:b * K]
        self.experts = experts_k.resolve(layer.experts, b, K, s.lists.wide_rows, cfg.beta,
                                         cfg.linear_beta)
        experts_k._check_workspace(s.hidden, b, K, L, cfg.intermediate_per_rank, device)
        self.latent_out = s.latent_out[:b]
        self.normed = s.normed[:b]
        self.finalize = finalize_k.resolve(b, L, K, True, device)
        self.norm = tail_k.resolve_norm(b, L, cfg.rms_eps, device)
        self.up = tail_k.resolve_up(b, cfg.hidden_per_rank, L, device)
        for run, workspace in ((self.shared[0], s.shared_workspace),
                               (self.shared[1], s.shared_workspace),
                               (self.front, s.front_workspace), (self.up, s.tail_workspace)):
            if run.parts > 1:
                front_k._check_workspace(workspace, run.parts, b, run.gemm["N"], device)


class SimulatedGroup:
    """T ranks of ``WideMoE`` in one process over T local mailboxes and tail rows (tests,
    CPU, one GPU): every stage runs rank by rank, so each rank's polls find its peers'
    data already there. Everything runs on the current stream (CUDA-graph capturable).

    ``stock``: the whole layer, sliced into ``world`` ranks; or one ``LatentMoE`` a rank
    (``world`` = their count), each the whole layer or that rank's shard.
    ``all_reduce``: "mailbox" (the ranks' own tail all-reduces) or "nccl", which NCCL's
    sum stands in for here: FP32 sums of the BF16 partials in rank order, rounded once, on
    the host side of the kernels."""

    def __init__(self, stock, world: int | None = None, device=None,
                 spin_limit: int = mailbox_k.DEFAULT_SPIN_LIMIT, all_reduce: str = "mailbox"):
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
        self.cfg, self.all_reduce = cfg, all_reduce
        self.ranks = [WideMoE(cfg, _to(shard(m, r, world), device), scratches[r],
                              spin_limit=spin_limit, all_reduce=all_reduce)
                      for r, m in enumerate(per_rank)]

    @staticmethod
    def _reduce(parts: list[torch.Tensor]) -> torch.Tensor:
        # From +0, as the mailbox's sum: partials that are all -0 sum to +0.
        total = torch.zeros_like(parts[0], dtype=torch.float32)
        for p in parts:
            total = total + p.float()
        return total.to(torch.bfloat16)

    def __call__(self, x: torch.Tensor, skip_publish: set[int] = frozenset(),
                 tap=None) -> list:
        """Every rank's output for x (each rank sees the same x), in chunks of wide_rows
        rows as ``WideMoE``; ``skip_publish`` names ranks that publish nothing, neither
        into the mailbox nor into the tail rows (to test the poll timeouts). ``tap``, if
        given, is called with "mailbox", "latent" and "hidden" once every rank has
        published into that exchange and before any rank reads it (mailbox all-reduce),
        so a caller can copy what the ranks published (benchmarks/rank0.py)."""
        x = check_input(x, self.cfg.hidden, self.ranks[0].device)
        rows = self.cfg.wide_rows
        if x.shape[0] <= rows:
            return self._call(x, skip_publish, tap)
        chunks = [self._call(x[i:i + rows], skip_publish, tap)
                  for i in range(0, x.shape[0], rows)]
        return [torch.cat(outs) for outs in zip(*chunks)]

    def _call(self, x: torch.Tensor, skip: set[int], tap=None) -> list:
        b = x.shape[0]
        if b == 0:
            return [x.new_empty(0, self.cfg.hidden) for _ in self.ranks]
        ranks = self.ranks
        shared = [m.shared(x) for m in ranks]
        tap = tap or (lambda exchange: None)
        for m in ranks:
            if m.rank not in skip:
                m.publish(x)
        tap("mailbox")
        latent = [m.routed(b) for m in ranks]
        if self.all_reduce == "nccl":
            total = self._reduce([t.clone() for t in latent])
            hidden = self._reduce([m.norm_up(total.clone(), s) for m, s in zip(ranks, shared)])
            return [hidden.clone() for _ in ranks]
        for m, t in zip(ranks, latent):
            if m.rank not in skip:
                m.publish_latent(t)
        tap("latent")
        for m, t, s in zip(ranks, latent, shared):
            m.norm_up(t, s)
        for m, s in zip(ranks, shared):
            if m.rank not in skip:
                m.publish_hidden(s)
        tap("hidden")
        return [m.reduce_hidden(s) for m, s in zip(ranks, shared)]


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
