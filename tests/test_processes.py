"""Ranks as processes: T spawned processes over a gloo group, each rank's mailbox and tail
rows in POSIX shared memory (tests/ranks.py runs them). Each rank's output against
``SimulatedGroup``'s bits and the stock layer; batch invariance across processes; the
"nccl" tail over gloo; silent, killed and mismatched ranks; no segment left behind."""

import glob
import os
import re
import secrets
import subprocess
import sys
import time

import pytest
import torch
from hypothesis import given, settings, strategies as st

from conftest import DEVICE, QUICK
from ranks import Died, Ranks, as_bits, cpu_rank_environment, from_numpy, make_x
from test_module import assert_close_to_stock
from wide_moe_triton import LatentMoE, WideMoEConfig, checkpoint
from wide_moe_triton.kernels import mailbox as mailbox_k
from wide_moe_triton.processes import PREFIX, SHM_DIR

if not os.path.isdir(SHM_DIR):
    pytest.skip(f"ranks as processes share memory through {SHM_DIR}", allow_module_level=True)

# wide_rows 8: batches wider than one call stay cheap in the interpreter.
CFG = WideMoEConfig.tiny(wide_rows=8)
POLL = 2.0          # seconds a rank waits for a silent peer in these tests


@pytest.fixture(scope="module")
def stock():
    return LatentMoE(CFG, seed=0)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """Two ranks serving the tests that leave them alive."""
    with Ranks(2, tmp_path_factory.mktemp("pair")) as ranks:
        yield ranks


def build(ranks, **kwargs) -> list[str]:
    """Build the layer on every rank; its segment names, checked already unlinked (they
    are, once every rank has mapped every segment)."""
    replies = ranks.call("build", cfg=CFG, **kwargs)
    for r, reply in enumerate(replies):
        assert not isinstance(reply, Exception), f"rank {r}: {reply}"
    names = replies[0]
    assert len(names) == ranks.world * (1 if kwargs.get("all_reduce") == "nccl" else 2)
    assert_no_segment(names)
    return names


def assert_no_segment(names) -> None:
    left = [n for n in names if os.path.exists(os.path.join(SHM_DIR, n))]
    assert not left, f"left in {SHM_DIR}: {left}"


def simulated_outputs(ranks, world, b, seed, all_reduce="mailbox"):
    """``SimulatedGroup``'s every rank's output for ``make_x(b, seed)`` at T = ``world``, a
    call per wide_rows rows as the module chunks, and the tokens whose plan flipped
    against the stock path (``plan_flips``): computed by rank 0 of ``ranks``, whose
    kernels run in the interpreter wherever the tests run (this process may have a GPU
    and no interpreter)."""
    reply = ranks.call("simulated", ranks=[0], cfg=CFG, world=world, b=b, seed=seed,
                       all_reduce=all_reduce)[0]
    if isinstance(reply, Exception):
        raise AssertionError(f"rank 0's SimulatedGroup: {reply}")
    outs, flips = reply
    return [from_numpy(o) for o in outs], torch.from_numpy(flips)


def bits(t):
    return t.view(torch.int16)


# ----------------------------------------------------------------------- exact results

@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
@given(b=st.integers(1, 12), seed=st.integers(0, 2 ** 16))
@settings(max_examples=2 if QUICK else 3)
def test_ranks_equal_simulated_group_and_stock(request, stock, world, b, seed):
    # b up to 12 > wide_rows = 8: some calls run in two chunks, as SimulatedGroup's.
    ranks = request.getfixturevalue("pair" if world == 2 else "quad")
    build(ranks)
    outs = [from_numpy(o) for o in as_bits(ranks.call("forward", b=b, seed=seed))]
    x = make_x(b, seed, CFG.hidden)
    expected, flipped = simulated_outputs(ranks, world, b, seed)
    for r, out in enumerate(outs):
        assert torch.equal(bits(out), bits(expected[r])), f"rank {r}"
    assert_close_to_stock(outs[0], stock(x), flipped)
    assert all(ranks.call("empty")), "a mailbox or tail row left published"


@given(b=st.integers(1, 12), seed=st.integers(0, 2 ** 16))
@settings(max_examples=2)
def test_nccl_tail_over_gloo(pair, stock, b, seed):
    # all_reduce="nccl" runs the tail's sums on the group's all-reduce (gloo's here). Two
    # BF16 partials' sum rounded once is the same value whatever the order, so it equals
    # the host-side stand-in's; the sign of a zero may differ (-0 + -0), hence values,
    # not bits, for that comparison. Every rank holds the same bits.
    build(pair, all_reduce="nccl")
    outs = [from_numpy(o) for o in as_bits(pair.call("forward", b=b, seed=seed))]
    x = make_x(b, seed, CFG.hidden)
    expected, flipped = simulated_outputs(pair, 2, b, seed, "nccl")
    assert torch.equal(bits(outs[0]), bits(outs[1]))
    assert torch.equal(outs[0], expected[0])
    assert_close_to_stock(outs[0], stock(x), flipped)


