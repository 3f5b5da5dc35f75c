"""The sweep's cases: each kernel of the layer at one rank-local shape and batch width,
as a ``Case`` the engine compiles, checks and times (its launch wrapper, its reference
check, its config space and its priors)."""

from __future__ import annotations

import torch

from .. import mx, reference
from ..config import WideMoEConfig

# The names ``cases`` tunes (``--kernels`` takes some of them), in the order it yields them.
KERNELS = ("front", "route", "plan", "route_plan", "experts_up", "experts_down", "finalize",
           "rms_norm", "shared_gate_up", "shared_down", "latent_up")


class Case:
    """One kernel at one shape and batch width: ``run(config)`` launches it and returns its
    output; ``ok(output)`` says whether that output is right.

    Candidates (``candidates``): the default, the ``priors``, the default's neighbours (one
    key changed) and random configs of the space. Under --quick only neighbours along
    ``quick_keys`` (all keys when None), at most ``quick_near`` of them (all when None),
    and ``quick_random`` random configs. ``reduction_keys``: keys that set the reduction
    order, one choice per shape (``choose_reduction``); ``pair_keys``: keys tried with
    each reduction choice, in every combination, before it is chosen (how the splits
    run). ``outputs``: the buffers ``run`` writes and those it reads back (the experts'
    hidden), poisoned before each checked run (``poison``), so that a config that writes
    nothing fails its check instead of passing on an earlier config's results. ``timed``:
    what is timed after the check passed (default ``run``), e.g. one of the two launches
    ``run`` makes."""

    def __init__(self, kernel, shape, space, default, run, ok, reduction_keys=(), priors=(),
                 quick_near=None, quick_keys=None, quick_random=3, pair_keys=(), outputs=(),
                 timed=None):
        self.kernel, self.shape, self.space, self.default = kernel, shape, space, default
        self.run, self.ok, self.reduction_keys = run, ok, tuple(reduction_keys)
        self.outputs, self.timed = tuple(outputs), timed or run
        self.priors = [dict(p) for p in priors]
        self.quick_near, self.quick_keys, self.quick_random = quick_near, quick_keys, quick_random
        self.pair_keys = tuple(pair_keys)


def poison(*tensors: torch.Tensor) -> None:
    """Fill buffers with what a kernel that writes nothing would leave for its check to
    reject: NaN for floats, 0xA5 in every byte of integers (ids out of range, codes and
    scale bytes a reference holds everywhere only by chance). The tests poison with it
    too (tests/conftest.py)."""
    for t in tensors:
        if t.is_floating_point():
            t.fill_(float("nan"))
        else:
            size = t.element_size()
            pattern = int.from_bytes(b"\xa5" * size, "little")
            if torch.iinfo(t.dtype).min < 0:  # the same bytes, read as a signed integer
                pattern -= 1 << (8 * size)
            t.fill_(pattern)


def _equal(ref):
    return lambda out: all(torch.equal(a, b) for a, b in zip(_tuple(out), _tuple(ref)))


def _close(ref, tol):
    def ok(out):
        a, b = out.double(), ref.double()
        return bool(torch.isfinite(a).all()) and ((a - b).norm() / b.norm()).item() < tol
    return ok


def _tuple(x):
    return x if isinstance(x, tuple) else (x,)


