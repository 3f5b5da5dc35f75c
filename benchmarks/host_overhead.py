"""The host's share of one ``WideMoE.forward``: what our own Python costs per call.

    python benchmarks/host_overhead.py [--batches 1 64] [--calls 2000] [--top 15]
    python benchmarks/host_overhead.py --gpu [--experts 128] [--batches 1 65 1024]

Stubbed (the default; any machine, CPU included): every Triton launch (compiled or
interpreted) is replaced by a no-op that only counts, so what is timed is the layer's own Python (argument checks,
configs, grids, views, streams) at ``WideMoEConfig.tiny`` dims. Prints the time per
forward (the least of 25 rounds of ``--calls``/25 forwards, after warm-up: the machine's
other work only ever adds to a round; beside it the median, and the process's CPU time a
forward, which time spent waiting for a core does not inflate), the launches and
the argument checks (``check_tensor`` calls) per forward, and a cProfile's top entries.

``--gpu`` (a CUDA GPU): the layer at Kimi-K3's dims at T = 1 with ``--experts`` experts
(896 need ~60 GB of weights and minutes to build; the host's work per call does not
depend on E, the GPU's does a little), timed eager and as a CUDA graph at each width;
prints both and eager minus graph, and the host's own time a call: the calls issued
while the GPU is held busy (``torch.cuda._sleep``), so that no launch waits for the GPU
and no kernel for the host. Eager minus graph is the host's time only where the host is
the slower of the two; beside the host's own time it tells host drag from GPU time that
only eager calls pay (e.g. the side stream's kernels contending with the chain's). The
table the layer reads is the one ``wide-moe tables`` names (``WIDE_MOE_TABLE=none``: the
defaults; ``WIDE_MOE_TABLE=PATH``: that table); printed first.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import os
import pathlib
import pstats
import statistics
import sys
import time

import torch
import triton

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from wide_moe_triton import LatentMoE, WideMoE, WideMoEConfig, checks  # noqa: E402


@contextlib.contextmanager
def stubbed_launches():
    """Within: every ``@triton.jit`` kernel's launch (``kernel[grid](...)``, compiled or
    interpreted) calls a no-op that only counts; yields the counter (a one-element list).
    Triton's own launch path (the grid's proxy, argument binding, cache lookup, the
    driver call) is stubbed with it: what remains is the caller's Python, the building
    of each launch's arguments included."""
    from triton.runtime.jit import KernelInterface

    count = [0]

    def launch(*args, **kwargs):
        count[0] += 1

    saved = KernelInterface.__getitem__
    KernelInterface.__getitem__ = lambda self, grid: launch
    try:
        yield count
    finally:
        KernelInterface.__getitem__ = saved


@contextlib.contextmanager
def counted_checks():
    """Within: ``checks.check_tensor`` counts its calls (every module that imported it by
    name included); yields the counter."""
    count = [0]
    original = checks.check_tensor
    patched = []

    def counting(*args, **kwargs):
        count[0] += 1
        return original(*args, **kwargs)

    for mod in list(sys.modules.values()):
        if getattr(mod, "__name__", "").startswith("wide_moe_triton") and \
                getattr(mod, "check_tensor", None) is original:
            mod.check_tensor = counting
            patched.append(mod)
    try:
        yield count
    finally:
        for mod in patched:
            mod.check_tensor = original