@pytest.fixture(scope="module")
def quad(tmp_path_factory):
    with Ranks(4, tmp_path_factory.mktemp("quad")) as ranks:
        yield ranks


@pytest.mark.slow  # 65 rows a rank in the interpreter
@given(seed=st.integers(0, 2 ** 16), row=st.integers(0, 64))
@settings(max_examples=1)
def test_batch_invariance_across_processes(pair, seed, row):
    # A row alone, inside 65 rows (nine calls of wide_rows = 8: the row sits in a call
    # of 8 or in the last call of 1) holds the same bits on every rank. At T = 4 the
    # processes' bits are SimulatedGroup's (above), whose batch invariance at T = 4
    # test_module checks: the four-process case would add half a minute of CI for it.
    build(pair)
    wide = as_bits(pair.call("forward", b=65, seed=seed))
    alone = as_bits(pair.call("forward", b=65, seed=seed, rows=slice(row, row + 1)))
    for r in range(2):
        assert (wide[r][row] == alone[r][0]).all(), f"rank {r}, row {row}"
        assert (wide[r] == wide[0]).all()


# ------------------------------------------------------------------------------ faults

def assert_names_missing(reply, rank: int, missing: int) -> None:
    assert isinstance(reply, Exception) and reply.kind == "RuntimeError", reply
    message = str(reply)
    assert "mailbox poll timed out" in message, message
    assert f"rank {rank} of" in message
    assert f"in the columns of rank(s) [{missing}]" in message, message


def seconds_of(reply) -> float:
    """The failed call's seconds, as ``job_forward`` appends them."""
    return float(str(reply).split("[after ")[1].split(" s]")[0])


def test_silent_rank_is_named_then_rearm_makes_next_call_exact(pair):
    # Rank 1 publishes nothing: both ranks raise naming rank 1 (rank 1 too: its own
    # columns never came) once the bound has passed, not before and not much after;
    # rearm on every rank, and the next call has the bits of a clean one.
    build(pair, poll_timeout=POLL)
    pair.call("silent", ranks=[1])
    replies = pair.call("forward", b=5, seed=11)
    for r, reply in enumerate(replies):
        assert_names_missing(reply, r, 1)
        assert POLL <= seconds_of(reply) < POLL + 30, reply
    pair.call("speak", ranks=[1])
    pair.call("rearm")
    outs = as_bits(pair.call("forward", b=5, seed=11))
    expected, _ = simulated_outputs(pair, 2, 5, 11)
    for r in range(2):
        assert torch.equal(bits(from_numpy(outs[r])), bits(expected[r])), f"rank {r}"
    assert all(pair.call("empty"))


@pytest.mark.parametrize("world,victim,stage", [
    (2, 1, "publish_latent"),   # the front published, then killed: the tail waits
    pytest.param(4, 2, "_publish", marks=pytest.mark.slow),   # killed before publishing
])
def test_killed_rank_is_named_at_once(tmp_path, world, victim, stage):
    # SIGKILL mid-call: every survivor raises naming the victim as soon as it finds the
    # process gone, long before the poll's 60 s bound; no segment outlives the group.
    with Ranks(world, tmp_path) as ranks:
        names = build(ranks, poll_timeout=60.0)
        ranks.call("kill_at", ranks=[victim], stage=stage)
        replies = ranks.call("forward", b=3, seed=5)
        for r, reply in enumerate(replies):
            if r == victim:
                assert isinstance(reply, Died), reply
                continue
            assert_names_missing(reply, r, victim)
            assert "has exited" in str(reply)
            assert seconds_of(reply) < 20, reply
    assert_no_segment(names)


def test_peer_dying_during_construction_leaves_no_segment(tmp_path):
    # The last rank is killed once its segments exist, before its peer maps them: the
    # survivor's construction fails, and it removes every name of the group.
    token = secrets.token_hex(6)
    with Ranks(2, tmp_path) as ranks:
        ranks.call("kill_after_create", token=token)
        replies = ranks.call("build", cfg=CFG)
        assert isinstance(replies[1], Died)
        assert isinstance(replies[0], Exception), replies[0]
    assert not glob.glob(os.path.join(SHM_DIR, f"{PREFIX}{token}*"))


@pytest.fixture(scope="module")
def two_layers(tmp_path_factory, stock):
    """The same weights saved as layer 3 of one checkpoint and layer 5 of another."""
    base = tmp_path_factory.mktemp("ckpt")
    checkpoint.save_layer(stock, base / "a", 3)
    checkpoint.save_layer(stock, base / "b", 5)
    return base / "a", base / "b"


