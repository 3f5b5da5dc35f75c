"""Ranks as processes for the tests: ``Ranks(T, dir)`` spawns T processes joined in a gloo
group (a file rendezvous in ``dir``), each serving jobs the test sends (the functions
below whose name starts with ``job_``), so that one set of processes serves a test's
hypothesis examples. Every reply is awaited with a deadline: a rank that hangs fails the
test instead of hanging it, and the processes are killed when the test ends."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
import traceback

import numpy as np

JOB_TIMEOUT = 150.0       # seconds a job may take before the test fails as hung
GROUP_TIMEOUT = 60.0      # the gloo group's own bound on a collective


def make_x(b: int, seed: int, hidden: int):
    """The test input every rank and the parent draw alike: BF16 [b, hidden]."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, hidden, generator=g).bfloat16()


def to_numpy(t):
    """A BF16 tensor's bits as int16 numpy (pickled by value between processes)."""
    return t.view(__import__("torch").int16).numpy().copy()


def from_numpy(a):
    import torch

    return torch.from_numpy(a).view(torch.bfloat16)


class Died(Exception):
    """A rank's process exited before replying."""


class Ranks:
    """T rank processes over one gloo group. ``call(job, ...)`` runs ``job_<job>`` on the
    ranks (all by default) and returns their replies in rank order: the job's value, or
    the exception it raised (an ``Exception`` whose message is the rank's, type name
    kept as ``.kind``), or ``Died`` for a rank whose process is gone."""

    def __init__(self, world: int, directory, timeout: float = JOB_TIMEOUT,
                 environment: dict | None = None):
        # environment: set in each rank before it imports torch; None: a CPU rank's
        # (``cpu_rank_environment``).
        ctx = multiprocessing.get_context("spawn")
        self.world, self.timeout = world, timeout
        init = f"file://{os.path.join(str(directory), 'rendezvous')}"
        self.conns, self.procs = [], []
        for r in range(world):
            mine, theirs = ctx.Pipe()
            p = ctx.Process(target=_serve, args=(r, world, init, theirs, environment),
                            daemon=True)
            p.start()
            theirs.close()
            self.conns.append(mine)
            self.procs.append(p)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def call(self, job: str, ranks=None, timeout: float | None = None, **kwargs) -> list:
        """``job_<job>(**kwargs)`` on ``ranks`` (all by default); ``rank<r>=dict(...)``
        gives rank r its own arguments instead."""
        ranks = range(self.world) if ranks is None else ranks
        own = {r: kwargs.pop(f"rank{r}") for r in range(self.world) if f"rank{r}" in kwargs}
        for r in ranks:
            self.conns[r].send((job, own.get(r, kwargs)))
        deadline = time.monotonic() + (timeout or self.timeout)
        replies = []
        for r in ranks:
            replies.append(self._reply(r, deadline, job))
        return replies

    def _reply(self, r: int, deadline: float, job: str):
        conn = self.conns[r]
        while not conn.poll(0.05):
            if not self.procs[r].is_alive():
                return Died(f"rank {r} exited with {self.procs[r].exitcode}")
            if time.monotonic() > deadline:
                self.close()
                raise AssertionError(f"rank {r} did not finish {job!r} in time: hung")
        try:
            status, value = conn.recv()
        except EOFError:
            self.procs[r].join(5)
            return Died(f"rank {r} exited with {self.procs[r].exitcode}")
        if status == "ok":
            return value
        kind, message = value
        err = Exception(message)
        err.kind = kind
        return err

    def close(self) -> None:
        for conn, p in zip(self.conns, self.procs):
            if p.is_alive():
                try:
                    conn.send(None)
                except (BrokenPipeError, OSError):
                    pass
        for p in self.procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join(5)


def cpu_rank_environment(env) -> None:
    """Make ``env`` (a process's environment, before it imports torch or the package) a
    CPU rank's: the kernels in Triton's interpreter and no GPU visible, so the rank runs
    the same path on a machine with GPUs as on one without (``triton.jit`` reads
    TRITON_INTERPRET once, when the package is imported)."""
    env["TRITON_INTERPRET"] = "1"
    env["CUDA_VISIBLE_DEVICES"] = ""


