"""Ranks as processes on ONE GPU: T = 2, 4 and 8 processes, each rank's mailbox in
symmetric memory on a shared device (TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1), joined
over gloo, the kernels publishing into and polling one another's memory. The checks,
each a line PASS or FAIL in the log (``--out``):

    bits        every rank's output = SimulatedGroup's bit for bit, at every --widths
                (1, 65, 257 = wide_rows + 1 by default: a call in two chunks)
    invariance  rows alone = the same rows inside --b (65), on every rank
    replays     --replays CUDA-graph replays (a graph captured on every rank) = the
                eager call, on every rank
    late        a peer late by half the poll bound: exact (--b rows, as below)
    skip        a rank that skips a call: every other rank's check_mailbox() names it
    rearm       then rearm() on every rank: the next call exact
    kill        a peer SIGKILLed mid-call: every survivor's call raises naming it within
                the bound, no rank hangs, and the survivors' GPU memory comes back once
                the group is destroyed (theirs: allocated back to its level before the
                build; the device's: free memory back once the ranks have exited)

    python benchmarks/procs_gpu.py --out procs.log            # one GPU, ~6 minutes
    python benchmarks/procs_gpu.py --dry-run --out procs.log  # CPU: gloo, shared memory,
                                                              # the interpreter, T = 2

Configs: "small" (hidden = latent = 256, 16 experts, I = S = 256: admits T = 8) and
"kimi" (Kimi-K3's dims with --experts routed experts). SimulatedGroup's bits come from
this process on the same GPU before the ranks start (the ranks then find every kernel
compiled in Triton's cache). Exit 0 when every check passed; 1 when one failed; 2 when
--budget ran out before every check ran (those are logged SKIPPED).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import signal
import sys
import tempfile
import time

GPU_ENV = {"TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES": "1", "OMP_NUM_THREADS": "1"}
DRY = "--dry-run" in sys.argv[1:]
# Before torch and triton are imported, here and in every rank this process spawns
# (a spawned rank runs this module's top again, and inherits the environment).
if DRY:  # CPU ranks, the interpreter
    os.environ["TRITON_INTERPRET"] = "1"
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
else:    # every rank's symmetric memory on the one GPU
    os.environ.update(GPU_ENV)

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [os.path.join(ROOT, "tests"), ROOT]  # tests/ranks.py; spawned ranks too

import torch  # noqa: E402

from ranks import Died, Ranks, from_numpy, make_x  # noqa: E402
from wide_moe_triton import SimulatedGroup, WideMoEConfig, reference  # noqa: E402

SLACK_S = 15.0      # past the bound: the call's launches, the sync, a loaded host
BUILD_TIMEOUT_S = 600.0


def small(wide_rows: int) -> WideMoEConfig:
    return WideMoEConfig(hidden=256, latent=256, num_experts=16, top_k=4,
                         expert_intermediate=256, shared_intermediate=256,
                         routed_scaling_factor=2.5, wide_rows=wide_rows)


def kimi(wide_rows: int, experts: int) -> WideMoEConfig:
    return WideMoEConfig.kimi_k3(wide_rows=wide_rows).replace(num_experts=experts)


class Log:
    """The log: every line to stdout and ``path`` as it comes; counts of each verdict."""

    def __init__(self, path: str):
        self.path, self.counts = path, {"PASS": 0, "FAIL": 0, "SKIPPED": 0}
        open(path, "w").close()

    def line(self, text: str) -> None:
        print(text, flush=True)
        with open(self.path, "a") as f:
            f.write(text + "\n")

    def check(self, where: str, name: str, ok: bool, detail: str) -> None:
        verdict = "PASS" if ok else "FAIL"
        self.counts[verdict] += 1
        self.line(f"{where} {name}: {verdict} ({detail})")

    def skipped(self, where: str, why: str) -> None:
        self.counts["SKIPPED"] += 1
        self.line(f"{where}: SKIPPED ({why})")


def simulated_bits(cfg, seed, device, cases) -> dict:
    """{(b, x seed): every rank's output bits (int16, CPU)} of SimulatedGroup over the T
    ranks' own shards (``reference.random_shard``, drawn on ``device`` as the ranks
    draw theirs); its GPU memory handed back after."""
    shards = [reference.random_shard(cfg, seed, r, cfg.tp, device=device)
              for r in range(cfg.tp)]
    group = SimulatedGroup(shards)
    out = {}
    for b, s in cases:
        x = make_x(b, s, cfg.hidden).to(device)
        out[b, s] = [o.view(torch.int16).cpu() for o in group(x)]
    del group, shards
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    return out


def failures(replies) -> list[str]:
    return [f"rank {r}: {str(v).splitlines()[0]}" for r, v in enumerate(replies)
            if isinstance(v, (Exception, Died))]


def named(reply, victim: int) -> bool:
    """Whether a failed call's error is the mailbox's, naming ``victim``."""
    text = str(reply)
    if "mailbox poll timed out" not in text:
        return False
    listed = text.split("in the columns of rank(s) [", 1)[1].split("]", 1)[0]
    return str(victim) in [r.strip() for r in listed.split(",")]


def seconds_of(reply) -> float:
    """The failed call's seconds, as ``ranks.job_forward`` appends them."""
    return float(str(reply).split("[after ")[1].split(" s]")[0])