def test_rank_with_another_layer_is_refused_by_name(pair, two_layers):
    # Refused at construction, on every rank with the same message, before any segment
    # is made; the group stays usable.
    a, b = (str(p) for p in two_layers)
    cases = [("weights (bias, norm weight) sha256", {}, dict(seed=1)),
             ("cfg.rms_eps", {}, dict(cfg=CFG.replace(rms_eps=1e-5))),
             ("all_reduce", {}, dict(all_reduce="nccl")),
             ("checkpoint layer", dict(checkpoint=a, layer=3), dict(checkpoint=b, layer=5))]
    before = set(glob.glob(os.path.join(SHM_DIR, PREFIX + "*")))
    for field, rank0, rank1 in cases:
        replies = pair.call("build", rank0=dict(dict(cfg=CFG), **rank0),
                            rank1=dict(dict(cfg=CFG), **rank1))
        for reply in replies:
            assert isinstance(reply, Exception) and reply.kind == "ValueError", reply
            assert f"{field} is " in str(reply) and "(rank 1: " in str(reply), reply
        assert str(replies[0]).splitlines()[0] == str(replies[1]).splitlines()[0]
    assert set(glob.glob(os.path.join(SHM_DIR, PREFIX + "*"))) <= before
    build(pair)


# ---------------------------------------------------------------------------- launcher

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def torchrun(*args, nproc: int, timeout: float = 240):
    """``torchrun --standalone --nproc-per-node nproc *args`` with this checkout first on
    the path, its ranks CPU ranks (the interpreter, no GPU) wherever the tests run."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
        [ROOT] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    cpu_rank_environment(env)
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone",
         f"--nproc-per-node={nproc}", *args],
        capture_output=True, text=True, timeout=timeout, env=env)


@pytest.mark.slow  # torchrun and two ranks in the interpreter
def test_launcher_runs_two_ranks_and_refuses_another_world_size():
    run = torchrun("-m", "wide_moe_triton", "--tp", "2", "--batches", "1", "9",
                   "--wide-rows", "8", nproc=2)
    assert run.returncode == 0, run.stdout + run.stderr
    rows = [line.split() for line in run.stdout.splitlines()
            if line.split() and line.split()[0] in ("1", "9")]
    # One table (rank 0's): one row a width, every rank's bits alike.
    assert [r[0] for r in rows] == ["1", "9"], run.stdout
    assert all(r[-2:] == ["same", "bits"] for r in rows), run.stdout
    assert run.stdout.count("wide_moe_triton, T = 2") == 1
    assert "OK: the 2 ranks hold the same bits" in run.stdout
    bad = torchrun("-m", "wide_moe_triton", "--tp", "3", nproc=2, timeout=120)
    assert bad.returncode != 0
    # torchrun stops the other rank once one exits, which may be before that rank has
    # said anything: every rank that speaks refuses by name, and at least one does.
    said = re.findall(r"wide-moe: error: rank (\d) of 2: (.*)", bad.stderr)
    assert said, bad.stderr
    assert all(why.startswith("--tp 3 does not match the 2 processes") for _, why in said), \
        bad.stderr
    assert "exitcode  : 2" in bad.stderr


@pytest.mark.slow  # torchrun and two ranks in the interpreter
def test_tp_benchmark_dry_run_under_torchrun(tmp_path):
    # The benchmark's steps on the CPU: check, then one timed call a width (no graph).
    out = tmp_path / "tp.md"
    run = torchrun(os.path.join(ROOT, "benchmarks", "bench_tp.py"), "--dry-run", "--batches",
                   "1", "9", "--wide-rows", "8", "--out", str(out), nproc=2)
    assert run.returncode == 0, run.stdout + run.stderr
    rows = [line for line in out.read_text().splitlines() if line.startswith("| 1 |")
            or line.startswith("| 9 |")]
    assert len(rows) == 2, out.read_text()
    assert all("ranks: same bits" in r and "second call = eager" in r for r in rows), rows


# --------------------------------------------------------------------------- host waits
# In one process: the host-side wait that CPU ranks make before a polling launch names
# exactly the ranks whose words are missing, records them as a kernel's timeout does,
# and stops at once for a rank found gone.

def assert_wait(missing_fn, expected, place):
    error = mailbox_k.new_error_record("cpu")
    start = time.monotonic()
    dead = mailbox_k.await_published(missing_fn, error, place, 0.05)
    if not expected:
        assert dead is None and int(error.abs().sum()) == 0
        return
    assert dead == [] and time.monotonic() - start >= 0.05
    assert int(error[0]) == sum(1 << r for r in expected)
    assert int(error[1]) == 1 << place
    # Every missing rank found gone ends the wait at once, long before its bound; one
    # of them still alive holds it to the bound.
    error.zero_()
    start = time.monotonic()
    dead = mailbox_k.await_published(missing_fn, error, place, 60.0, gone=lambda r: r)
    assert dead == expected and time.monotonic() - start < 5
    assert int(error[0]) == sum(1 << r for r in expected)
    if len(expected) > 1:
        start = time.monotonic()
        dead = mailbox_k.await_published(missing_fn, error, place, 0.05, gone=lambda r: r[1:])
        assert dead == expected[1:] and time.monotonic() - start >= 0.05


@given(world=st.sampled_from([1, 2, 4]), data=st.data())
@settings(max_examples=6)
def test_host_wait_names_the_ranks_whose_mailbox_words_are_missing(world, data):
    cfg = CFG.replace(tp=world)
    rows = data.draw(st.integers(1, cfg.wide_rows), label="rows")
    parity = data.draw(st.integers(0, 1), label="parity")
    published = data.draw(st.sets(st.integers(0, world - 1)), label="published")
    # A rank that publishes every row but the last is missing too.
    short = data.draw(st.sets(st.sampled_from(sorted(published))) if published and rows > 1
                      else st.just(set()), label="short")
    boxes = [mailbox_k.empty_mailbox(cfg, DEVICE) for _ in range(world)]
    table = mailbox_k.mailbox_table(boxes)
    generation = torch.tensor([parity], dtype=torch.int32, device=DEVICE)
    gen = torch.Generator().manual_seed(rows)
    for r in published:
        n = rows - 1 if r in short else rows
        front = torch.randn(n, cfg.experts_per_rank + cfg.latent_per_rank,
                            generator=gen).to(DEVICE)
        mailbox_k.publish(front, table, r, world, generation, cfg.latent, cfg.num_experts,
                          wide_rows=cfg.wide_rows)
    expected = sorted(set(range(world)) - (published - short))
    for box in boxes:
        assert mailbox_k.missing_in_mailbox(box, parity, rows, cfg.latent, world) == expected
        assert mailbox_k.missing_in_mailbox(box, 1 - parity, rows, cfg.latent,
                                            world) == list(range(world))
    assert_wait(lambda: mailbox_k.missing_in_mailbox(boxes[0], parity, rows, cfg.latent, world),
                expected, parity)


@given(world=st.sampled_from([2, 4]), which=st.sampled_from(["latent", "hidden"]),
       data=st.data())
@settings(max_examples=4)
def test_host_wait_names_the_ranks_whose_tail_slots_are_missing(world, which, data):
    cfg = CFG.replace(tp=world)
    dims = mailbox_k.tail_dims(cfg)
    rows = data.draw(st.integers(1, cfg.wide_rows), label="rows")
    published = data.draw(st.sets(st.integers(0, world - 1)), label="published")
    tails = [mailbox_k.empty_tail(cfg, DEVICE) for _ in range(world)]
    table = mailbox_k.tail_table(tails)
    width = cfg.latent if which == "latent" else cfg.hidden
    for r in published:
        partial = torch.randn(rows, width, generator=torch.Generator().manual_seed(r))
        mailbox_k.publish_partial(partial.bfloat16().to(DEVICE), table, r, dims, which)
    expected = sorted(set(range(world)) - published)
    other = "hidden" if which == "latent" else "latent"
    for tail in tails:
        assert mailbox_k.missing_in_tail(tail, dims, rows, which) == expected
        assert mailbox_k.missing_in_tail(tail, dims, rows, other) == list(range(world))
    place = mailbox_k.tail_region(dims, which).place
    assert_wait(lambda: mailbox_k.missing_in_tail(tails[-1], dims, rows, which), expected, place)


def test_rearm_returns_the_scratch_to_a_fresh_one():
    # After calls, the call counter and the routing lists' counts are not zero; rearm
    # zeroes them with the mailbox and the error record (ranks a fault left a call apart
    # then agree again), and the next call has a fresh module's bits.
    from wide_moe_triton import WideMoE

    stock = LatentMoE(CFG, seed=0, device=DEVICE)
    wide = WideMoE.from_module(stock)
    x = make_x(2, 1, CFG.hidden).to(DEVICE)
    wide(x)
    wide(make_x(1, 2, CFG.hidden).to(DEVICE))
    s = wide.scratch
    assert int(s.lists.generation[0]) == 2 and int(s.lists.counts.abs().sum()) > 0
    s.error.fill_(3)
    s.rearm()
    assert int(s.lists.generation[0]) == 0 and int(s.lists.counts.abs().sum()) == 0
    assert int(s.error.abs().sum()) == 0
    assert torch.equal(bits(wide(x)), bits(WideMoE.from_module(stock)(x)))