def _serve(rank: int, world: int, init: str, conn, environment=None) -> None:
    """A rank's loop: join the group, then run each job sent until None."""
    if environment is None:
        cpu_rank_environment(os.environ)
    else:
        os.environ.update(environment)
    import conftest  # noqa: F401  (the interpreter's once-a-launch patch, as in the tests)
    import datetime

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=GROUP_TIMEOUT))
    state = {"rank": rank, "world": world}
    while True:
        try:
            message = conn.recv()
        except EOFError:
            break
        if message is None:
            break
        job, kwargs = message
        try:
            conn.send(("ok", globals()[f"job_{job}"](state, **kwargs)))
        except Exception as e:  # the test asserts on it
            conn.send(("error", (type(e).__name__, f"{e}\n{traceback.format_exc()}")))
    if dist.is_initialized():
        dist.destroy_process_group()


# ----------------------------------------------------------------------------- jobs

def job_build(state, cfg, seed=0, all_reduce="mailbox", poll_timeout=None,
              checkpoint=None, layer=None):
    """This rank's WideMoE over the gloo group (from the whole layer drawn from ``seed``,
    or from ``layer`` of ``checkpoint``); replies with its shared-memory segment names."""
    import torch.distributed as dist

    from wide_moe_triton import LatentMoE, WideMoE

    state.pop("layer", None)
    group = dist.group.WORLD
    if checkpoint is not None:
        layer = WideMoE.from_checkpoint(checkpoint, layer, group, wide_rows=cfg.wide_rows,
                                        all_reduce=all_reduce, poll_timeout=poll_timeout)
    else:
        layer = WideMoE.from_module(LatentMoE(cfg, seed=seed), group, all_reduce=all_reduce,
                                    poll_timeout=poll_timeout)
    state["layer"] = layer
    segments = layer.scratch.segments
    return [] if segments is None else segments.names


def job_build_shard(state, cfg, seed=0, poll_timeout=None, device="cpu", widths=()):
    """This rank's WideMoE over the group from its own shard of the random layer
    (``reference.random_shard``, drawn on ``device``), warmed up for ``widths``
    (``WideMoE.warmup``). Replies with this rank's GPU memory allocated before the build
    and its peak after it (bytes; 0 on a CPU)."""
    import torch
    import torch.distributed as dist

    from wide_moe_triton import WideMoE, reference

    state.pop("layer", None)
    dev = torch.device(device)
    cuda = dev.type == "cuda"
    if cuda:
        torch.cuda.set_device(dev)
    before = torch.cuda.memory_allocated(dev) if cuda else 0
    mine = reference.random_shard(cfg, seed, state["rank"], state["world"], device=dev)
    layer = WideMoE.from_module(mine, dist.group.WORLD, poll_timeout=poll_timeout)
    del mine
    layer.warmup(widths)
    state["layer"] = layer
    return before, torch.cuda.max_memory_allocated(dev) if cuda else 0


def job_forward(state, b, seed, rows=None, delay=0.0):
    """The layer's output (bits) for ``make_x(b, seed)``, or for its rows ``rows`` (a
    slice), and the call's seconds; ``delay``: seconds this rank sleeps first (a late
    peer). On a GPU the mailbox's error record is read after the call (a sync)."""
    layer = state["layer"]
    x = make_x(b, seed, layer.cfg.hidden)
    if rows is not None:
        x = x[rows]
    x = x.to(layer.device)
    time.sleep(delay)
    start = time.monotonic()
    try:
        out = layer(x)
        if out.is_cuda:
            layer.check_mailbox()
            out = out.cpu()
    except Exception as e:
        e.args = (f"{e.args[0] if e.args else e} [after {time.monotonic() - start:.2f} s]",)
        raise
    return to_numpy(out), time.monotonic() - start


def job_simulated(state, cfg, world, b, seed, all_reduce="mailbox", seed_layer=0):
    """``SimulatedGroup``'s every rank's output bits for ``make_x(b, seed)`` (one call a
    ``wide_rows`` rows, as the module chunks) and, a token a row, whether its plan flipped
    against the stock path (``test_module.plan_flips``): computed in a rank's process,
    the interpreter's, wherever the tests run. The group is made once a (world,
    all_reduce)."""
    import torch

    from test_module import plan_flips
    from wide_moe_triton import LatentMoE, SimulatedGroup

    key = ("simulated", world, all_reduce, seed_layer, cfg)
    if key not in state:
        stock = LatentMoE(cfg, seed=seed_layer)
        state[key] = (stock, SimulatedGroup(stock, world, all_reduce=all_reduce))
    stock, group = state[key]
    x = make_x(b, seed, cfg.hidden)
    outs, flips = [], []
    for i in range(0, b, cfg.wide_rows):
        chunk = x[i:i + cfg.wide_rows]
        outs.append(group(chunk))
        flips.append(plan_flips(stock, chunk, group.ranks[0].scratch))
    return [to_numpy(torch.cat(o)) for o in zip(*outs)], torch.cat(flips).numpy()