def cases(cfg: WideMoEConfig, b: int, gen: torch.Generator, weights: dict):
    """Every kernel's case at rank-local dims ``cfg`` (cfg.tp = T) and batch width b."""
    from ..kernels import experts as ek, finalize as fk, front as frk, plan as pk
    from ..kernels import route as rk, tail as tk

    dev = gen.device
    H, L, E, K = cfg.hidden, cfg.latent, cfg.num_experts, cfg.top_k
    I = cfg.intermediate_per_rank
    N = cfg.experts_per_rank + cfg.latent_per_rank
    rnd = lambda *s: torch.randn(*s, generator=gen, device=dev)  # noqa: E731

    x = rnd(b, H).bfloat16()
    packed = (rnd(N, H) * H ** -0.5).bfloat16()
    front_out = torch.empty(b, N, device=dev)
    yield Case(frk.KERNEL, frk.shape_key(N, H), frk.SPACE, frk.default_config(N, H, b),
               lambda c: frk.front_gemm(x, packed, out=front_out, config=c),
               _close(x.double() @ packed.double().t(), 1e-5), frk.REDUCTION_KEYS,
               priors=FRONT_PRIORS, pair_keys=FRONT_PAIR_KEYS, outputs=(front_out,))

    logits, bias = rnd(b, E), rnd(E) * 1e-3  # a balanced load, as after training
    lists = rk.RoutingLists.empty(E, max(b, 1), dev)
    ids_ref = reference.route(logits, bias, K, True, cfg.routed_scaling_factor)
    routed = (torch.empty(b, K, dtype=torch.int32, device=dev),
              torch.empty(b, K, dtype=torch.bfloat16, device=dev))

    def route(c):
        lists.counts.zero_()
        return rk.route(logits, bias, K, True, cfg.routed_scaling_factor, lists=lists,
                        ids=routed[0], weights=routed[1], config=c)
    # The route compiles in 10-25 s a config (Triton 3.6, sm_90): --quick tries the
    # default's neighbours only, no random configs.
    yield Case(rk.KERNEL, rk.shape_key(E, K), rk.SPACE, rk.DEFAULT, route, _equal(ids_ref),
               quick_random=0, outputs=routed)

    latent = rnd(b, L).bfloat16()
    plan_ref = mx.quantize_mxfp8(latent)
    planned = (torch.empty(b, L, dtype=torch.uint8, device=dev),
               torch.empty(b, L // 32, dtype=torch.uint8, device=dev))
    yield Case(pk.KERNEL, pk.shape_key(L), pk.SPACE, pk.DEFAULT,
               lambda c: pk.quantize_mxfp8(latent, out=planned, config=c), _equal(plan_ref),
               outputs=planned)

    def route_plan(c):  # the layer's launch: route, claims and plan together
        lists.counts.zero_()
        return rk.route_and_plan(logits, latent, bias, K, True, cfg.routed_scaling_factor,
                                 lists=lists, ids=routed[0], weights=routed[1], out=planned,
                                 config=c)
    yield Case(rk.KERNEL_PLAN, rk.shape_key(E, K, L), rk.SPACE_PLAN, rk.DEFAULT_PLAN,
               route_plan, _equal((*ids_ref, *plan_ref)), quick_random=0,
               outputs=(*routed, *planned))

    ids, _ = ids_ref
    q, qs = plan_ref
    # Lists of their own (the sweep builds every case before it runs one, and the route
    # cases above write theirs on every run).
    expert_lists = rk.RoutingLists.empty(E, max(b, 1), dev)
    rk.route(logits, bias, K, True, 1.0, lists=expert_lists)
    w = weights
    sub = min(b, 16)
    ref_rows = reference.expert_rows(q[:sub], qs[:sub], ids[:sub], w["w13"], w["w13_scales"],
                                     w["w2"], w["w2_scales"], cfg.beta, cfg.linear_beta)
    rows = torch.empty(b * K, L, dtype=torch.bfloat16, device=dev)
    ws = ek.make_workspace(b, K, L, I, dev)

    def experts(up, down):
        return ek.experts(q, qs, w["prepared"], expert_lists.counts, expert_lists.pairs,
                          expert_lists.generation, K,
                          cfg.beta, cfg.linear_beta, rows=rows, workspace=ws,
                          config_up=up, config_down=down)

    ok_rows = lambda out: _close(ref_rows, 1e-2)(out[:sub * K])  # noqa: E731
    # The configs of the layout this GPU stores its weights in (experts.default_layout).
    t = ek.tuning(w["prepared"].layout, dev)
    key = ek.shape_key(L, I, E) + t.suffix
    # --quick: the priors (and the shipped table's configs) and the default's neighbours,
    # no random configs: each check and timing runs both GEMMs over every expert.
    # The hidden too: an up config that writes none would leave the last one's to down.
    written = (rows, *ws)

    def alone(kind, run):
        # Checked as a whole call, timed as the one launch swept: the other one, at its
        # default, would add 300-800 µs of its own (and their noise) to every candidate
        # at b = 1024 (NOTES: Tuning method).
        def timed(c):
            with ek.only_launch(kind):
                return run(c)
        return timed

    up_run = lambda c: experts(c, t.default_down)  # noqa: E731
    down_run = lambda c: experts(t.default_up, c)  # noqa: E731
    yield Case(ek.KERNEL_UP, key, t.space_up, t.default_up, up_run, ok_rows,
               priors=t.priors_up, quick_random=0, outputs=written,
               timed=alone("up", up_run))
    yield Case(ek.KERNEL_DOWN, key, t.space_down, t.default_down, down_run, ok_rows,
               priors=t.priors_down, quick_random=0, outputs=written,
               timed=alone("down", down_run))

    expanded = rnd(b * K, L).bfloat16()
    wts = (rnd(b, K) * 0.2).bfloat16()
    combined = torch.empty(b, L, dtype=torch.bfloat16, device=dev)
    yield Case(fk.KERNEL, fk.shape_key(L, K), fk.SPACE, fk.DEFAULT,
               lambda c: fk.finalize(expanded, wts, out=combined, config=c),
               _equal(reference.finalize(expanded, wts)), outputs=(combined,))

    norm_w = (1 + 0.1 * rnd(L)).bfloat16()
    norm_out = torch.empty(b, L, dtype=torch.bfloat16, device=dev)
    yield Case(tk.KERNEL, tk.shape_key(L), tk.SPACE, tk.DEFAULT,
               lambda c: tk.rms_norm(latent, norm_w, cfg.rms_eps, out=norm_out, config=c),
               _close(reference.rms_norm(latent, norm_w, cfg.rms_eps), 2 ** -8),
               outputs=(norm_out,))

    yield from linear_cases(cfg, b, x, rnd)


# Neighbours of the best reduction trial tried per bucket by --quick for the linears
# that run on the front GEMM (their space is the front's, tuned in full beside them).
QUICK_LINEAR = 2
# Keys tried with each reduction choice of a front-GEMM kernel before one is chosen, in
# every combination the space holds: a split count runs as one program or as a grid of
# programs summing GROUP segments each, and which is faster depends on the batch width
# (at b = 1024 the grouped programs are two keys from the default, out of reach of a
# one-key neighbour).
FRONT_PAIR_KEYS = ("SPLIT_GRID", "GROUP")
# Tiles the front-GEMM kernels always try, over whatever reduction and split the base
# has: wide tiles on two warpgroups, several keys from the 64x64, 4-warp default (the
# H200 sweep of 2026-12-03 left the front at 1.8x torch.mm at b = 1024 on 128x64 tiles).
FRONT_PRIORS = ({"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 3},
                {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 4},
                {"BLOCK_M": 64, "BLOCK_N": 128, "num_warps": 8, "num_stages": 4})


def linear_cases(cfg: WideMoEConfig, b: int, x: torch.Tensor, rnd):
    """The dense linears on the front GEMM, each under its own tuning name and shape: the
    shared expert's gate/up with SiTU and its down, and the tail's up-projection."""
    from ..kernels import front as frk, shared as sk, tail as tk

    dev = x.device
    H, L, S, Hr = cfg.hidden, cfg.latent, cfg.shared_per_rank, cfg.hidden_per_rank
    bf16 = torch.bfloat16

    def case(kernel, N, K, run, expected, out):
        return Case(kernel, frk.shape_key(N, K), frk.SPACE, frk.default_config(N, K, b), run,
                    _close(expected, 1e-2), frk.REDUCTION_KEYS, priors=FRONT_PRIORS,
                    quick_near=QUICK_LINEAR, quick_random=0, pair_keys=FRONT_PAIR_KEYS,
                    outputs=(out,))

    gate_up = (rnd(2 * S, H) * H ** -0.5).to(bf16)
    pairs = sk.interleave_gate_up(gate_up)
    gu = (x.double() @ gate_up.double().t()).float().to(bf16)
    hidden = torch.empty(b, S, dtype=bf16, device=dev)
    yield case(sk.KERNEL_GATE_UP, 2 * S, H,
               lambda c: frk.linear_situ(x, pairs, cfg.beta, cfg.linear_beta, out=hidden,
                                         kernel=sk.KERNEL_GATE_UP, config=c),
               reference.situ(gu[:, :S], gu[:, S:], cfg.beta, cfg.linear_beta), hidden)

    h, down = rnd(b, S).to(bf16), (rnd(H, S) * S ** -0.5).to(bf16)
    shared_out = torch.empty(b, H, dtype=bf16, device=dev)
    yield case(sk.KERNEL_DOWN, H, S,
               lambda c: frk.linear(h, down, out=shared_out, kernel=sk.KERNEL_DOWN, config=c),
               h.double() @ down.double().t(), shared_out)

    # As in the layer: this rank's columns of a [b, H] shared partial, added into in
    # place, so each run starts from a copy of the same partial (a copy every config pays).
    normed, up = rnd(b, L).to(bf16), (rnd(Hr, L) * L ** -0.5).to(bf16)
    start, partial = rnd(b, Hr).to(bf16), torch.empty(b, H, dtype=bf16, device=dev)
    cols = partial[:, :Hr]

    def up_projection(c):
        cols.copy_(start)
        return tk.add_up_projection(normed, up, cols, config=c)
    # (poisoned before the copy, which overwrites it: a run that adds nothing fails on
    # the partial alone)
    yield case(tk.KERNEL_UP, Hr, L, up_projection,
               start.double() + normed.double() @ up.double().t(), cols)


def random_expert_weights(cfg: WideMoEConfig, gen: torch.Generator,
                          layout: str | None = None) -> dict:
    """Rank-local MXFP4 experts drawn like ``LatentMoE``'s, without building the layer,
    prepared in ``layout`` (default: ``experts.default_layout`` of the generator's
    device)."""
    from ..kernels import experts as ek

    dev = gen.device
    E, L, I = cfg.num_experts, cfg.latent, cfg.intermediate_per_rank
    parts: dict = {"w13": [], "w13_scales": [], "w2": [], "w2_scales": []}
    for start in range(0, E, 64):
        n = min(64, E - start)
        p, s = mx.quantize_mxfp4(torch.randn(n, 2 * I, L, generator=gen, device=dev) * L ** -0.5)
        parts["w13"].append(p), parts["w13_scales"].append(s)
        p, s = mx.quantize_mxfp4(torch.randn(n, L, I, generator=gen, device=dev) * I ** -0.5)
        parts["w2"].append(p), parts["w2_scales"].append(s)
    w = {k: torch.cat(v) for k, v in parts.items()}
    w["prepared"] = ek.prepare_weights(w["w13"], w["w13_scales"], w["w2"], w["w2_scales"],
                                       layout)
    return w
