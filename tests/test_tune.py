"""The tuning sweep's choices, with stand-in kernels whose times the test sets: one
reduction setting for every bucket of a shape (the least worst slowdown), a config
that fails its check never chosen, the final choice by interleaved rounds, resume and
the time limit."""

import json
import os
import random
import subprocess
import sys

import pytest
from hypothesis import given, strategies as st

from wide_moe_triton import ops, tune, tuning  # noqa: F401
from wide_moe_triton.kernels import front
from wide_moe_triton.tune import search

from conftest import DEVICE


def _triton_version() -> tuple:
    """(major, minor) of the Triton installed."""
    import triton
    return tuple(int(part) for part in triton.__version__.split(".")[:2])


BUCKETS = (64, 256, 1024)


def brute_force_worst(times: dict, setting) -> float:
    """The worst slowdown of ``setting`` over the buckets, from the definition."""
    worst = 0.0
    for b, us in times[setting].items():
        best = min(t[b] for t in times.values() if t[b] is not None)
        worst = max(worst, us / best)
    return worst


@given(st.lists(st.lists(st.one_of(st.none(), st.floats(1.0, 1e4)), min_size=3, max_size=3),
                min_size=1, max_size=6),
       st.lists(st.floats(1.0, 1e4), min_size=3, max_size=3))
def test_choose_reduction_least_worst_slowdown(rows, whole):
    times = {i: dict(zip(BUCKETS, row)) for i, row in enumerate(rows)}
    times[len(rows)] = dict(zip(BUCKETS, whole))  # one setting that runs everywhere
    chosen = tune.choose_reduction(times)
    assert all(us is not None for us in times[chosen].values())
    complete = [s for s, t in times.items() if None not in t.values()]
    assert brute_force_worst(times, chosen) <= min(
        brute_force_worst(times, s) for s in complete) * (1 + 1e-12)


def test_choose_reduction_not_the_smallest_buckets_winner():
    # What the sweep did before: the split that wins b = 64 held for b = 1024 (1.84x).
    times = {"split 8": {64: 6.6, 256: 12.7, 1024: 33.4},
             "split 2": {64: 7.5, 256: 12.0, 1024: 18.2}}
    assert tune.choose_reduction(times) == "split 2"
    with pytest.raises(RuntimeError, match="every bucket"):
        tune.choose_reduction({"a": {64: None, 256: 1.0}, "b": {64: 1.0, 256: None}})


def front_case(b: int, N: int = 560, H: int = 7168, priors=tune.FRONT_PRIORS) -> tune.Case:
    """The front GEMM's case as ``tune.cases`` builds it, with no kernel to run."""
    return tune.Case("front", front.shape_key(N, H), front.SPACE, front.default_config(N, H, b),
                     run=None, ok=None, reduction_keys=front.REDUCTION_KEYS, priors=priors,
                     pair_keys=tune.FRONT_PAIR_KEYS)


SETTINGS = sorted({(c["BLOCK_K"], c["SPLIT_K"]) for c in front.SPACE})


@given(st.sampled_from([1, 64, 512, 1024]), st.sampled_from(SETTINGS),
       st.sampled_from([(0, 1), (1, 1), (1, 2)]), st.booleans())
def test_candidates_lay_partial_priors_over_the_base(b, setting, split, quick):
    """A prior that names some keys is tried over the base (the held reduction and
    split kept); only configs of the space, the base first, each once."""
    case = front_case(b)
    held = dict(zip(("BLOCK_K", "SPLIT_K"), setting))
    base = dict(case.default, **held, SPLIT_GRID=split[0], GROUP=split[1])
    got = tune.candidates(case, base, case.priors, quick, sample=0, seed=1, held=held)
    assert got[0] == base
    assert all(c in front.SPACE for c in got[1:])
    assert all(c[k] == v for c in got for k, v in held.items())
    assert len({search._key(c) for c in got}) == len(got)
    for prior in tune.FRONT_PRIORS:
        laid = dict(base, **prior)
        assert (laid in got) == (laid in front.SPACE), prior