def check_bits(log, where, ranks, expected, widths, seed) -> None:
    for b in widths:
        replies = ranks.call("forward", b=b, seed=seed)
        bad = failures(replies)
        if not bad:
            bad = [f"rank {r}" for r, (out, _) in enumerate(replies)
                   if not torch.equal(from_numpy(out).view(torch.int16), expected[b, seed][r])]
        log.check(where, f"bits b={b}", not bad,
                  "= SimulatedGroup on every rank" if not bad else "differ: " + "; ".join(bad))


def check_invariance(log, where, ranks, seed, b) -> None:
    rows = (0, b // 2, b - 1)
    wide = ranks.call("forward", b=b, seed=seed)
    bad = failures(wide)
    for row in rows:
        if bad:
            break
        alone = ranks.call("forward", b=b, seed=seed, rows=slice(row, row + 1))
        bad = failures(alone) or [
            f"rank {r} row {row}" for r in range(ranks.world)
            if not ((wide[r][0][row] == alone[r][0][0]).all() and
                    (wide[r][0] == wide[0][0]).all())]
    log.check(where, "invariance", not bad, f"rows {list(rows)} alone = inside {b}, every "
              "rank alike" if not bad else "; ".join(bad))


def check_replays(log, where, ranks, seed, b, replays) -> None:
    replies = ranks.call("replays", b=b, seed=seed, replays=replays)
    bad = failures(replies) or [f"rank {r}: {d} of {n} differ" for r, (d, n) in
                                enumerate(replies) if d]
    what = "graph replays" if torch.cuda.is_available() else "eager calls (dry run)"
    log.check(where, "replays", not bad, f"{replays} {what} = eager on every rank"
              if not bad else "; ".join(bad))


def check_late(log, where, ranks, expected, seed, b, bound) -> None:
    late = ranks.world - 1
    replies = ranks.call("forward", b=b, seed=seed,
                         **{f"rank{late}": dict(b=b, seed=seed, delay=bound / 2)})
    bad = failures(replies) or [f"rank {r}" for r, (out, _) in enumerate(replies)
                                if not torch.equal(from_numpy(out).view(torch.int16),
                                                   expected[b, seed][r])]
    log.check(where, "late", not bad, f"rank {late} late by {bound / 2:g} s: exact"
              if not bad else "; ".join(bad))


def check_skip_and_rearm(log, where, ranks, expected, seed, b, bound) -> None:
    skipper = 1
    others = [r for r in range(ranks.world) if r != skipper]
    replies = ranks.call("forward", ranks=others, b=b, seed=seed)
    bad = [f"rank {r}: {str(v).splitlines()[0][:160]}" for r, v in zip(others, replies)
           if not (isinstance(v, Exception) and named(v, skipper)
                   and seconds_of(v) < bound + SLACK_S)]
    log.check(where, "skip", not bad, f"rank {skipper} skipped a call: ranks {others} "
              f"named it within {bound:g} + {SLACK_S:g} s" if not bad else "; ".join(bad))
    rearm = ranks.call("rearm")
    replies = ranks.call("forward", b=b, seed=seed)
    bad = failures(rearm) or failures(replies) or [
        f"rank {r}" for r, (out, _) in enumerate(replies)
        if not torch.equal(from_numpy(out).view(torch.int16), expected[b, seed][r])]
    log.check(where, "rearm", not bad, "rearm() on every rank, then the next call exact"
              if not bad else "; ".join(bad))


def check_kill(log, where, ranks, seed, b, bound, before) -> None:
    """SIGKILL the last rank as its call reaches the tail (its front published): every
    survivor names it; then their memory. Ends the group."""
    victim = ranks.world - 1
    survivors = list(range(victim))
    ranks.call("kill_at", ranks=[victim], stage="publish_latent")
    replies = ranks.call("forward", b=b, seed=seed)
    bad = [f"rank {r}: {str(v).splitlines()[0][:160]}" for r, v in zip(survivors, replies)
           if not (isinstance(v, Exception) and named(v, victim)
                   and seconds_of(v) < bound + SLACK_S)]
    if not isinstance(replies[victim], Died):
        bad.append(f"rank {victim} was not killed: {replies[victim]}")
    log.check(where, "kill", not bad, f"rank {victim} SIGKILLed mid-call: ranks "
              f"{survivors} named it within {bound:g} + {SLACK_S:g} s, none hung"
              if not bad else "; ".join(bad))
    released = ranks.call("release", ranks=survivors)
    if not torch.cuda.is_available():
        log.check(where, "kill memory", not failures(released),
                  "survivors released the layer and the group (GPU memory: GPU only)")
        return
    bad = failures(released) or [f"rank {r}: {a} bytes allocated, {before[r]} before "
                                 "the build" for r, a in zip(survivors, released)
                                 if a > before[r]]
    log.check(where, "kill memory", not bad, "every survivor's allocated GPU memory back "
              "to its level before the build" if not bad else "; ".join(bad))


def run_world(log, args, name, cfg, device) -> None:
    """Every check at T = cfg.tp, one group of processes."""
    where = f"{name} T={cfg.tp}"
    seeds = dict(bits=1, invariance=2, replays=3, late=4, rearm=5, kill=6)
    b = args.b
    cases = [(w, seeds["bits"]) for w in args.widths] + [(b, seeds["late"]), (b, seeds["rearm"])]
    start = time.monotonic()
    expected = simulated_bits(cfg, args.seed, device, cases)
    free_before = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else 0
    log.line(f"{where}: SimulatedGroup's bits in {time.monotonic() - start:.0f} s")
    env = GPU_ENV if device.type == "cuda" else None
    with tempfile.TemporaryDirectory() as tmp, Ranks(cfg.tp, tmp, timeout=BUILD_TIMEOUT_S,
                                                     environment=env) as ranks:
        widths = sorted(set(args.widths) | {b, 1})
        built = ranks.call("build_shard", cfg=cfg, seed=args.seed, device=str(device),
                           poll_timeout=args.poll_timeout, widths=widths)
        bad = failures(built)
        log.check(where, "build", not bad, "every rank built its shard and warmed up "
                  f"widths {widths} in {time.monotonic() - start:.0f} s; peak GiB a rank: "
                  + ", ".join(f"{p / 2 ** 30:.2f}" for _, p in built) if not bad
                  else "; ".join(bad))
        if bad:
            return
        before = [m for m, _ in built]
        ranks.timeout = args.job_timeout
        bound = args.poll_timeout
        try:
            check_bits(log, where, ranks, expected, args.widths, seeds["bits"])
            check_invariance(log, where, ranks, seeds["invariance"], b)
            check_replays(log, where, ranks, seeds["replays"], b, args.replays)
            check_late(log, where, ranks, expected, seeds["late"], b, bound)
            check_skip_and_rearm(log, where, ranks, expected, seeds["rearm"], b, bound)
            check_kill(log, where, ranks, seeds["kill"], b, bound, before)
        except AssertionError as e:  # a rank did not reply in time: the group is gone
            log.check(where, "no rank hangs", False, str(e))
    if device.type == "cuda":
        free_after = torch.cuda.mem_get_info(device)[0]
        log.check(where, "device memory", free_after >= free_before - (256 << 20),
                  f"free {free_after / 2 ** 30:.2f} GiB after the ranks exited, "
                  f"{free_before / 2 ** 30:.2f} before they started")
    log.line(f"{where}: {time.monotonic() - start:.0f} s")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="the log (each check PASS / FAIL)")
    p.add_argument("--worlds", type=int, nargs="+", help="T (default: 2 4 8; dry run: 2)")
    p.add_argument("--configs", nargs="+", choices=("small", "kimi"),
                   help="default: small kimi (dry run: small)")
    p.add_argument("--experts", type=int, default=64,
                   help="routed experts of the kimi config (default: 64)")
    p.add_argument("--wide-rows", type=int, help="default: 256 (dry run: 8)")
    p.add_argument("--widths", type=int, nargs="+",
                   help="the bits' widths (default: 1 65 wide_rows+1; dry run: 1 9)")
    p.add_argument("--b", type=int, help="the rows of the other checks' calls (default: "
                   "65; dry run: 9)")
    p.add_argument("--replays", type=int, help="default: 200 (dry run: 3 eager calls)")
    p.add_argument("--job-timeout", type=float,
                   help="seconds a check's call may take before its rank counts as hung "
                        "(default: 120; dry run: 600)")
    p.add_argument("--poll-timeout", type=float,
                   help="the ranks' poll bound in seconds (default: 4; dry run: 2)")
    p.add_argument("--seed", type=int, default=0, help="the weights' seed (default: 0)")
    p.add_argument("--budget", type=float, default=float("inf"),
                   help="seconds: a (config, T) not started by then is SKIPPED")
    p.add_argument("--dry-run", action="store_true",
                   help="on the CPU: gloo, shared memory, the interpreter, tiny dims")
    return p