def job_silent(state):
    """From now on this rank publishes nothing (front, latent and hidden rows) until
    ``job_speak``."""
    layer = state["layer"]
    names = ("_publish", "publish_latent", "publish_hidden")
    state["speak"] = {name: getattr(layer, name) for name in names}
    for name in names:
        setattr(layer, name, lambda *args, **kwargs: None)


def job_speak(state):
    """This rank publishes again (after ``job_silent``)."""
    for name, fn in state.pop("speak").items():
        setattr(state["layer"], name, fn)


def job_kill_at(state, stage):
    """SIGKILL this process when the layer's next call reaches ``stage`` (a method of
    WideMoE: "_publish" before anything is published, "publish_latent" with the front
    published)."""
    layer = state["layer"]

    def die(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGKILL)

    setattr(layer, stage, die)


def job_kill_after_create(state, token):
    """Segments named from ``token``; this rank is SIGKILLed once it has created its
    segments, before any peer maps them."""
    from wide_moe_triton import processes

    original = processes._create
    processes.secrets = type("Fixed", (), {"token_hex": staticmethod(lambda n: token)})

    def create_then_die(path, nbytes):
        original(path, nbytes)
        if state["rank"] == state["world"] - 1:
            os.kill(os.getpid(), signal.SIGKILL)

    processes._create = create_then_die


def job_rearm(state):
    """Every rank: a barrier, ``rearm``, a barrier (no call in flight meanwhile; on a GPU
    the re-arm is done before the second barrier)."""
    import torch
    import torch.distributed as dist

    dist.barrier()
    layer = state["layer"]
    layer.scratch.rearm()
    if layer.device.type == "cuda":
        torch.cuda.synchronize(layer.device)
    dist.barrier()


def job_replays(state, b, seed, replays):
    """(calls whose bits differ from the first eager call's, calls made): on a GPU
    ``replays`` replays of a CUDA graph of the call (every rank captures its own; each
    replay exchanges with the peers' replays), compared on the device; on a CPU
    ``replays`` eager calls. The error record is read at the end."""
    import torch

    layer = state["layer"]
    x = make_x(b, seed, layer.cfg.hidden).to(layer.device)
    if not x.is_cuda:
        eager = layer(x)
        differ = sum(not torch.equal(layer(x).view(torch.int16), eager.view(torch.int16))
                     for _ in range(replays))
        return differ, replays
    # The eager call on a side stream, as capture wants its warm-up calls.
    side, main = torch.cuda.Stream(), torch.cuda.current_stream()
    side.wait_stream(main)
    with torch.cuda.stream(side):
        eager = layer(x)
    main.wait_stream(side)
    layer.check_mailbox()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = layer(x)
    differ = torch.zeros((), dtype=torch.int32, device=layer.device)
    for _ in range(replays):
        graph.replay()
        differ += (out.view(torch.int16) != eager.view(torch.int16)).any().int()
    torch.cuda.synchronize(layer.device)
    layer.check_mailbox()
    return int(differ), replays


def job_release(state):
    """Drop the layer, destroy the process group, hand cached GPU memory back; the GPU
    memory this rank still has allocated (bytes; 0 on a CPU)."""
    import gc

    import torch
    import torch.distributed as dist

    layer = state.pop("layer", None)
    cuda = layer is not None and layer.device.type == "cuda"
    del layer
    gc.collect()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    if dist.is_initialized():
        dist.destroy_process_group()
    return torch.cuda.memory_allocated() if cuda else 0


def job_empty(state):
    """Whether this rank's mailbox and tail rows are all empty, and its error record
    clear."""
    from wide_moe_triton.kernels import mailbox as mailbox_k

    s = state["layer"].scratch
    latent = s.mailbox[:, :, :s.cfg.latent]
    words = s.mailbox[:, :, s.cfg.latent:].contiguous().view(__import__("torch").int32)
    ok = bool((latent == mailbox_k.SENTINEL_BF16).all() and
              (words == mailbox_k.SENTINEL_WORD).all())
    if s.tail is not None:
        ok = ok and bool((s.tail == mailbox_k.SENTINEL_BF16).all())
    return ok and int(s.error.abs().sum()) == 0


def as_bits(replies) -> list[np.ndarray]:
    """The output bits of ``job_forward`` replies; raises if a rank failed."""
    out = []
    for r, reply in enumerate(replies):
        if isinstance(reply, Exception):
            raise AssertionError(f"rank {r}: {reply}")
        out.append(reply[0])
    return out