@given(st.sampled_from(["up", "down"]), st.booleans())
def test_staged_experts_priors_are_all_tried(kind, quick):
    """Every prior of the staged experts launches is a candidate, those that set a key
    the default leaves unset (HALF_TILE) included: a sweep that dropped them silently
    never times the TP8 down launch's best at b = 1024 (NOTES: Tuning method)."""
    from wide_moe_triton.kernels import experts as ex

    t = ex._tuning("wgmma_decode", staged=True)
    default, space, priors = ((t.default_up, t.space_up, t.priors_up) if kind == "up" else
                              (t.default_down, t.space_down, t.priors_down))
    # the case this test is about: down priors that end in a half tile
    assert any(set(p) - set(t.default_down) for p in t.priors_down)
    case = tune.Case(kind, "key", space, default, run=None, ok=None, priors=priors,
                     quick_random=0)
    got = tune.candidates(case, default, case.priors, quick, sample=0)
    assert got[0] == default
    for prior in priors:
        assert dict(default, **prior) in got, prior


def test_grouped_programs_are_trials_at_b_1024():
    """At b = 1024 the default sums its segments in one program (SPLIT_GRID 0); the
    grouped programs (SPLIT_GRID 1, GROUP > 1) are two keys away and still judged."""
    case = front_case(1024)
    assert case.default["SPLIT_GRID"] == 0
    trials = tune.reduction_trials(case, {"BLOCK_K": 128, "SPLIT_K": 4})
    assert any(t["SPLIT_GRID"] == 1 and t["GROUP"] > 1 for t in trials)


def test_wide_tile_priors_reach_the_front_at_b_1024():
    """The priors that motivated partial priors: 128x128 tiles on 8 warps over the TP8
    front's shipped reduction (BLOCK_K 128, SPLIT_K 4, split over the grid)."""
    case = front_case(1024)
    held = {"BLOCK_K": 128, "SPLIT_K": 4}
    base = dict(case.default, **held, SPLIT_GRID=1, GROUP=1)
    got = tune.candidates(case, base, case.priors, True, held=held)
    assert dict(base, BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3) in got


@given(st.sampled_from([64, 1024]), st.sampled_from(SETTINGS))
def test_reduction_trials_every_split_of_a_setting(b, setting):
    """A reduction setting is judged by the default with it and by every way the space
    runs its splits (SPLIT_GRID, GROUP), all else as the default has it."""
    case = front_case(b)
    held = dict(zip(("BLOCK_K", "SPLIT_K"), setting))
    trials = tune.reduction_trials(case, held)
    base = dict(case.default, **held)
    if base in front.SPACE or base == case.default:  # else the space never runs it
        assert trials[0] == base
    else:
        assert base not in trials
    free = set(tune.FRONT_PAIR_KEYS)
    same = lambda c: all(c[k] == v for k, v in base.items() if k not in free)  # noqa: E731
    want = [c for c in front.SPACE if same(c)]
    assert all(same(c) for c in trials)
    keys = [search._key(c) for c in trials]
    assert len(set(keys)) == len(keys)
    assert set(keys) == {search._key(c) for c in want} | ({search._key(base)} if base in trials
                                                         else set())


class Model:
    """A stand-in front GEMM: its output is the config, right unless listed in
    ``wrong``; its time a random function of (b, config), the wrong configs fastest."""

    def __init__(self, seed: int, wrong_fraction: float):
        self.rng = random.Random(seed)
        self.costs: dict = {}
        self.wrong_fraction = wrong_fraction
        self.timed: list = []

    def time(self, case, config, rep=20):
        key = (case.b, search._key(config))
        if key not in self.costs:
            wrong = config != case.default and self.rng.random() < self.wrong_fraction
            self.costs[key] = (0.5 if wrong else self.rng.uniform(1, 10), wrong)
        self.timed.append(key)
        cost, wrong = self.costs[key]
        return None if wrong else cost

    def case(self, b: int, N: int = 560, H: int = 7168):
        c = front_case(b, N, H, priors=())
        c.b = b
        return c


def run_group(model: Model, quick: bool, known=None, held=None):
    args = type("Args", (), dict(quick=quick, candidates=4, seed=0, kernel_budget=None))
    group = tune.Group({b: model.case(b) for b in BUCKETS}, args, known or {}, held)
    while group.stage != "done":
        for b, configs in group.pending().items():
            for c in configs:
                group.record(b, c, model.time(group.cases[b], c))
        group.advance()
    return group


