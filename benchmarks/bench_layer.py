"""Check, then time, every stage of WideMoE and the whole layer against its peers and the
bandwidth floor, in one run on one GPU (DESIGN.md, benchmarks/NOTES.md).

    python benchmarks/bench_layer.py [--batches 65 128 256 512 1024] [--shapes tp8 tp16 tp1]
                                     [--out DIR] [--no-peers] [--experts-only]

Peers of the experts stage at the TP shapes: ``torch._grouped_mm`` (BF16) and, when
``triton_kernels`` is importable (``PYTHONPATH=.peers``, see benchmarks/peers.py and
NOTES.md), Triton's MXFP4 ``matmul_ogs``. ``--experts-only`` times the experts rows alone
(ours and the peers), skipping the other stages and the whole layer.

Every timing is ``triton.testing.do_bench``'s median (or a CUDA graph's replays, for
the whole layer); the floor of a stage is the bytes it must move over the copy bandwidth
measured in the same run. A stage is timed only after its output was checked against
the stock reference in this run: a fast wrong kernel reports no number.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import math
import os
import pathlib
import sys
import time
import traceback

import torch
import triton

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from wide_moe_triton import LatentMoE, WideMoE, WideMoEConfig, mx, reference  # noqa: E402
from wide_moe_triton.kernels import experts as experts_k  # noqa: E402
from wide_moe_triton.kernels import finalize as finalize_k  # noqa: E402
from wide_moe_triton.kernels import front as front_k  # noqa: E402
from wide_moe_triton.kernels import mailbox as mailbox_k  # noqa: E402
from wide_moe_triton.kernels import plan as plan_k  # noqa: E402
from wide_moe_triton.kernels import route as route_k  # noqa: E402
from wide_moe_triton.kernels import shared as shared_k  # noqa: E402
from wide_moe_triton.kernels import tail as tail_k  # noqa: E402
from wide_moe_triton.sharding import shard  # noqa: E402

import peers  # noqa: E402  (benchmarks/peers.py: the peers that need outside code)

ROWS: list[dict] = []


@dataclasses.dataclass
class Machine:
    name: str
    copy_bw: float      # bytes/s, read + written
    bf16_flops: float   # FLOP/s of a large BF16 matmul


def header() -> Machine:
    name = torch.cuda.get_device_name()
    clocks = ""
    try:
        import pynvml

        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
        clocks = (f"SM {pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM)} MHz "
                  f"(max {pynvml.nvmlDeviceGetMaxClockInfo(h, pynvml.NVML_CLOCK_SM)}), "
                  f"memory {pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_MEM)} MHz")
    except Exception as err:  # clocks are informative only
        clocks = f"clocks unavailable ({type(err).__name__})"
    a = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    copy_ms = triton.testing.do_bench(lambda: b.copy_(a), return_mode="median")
    copy_bw = 2 * a.numel() / (copy_ms * 1e-3)
    del a, b
    m = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    mm_ms = triton.testing.do_bench(lambda: m @ m, return_mode="median")
    flops = 2 * 8192 ** 3 / (mm_ms * 1e-3)
    del m
    print(f"# {name}; {clocks}; torch {torch.__version__}, triton {triton.__version__}")
    print(f"# copy bandwidth {copy_bw / 1e12:.2f} TB/s (2 GiB device copy, read + write); "
          f"bf16 matmul {flops / 1e12:.0f} TFLOP/s (8192^3, random)")
    return Machine(name, copy_bw, flops)


def bench(fn) -> float:
    """Median seconds of one ``fn`` call, replayed from a CUDA graph of many calls, so that
    host launch overhead (tens of µs a Triton launch) stays out of device time."""
    return triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median") * 1e-3


def bench_eager(fn) -> float:
    """Median seconds of ``fn`` launched from Python (do_bench, L2 flushed between runs)."""
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e-3


def bench_once(fn) -> float:
    """Seconds of one ``fn`` call after one warm-up (for the stock path, whose calls take
    up to seconds: do_bench's repetitions would cost minutes of device time)."""
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e-3


def record(shape, b, stage, impl, seconds, nbytes, machine, flops=0.0, check=""):
    floor = max(nbytes / machine.copy_bw, flops / machine.bf16_flops)
    ROWS.append(dict(shape=shape, b=b, stage=stage, impl=impl, us=seconds * 1e6,
                     floor_us=floor * 1e6, bw_TBps=nbytes / seconds / 1e12,
                     of_copy_bw=nbytes / seconds / machine.copy_bw, check=check))


def rel_err(out, ref) -> float:
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def routed_ids(cfg, b, gen, device):
    """Logits and bias of b random tokens with a balanced load, as a trained router's
    correction bias makes it: unit logits, a bias too small to favour any expert."""
    logits = torch.randn(b, cfg.num_experts, generator=gen, device=device)
    bias = torch.randn(cfg.num_experts, generator=gen, device=device) * 1e-3
    return logits, bias


# ------------------------------------------------------------------------- rank stages

def stage_rank(stock, cfg_t, rank, batches, machine, label, with_peers=True,
               experts_only=False):
    """Stages of rank ``rank`` of T = cfg_t.tp at production dims, on this one GPU (with
    ``experts_only``, the experts rows alone: the other stages still run, untimed, to
    feed it)."""
    dev = torch.device("cuda")
    w = shard(stock, rank, cfg_t.tp)
    E, K, L, I = cfg_t.num_experts, cfg_t.top_k, cfg_t.latent, cfg_t.intermediate_per_rank
    packed = front_k.pack_front(w.gate_weight, w.latent_down, 0, 1)
    # Rotate 16 copies of the 8 MB front weights so that do_bench does not read them
    # from L2, as the real layer (with other layers in between) does not.
    copies = [packed.clone() for _ in range(max(1, (128 << 20) // packed.numel() // 2))]
    prepared = experts_k.prepare_weights(w.w13, w.w13_scales, w.w2, w.w2_scales)
    gen = torch.Generator(device=dev).manual_seed(1234)
    lists = route_k.RoutingLists.empty(E, cfg_t.wide_rows, dev)
    grouped_w = None
    ogs = None  # the matmul_ogs peer, its weights converted once; False where it cannot run
    for b in batches:
        x = torch.randn(b, cfg_t.hidden, generator=gen, device=dev).bfloat16()
        # front GEMM vs torch.mm with FP32 out
        out = front_k.front_gemm(x, packed)
        err = rel_err(out, x.double() @ packed.double().t())
        ok = err < 1e-5
        nb = packed.numel() * 2 + x.numel() * 2 + out.numel() * 4
        it = iter(range(1 << 60))
        if ok and not experts_only:
            record(label, b, "front", "triton", bench(
                lambda: front_k.front_gemm(x, copies[next(it) % len(copies)], out=out)),
                nb, machine, check=f"{err:.1e}")
        if not experts_only:
            record(label, b, "front", "torch.mm", bench(
                lambda: torch.mm(x, copies[next(it) % len(copies)].t(), out_dtype=torch.float32)),
                nb, machine)
            dense_linears(label, b, w, cfg_t, x, gen, machine, with_peers)
        # route + claims (plain logits) and plan (plain latent): one launch, as the layer
        # runs them (route_and_plan; the layer's polled variant reads the same rows out of
        # the mailbox), and the two stages' own launches for comparison
        logits, bias = routed_ids(cfg_t, b, gen, dev)
        latent = torch.randn(b, L, generator=gen, device=dev).bfloat16()
        ids, weights, q, qs = route_k.route_and_plan(
            logits, latent, bias, K, True, cfg_t.routed_scaling_factor, lists=lists)
        rid, rw = reference.route(logits, bias, K, True, cfg_t.routed_scaling_factor)
        ok = torch.equal(ids, rid) and torch.equal(weights, rw)
        rq, rqs = mx.quantize_mxfp8(latent)
        ok_plan = torch.equal(q, rq) and torch.equal(qs, rqs)
        alone = route_k.route(logits, bias, K, True, cfg_t.routed_scaling_factor)
        ok_alone = torch.equal(alone[0], rid) and torch.equal(alone[1], rw)
        nb_route = logits.numel() * 4 + ids.numel() * 6 + b * K * 4
        nb_plan = latent.numel() * 2 + q.numel() + qs.numel()
        if ok and ok_plan and ok_alone and not experts_only:
            record(label, b, "route+claims+plan", "triton", bench(
                lambda: route_k.route_and_plan(logits, latent, bias, K, True, 1.0, lists=lists,
                                               ids=ids, weights=weights, out=(q, qs))),
                nb_route + nb_plan, machine, check="bitwise")

            def two_launches():
                route_k.route(logits, bias, K, True, 1.0, lists=lists, ids=ids, weights=weights)
                plan_k.quantize_mxfp8(latent, out=(q, qs))
            record(label, b, "route+claims+plan", "triton, 2 launches", bench(two_launches),
                   nb_route + nb_plan, machine, check="bitwise")
            record(label, b, "route+claims", "triton", bench(
                lambda: route_k.route(logits, bias, K, True, 1.0, lists=lists, ids=ids,
                                      weights=weights)), nb_route, machine, check="bitwise")
        elif not (ok and ok_plan and ok_alone):
            print(f"!! {label} b={b}: route ok={ok} plan ok={ok_plan} route alone ok={ok_alone}:"
                  " not timed")
        # experts over the lists just claimed (generation 0 parity)
        lists.generation.zero_()
        lists.counts.zero_()
        route_k.route(logits, bias, K, True, 1.0, lists=lists)
        work = experts_k.make_workspace(b, K, L, I, dev)
        rows = experts_k.experts(q, qs, prepared, lists.counts, lists.pairs, lists.generation,
                                 K, cfg_t.beta, cfg_t.linear_beta, workspace=work)
        check_b = min(b, 65)
        sub = ids[:check_b]
        ref_rows = reference.expert_rows(q[:check_b], qs[:check_b], sub, w.w13, w.w13_scales,
                                         w.w2, w.w2_scales, cfg_t.beta, cfg_t.linear_beta)
        err = rel_err(rows[:check_b * K], ref_rows)
        touched = torch.unique(ids).numel()
        expert_bytes = touched * (w.w13[0].numel() + w.w13_scales[0].numel() + w.w2[0].numel()
                                  + w.w2_scales[0].numel())
        nb = expert_bytes + q.numel() + qs.numel() + rows.numel() * 2
        flops = 2 * b * K * (L * 2 * I + I * L)
        if err < 1e-2:
            record(label, b, "experts", "triton", bench(
                lambda: experts_k.experts(q, qs, prepared, lists.counts, lists.pairs,
                                          lists.generation, K, cfg_t.beta, cfg_t.linear_beta,
                                          rows=rows, workspace=work)), nb, machine, flops,
                f"{err:.1e}")
        else:
            print(f"!! {label} b={b}: experts rel err {err:.2e}: not timed")
        if with_peers and hasattr(torch, "_grouped_mm"):
            if grouped_w is None:
                grouped_w = bf16_experts(w)
            t = grouped_peer(grouped_w, latent, ids, cfg_t)
            if t is not None:
                record(label, b, "experts", "torch._grouped_mm bf16", t,
                       touched * (2 * I * L + I * L) * 2 + latent.numel() * 2 + rows.numel() * 2,
                       machine, flops)
        if with_peers and ogs is None:
            ogs = matmul_ogs_peer(w) or False
        if with_peers and ogs:
            # Its own bytes: the same MXFP4 weights, BF16 latent in, the combined [b, L] out.
            matmul_ogs_rows(ogs, w, latent, ids, weights, check_b, label, b, machine, flops,
                            expert_bytes + latent.numel() * 2 * 2)
        if experts_only:
            print_rows(label, b)
            continue
        # finalize
        fin = finalize_k.finalize(rows, weights)
        ok = torch.equal(fin, reference.finalize(rows, weights))
        nb = rows.numel() * 2 + weights.numel() * 2 + fin.numel() * 2
        if ok:
            record(label, b, "finalize", "triton",
                   bench(lambda: finalize_k.finalize(rows, weights, out=fin)), nb, machine,
                   check="bitwise")
        else:
            print(f"!! {label} b={b}: finalize not bitwise: not timed")
        print_rows(label, b)


def dense_linears(label, b, w, cfg_t, x, gen, machine, peers=True):
    """The shared expert and the tail's up-projection on the front GEMM (batch invariant)
    beside the stock path's cuBLAS linears (``reference.shared_expert``, ``addmm_``).
    Their weights are not rotated as the front's are: both sides may find part of them
    in L2, so the ratio is fair and the absolute times optimistic."""
    dev = x.device
    H, L, S, Hr = cfg_t.hidden, cfg_t.latent, cfg_t.shared_per_rank, cfg_t.hidden_per_rank
    pairs = shared_k.interleave_gate_up(w.shared_gate_up)
    hidden = torch.empty(b, S, dtype=torch.bfloat16, device=dev)
    out = torch.empty(b, H, dtype=torch.bfloat16, device=dev)

    def ours():
        return shared_k.shared_expert(x, pairs, w.shared_down, cfg_t.beta, cfg_t.linear_beta,
                                      hidden=hidden, out=out)

    def stock():
        return reference.shared_expert(x, w.shared_gate_up, w.shared_down, cfg_t.beta,
                                       cfg_t.linear_beta)
    err = rel_err(ours(), stock())
    nb = (pairs.numel() + w.shared_down.numel() + x.numel() + out.numel()) * 2
    flops = 2 * b * 3 * S * H
    if err < 1e-2:
        record(label, b, "shared expert", "triton", bench(ours), nb, machine, flops,
               f"{err:.1e}")
    else:
        print(f"!! {label} b={b}: shared expert rel err {err:.2e}: not timed")
    if peers:
        record(label, b, "shared expert", "F.linear (cuBLAS)", bench(stock), nb, machine, flops)
    normed = torch.randn(b, L, generator=gen, device=dev).bfloat16()
    partial = torch.randn(b, H, generator=gen, device=dev).bfloat16()
    cols = partial[:, :Hr]
    ref = (cols.float() + reference.mm_f32(normed, w.latent_up)).bfloat16()
    # Each timed call adds into the same columns again: the values drift, the work does not.
    err = rel_err(tail_k.add_up_projection(normed, w.latent_up, cols.clone()), ref)
    nb = (w.latent_up.numel() + normed.numel() + 2 * cols.numel()) * 2
    flops = 2 * b * Hr * L
    if err < 1e-2:
        record(label, b, "tail up", "triton",
               bench(lambda: tail_k.add_up_projection(normed, w.latent_up, cols)), nb, machine,
               flops, f"{err:.1e}")
    else:
        print(f"!! {label} b={b}: tail up-projection rel err {err:.2e}: not timed")
    if peers:
        record(label, b, "tail up", "addmm_ (cuBLAS)",
               bench(lambda: cols.addmm_(normed, w.latent_up.t())), nb, machine, flops)


def bf16_experts(w):
    """Every expert of the shard dequantized to BF16, [E, L, 2I] and [E, I, L] (the
    layouts torch._grouped_mm takes as its second operand)."""
    E = w.w13.shape[0]
    w13 = torch.empty(E, w.w13.shape[2] * 2, w.w13.shape[1], dtype=torch.bfloat16, device="cuda")
    w2 = torch.empty(E, w.w2.shape[2] * 2, w.w2.shape[1], dtype=torch.bfloat16, device="cuda")
    for e in range(0, E, 64):
        sl = slice(e, e + 64)
        w13[sl] = mx.dequantize_mxfp4(w.w13[sl], w.w13_scales[sl]).transpose(1, 2).bfloat16()
        w2[sl] = mx.dequantize_mxfp4(w.w2[sl], w.w2_scales[sl]).transpose(1, 2).bfloat16()
    return w13, w2


def grouped_peer(weights, latent, ids, cfg_t):
    """Seconds of the BF16 grouped-GEMM peer (sort pairs by expert, two grouped GEMMs,
    SiTU between) over the same routing; None where it cannot run."""
    w13, w2 = weights
    K, I = cfg_t.top_k, cfg_t.intermediate_per_rank
    flat = ids.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=cfg_t.num_experts)
    offs = torch.cumsum(counts, 0).to(torch.int32)
    a = latent[order // K]
    try:
        def run():
            gu = torch._grouped_mm(a, w13, offs=offs)
            h = reference.situ(gu[:, :I], gu[:, I:], cfg_t.beta, cfg_t.linear_beta).bfloat16()
            return torch._grouped_mm(h, w2, offs=offs)
        run()
        return bench(run)
    except Exception as err:
        print(f"   torch._grouped_mm could not run: {type(err).__name__}: {str(err)[:120]}")
        return None


def matmul_ogs_peer(w):
    """triton_kernels' matmul_ogs over shard ``w`` (weights converted once, vLLM's Hopper
    layout on an H200), or None where it cannot run (the reason printed)."""
    try:
        return peers.MatmulOgsExperts(w.w13, w.w13_scales, w.w2, w.w2_scales)
    except peers.PeerUnavailable as err:
        print(f"   {peers.MATMUL_OGS}: not run: {err}")
    except Exception as err:  # a peer's failure must not stop our own rows
        print(f"   {peers.MATMUL_OGS}: weight conversion failed: {type(err).__name__}: "
              f"{str(err)[:300]}")
    return None


def matmul_ogs_rows(ogs, w, latent, ids, weights, check_b, label, b, machine, flops, nbytes):
    """Checks the matmul_ogs peer on the first ``check_b`` tokens against float64 math
    (peers.Check), then records it twice: as a user runs it per forward (routing from ids
    and weights + up GEMM with fused SwiGLU + down GEMM with the gammas and the top-K
    combine) and with its routing built beforehand (the GEMMs and the combine alone)."""
    try:
        chk = peers.check_matmul_ogs(ogs, latent, ids, weights, w.w13, w.w13_scales, w.w2,
                                     w.w2_scales, check_b)
    except Exception as err:  # a peer's failure must not stop our own rows
        print(f"   {peers.MATMUL_OGS} could not run: {type(err).__name__}: {str(err)[:300]}")
        return
    if not chk.ok:
        print(f"!! {label} b={b}: {peers.MATMUL_OGS} wrong ({chk}): not timed")
        return
    routing = ogs.route(ids, weights)
    record(label, b, "experts", "matmul_ogs routing+swiglu+combine",
           bench(lambda: ogs(latent, ids, weights)), nbytes, machine, flops, str(chk))
    record(label, b, "experts", "matmul_ogs swiglu+combine",
           bench(lambda: ogs.gemms(latent, routing)), nbytes, machine, flops, str(chk))


# -------------------------------------------------------------------------- whole layer

def capture_graph(module, static, warmups=3):
    """(CUDA graph of one ``module(static)`` call, its output tensor), after warm-up calls
    on a side stream (compiles, workspace allocations) as capture requires."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmups):
            module(static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = module(static)
    return graph, out


def whole_layer(stock, batches, machine, label="tp1"):
    """WideMoE vs LatentMoE at T = 1 on this GPU: checked, then timed (eager and graph)."""
    wide = WideMoE.from_module(stock)
    cfg = stock.cfg
    gen = torch.Generator(device="cuda").manual_seed(99)
    per_expert = (stock.w13[0].numel() + stock.w13_scales[0].numel() + stock.w2[0].numel()
                  + stock.w2_scales[0].numel())
    for b in batches:
        xs = [torch.randn(b, cfg.hidden, generator=gen, device="cuda").bfloat16() for _ in range(4)]
        ref = stock(xs[0])
        out = wide(xs[0])
        err = rel_err(out, ref)
        same = (out == ref).float().mean().item()
        print(f"   {label} b={b}: WideMoE vs LatentMoE rel err {err:.2e}, {same:.1%} bitwise")
        if not err < 1e-2:
            print(f"!! {label} b={b}: whole layer wrong: not timed")
            continue
        logits = reference.mm_f32(xs[0], stock.gate_weight)
        ids, _ = reference.route(logits, stock.e_score_correction_bias, cfg.top_k, True, 1.0)
        touched = torch.unique(ids).numel()
        dense = (stock.gate_weight.numel() + stock.latent_down.numel() + stock.latent_up.numel()
                 + stock.shared_gate_up.numel() + stock.shared_down.numel()) * 2
        nb = touched * per_expert + dense + 2 * b * cfg.hidden * 2
        it = iter(range(1 << 60))
        record(label, b, "layer", "WideMoE eager", bench_eager(lambda: wide(xs[next(it) % 4])), nb,
               machine, check=f"{err:.1e}")
        try:
            static = xs[0].clone()
            graph, y = capture_graph(wide, static)
            graph.replay()
            torch.cuda.synchronize()
            same_graph = torch.equal(y, wide(static))
            record(label, b, "layer", "WideMoE graph", bench_eager(graph.replay), nb, machine,
                   check="= eager" if same_graph else "!= eager")
        except Exception as err2:
            print(f"   graph capture failed: {type(err2).__name__}: {str(err2)[:200]}")
        record(label, b, "layer", "LatentMoE (stock)", bench_once(lambda: stock(xs[1])), nb,
               machine)
        print_rows(label, b)


# ------------------------------------------------------------------------------ output

def print_rows(shape, b):
    for r in ROWS:
        if r["shape"] == shape and r["b"] == b:
            print(f"   {r['shape']:>5} {r['b']:>5} {r['stage']:<18} {r['impl']:<34} "
                  f"{r['us']:>9.1f} us  floor {r['floor_us']:>8.1f} us  "
                  f"{r['of_copy_bw']:>6.1%} of copy BW  {r['check']}", flush=True)


def write_outputs(out_dir: pathlib.Path, machine: Machine):
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / "results.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(ROWS[0]))
        writer.writeheader()
        writer.writerows(ROWS)
    lines = [f"GPU: {machine.name}; copy {machine.copy_bw / 1e12:.2f} TB/s; bf16 "
             f"{machine.bf16_flops / 1e12:.0f} TFLOP/s; torch {torch.__version__}; "
             f"triton {triton.__version__}", "",
             "| shape | b | stage | impl | µs | floor µs | floor/time | check |",
             "|---|---|---|---|---|---|---|---|"]
    for r in ROWS:
        lines.append(f"| {r['shape']} | {r['b']} | {r['stage']} | {r['impl']} | {r['us']:.1f} "
                     f"| {r['floor_us']:.1f} | {r['floor_us'] / r['us']:.0%} | {r['check']} |")
    (out_dir / "results.md").write_text("\n".join(lines) + "\n")
    try:
        plot(out_dir / "layer.png")
    except ImportError:
        print("(matplotlib absent: no plot)")


def plot(path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stages = sorted({(r["shape"], r["stage"]) for r in ROWS})
    fig, axes = plt.subplots(1, len(stages), figsize=(4 * len(stages), 3.5), squeeze=False)
    for ax, (shape, stage) in zip(axes[0], stages):
        sel = [r for r in ROWS if r["shape"] == shape and r["stage"] == stage]
        for impl in sorted({r["impl"] for r in sel}):
            pts = sorted((r["b"], r["us"]) for r in sel if r["impl"] == impl)
            ax.plot(*zip(*pts), marker="o", label=impl)
        # The floor of the stage itself: the fewest bytes any implementation must move.
        floor = {}
        for r in sel:
            floor[r["b"]] = min(floor.get(r["b"], float("inf")), r["floor_us"])
        ax.plot(*zip(*sorted(floor.items())), "k--", label="floor")
        ax.set_title(f"{shape} {stage}")
        ax.set_xlabel("batch rows")
        ax.set_ylabel("µs")
        ax.set_xscale("log", base=2)
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def summary():
    print("\n| shape | b | stage | impl | µs | floor/time | check |")
    print("|---|---|---|---|---|---|---|")
    for r in ROWS:
        print(f"| {r['shape']} | {r['b']} | {r['stage']} | {r['impl']} | {r['us']:.1f} | "
              f"{r['floor_us'] / r['us']:.0%} | {r['check']} |")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--batches", type=int, nargs="+", default=[65, 128, 256, 512, 1024])
    p.add_argument("--shapes", nargs="+", default=["tp8", "tp16", "tp1"])
    p.add_argument("--layer-batches", type=int, nargs="+", default=[1, 65, 257, 1024])
    p.add_argument("--no-peers", action="store_true")
    p.add_argument("--experts-only", action="store_true",
                   help="time only the experts rows (ours and the peers); no whole layer")
    p.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    args = p.parse_args(argv)
    machine = header()
    if not args.no_peers:
        for name, status in peers.availability().items():
            print(f"# peer {name}: {status}")
    t0 = time.time()
    stock = LatentMoE(WideMoEConfig.kimi_k3(tp=1), seed=0, device="cuda")
    print(f"# stock layer built in {time.time() - t0:.0f} s")
    for label in args.shapes:
        tp = int(label[2:])
        try:
            if tp == 1 and not args.experts_only:
                whole_layer(stock, args.layer_batches, machine)
            stage_rank(stock, WideMoEConfig.kimi_k3(tp=tp), 0, args.batches, machine, label,
                       with_peers=not args.no_peers and tp > 1,
                       experts_only=args.experts_only)
        except Exception:
            traceback.print_exc()
        torch.cuda.empty_cache()
    if ROWS:
        write_outputs(pathlib.Path(args.out), machine)
        summary()


if __name__ == "__main__":
    main()