def _stop(signum, frame) -> None:
    """On a SIGTERM (a caller's time limit): this process's ranks are killed, so none
    stays behind on the GPU, then exit."""
    for child in multiprocessing.active_children():
        child.kill()
    sys.exit(128 + signum)


def main(argv=None) -> int:
    signal.signal(signal.SIGTERM, _stop)
    args = parser().parse_args(argv)
    wide_rows = args.wide_rows or (8 if DRY else 256)
    args.widths = args.widths or ([1, 9] if DRY else [1, 65, wide_rows + 1])
    args.replays = args.replays or (3 if DRY else 200)
    args.b = args.b or (9 if DRY else 65)
    args.job_timeout = args.job_timeout or (600.0 if DRY else 120.0)
    args.poll_timeout = args.poll_timeout or (2.0 if DRY else 4.0)
    worlds = args.worlds or ([2] if DRY else [2, 4, 8])
    configs = args.configs or (["small"] if DRY else ["small", "kimi"])
    if not DRY and not torch.cuda.is_available():
        print("procs_gpu: no GPU here; --dry-run runs the checks on the CPU", file=sys.stderr)
        return 2
    device = torch.device("cuda", 0) if not DRY else torch.device("cpu")
    log = Log(args.out)
    where = (f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}"
             if not DRY else "CPU dry run (gloo, shared memory, Triton's interpreter)")
    log.line(f"procs_gpu: ranks as processes on one device: {where}; T = {worlds}; "
             f"configs {configs}; poll bound {args.poll_timeout:g} s; "
             f"{time.strftime('%Y-%m-%d %H:%M:%S')}")
    start = time.monotonic()
    # The widest groups first: T = 8 is what a GPU of one's own never exercised.
    for world in sorted(worlds, reverse=True):
        for name in configs:
            cfg = (small(wide_rows) if name == "small"
                   else kimi(wide_rows, args.experts)).replace(tp=world)
            if time.monotonic() - start > args.budget:
                log.skipped(f"{name} T={world}", f"the budget of {args.budget:g} s ran out")
                continue
            run_world(log, args, name, cfg, device)
    c = log.counts
    log.line(f"procs_gpu: {c['PASS']} passed, {c['FAIL']} FAILED, {c['SKIPPED']} skipped, "
             f"{time.monotonic() - start:.0f} s")
    return 1 if c["FAIL"] else 2 if c["SKIPPED"] else 0


if __name__ == "__main__":
    sys.exit(main())