@given(st.integers(0, 2 ** 32 - 1), st.booleans(), st.sampled_from([0.0, 0.3]))
def test_group_one_reduction_setting_never_a_wrong_config(seed, quick, wrong_fraction):
    model = Model(seed, wrong_fraction)
    group = run_group(model, quick)
    chosen = {b: group.best(b) for b in BUCKETS}
    settings = {tuple(c[k] for k in front.REDUCTION_KEYS) for c in chosen.values()}
    assert len(settings) == 1, chosen
    for b, c in chosen.items():
        cost, wrong = model.costs[(b, search._key(c))]
        assert not wrong
        # The fastest right config timed at b among those of the chosen setting.
        rights = [model.costs[k][0] for k in model.costs
                  if k[0] == b and not model.costs[k][1]
                  and all(dict(k[1])[r] == c[r] for r in front.REDUCTION_KEYS)]
        assert cost == min(rights)
    # The setting: the least worst slowdown among those compared, each judged by its
    # best trial (the default with it, and its split mode flipped) at every bucket.
    per_setting = {}
    for s in group.settings:
        key = tuple(s.values())
        for b in BUCKETS:
            trials = [search._key(t) for t in tune.reduction_trials(group.cases[b], s)]
            right = [model.costs[(b, t)][0] for t in trials if not model.costs[(b, t)][1]]
            per_setting.setdefault(key, {})[b] = min(right) if right else None
    mine = tuple(group.setting.values())
    complete = [s for s, t in per_setting.items() if None not in t.values()]
    assert brute_force_worst(per_setting, mine) <= min(
        brute_force_worst(per_setting, s) for s in complete) * (1 + 1e-12)


def test_group_quick_compares_few_settings_and_keeps_a_held_one():
    model = Model(1, 0.0)
    known = {64: dict(front.default_config(560, 7168, 64), SPLIT_K=8)}
    group = run_group(model, True, known)
    splits = [s["SPLIT_K"] for s in group.settings]
    assert 2 <= len(splits) <= tune.QUICK_REDUCTIONS + 1 and 8 in splits
    assert splits[0] == front.default_config(560, 7168, 64)["SPLIT_K"]
    held = {"BLOCK_K": 64, "SPLIT_K": 4}
    resumed = run_group(Model(2, 0.0), True, held=held)
    for b in BUCKETS:
        assert all(resumed.best(b)[k] == v for k, v in held.items())


class Fake:
    """tune.cases stand-in: two kernels a bucket, one with reduction keys."""

    def __init__(self, model):
        self.model = model

    def __call__(self, cfg, b, gen, weights):
        yield self.model.case(b)
        plain = tune.Case("plain", "S1", [{"X": x} for x in range(6)], {"X": 0},
                          run=None, ok=None)
        plain.b = b
        yield plain


def sweep(monkeypatch, tmp_path, model, *extra, fake=Fake, out="table.json"):
    # ``ops`` (imported above) has defined every kernel before --dry-run sets
    # TRITON_INTERPRET here: a kernel module first imported under it on a GPU would define
    # interpreted kernels for the rest of the worker, and the compiled tests after it fail
    # ("Unsupported function referenced: InterpretedFunction", seen on the H200).
    monkeypatch.setattr(tune.kernel_cases, "cases", fake(model))
    # The fake's "plain" kernel is one --kernels may name, as the sweep's own are.
    monkeypatch.setattr(tune.kernel_cases, "KERNELS", (*tune.KERNELS, "plain"))
    monkeypatch.setattr(tune.kernel_cases, "random_expert_weights", lambda cfg, gen, layout: None)
    monkeypatch.setattr(tune.engine, "time_config", model.time)
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # --dry-run sets it: restored after the test
    out = out and tmp_path / out
    assert tune.main(["--dry-run", "--quick", "--tp", "1", "--workers", "1",
                      *(["--out", str(out)] if out else []),
                      "--batches", *map(str, BUCKETS), *extra]) == 0
    return out


def test_the_table_goes_to_the_users_directory(monkeypatch, tmp_path):
    """Without --out the tuner writes into the user's tables' directory (never beside
    the package)."""
    tables = tmp_path / "tables"
    monkeypatch.setenv("WIDE_MOE_CONFIG_DIR", str(tables))
    assert sweep(monkeypatch, tmp_path, Model(8, 0.0), out=None) is None
    assert sorted(p.name for p in tables.iterdir()) == [
        "dry-run.json", "dry-run.md", "dry-run.partial.json"]
    assert sorted(json.loads((tables / "dry-run.json").read_text())["kernels"]) == [
        "front", "plain"]


