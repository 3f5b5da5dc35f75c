"""``python -m wide_moe_triton.tune`` (``wide-moe-tune``): sweep every kernel's launch
configs on this GPU and write ``<GPU name>.json`` in the user's tables' directory
(``tuning.user_dir``), which the layer searches before the shipped tables.

For each kernel, dims (TP rank-local shapes of Kimi-K3) and batch-width bucket it runs
each candidate through the kernel's own launch wrapper, checks the output against the
reference (a wrong config is never chosen), times it (``do_bench_cudagraph`` median) and
keeps the fastest. Keys that set a kernel's reduction order (``REDUCTION_KEYS``) are one
choice per shape for every bucket, so tuning never makes a token's bits depend on its
batch width: the choice that minimises the worst slowdown over the swept buckets
(``choose_reduction``); the other keys are then tuned per bucket. The dense linears
that run on the front GEMM (the shared expert's ``shared_gate_up`` and ``shared_down``,
the tail's ``latent_up``) are tuned as kernels of their own, each at its own shapes.

Every candidate of a TP shape is compiled first, in a thread pool (Triton's
``AsyncCompileMode``; the route kernel alone takes 10-25 s a config to compile), then
checked and timed one at a time. Progress goes to a ``.partial.json`` file beside the
output after every kernel: an interrupted sweep resumes where it was; ``--time-limit``
stops starting kernels after that many seconds and writes the table of what is done.
Each point's choice is made at the end, by ``final_ranking``: the sweep's fastest
configs and the default timed again in interleaved rounds, the least median wins.
Beside the table, ``<table>.md``: the tuned config against the default at every point,
their medians of those rounds.

    python -m wide_moe_triton.tune --quick --tp 8 16 1    # buckets 64, 256, 512, 1024
    python -m wide_moe_triton.tune --tp 8 16 1 --batches 1 16 64 128 256 512 1024
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import pathlib
import random
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from . import cli, mx, reference, tuning
from .config import WideMoEConfig

BUCKETS = (1, 16, 64, 128, 256, 512, 1024)
# A batch runs the config of the narrowest bucket at least as wide (tuning.bucket_for), so
# without 512 a batch of 257-1024 runs the b = 1024 config: on the H200 that gave b = 512's
# experts 32-row tiles for about 9 tokens an expert, the likely cause of their 35% step
# over b = 256 (NOTES: Tuning method).
QUICK_BUCKETS = (64, 256, 512, 1024)
REP_MS, QUICK_REP_MS = 20, 10  # CUDA-graph replay time of one measurement
QUICK_KERNEL_BUDGET = 60  # s of timing a kernel's candidates may take under --quick
# The final choice at each point (``_finish``): the sweep's fastest FINALISTS configs, the
# table's config there and the default, timed again in ROUNDS interleaved rounds, the
# least median chosen. The sweep times each candidate once, minutes apart from some
# others; at a power cap the GPU's clock drifts over that time by more than configs
# differ (the H200's experts at b = 1024: one call spread 779-857 µs within a minute,
# NOTES: Machine and floors), so single timings rank close configs by when
# they ran.
FINALISTS, ROUNDS = 3, 3
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
    from .kernels import experts as ek, finalize as fk, front as frk, plan as pk
    from .kernels import route as rk, tail as tk

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
    from .kernels import front as frk, shared as sk, tail as tk

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
    from .kernels import experts as ek

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


def time_config(case: Case, config: dict, rep: int = 20) -> float | None:
    """Median µs of ``case`` under ``config`` (CUDA-graph replays of ``rep`` ms), or None
    when it fails or is wrong."""
    import triton

    cuda = torch.cuda.is_available()
    try:
        poison(*case.outputs)
        out = case.run(config)
        if cuda:
            torch.cuda.synchronize()
        if not case.ok(out):
            return None
        if not cuda:  # --dry-run in the interpreter: checks, and a token wall time
            start = time.perf_counter()
            case.timed(config)
            return (time.perf_counter() - start) * 1e6
        return triton.testing.do_bench_cudagraph(lambda: case.timed(config), rep=rep,
                                                 return_mode="median") * 1e3
    except Exception:  # a candidate that does not compile or launch is skipped
        if cuda:
            torch.cuda.synchronize()
        return None


@contextlib.contextmanager
def compile_only(workers: int):
    """Within: a Triton launch compiles its kernel in a pool of ``workers`` threads
    (Triton's ``AsyncCompileMode``; its passes and ptxas run outside the GIL) and launches
    nothing. On leaving, every compile has finished (failures are dropped: the timing
    compiles them again and skips them) and later launches find them cached."""
    import triton
    from triton.runtime.jit import JITFunction

    own = JITFunction.__dict__.get("__getitem__")

    def warmup(self, grid):
        return lambda *args, **kwargs: self.run(*args, grid=grid, warmup=True, **kwargs)

    JITFunction.__getitem__ = warmup
    try:
        with ThreadPoolExecutor(workers) as pool, \
                triton.AsyncCompileMode(pool, ignore_errors=True):
            yield
    finally:
        if own is None:
            del JITFunction.__getitem__
        else:
            JITFunction.__getitem__ = own


def compile_all(work: list, workers: int) -> float:
    """Compile every (case, config) of ``work`` in parallel; the seconds it took."""
    start = time.monotonic()
    if workers > 1 and work and torch.cuda.is_available():
        try:
            with compile_only(workers):
                for case, config in work:
                    try:
                        case.run(config)
                    except Exception:  # a config its wrapper refuses: the timing skips it
                        pass
        except Exception as err:  # the pool failed as a whole: each config compiles when timed
            print(f"warning: the parallel compile failed ({type(err).__name__}: {err}); "
                  f"configs compile one by one as they are timed (--workers 1)", flush=True)
        torch.cuda.synchronize()
    return time.monotonic() - start


def neighbours(space, base: dict, keys=None) -> list:
    """Configs of ``space`` that differ from ``base`` in exactly one key (one of ``keys``
    when given)."""
    out = []
    for c in space:
        changed = [k for k, v in base.items() if c.get(k) != v]
        if len(changed) == 1 and (keys is None or changed[0] in keys):
            out.append(dict(c))
    return out


def _unique(configs) -> list:
    out = []
    for c in configs:
        if c not in out:
            out.append(dict(c))
    return out


def _holds(config: dict, held: dict | None) -> bool:
    return not held or all(config.get(k) == v for k, v in held.items())


def candidates(case: Case, base: dict, extra=(), quick: bool = False,
               sample: int | None = None, seed: int = 0, held: dict | None = None) -> list:
    """Configs to time for ``case``, ``base`` first: ``extra`` (priors: whole configs, or
    some keys set over base's; those in the space), base's neighbours, then random
    configs of the space (``sample`` of them; None: all). Only configs that keep the keys
    of ``held``. Under ``quick`` the case's quick limits apply (``Case``)."""
    space = [c for c in case.space if _holds(c, held)]
    keys = case.quick_keys if quick else None
    if held:
        keys = [k for k in (keys or base) if k not in held]
    near = neighbours(space, base, keys)
    rng = random.Random(seed)
    if quick:
        if case.quick_near is not None:
            near = rng.sample(near, min(case.quick_near, len(near)))
        sample = case.quick_random
    # A prior may set keys the base leaves unset (experts.STAGED_KEYS: HALF_TILE, TMA);
    # being in the space is what makes it a candidate.
    priors = [dict(base, **p) for p in extra]
    priors = [p for p in priors if p in space]
    rest = [c for c in space if c != base and c not in near and c not in priors]
    if sample is not None:
        rest = rng.sample(rest, min(sample, len(rest)))
    return _unique([base, *priors, *near, *rest])


# --quick compares the default's split count with about a half, a quarter and twice it
# (nearest values of the space): a wide batch fills the GPU with fewer splits.
QUICK_SPLIT_FACTORS = (0.5, 0.25, 2.0)
QUICK_REDUCTIONS = 3


def reduction_options(case: Case, quick: bool, known=()) -> list:
    """Settings of ``case.reduction_keys`` to compare over the buckets, the default's
    first, then those of ``known`` configs (a shipped table's). All of the space's; under
    --quick the default's with the last key (a split count) scaled by
    ``QUICK_SPLIT_FACTORS`` instead, ``QUICK_REDUCTIONS`` in all, and the known ones."""
    keys = case.reduction_keys
    base = {k: case.default[k] for k in keys}
    present = _unique({k: c[k] for k in keys} for c in case.space)
    if not quick:
        return _unique([base, *present])
    last = keys[-1]
    values = sorted({r[last] for r in present if _holds(r, {k: base[k] for k in keys[:-1]})})
    options = [base]
    for factor in QUICK_SPLIT_FACTORS:
        if values and len(_unique(options)) < QUICK_REDUCTIONS:
            want = base[last] * factor
            options.append(dict(base, **{last: min(values, key=lambda v: abs(v - want))}))
    options += [{k: c[k] for k in keys} for c in known if all(k in c for k in keys)]
    return _unique(options)


def reduction_trials(case: Case, setting: dict) -> list:
    """What a reduction setting is judged by at one bucket: the default with that setting,
    and every config of the space that differs from it in ``case.pair_keys`` only."""
    base = dict(case.default, **setting)
    free = set(case.pair_keys)
    variants = [c for c in case.space if c != base
                and all(c.get(k) == v for k, v in base.items() if k not in free)]
    return [c for c in [base, *variants] if c == case.default or c in case.space]


def choose_reduction(times: dict):
    """The key of ``times`` ({setting: {bucket: µs or None}}) whose worst slowdown over the
    buckets (its time over the best of any setting there) is least, ties by the sum of
    slowdowns, then by order. A setting that failed at a bucket is out."""
    buckets = {b for per in times.values() for b, us in per.items() if us is not None}
    best = {b: min(per[b] for per in times.values() if per.get(b) is not None)
            for b in buckets}
    whole = [s for s, per in times.items() if all(per.get(b) is not None for b in buckets)]
    if not whole:
        raise RuntimeError("no reduction setting ran at every bucket")

    def slowdowns(s):
        ratios = [times[s][b] / best[b] for b in buckets]
        return max(ratios), sum(ratios)
    return min(whole, key=slowdowns)


def _key(config: dict) -> tuple:
    return tuple(sorted(config.items()))


class Group:
    """One kernel at one shape over the buckets left to tune (``cases``: {b: Case}):
    ``pending()`` gives the configs to compile and time next, round by round, ``timed``
    records their times, ``chosen()`` the best config per bucket. A kernel with reduction
    keys first times each reduction setting (``reduction_options``) at every bucket, takes
    ``choose_reduction``'s, then tunes its other keys per bucket; ``held``: a setting
    already chosen (a resumed sweep)."""

    def __init__(self, cases: dict, args, known: dict, held: dict | None = None):
        self.cases, self.args, self.known = cases, args, known
        first = next(iter(cases.values()))
        self.kernel, self.shape, self.keys = first.kernel, first.shape, first.reduction_keys
        self.times = {b: {} for b in cases}
        self.configs = {b: {} for b in cases}
        self.setting = held
        self.stage = "reduction" if self.keys and held is None else "tune"
        self.settings = []

    def _extra(self, b: int, case: Case) -> list:
        table = [c for _, c in sorted(self.known.items(), key=lambda kv: kv[0] != b)]
        return [*case.priors, *table]

    def pending(self) -> dict:
        """{b: [configs]} to time next (empty when done)."""
        a = self.args
        if self.stage == "reduction":
            case = next(iter(self.cases.values()))
            self.settings = reduction_options(case, a.quick, self.known.values())
            return {b: _unique(c for s in self.settings for c in reduction_trials(case, s))
                    for b, case in self.cases.items()}
        if self.stage == "tune":
            out = {}
            for b, case in self.cases.items():
                base = dict(case.default, **(self.setting or {}))
                if self.setting:  # the best trial of the chosen setting at this bucket
                    base = self.best(b) or base
                out[b] = candidates(case, base, self._extra(b, case), a.quick, a.candidates,
                                    a.seed, self.setting)
            return out
        return {}

    def record(self, b: int, config: dict, us: float | None) -> None:
        self.times[b][_key(config)] = us
        self.configs[b][_key(config)] = dict(config)

    def advance(self) -> None:
        """After the pending configs were timed: the next stage."""
        if self.stage == "reduction":
            per_setting = {}
            for i, s in enumerate(self.settings):
                per_setting[i] = {b: self._best_us(b, s) for b in self.cases}
            self.setting = self.settings[choose_reduction(per_setting)]
            self.stage = "tune"
        else:
            self.stage = "done"

    def _best_us(self, b: int, held: dict | None):
        found = [us for k, us in self.times[b].items()
                 if us is not None and _holds(dict(k), held)]
        return min(found) if found else None

    def best(self, b: int) -> dict | None:
        """The fastest correct config timed at bucket b (keeping the chosen setting)."""
        ranked = self.ranked(b)
        return ranked[0] if ranked else None

    def incumbent(self, b: int) -> list:
        """[the table's config at bucket b] where the sweep timed it correct and it keeps
        the chosen setting, else []: the final rounds time it beside the sweep's
        fastest, so that a new choice replaces it only by beating it there."""
        known = self.known.get(b)
        if known is None or not _holds(known, self.setting):
            return []
        return [dict(known)] if self.times[b].get(_key(known)) is not None else []

    def ranked(self, b: int) -> list:
        """The correct configs timed at bucket b that keep the chosen setting, fastest
        first (by their sweep timings)."""
        found = sorted((us, k) for k, us in self.times[b].items()
                       if us is not None and _holds(dict(k), self.setting))
        return [dict(self.configs[b][k]) for _, k in found]


def sweep(args) -> dict:
    out = pathlib.Path(args.out)
    partial = out.with_suffix(".partial.json")
    done = read_json(partial) if partial.exists() and not args.fresh else {}
    args.done = done
    start = time.monotonic()
    known_table = _current_table(args)
    for tp in args.tp:
        if _out_of_time(args, start):
            break
        cfg = _dims(args, tp)
        gen = torch.Generator(device="cpu" if args.dry_run else "cuda").manual_seed(tp)
        t0 = time.monotonic()
        weights = random_expert_weights(cfg, gen, args.experts_layout)
        groups = {}
        for b in sorted(args.batches):
            for case in cases(cfg, b, gen, weights):
                if args.kernels and case.kernel not in args.kernels:
                    continue
                if str(b) not in done.get(case.kernel, {}).get(case.shape, {}):
                    groups.setdefault((case.kernel, case.shape), {})[b] = case
        print(f"tp{tp}: {len(groups)} kernels to tune, set up in {time.monotonic() - t0:.1f} s",
              flush=True)
        tuners = [_group(cases_b, done, args, known_table) for cases_b in groups.values()]
        _run_groups(tuners, args, tp, start)
        del weights, groups, tuners
        if not args.dry_run:
            torch.cuda.empty_cache()
    args.stopped = _out_of_time(args, start)
    return done


def _current_table(args) -> dict:
    """The kernels of the table the layer reads now on this GPU (the user's, else the
    shipped one: ``tuning.find_table``), whose configs the sweep tries as priors; {} when
    there is none or it is not valid."""
    try:
        table = tuning.load_table(tuning.gpu_name())
    except ValueError:
        table = None
    return (table or {}).get("kernels", {})


def _group(cases_b: dict, done: dict, args, known_table: dict) -> Group:
    case = next(iter(cases_b.values()))
    slot = done.get(case.kernel, {}).get(case.shape, {})
    held = None
    if case.reduction_keys and slot:  # resumed: keep the setting its done buckets have
        held = {k: next(iter(slot.values()))[k] for k in case.reduction_keys}
    known = {int(b): {k: v for k, v in c.items() if not k.startswith("_")}
             for b, c in known_table.get(case.kernel, {}).get(case.shape, {}).items()}
    return Group(cases_b, args, known, held)


def _out_of_time(args, start: float) -> bool:
    return bool(args.time_limit) and time.monotonic() - start > args.time_limit


def _run_groups(tuners: list, args, tp: int, start: float) -> None:
    """Compile every group's next configs together, then time each group's in turn; a
    group with more stages is compiled and timed again; a finished group is written
    to the partial file."""
    active = list(tuners)
    while active:
        if _out_of_time(args, start):
            print(f"tp{tp}: time limit ({args.time_limit} s) reached; not tuned: "
                  + ", ".join(f"{g.kernel} {g.shape}" for g in active), flush=True)
            return
        work = {id(g): g.pending() for g in active}
        pairs = [(g.cases[b], c) for g in active for b, cs in work[id(g)].items() for c in cs]
        seconds = compile_all(pairs, args.workers)
        if torch.cuda.is_available() and args.workers > 1:
            print(f"tp{tp}: compiled {len(pairs)} configs of {len(active)} kernels in "
                  f"{seconds:.1f} s ({args.workers} threads)", flush=True)
        still = []
        for g in active:
            if _out_of_time(args, start):
                still.append(g)
                continue
            t0 = time.monotonic()
            n = _time_group(g, work[id(g)], args, f"tp{tp} {g.kernel}")
            g.advance()
            what = "tuned" if g.stage == "done" else f"reduction setting {g.setting}"
            print(f"tp{tp} {g.kernel} {g.shape}: {what}, {n} configs timed in "
                  f"{time.monotonic() - t0:.1f} s (elapsed {time.monotonic() - start:.0f} s)",
                  flush=True)
            if g.stage == "done":
                _finish(g, args)
            else:
                still.append(g)
        active = still


def _time_group(g: Group, pending: dict, args, label: str) -> int:
    """Check and time ``pending`` ({b: [configs]}): the first config of every bucket, then
    the second of every bucket, ..., until done or the group's budget (quick) is spent.
    On a terminal, a progress bar shows the kernel and the width."""
    rep = QUICK_REP_MS if args.quick else REP_MS
    deadline = time.monotonic() + args.kernel_budget if args.kernel_budget else None
    bar = _bar(sum(map(len, pending.values())))
    n = 0
    for i in range(max((len(cs) for cs in pending.values()), default=0)):
        for b, cs in pending.items():
            if i >= len(cs) or _key(cs[i]) in g.times[b]:
                continue
            if i and deadline and time.monotonic() > deadline:
                continue
            if bar:
                bar.set_description(f"{label} b={b}")
                bar.update(1)
            g.record(b, cs[i], time_config(g.cases[b], cs[i], rep))
            n += 1
    if bar:
        bar.close()
    return n


def _bar(total: int):
    """A tqdm bar on a terminal (a log gets the per-kernel lines only), else None."""
    if not sys.stderr.isatty():
        return None
    try:
        from tqdm import tqdm
    except ImportError:  # the bar is optional; the per-kernel lines still print
        return None
    return tqdm(total=total, unit="config", leave=False)


def _time_again() -> bool:
    """Whether ``_finish`` times each bucket's best and default again: on a GPU (the
    interpreter's token times are not worth it)."""
    return torch.cuda.is_available()


def final_ranking(configs: list, time_fn, rounds: int) -> list:
    """The median of ``rounds`` timings of each of ``configs`` (``time_fn(config)``: µs,
    or None when it fails), in the configs' order; None for a config that failed in any
    round. Interleaved: round r times the configs in their order rotated by r, so a drift
    of the GPU over the rounds (its clock at a power cap, its temperature) reaches each
    config alike: with an odd number of rounds, a drift of at most d from one timing to
    the next moves any two medians apart by less than d * len(configs) (``test_tune``)."""
    times = [[] for _ in configs]
    n = len(configs)
    for r in range(rounds):
        for j in range(n):
            i = (r + j) % n
            times[i].append(time_fn(configs[i]))
    return [None if None in t else sorted(t)[(len(t) - 1) // 2] for t in times]


def _finish(g: Group, args) -> None:
    """Store each bucket's choice and its and the default's times (the report's
    figures), and write the partial file. On a GPU the choice is ``final_ranking``'s
    among the sweep's ``args.finalists`` fastest configs, the table's config for the
    point (``Group.incumbent``) and the default (where it keeps the chosen reduction
    setting; it wins ties), in ``args.rounds`` rounds; in the interpreter
    (``_time_again``) the sweep's fastest, whose token times are not worth timing
    again."""
    rep = QUICK_REP_MS if args.quick else REP_MS
    again = _time_again()
    slot = args.done.setdefault(g.kernel, {}).setdefault(g.shape, {})
    for b, case in g.cases.items():
        ranked = g.ranked(b)
        if not ranked:
            raise RuntimeError(f"{g.kernel} at {g.shape}, b={b}: no config passed its check")
        default = dict(case.default)
        if again:
            finalists = _unique([default, *g.incumbent(b), *ranked[:args.finalists]])
            medians = final_ranking(finalists, lambda c: time_config(case, c, rep),
                                    args.rounds)
            default_us = medians[0]
            eligible = [(us, i) for i, us in enumerate(medians) if us is not None
                        and (i or _holds(default, g.setting))]
            if not eligible:  # each passed its check in the sweep: keep the sweep's choice
                best, best_us = ranked[0], g.times[b][_key(ranked[0])]
            else:
                best_us, i = min(eligible)
                best = dict(finalists[i])
        else:
            best, default_us = ranked[0], g.times[b].get(_key(default))
            best_us = g.times[b][_key(best)]
            if default_us is None:
                default_us = time_config(case, default, rep)
        if default_us is None:
            raise RuntimeError(f"{g.kernel} at {g.shape}: the default config fails its check")
        best["_us"], best["_default_us"] = round(best_us, 2), round(default_us, 2)
        best["_changed"] = changed_keys(best, case.default)
        # Whether the table may take this shape's buckets from two sweeps (``_fold``).
        best["_reduction"] = list(case.reduction_keys)
        slot[str(b)] = best
    partial = pathlib.Path(args.out).with_suffix(".partial.json")
    partial.parent.mkdir(parents=True, exist_ok=True)
    partial.write_text(json.dumps(args.done, indent=1))


def changed_keys(config: dict, default: dict) -> str:
    """The report's "tuned keys (default's)": each key of ``config`` whose value differs
    from ``default``'s, with the default's value, or "unset" for a key it lacks (the
    staged experts' HALF_TILE, say)."""
    return ", ".join(f"{k} {v} ({default[k] if k in default else 'unset'})"
                     for k, v in config.items() if not k.startswith("_")
                     and (k not in default or default[k] != v))


def _fold(old: dict, new: dict, whole: set) -> dict:
    """{kernel: {shape: {bucket: ...}}} of ``old`` with ``new``'s entries laid over it
    bucket by bucket, so that a sweep of some buckets keeps the table's others; except
    the (kernel, shape) pairs in ``whole``, which replace theirs whole: a kernel with
    reduction keys has one reduction setting a shape, and the buckets of two sweeps may
    hold two."""
    out = {k: {s: dict(buckets) for s, buckets in shapes.items()} for k, shapes in old.items()}
    for kernel, shapes in new.items():
        for shape, buckets in shapes.items():
            kept = {} if (kernel, shape) in whole else out.get(kernel, {}).get(shape, {})
            out.setdefault(kernel, {})[shape] = {**kept, **buckets}
    return out


def write_table(done: dict, path: pathlib.Path, args=None) -> None:
    """The table of the sweep ``done`` at ``path``. A sweep of some kernels only
    (``--kernels``) folds into the table already there, or where there is none into the
    one the layer reads now on this GPU (``_fold``): the buckets it swept replace theirs,
    every other entry stays; a shape of a kernel with reduction keys is replaced whole."""
    import triton

    gpu = tuning.gpu_name()
    name = gpu or "interpreter (dry run)"
    kernels = {k: {s: {b: {n: v for n, v in c.items() if not n.startswith("_")}
                       for b, c in buckets.items()} for s, buckets in shapes.items()}
               for k, shapes in done.items()}
    timings = {k: {s: {b: {"tuned": c.get("_us"), "default": c.get("_default_us")}
                       for b, c in buckets.items()}
                   for s, buckets in shapes.items()} for k, shapes in done.items()}
    table = {"gpu": name, "triton": triton.__version__, "torch": torch.__version__,
             "date": datetime.date.today().isoformat(),
             "dims": "Kimi-K3 (H 7168, L 3584, E 896, K 16, I 3072) rank-local shapes",
             "kernels": kernels, "timings_us": timings}
    if args is not None:
        table["sweep"] = (f"{'--quick ' if args.quick else ''}--tp {' '.join(map(str, args.tp))}"
                          f" --batches {' '.join(map(str, sorted(args.batches)))}"
                          f"{' --kernels ' + ' '.join(args.kernels) if args.kernels else ''}"
                          f" (final: {args.finalists} finalists, {args.rounds} rounds)"
                          f"{' (stopped at --time-limit: incomplete)' if args.stopped else ''}")
        old = _base_table(path, gpu) if args.kernels else None
        if old is not None:
            # An entry without the marker (a partial file of an older sweep) is taken
            # as having reduction keys: replaced whole, as every entry was then.
            whole = {(k, s) for k, shapes in done.items() for s, buckets in shapes.items()
                     if any(c.get("_reduction", True) for c in buckets.values())}
            table["kernels"] = _fold(old.get("kernels", {}), kernels, whole)
            table["timings_us"] = _fold(old.get("timings_us", {}), timings, whole)
            table["sweep"] = f"{old.get('sweep', '?')}; then {table['sweep']}"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(table, indent=1) + "\n")
    print(f"wrote {path}")


def _base_table(path: pathlib.Path, gpu: str | None) -> dict | None:
    """What a sweep of some kernels folds into: the table at ``path``, else GPU ``gpu``'s
    table that the layer reads now (``tuning.find_table``: a shipped one, say), else
    None."""
    found = path if path.exists() else (tuning.find_table(gpu) if gpu else None)
    return None if found is None else read_json(found)


def read_json(path) -> dict:
    """The JSON object in file ``path``; ValueError naming the file where it holds none
    (a table or a partial sweep edited by hand, or cut short)."""
    try:
        data = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path}: not valid JSON ({err})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: holds a JSON {type(data).__name__}, not an object")
    return data


def gains_report(done: dict, title: str) -> str:
    """Markdown: the tuned config against the default at every point of the sweep (on a GPU
    their medians of the final rounds, ``final_ranking``), and the gain per kernel."""
    lines = [f"# {title}", "",
             "At the end of the same sweep, each point's default and its fastest configs "
             "were checked and timed again in interleaved rounds (`tune.final_ranking`; "
             "the table's `sweep` says how many); the figures are the medians of those "
             "rounds (each a CUDA-graph median, µs).", "",
             "| kernel | shape | b | default µs | tuned µs | gain | tuned keys (default's) |",
             "|---|---|---|---|---|---|---|"]
    per_kernel = {}
    for kernel, shapes in done.items():
        for shape, buckets in shapes.items():
            for b in sorted(buckets, key=int):
                c = buckets[b]
                gain = c["_default_us"] / c["_us"]
                per_kernel.setdefault(kernel, []).append(gain)
                lines.append(f"| {kernel} | {shape} | {b} | {c['_default_us']:.1f} | "
                             f"{c['_us']:.1f} | {gain:.2f}x | {c.get('_changed', '')} |")
    lines += ["", "| kernel | points | gain (geometric mean) | least | most |",
              "|---|---|---|---|---|"]
    for kernel, gains in per_kernel.items():
        mean = 1.0
        for g in gains:
            mean *= g ** (1 / len(gains))
        lines.append(f"| {kernel} | {len(gains)} | {mean:.2f}x | {min(gains):.2f}x | "
                     f"{max(gains):.2f}x |")
    return "\n".join(lines) + "\n"


DESCRIPTION = f"""\
Find the fastest launch settings of the layer's GPU kernels on this GPU and save them
as a table that the layer reads from then on, on any machine with this GPU model.

For each kernel of the layer (routing the tokens to experts, the experts' two matrix
products, adding up each token's expert outputs, the norm, and the dense matrix products
of the router, the shared expert and the output projection), at the per-rank shapes of
Kimi-K3 for each tensor-parallel degree of --tp and at each batch width of --batches, it
tries launch settings (tile sizes, warps, pipeline stages, how a long sum is split),
checks each one's output against a reference computation (a setting that gives a wrong
answer is never kept), times those that pass, and keeps the fastest. At the end the
few fastest and the default are timed again side by side, several times over, and the
one with the least median time is kept (a GPU's clock drifts over a long sweep).

How long: with --quick (widths {" ".join(map(str, QUICK_BUCKETS))}, a few settings each)
--tp 8 16 1 took 160-230 s on an H200. Without --quick it tries every width of
{" ".join(map(str, BUCKETS))} and more settings each: longer (not measured). A progress
line (a bar with tqdm installed) shows the kernel and the width being tried;
--time-limit bounds the sweep; an interrupted sweep resumes where it stopped (from
<table>.partial.json).

Where it writes: <GPU name>.json in your tables' directory: $WIDE_MOE_CONFIG_DIR, else
$XDG_CACHE_HOME/wide_moe_triton, else ~/.cache/wide_moe_triton. The layer looks there
first, then among the tables the package ships (the H200's). --out writes elsewhere.
Beside the table, <GPU name>.md: each kept setting against the default, with their
times. A sweep of some kernels (--kernels) keeps the table's other entries (from the
table the layer reads now on this GPU, when your directory has none yet); a sweep of
every kernel writes the table anew.

No GPU: tuning times kernels on the GPU it tunes for, so it needs one. --dry-run runs
the whole sweep on the CPU instead, in Triton's interpreter at small dims, to see it
work: it checks every setting and times nothing that matters.

Errors are one line naming the argument or file: exit status 2 for a bad argument, 1
for a failure while tuning (--debug shows the traceback).

Examples:
  %(prog)s --quick --tp 8 16 1
  %(prog)s --tp 8 16 1 --batches 1 16 64 128 256 512 1024
  %(prog)s --quick --kernels front latent_up
  %(prog)s --dry-run --quick --tp 1 --batches 4 --kernels finalize
"""


def parser() -> cli.Parser:
    """The command line of ``wide-moe-tune`` (``python -m wide_moe_triton.tune``)."""
    p = cli.Parser("wide_moe_triton.tune", description=DESCRIPTION)
    p.add_argument("--tp", type=cli.positive_int, nargs="+", metavar="T",
                   help="tensor-parallel degrees (GPUs a layer is split over) whose per-GPU "
                        "shapes are tuned (default: 8 16 1; with --dry-run 1)")
    p.add_argument("--batches", type=cli.positive_int, nargs="+", metavar="B",
                   help="batch widths (tokens a step) to tune; a batch runs the settings "
                        "of the narrowest width at least as wide (default: "
                        f"{' '.join(map(str, BUCKETS))}; with --quick "
                        f"{' '.join(map(str, QUICK_BUCKETS))})")
    p.add_argument("--kernels", nargs="+", metavar="KERNEL", choices=KERNELS,
                   help=f"tune only these kernels, keeping the table's other entries (names: "
                        f"{', '.join(KERNELS)}) (default: every kernel, the table written "
                        f"anew)")
    p.add_argument("--experts-layout", metavar="LAYOUT",
                   help="how the experts' weights are laid out in memory for the tuned "
                        "kernels (one of wgmma_decode, wgmma, nk); each layout has its own "
                        "table entries (default: the one this GPU uses, wgmma_decode on "
                        "Hopper GPUs such as the H100 and H200, nk elsewhere)")
    p.add_argument("--quick", action="store_true",
                   help=f"a short sweep: widths {' '.join(map(str, QUICK_BUCKETS))}; the "
                        f"default, settings known to be good and their close variants (3 "
                        f"random settings more for the cheap kernels, {QUICK_REDUCTIONS} or "
                        f"more ways of splitting the sums of the dense products), "
                        f"{QUICK_REP_MS} ms a measurement, {QUICK_KERNEL_BUDGET} s a kernel "
                        f"at most (default: off)")
    p.add_argument("--candidates", type=cli.natural_int, metavar="N",
                   help="random settings to try at each point besides the close variants "
                        "of the best so far (default: every setting)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the random settings and the test data (default: 0)")
    p.add_argument("--fresh", action="store_true",
                   help="start over, ignoring what an interrupted sweep left in "
                        "<table>.partial.json (default: resume from it)")
    p.add_argument("--out", metavar="PATH",
                   help="the table to write (default: <GPU name>.json in your tables' "
                        "directory, see above); the report goes beside it as .md")
    p.add_argument("--workers", type=cli.positive_int,
                   default=min(16, len(os.sched_getaffinity(0))), metavar="N",
                   help="threads compiling settings ahead of timing them; 1 compiles each "
                        "when it is first timed (default: this machine's cores, at most "
                        "16: %(default)s)")
    p.add_argument("--time-limit", type=cli.positive_float, metavar="S",
                   help="start no kernel after S seconds and write the table of what is "
                        "done (default: no limit)")
    p.add_argument("--kernel-budget", type=cli.positive_float, metavar="S",
                   help=f"seconds of timing one kernel's settings may take (default: "
                        f"{QUICK_KERNEL_BUDGET} under --quick, else no limit)")
    p.add_argument("--finalists", type=cli.positive_int, default=FINALISTS, metavar="N",
                   help=f"how many of the fastest settings at each point are timed again "
                        f"beside the default at the end (default: {FINALISTS})")
    p.add_argument("--rounds", type=cli.positive_int, default=ROUNDS, metavar="N",
                   help=f"how many times that final timing runs, the settings taking turns; "
                        f"the least median time wins (default: {ROUNDS})")
    p.add_argument("--dry-run", action="store_true",
                   help="no GPU needed: the whole sweep at small dims in Triton's "
                        "interpreter on the CPU, to see it work; times nothing that "
                        "matters (default: off; writes dry-run.json in your tables' "
                        "directory unless --out)")
    return p


def main(argv=None) -> int:
    """The command: 0 once the table is written; an error is one line (``cli.run``): 2
    for a bad argument (no GPU without --dry-run included), 1 for a failure."""
    return cli.run("wide-moe-tune", parser(), _main, argv)


def _main(args, p: cli.Parser) -> int:
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"
    elif not torch.cuda.is_available():
        p.error("no CUDA GPU here, and tuning times the kernels on the GPU it tunes for; "
                "--dry-run runs the sweep on this CPU instead (Triton's interpreter, small "
                "dims, no timings that matter)")
    # Imported only now: kernels defined before --dry-run sets TRITON_INTERPRET would not
    # run in the interpreter.
    from .kernels.experts import LAYOUTS
    if args.experts_layout is not None and args.experts_layout not in LAYOUTS:
        p.error(f"argument --experts-layout: must be one of {', '.join(LAYOUTS)}, got "
                f"{args.experts_layout!r}")
    args.tp = args.tp or ([1] if args.dry_run else [8, 16, 1])
    for tp in args.tp:
        try:
            _dims(args, tp)
        except ValueError as err:
            p.error(f"argument --tp: {tp} does not split the layer's dims ({err})")
    name = tuning.gpu_name()
    args.out = args.out or str(tuning.user_dir() / "dry-run.json" if args.dry_run
                               else tuning.table_path(name))
    if os.path.isdir(args.out):
        p.error(f"argument --out: {args.out} is a directory; give the table's file name")
    if args.kernels:  # the table it folds into, read now rather than after the sweep
        _base_table(pathlib.Path(args.out), name)
    args.batches = args.batches or list(QUICK_BUCKETS if args.quick else BUCKETS)
    if args.kernel_budget is None and args.quick:
        args.kernel_budget = QUICK_KERNEL_BUDGET
    args.stopped = False
    start = time.monotonic()
    done = sweep(args)
    out = pathlib.Path(args.out)
    write_table(done, out, args)
    name = name or "interpreter (dry run)"
    report = gains_report(done, f"Tuned vs default launch configs, {name} "
                                f"({datetime.date.today().isoformat()}, "
                                f"`tune {json.loads(out.read_text())['sweep']}`)")
    out.with_suffix(".md").write_text(report)
    print("\n" + report + f"\nwrote {out.with_suffix('.md')}; sweep took "
          f"{time.monotonic() - start:.0f} s" + (" (stopped at the time limit)"
                                                  if args.stopped else ""))
    return 0


def _dims(args, tp: int) -> WideMoEConfig:
    """The dims the sweep tunes at tensor-parallel degree ``tp``: Kimi-K3's, or the tiny
    config's under --dry-run."""
    return WideMoEConfig.tiny(tp=tp) if args.dry_run else WideMoEConfig.kimi_k3(tp=tp)


if __name__ == "__main__":
    sys.exit(main())
