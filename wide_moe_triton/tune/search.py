"""Which configs the sweep tries at a point: the candidates around a base config, and the
reduction settings compared over the buckets (one a shape: ``choose_reduction``)."""

from __future__ import annotations

import random

from .kernel_cases import Case


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