def test_some_kernels_fold_into_the_table_the_layer_reads(monkeypatch, tmp_path):
    """--kernels with no table at --out yet: the sweep folds into the table the layer
    reads now on this GPU (here the user's), keeping its other kernels."""
    tables = tmp_path / "tables"
    tables.mkdir()
    current = {"gpu": "Some GPU", "triton": "3.9.0", "date": "2026-12-01",
               "kernels": {"other": {"S9": {"64": {"X": 1}}}}, "sweep": "by hand"}
    (tables / "Some_GPU.json").write_text(json.dumps(current))
    monkeypatch.setenv("WIDE_MOE_CONFIG_DIR", str(tables))
    monkeypatch.setattr(tuning, "gpu_name", lambda device=None: "Some GPU")
    tuning.load_table.cache_clear()
    try:
        out = sweep(monkeypatch, tmp_path, Model(9, 0.0), "--kernels", "plain")
    finally:
        tuning.load_table.cache_clear()
    table = json.loads(out.read_text())
    assert table["kernels"]["other"] == current["kernels"]["other"]
    assert sorted(map(int, table["kernels"]["plain"]["S1"])) == list(BUCKETS)
    assert "front" not in table["kernels"] and table["sweep"].startswith("by hand; then")


def test_sweep_writes_table_report_and_resumes(monkeypatch, tmp_path):
    model = Model(3, 0.2)
    out = sweep(monkeypatch, tmp_path, model)
    table = tuning._check_table(out, json.loads(out.read_text()))
    entries = table["kernels"]["front"][front.shape_key(560, 7168)]
    assert sorted(map(int, entries)) == list(BUCKETS)
    assert len({(c["BLOCK_K"], c["SPLIT_K"]) for c in entries.values()}) == 1
    assert sorted(map(int, table["kernels"]["plain"]["S1"])) == list(BUCKETS)
    report = out.with_suffix(".md").read_text()
    assert report.count("| front |") == len(BUCKETS) + 1  # the points and the summary
    # Resumed from the partial file: nothing is timed again.
    model.timed.clear()
    sweep(monkeypatch, tmp_path, model)
    assert model.timed == []
    assert json.loads(out.read_text())["kernels"] == table["kernels"]


class Drifting(Model):
    """A Model whose "plain" configs other than the default are fast when first timed
    and slow when timed again (the default: the same each time)."""

    def __init__(self, seed):
        super().__init__(seed, 0.0)
        self.seen: set = set()

    def time(self, case, config, rep=20):
        if case.kernel != "plain":
            return super().time(case, config, rep)
        key = (case.b, search._key(config))
        again = key in self.seen
        self.seen.add(key)
        return 5.0 if config == case.default else (9.0 if again else 1.0 + config["X"] / 10)


def test_sweep_keeps_the_default_where_the_final_timing_finds_it_faster(monkeypatch,
                                                                        tmp_path):
    """The final rounds decide between the sweep's fastest and the default; the
    reduction setting chosen for a shape is kept at every bucket."""
    monkeypatch.setattr(tune.engine, "_time_again", lambda: True)
    out = sweep(monkeypatch, tmp_path, Drifting(4))
    table = json.loads(out.read_text())
    assert all(c == {"X": 0} for c in table["kernels"]["plain"]["S1"].values())
    assert all(t["tuned"] == t["default"] == 5.0
               for t in table["timings_us"]["plain"]["S1"].values())
    front_entries = table["kernels"]["front"][front.shape_key(560, 7168)].values()
    assert len({(c["BLOCK_K"], c["SPLIT_K"]) for c in front_entries}) == 1


@given(base=st.lists(st.floats(1.0, 1e3), min_size=1, max_size=6),
       rounds=st.sampled_from([1, 3, 5, 7]), drift=st.floats(0.0, 10.0),
       failing=st.lists(st.integers(0, 40), max_size=2))