def stubbed(batches, calls, top):
    """The stubbed figures at tiny dims, one block of lines per batch width."""
    if torch.cuda.is_available():
        print("note: a GPU is present; the stubbed figures are still the CPU path's")
    cfg = WideMoEConfig.tiny(wide_rows=max(64, max(batches)))
    wide = WideMoE.from_module(LatentMoE(cfg, seed=0))
    for b in batches:
        x = torch.randn(b, cfg.hidden).bfloat16()
        with stubbed_launches() as launches:
            for _ in range(20):
                wide(x)
            with counted_checks() as checked:
                launches[0] = 0
                wide(x)
            per_call = launches[0]
            rounds, cpu = [], []
            for _ in range(25):
                start, start_cpu = time.perf_counter(), time.process_time()
                for _ in range(calls // 25):
                    wide(x)
                rounds.append((time.perf_counter() - start) / (calls // 25))
                cpu.append((time.process_time() - start_cpu) / (calls // 25))
            profile = cProfile.Profile()
            profile.enable()
            for _ in range(calls // 10):
                wide(x)
            profile.disable()
        print(f"b = {b}: {min(rounds) * 1e6:.1f} us of Python per forward (the least of 25 "
              f"rounds; median {statistics.median(rounds) * 1e6:.1f}; CPU time "
              f"{statistics.median(cpu) * 1e6:.1f}), {per_call} launches, {checked[0]} "
              f"check_tensor calls; load average {os.getloadavg()[0]:.1f}")
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(top)
        print("\n".join(line for line in text.getvalue().splitlines()[4:] if line.strip()))


def gpu(batches, experts, iters, tables=None, top=0):
    """Eager and CUDA-graph time per call of the T = 1 layer at production dims, and the
    host's own time a call; once for each of ``tables`` (values of ``WIDE_MOE_TABLE``:
    "auto" for the layer's own choice, "none", "own" or a table's path; default: the
    environment's), each a fresh ``WideMoE`` over the same weights. ``top`` > 0: also a
    cProfile of the host's issue of ``iters`` calls at the narrowest width, its ``top``
    entries by own time (where the host's time goes, Triton's launcher included)."""
    import os

    from wide_moe_triton import tuning

    cfg = WideMoEConfig.kimi_k3(wide_rows=max(1024, max(batches))).replace(
        num_experts=experts)
    device = torch.device("cuda")
    stock = LatentMoE(cfg, seed=0, device=device)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton "
          f"{triton.__version__}; Kimi-K3 dims at T = 1, E = {experts}")
    for value in tables or [os.environ.get(tuning.TABLE_ENV, "auto")]:
        _choose(value)
        choice = tuning.choose_table(tuning.gpu_info(device))
        print(f"\ntable ({tuning.TABLE_ENV}={value}): {choice.source} {choice.path or ''}")
        wide = WideMoE.from_module(stock)
        print("| b | eager µs | graph µs | eager - graph µs | eager / graph | host µs |")
        print("| --- | --- | --- | --- | --- | --- |")
        for b in batches:
            _widths(wide, cfg, device, b, iters)
        if top:
            _profile_host(wide, cfg, device, min(batches), iters, top)
        del wide
        torch.cuda.empty_cache()


def _choose(value: str) -> None:
    """The next layer's table: ``WIDE_MOE_TABLE`` set to ``value`` ("auto": unset), the
    tables read again and their warnings due again."""
    import os

    from wide_moe_triton import tuning

    os.environ.pop(tuning.TABLE_ENV, None)
    if value != "auto":
        os.environ[tuning.TABLE_ENV] = value
    tuning.clear_caches()
    tuning._warned.clear()


def _widths(wide, cfg, device, b, iters) -> None:
    x = torch.randn(b, cfg.hidden, device=device).bfloat16()
    for _ in range(3):  # compiles
        wide(x)
    # Half a second of calls first: the GPU's and the CPU's clocks up before any timing,
    # so the first table timed is not the one that pays for the ramp.
    start = time.perf_counter()
    while time.perf_counter() - start < 0.5:
        wide(x)
    torch.cuda.synchronize()
    eager = _timed(lambda: wide(x), iters)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        wide(x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        wide(x)
    replay = _timed(graph.replay, iters)
    host = _host_only(lambda: wide(x), iters)
    print(f"| {b} | {eager:.1f} | {replay:.1f} | {eager - replay:.1f} | "
          f"{eager / replay:.2f} | {host:.1f} |", flush=True)


def _timed(fn, iters) -> float:
    """Median µs per call over 5 rounds of ``iters`` back-to-back calls (the GPU's time
    or the host's, whichever is longer: calls queue without a sync between them)."""
    rounds = []
    for _ in range(5):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
        rounds.append((time.perf_counter() - start) / iters * 1e6)
    return statistics.median(rounds)


def _profile_host(wide, cfg, device, b, iters, top) -> None:
    x = torch.randn(b, cfg.hidden, device=device).bfloat16()
    torch.cuda.synchronize()
    torch.cuda._sleep(int(4e8))  # the GPU held: only the host's work is profiled
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(iters):
        wide(x)
    profile.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(top)
    print(f"host profile, {iters} calls at b = {b}:")
    print("\n".join(line for line in text.getvalue().splitlines()[4:] if line.strip()))


def _host_only(fn, iters) -> float:
    """Median µs the host takes to issue one call, over 5 rounds of ``iters`` calls
    issued behind a GPU sleep long enough to outlast them (each call's launches only
    queue: the host never waits for the GPU)."""
    rounds = []
    for _ in range(5):
        torch.cuda.synchronize()
        torch.cuda._sleep(int(4e8))  # ~0.2 s at the H100's clock: longer than the issue
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        rounds.append((time.perf_counter() - start) / iters * 1e6)
        torch.cuda.synchronize()
    return statistics.median(rounds)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", action="store_true",
                        help="eager minus CUDA graph on this GPU at production dims")
    parser.add_argument("--batches", type=int, nargs="+")
    parser.add_argument("--calls", type=int, default=2000, help="forwards a stubbed round")
    parser.add_argument("--top", type=int, default=15, help="profile entries to print")
    parser.add_argument("--experts", type=int, default=128, help="E of the --gpu layer")
    parser.add_argument("--iters", type=int, default=50, help="calls a --gpu round")
    parser.add_argument("--profile-host", action="store_true",
                        help="--gpu: also profile the host's issue of the calls at the "
                             "narrowest width (--top entries)")
    parser.add_argument("--tables", nargs="+", metavar="TABLE",
                        help="--gpu: run once for each value of WIDE_MOE_TABLE (auto, none, "
                             "own or a table's path), each a fresh layer over the same "
                             "weights (default: the environment's)")
    args = parser.parse_args(argv)
    if args.gpu:
        gpu(args.batches or [1, 65, 1024], args.experts, args.iters, args.tables,
            args.top if args.profile_host else 0)
    else:
        stubbed(args.batches or [1, 64], args.calls, args.top)


if __name__ == "__main__":
    main()
