"""The sweep engine: compile a TP shape's candidates in a thread pool, check and time
them kernel by kernel, resume from the partial file, and choose each point's config
in interleaved final rounds (``final_ranking``)."""

from __future__ import annotations

import contextlib
import json
import pathlib
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from .. import tuning
from ..config import WideMoEConfig
from . import kernel_cases
from .kernel_cases import Case, poison
from .search import (_holds, _key, _unique, candidates, choose_reduction, reduction_options,
                     reduction_trials)
from .table import changed_keys, read_json

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
        cfg = dims(args, tp)
        gen = torch.Generator(device="cpu" if args.dry_run else "cuda").manual_seed(tp)
        t0 = time.monotonic()
        weights = kernel_cases.random_expert_weights(cfg, gen, args.experts_layout)
        groups = {}
        for b in sorted(args.batches):
            for case in kernel_cases.cases(cfg, b, gen, weights):
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


def dims(args, tp: int) -> WideMoEConfig:
    """The dims the sweep tunes at tensor-parallel degree ``tp``: Kimi-K3's, or the tiny
    config's under --dry-run."""
    return WideMoEConfig.tiny(tp=tp) if args.dry_run else WideMoEConfig.kimi_k3(tp=tp)