def test_final_ranking_interleaves_rounds_against_drift(base, rounds, drift, failing):
    """Each config is timed once a round, in an order that rotates round by round, and
    its median is taken: a timing that drifts by ``drift`` a call (a GPU slowing at its
    power cap) moves any two medians apart by less than drift * len(configs), however
    many rounds (configs timed round after round, not interleaved, would drift apart by
    up to drift * rounds * len(configs)). A config that fails in any round gets None."""
    n = len(base)
    calls: list = []

    def time_fn(config):
        calls.append(config["i"])
        if len(calls) - 1 in failing:
            return None
        return base[config["i"]] + drift * (len(calls) - 1)

    medians = tune.final_ranking([{"i": i} for i in range(n)], time_fn, rounds)
    assert len(calls) == n * rounds
    for r in range(rounds):  # one timing of each config a round, rotated by r
        assert calls[r * n:(r + 1) * n] == [(r + j) % n for j in range(n)]
    failed = {calls[k] for k in failing if k < len(calls)}
    assert [m is None for m in medians] == [i in failed for i in range(n)]
    shifts = [m - base[i] for i, m in enumerate(medians) if m is not None]
    if shifts:
        assert max(shifts) - min(shifts) < drift * n + 1e-6 * max(base)


class Misleading(Model):
    """A Model whose "plain" configs read otherwise when first timed (the sweep) than
    ever after (the final rounds): first X = 1 fastest, then 2, 3; after, X = 2 is the
    fastest of those and X = 1 the slowest; X = 4 and 5, truly the fastest, rank below
    the finalists in the sweep. The default (X = 0) reads 5.0 each time."""

    FIRST = {0: 5.0, 1: 1.0, 2: 1.1, 3: 1.2, 4: 1.3, 5: 1.4}
    AFTER = {0: 5.0, 1: 9.0, 2: 2.0, 3: 3.0, 4: 0.5, 5: 0.5}

    def __init__(self, seed):
        super().__init__(seed, 0.0)
        self.count: dict = {}

    def time(self, case, config, rep=20):
        if case.kernel != "plain":
            return super().time(case, config, rep)
        key = (case.b, search._key(config))
        self.count[key] = self.count.get(key, 0) + 1
        return (self.FIRST if self.count[key] == 1 else self.AFTER)[config["X"]]


@pytest.mark.parametrize("rounds", [1, 5])
def test_sweep_chooses_by_the_final_rounds_among_its_fastest(monkeypatch, tmp_path, rounds):
    """At each point the sweep's fastest ``--finalists`` configs and the default are
    timed ``--rounds`` more times, and the least median is chosen: here X = 2, neither
    the sweep's fastest (X = 1, which the final rounds find slower than the default)
    nor the default; configs outside the finalists are not timed again."""
    monkeypatch.setattr(tune.engine, "_time_again", lambda: True)
    model = Misleading(11)
    out = sweep(monkeypatch, tmp_path, model, "--kernels", "plain", "--finalists", "3",
                "--rounds", str(rounds))
    table = json.loads(out.read_text())
    assert all(c == {"X": 2} for c in table["kernels"]["plain"]["S1"].values())
    assert all(t == {"tuned": 2.0, "default": 5.0}
               for t in table["timings_us"]["plain"]["S1"].values())
    assert "(final: 3 finalists, " + str(rounds) + " rounds)" in table["sweep"]
    for b in BUCKETS:
        for x in range(6):
            timed = model.count.get((b, search._key({"X": x})), 0)
            assert timed == (1 + rounds if x <= 3 else 1), (b, x, timed)


def test_the_tables_config_is_a_finalist(monkeypatch, tmp_path):
    """The config the table holds for a point joins the final rounds even where the
    sweep ranked it below the finalists (X = 5 here, truly the fastest): a sweep replaces
    it only by beating it in the same rounds."""
    monkeypatch.setattr(tune.engine, "_time_again", lambda: True)
    monkeypatch.setattr(tune.engine, "_current_table", lambda args: {
        "plain": {"S1": {str(b): {"X": 5} for b in BUCKETS}}})
    model = Misleading(12)
    out = sweep(monkeypatch, tmp_path, model, "--kernels", "plain", "--finalists", "2")
    table = json.loads(out.read_text())
    assert all(c == {"X": 5} for c in table["kernels"]["plain"]["S1"].values())
    assert all(t == {"tuned": 0.5, "default": 5.0}
               for t in table["timings_us"]["plain"]["S1"].values())
    for b in BUCKETS:  # the finalists: the default, X = 5, the sweep's X = 1 and 2
        assert [model.count[(b, search._key({"X": x}))] for x in range(6)] == [4, 4, 4, 1, 1, 4]


def test_sweep_time_limit_writes_what_is_done(monkeypatch, tmp_path):
    model = Model(4, 0.0)
    out = sweep(monkeypatch, tmp_path, model, "--time-limit", "1e-9", "--fresh")
    table = json.loads(out.read_text())
    assert table["kernels"] == {} and "incomplete" in table["sweep"]
    assert model.timed == []


def test_sweep_of_some_kernels_folds_into_the_table(monkeypatch, tmp_path):
    """``--kernels``: the shapes swept replace theirs in the table already there, every
    other entry stays; a sweep of every kernel writes the table anew."""
    model = Model(5, 0.0)
    out = sweep(monkeypatch, tmp_path, model)
    first = json.loads(out.read_text())
    first["kernels"]["other"] = {"S9": {"64": {"X": 1}}}
    first["kernels"]["plain"]["S0"] = {"64": {"X": 2}}
    out.write_text(json.dumps(first))
    again = json.loads(sweep(monkeypatch, tmp_path, Model(6, 0.0), "--fresh",
                             "--kernels", "plain").read_text())
    assert again["kernels"]["other"] == first["kernels"]["other"]
    assert again["kernels"]["front"] == first["kernels"]["front"]
    assert again["kernels"]["plain"]["S0"] == {"64": {"X": 2}}
    assert sorted(map(int, again["kernels"]["plain"]["S1"])) == list(BUCKETS)
    assert again["timings_us"]["front"] == first["timings_us"]["front"]
    assert again["sweep"].startswith(first["sweep"]) and "--kernels plain" in again["sweep"]
    whole = json.loads(sweep(monkeypatch, tmp_path, Model(7, 0.0), "--fresh").read_text())
    assert "other" not in whole["kernels"] and "S0" not in whole["kernels"]["plain"]


@pytest.mark.parametrize("swept", [(64,), (256, 1024), (1024,)])
def test_a_sweep_of_some_buckets_keeps_the_others(monkeypatch, tmp_path, swept):
    """``--kernels`` with ``--batches`` of some buckets: a kernel without reduction keys
    keeps the table's other buckets (otherwise a re-sweep of 256-1024 drops the TP16
    experts' b = 64 entry: NOTES, "Tuning method"); a front-GEMM shape is replaced
    whole, since the kept buckets may hold another reduction setting than the swept ones."""
    out = sweep(monkeypatch, tmp_path, Model(8, 0.0))
    first = json.loads(out.read_text())
    shape = front.shape_key(560, 7168)
    mark = {"tuned": 123456.0, "default": 123456.0}  # no Model time is this
    first["timings_us"]["plain"]["S1"] = {str(b): dict(mark) for b in BUCKETS}
    first["timings_us"]["front"][shape] = {str(b): dict(mark) for b in BUCKETS}
    out.write_text(json.dumps(first))
    again = json.loads(sweep(monkeypatch, tmp_path, Model(9, 0.0), "--fresh", "--kernels",
                             "plain", "front", "--batches", *map(str, swept)).read_text())
    plain = again["timings_us"]["plain"]["S1"]
    assert sorted(map(int, plain)) == list(BUCKETS)
    assert sorted(map(int, again["kernels"]["plain"]["S1"])) == list(BUCKETS)
    for b in BUCKETS:
        assert (plain[str(b)] == mark) == (b not in swept), b
        if b not in swept:
            assert again["kernels"]["plain"]["S1"][str(b)] == \
                first["kernels"]["plain"]["S1"][str(b)]
    assert sorted(map(int, again["kernels"]["front"][shape])) == sorted(swept)
    assert all(t != mark for t in again["timings_us"]["front"][shape].values())


class Unset(Fake):
    """Fake cases whose "plain" kernel's fastest configs set a key its default lacks
    (as the staged experts' HALF_TILE is absent from their default)."""

    def __call__(self, cfg, b, gen, weights):
        for case in super().__call__(cfg, b, gen, weights):
            if case.kernel == "plain":
                case.space = case.space + [{"X": x, "Y": 1} for x in range(3)]
            yield case


class FastWithY(Model):
    def time(self, case, config, rep=20):
        if case.kernel != "plain":
            return super().time(case, config, rep)
        return 1.0 if "Y" in config else 2.0 + config["X"]


def test_a_tuned_key_the_default_lacks_is_reported_unset(monkeypatch, tmp_path):
    """The report names the default's value of each key the tuned config changed; a key
    the default lacks is "unset" (not a KeyError: NOTES, "Tuning method")."""
    monkeypatch.setattr(tune.engine, "_time_again", lambda: False)
    out = sweep(monkeypatch, tmp_path, FastWithY(10, 0.0), "--kernels", "plain", fake=Unset)
    table = json.loads(out.read_text())
    assert all(c.get("Y") == 1 for c in table["kernels"]["plain"]["S1"].values())
    rows = [r for r in out.with_suffix(".md").read_text().splitlines()
            if r.startswith("| plain | S1 |")]
    assert len(rows) == len(BUCKETS) and all("Y 1 (unset)" in r for r in rows), rows


@given(st.dictionaries(st.sampled_from("ABC"), st.integers(0, 2)),
       st.dictionaries(st.sampled_from("ABC"), st.integers(0, 2)))
def test_changed_keys_lists_exactly_the_keys_that_differ(config, default):
    got = tune.changed_keys(dict(config, _us=1.0), default)
    listed = [part.split(" ")[0] for part in got.split(", ")] if got else []
    assert listed == [k for k in config if default.get(k, "absent") != config[k]]
    for part in filter(None, got.split(", ")):
        k, v, was = part.split(" ")
        assert int(v) == config[k] and was == (f"({default[k]})" if k in default else "(unset)")


@given(st.sampled_from(["wgmma", "wgmma_decode", "nk"]), st.sampled_from([1, 9]))
def test_experts_cases_tune_the_layout_asked_for(layout, b):
    """``--experts-layout``: the experts are prepared in that layout, and their cases
    carry its table key and its configs (BF16 activations only for "wgmma_decode")."""
    from wide_moe_triton import WideMoEConfig
    from wide_moe_triton.kernels import experts as ex
    import torch

    cfg = WideMoEConfig.tiny(tp=1)
    gen = torch.Generator(device=DEVICE).manual_seed(b)  # the cases launch kernels there
    weights = tune.random_expert_weights(cfg, gen, layout)
    assert weights["prepared"].layout == layout
    got = {c.kernel: c for c in tune.cases(cfg, b, gen, weights)
           if c.kernel in (ex.KERNEL_UP, ex.KERNEL_DOWN)}
    t = ex.tuning(layout, weights["prepared"].device)
    assert got[ex.KERNEL_UP].shape.endswith(t.suffix) and got[ex.KERNEL_UP].shape == \
        got[ex.KERNEL_DOWN].shape
    assert got[ex.KERNEL_UP].default == t.default_up
    assert got[ex.KERNEL_DOWN].default == t.default_down
    assert (layout == "wgmma_decode") == (t.suffix == "_decode")
    assert all(c["A_BF16"] for c in got[ex.KERNEL_UP].space) == (layout == "wgmma_decode")


@pytest.mark.slow  # a sweep in the interpreter, in a subprocess
@pytest.mark.skipif(_triton_version() < (3, 9), reason="--dry-run runs Triton's interpreter, "
                    "whose 3.9 the package pins (older ones lack what the experts use)")
def test_cli_dry_run_tunes_the_experts_layout_asked_for(tmp_path):
    """The command line as a user runs it, without TRITON_INTERPRET set beforehand
    (``--dry-run`` sets it before any kernel is defined): the experts of the layout asked
    for are swept into its own table entries."""
    from wide_moe_triton import WideMoEConfig
    from wide_moe_triton.kernels import experts as ex

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = tmp_path / "table.json"
    run = subprocess.run(
        [sys.executable, "-m", "wide_moe_triton.tune", "--dry-run", "--quick", "--tp", "1",
         "--kernels", ex.KERNEL_UP, "--experts-layout", "wgmma_decode", "--batches", "4",
         "--kernel-budget", "5", "--workers", "1", "--out", str(out)],
        env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    cfg = WideMoEConfig.tiny(tp=1)
    key = ex.shape_key(cfg.latent, cfg.intermediate_per_rank, cfg.num_experts) + "_decode"
    entries = json.loads(out.read_text())["kernels"]
    assert list(entries) == [ex.KERNEL_UP] and list(entries[ex.KERNEL_UP]) == [key]
    assert entries[ex.KERNEL_UP][key]["4"]["A_BF16"] == 1


@pytest.mark.parametrize("path", sorted(p for p in tuning.SHIPPED.iterdir()
                                         if p.name.endswith(".json")), ids=lambda p: p.stem)
def test_shipped_front_entries_lie_in_the_space_and_share_a_reduction(path):
    # Shipped tables are edited by hand too (a probe's best folded in): every front-GEMM
    # entry must be a config the tuner could have chosen, and all buckets of a shape must
    # cut the reduction alike, or the layer's rows would depend on the batch width.
    table = tuning._check_table(path, json.loads(path.read_text()))
    space = [dict(sorted(c.items())) for c in front.SPACE]
    for kernel, shapes in table["kernels"].items():
        if kernel not in ("front", "shared_gate_up", "shared_down", "latent_up"):
            continue
        for shape, buckets in shapes.items():
            orders = {tuple(c[k] for k in front.REDUCTION_KEYS) for c in buckets.values()}
            assert len(orders) == 1, (kernel, shape, orders)
            for bucket, config in buckets.items():
                assert dict(sorted(config.items())) in space, (kernel, shape, bucket, config)


def _stub_every_kernel(monkeypatch) -> None:
    """Replace every Triton kernel of the package by one whose launches do nothing."""
    import importlib
    import pkgutil
    import triton
    from wide_moe_triton import kernels

    class NoOp:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: None

    for info in pkgutil.iter_modules(kernels.__path__):
        module = importlib.import_module(f"{kernels.__name__}.{info.name}")
        for name, obj in vars(module).items():
            if isinstance(obj, triton.runtime.jit.KernelInterface):  # compiled or interpreted
                monkeypatch.setattr(module, name, NoOp())


@pytest.mark.slow  # every kernel's default run and checked, twice
@given(st.sampled_from([1, 5]))
def test_a_config_that_writes_nothing_fails_its_check(b):
    """Every case's default passes its check; with every kernel launching nothing, every
    case fails it, though the buffers still hold the good run's results (the sweep
    poisons them first): a config that writes nothing is never timed, never chosen."""
    from wide_moe_triton import WideMoEConfig
    import torch

    cfg = WideMoEConfig.tiny(tp=1)
    gen = torch.Generator(device=DEVICE).manual_seed(b)
    all_cases = list(tune.cases(cfg, b, gen, tune.random_expert_weights(cfg, gen)))
    assert [c.kernel for c in all_cases] == list(tune.KERNELS)  # what --kernels offers
    passed = {c.kernel: tune.time_config(c, c.default) is not None for c in all_cases}
    assert all(passed.values()), passed
    with pytest.MonkeyPatch.context() as patch:
        _stub_every_kernel(patch)
        written = {c.kernel: tune.time_config(c, c.default) is not None for c in all_cases}
    assert not any(written.values()), written


def test_experts_cases_time_the_launch_they_sweep(monkeypatch):
    """An experts case checks the whole call (both launches) but times only the launch
    it sweeps; the handles are the shipped ones again afterwards."""
    from wide_moe_triton import WideMoEConfig
    from wide_moe_triton.kernels import experts as ex
    import torch

    cfg = WideMoEConfig.tiny(tp=1)
    gen = torch.Generator(device=DEVICE).manual_seed(3)
    got = {c.kernel: c for c in tune.cases(cfg, 3, gen, tune.random_expert_weights(cfg, gen))
           if c.kernel in (ex.KERNEL_UP, ex.KERNEL_DOWN)}
    launched = []

    class Counting:
        def __init__(self, kind, kernel):
            self.kind, self.kernel = kind, kernel

        def __getitem__(self, grid):
            launched.append(self.kind)
            return self.kernel[grid]

    handles = {"up": Counting("up", ex._experts_up_kernel),
               "down": Counting("down", ex._experts_down_kernel)}
    monkeypatch.setattr(ex, "_experts_up_kernel", handles["up"])
    monkeypatch.setattr(ex, "_experts_down_kernel", handles["down"])
    for kernel, kind in ((ex.KERNEL_UP, "up"), (ex.KERNEL_DOWN, "down")):
        case = got[kernel]
        launched.clear()
        case.run(case.default)
        assert launched == ["up", "down"]
        launched.clear()
        case.timed(case.default)
        assert launched == [kind]
        assert (ex._experts_up_kernel, ex._experts_down_kernel) == \
            (handles["up"], handles["down"])
    with pytest.raises(ValueError, match="^kind must be"):
        with ex.only_launch("both"):
            pass
