"""Check, then time, every stage of WideMoE and the whole layer against its peers and the
bandwidth floor, in one run on one GPU (docs/design.md, benchmarks/NOTES.md).

    python benchmarks/bench_layer.py [--batches 65 128 256 512 1024] [--shapes tp8 tp16 tp1]
                                     [--out DIR] [--no-peers] [--experts-only]
                                     [--layer-only] [--stock-batches 1 65 ...]
                                     [--simulated 2] [--rank0] [--dry-run]

``--shapes``: ``tpN`` times rank 0 of T = N at production dims on this one GPU (every
stage, rank-local shapes); ``tp1`` adds the whole layer (WideMoE eager and CUDA graph
beside the stock ``LatentMoE``, at 1 and every ``--batches`` width, ``--layer-batches``
to change them) and a bitwise batch-invariance line (a row alone, inside 65 rows,
inside the widest); ``--layer-only`` leaves tp1's rank stages out. The stock path
loops over experts in Python (up to 2 s a call at b = 1024): it is timed once a width,
after the check call, at ``--stock-batches``.
``--simulated T`` (T > 1) adds T simulated ranks of the whole layer on this one GPU
(``SimulatedGroup``: the tail's all-reduces over the mailbox's tail rows, every rank's
stages one after another on one stream): every rank's output checked for the same bits,
the group's CUDA graph checked against eager and timed (the T ranks' work in series:
not a multi-GPU timing), and batch invariance on every rank.
``--rank0`` times rank 0's whole layer of each ``--shapes`` tpN instead, on this one
GPU, its peers' words pre-filled so its polls never wait (benchmarks/rank0.py), at
b = 65 80 160 192 256 320 640 1024 unless ``--batches`` names others, with uniform and
balanced routing, stage by stage too, beside its per-rank floor and the seed's figures:
``<GPU>-tp8-layer.csv`` and ``.md`` in ``--out``.
``--dry-run`` runs the same code at ``WideMoEConfig.tiny`` dims on the CPU (Triton's
interpreter, one untimed call a row, nominal floors): it checks the script, not the
kernels' speed.

Exit status: 1 where anything failed, after the rows it has are written: a part (a
shape, a simulated group) that raised, and with ``--rank0`` also a width whose rank 0
differs from ``SimulatedGroup``'s or a poll that timed out (benchmarks/rank0.py); 0
otherwise; 124 when stopped by SIGTERM.

Peers of the experts stage at the TP shapes: ``torch._grouped_mm`` (BF16) and, when
``triton_kernels`` is importable (``PYTHONPATH=.peers``, see benchmarks/peers.py and
NOTES.md), Triton's MXFP4 ``matmul_ogs``. ``--experts-only`` times the experts rows alone
(ours and the peers), skipping the other stages and the whole layer.

Every timing is ``triton.testing.do_bench``'s median (or a CUDA graph's replays, for
the whole layer); the floor of a stage is the bytes it must move over the copy bandwidth
measured in the same run, or its FLOPs over the BF16 matmul rate measured in the same run
where that is larger. Weights that fit in L2 (60 MB on an H200) are rotated through
copies worth >= 128 MB, so that a stage reads them from HBM as the real layer (other
layers in between) does. A stage is timed only after its output was checked against
the stock reference in this run: a fast wrong kernel reports no number. The table is
written after each part, and on SIGTERM (``timeout``'s signal) with every row timed so
far. Beside each row, the SM clock and board power NVML reads right after its timing: at
the board's power limit the clock drops, and a timing with it.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import gc
import math
import os
import pathlib
import signal
import sys
import time
import traceback

DRY = "--dry-run" in sys.argv[1:]
if DRY:  # before triton is imported: the kernels run in its interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import triton  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from wide_moe_triton import (LatentMoE, SimulatedGroup, WideMoE, WideMoEConfig, mx,  # noqa: E402
                             reference)
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
import rank0  # noqa: E402  (benchmarks/rank0.py: --rank0)

ROWS: list[dict] = []
NOTES: list[str] = []   # lines for the markdown below the table (invariance, skips)
DEVICE = torch.device("cpu" if DRY else "cuda")
ROTATE_BYTES = 128 << 20   # > 2x the H200's 60 MB L2
OURS = ("triton", "triton, 2 launches", "WideMoE graph", "WideMoE eager", "SimulatedGroup graph")


@dataclasses.dataclass
class Machine:
    name: str
    copy_bw: float      # bytes/s, read + written
    bf16_flops: float   # FLOP/s of a large BF16 matmul
    clocks: str = ""

    def line(self) -> str:
        return (f"GPU: {self.name}; {self.clocks}; copy {self.copy_bw / 1e12:.2f} TB/s; bf16 "
                f"{self.bf16_flops / 1e12:.0f} TFLOP/s; torch {torch.__version__}; "
                f"triton {triton.__version__}")


def header() -> Machine:
    if DRY:
        machine = Machine("dry run (CPU, Triton interpreter)", 4.3e12, 700e12,
                          "no clocks; nominal floors")
        print(f"# {machine.line()}")
        return machine
    name = torch.cuda.get_device_name()
    clocks = ""
    try:
        pynvml, h = nvml()
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
    return Machine(name, copy_bw, flops, clocks)


def dry_time(fn) -> float:
    """One untimed call (dry run): the row exists, its number means nothing."""
    fn()
    return 1e-6


def bench(fn, rep: int = 50) -> float:
    """Median seconds of one ``fn`` call, replayed from a CUDA graph of many calls (about
    ``rep`` ms of them), so that host launch overhead (tens of µs a Triton launch) stays
    out of device time."""
    if DRY:
        return dry_time(fn)
    return triton.testing.do_bench_cudagraph(fn, rep=rep, return_mode="median") * 1e-3


def bench_eager(fn) -> float:
    """Median seconds of ``fn`` launched from Python (do_bench, L2 flushed between runs)."""
    if DRY:
        return dry_time(fn)
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e-3


def bench_once(fn) -> float:
    """Seconds of one ``fn`` call, warmed by the check call just before (for the stock
    path, whose calls take up to seconds: do_bench's repetitions would cost minutes of
    device time)."""
    if DRY:
        return dry_time(fn)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e-3


_NVML: list = []  # [(pynvml, the GPU's handle)] once NVML is open, [the error] if it failed


def nvml():
    """(the pynvml module, this GPU's NVML handle), NVML opened on the first call; where
    that failed, raises its error on every call, without trying again."""
    if not _NVML:
        try:
            import pynvml

            pynvml.nvmlInit()
            _NVML.append((pynvml, pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())))
        except Exception as err:
            _NVML.append(err)
    if isinstance(_NVML[0], Exception):
        raise _NVML[0]
    return _NVML[0]


def power_state() -> str:
    """The GPU's SM clock and board power as NVML reads them now ("" in a dry run or
    without NVML). Read right after a timing, it says whether that timing ran at the
    board's power limit, where the SM clock drops and a timing moves with the GPU's
    recent draw: at TP8, b = 1024 the experts call spread over 785-857 µs within a
    minute there (benchmarks/NOTES.md, "Machine and floors")."""
    if DRY:
        return ""
    try:  # informative only, as the header's clocks: any failure leaves the column empty
        pynvml, h = nvml()
        return (f"{pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM)} MHz, "
                f"{pynvml.nvmlDeviceGetPowerUsage(h) / 1000:.0f} W")
    except Exception:
        return ""


def record(shape, b, stage, impl, seconds, nbytes, machine, flops=0.0, check=""):
    """One row; ``seconds`` is timed before the call, so ``power_state`` reads the GPU
    right after its timing."""
    floor = max(nbytes / machine.copy_bw, flops / machine.bf16_flops)
    ROWS.append(dict(shape=shape, b=b, stage=stage, impl=impl, us=seconds * 1e6,
                     floor_us=floor * 1e6, bw_TBps=nbytes / seconds / 1e12,
                     of_copy_bw=nbytes / seconds / machine.copy_bw, check=check,
                     after=power_state()))


def rotation(*tensors, nbytes=ROTATE_BYTES):
    """Copies of ``tensors`` (tuples, the originals first) worth at least ``nbytes``
    together, for a timed loop to cycle through: weights that fit in L2 are then read
    from HBM, as the real layer (other layers between two calls) reads them."""
    size = sum(t.numel() * t.element_size() for t in tensors)
    n = 1 if DRY else max(1, math.ceil(nbytes / max(1, size)))
    return [tensors] + [tuple(t.clone() for t in tensors) for _ in range(n - 1)]


def cycle(copies):
    """A callable giving the next element of ``copies`` on every call (captured calls
    of a CUDA graph each take the next one)."""
    it = iter(range(1 << 62))
    return lambda: copies[next(it) % len(copies)]


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
    dev = DEVICE
    w = shard(stock, rank, cfg_t.tp)
    E, K, L, I = cfg_t.num_experts, cfg_t.top_k, cfg_t.latent, cfg_t.intermediate_per_rank
    packed = front_k.pack_front(w.gate_weight, w.latent_down, 0, 1)
    # The 8 MB front weights (TP8) rotate through copies: do_bench must not find them
    # in L2, as the real layer (with other layers in between) does not.
    next_packed = cycle(rotation(packed))
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
        flops_front = 2 * b * packed.shape[0] * packed.shape[1]
        if ok and not experts_only:
            record(label, b, "front", "triton", bench(
                lambda: front_k.front_gemm(x, next_packed()[0], out=out)),
                nb, machine, flops_front, check=f"{err:.1e}")
        elif not ok:
            print(f"!! {label} b={b}: front GEMM rel err {err:.2e}: not timed")
        if not experts_only:
            record(label, b, "front", "torch.mm", bench(
                lambda: reference.mm_f32(x, next_packed()[0])), nb, machine, flops_front)
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
        if with_peers and grouped_w is None:
            grouped_w = bf16_experts(w) or False
        if with_peers and grouped_w:
            peer = grouped_peer(grouped_w, latent, ids, cfg_t, check_b)
            if peer is not None:
                record(label, b, "experts", "torch._grouped_mm bf16", peer[0],
                       touched * (2 * I * L + I * L) * 2 + latent.numel() * 2 + rows.numel() * 2,
                       machine, flops, peer[1])
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
    # 33 MB of shared weights at TP8 (16 at TP16) would stay in L2: rotate copies.
    ours_w = cycle(rotation(pairs, w.shared_down))
    stock_w = cycle(rotation(w.shared_gate_up, w.shared_down))

    def ours(weights=None):
        p_, d_ = weights or ours_w()
        return shared_k.shared_expert(x, p_, d_, cfg_t.beta, cfg_t.linear_beta,
                                      hidden=hidden, out=out)

    def stock(weights=None):
        gu, d_ = weights or stock_w()
        return reference.shared_expert(x, gu, d_, cfg_t.beta, cfg_t.linear_beta)
    err = rel_err(ours((pairs, w.shared_down)), stock((w.shared_gate_up, w.shared_down)))
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
    up = cycle(rotation(w.latent_up))
    if err < 1e-2:
        record(label, b, "tail up", "triton",
               bench(lambda: tail_k.add_up_projection(normed, up()[0], cols)), nb, machine,
               flops, f"{err:.1e}")
    else:
        print(f"!! {label} b={b}: tail up-projection rel err {err:.2e}: not timed")
    if peers:
        record(label, b, "tail up", "addmm_ (cuBLAS)",
               bench(lambda: cols.addmm_(normed, up()[0].t())), nb, machine, flops)


def fits(nbytes: int, what: str) -> bool:
    """Whether ``nbytes`` more fit in free device memory with 8 GiB to spare (else says
    so: at TP1 the BF16 copy of all 896 experts is 59 GB)."""
    if DRY:
        return True
    free = torch.cuda.mem_get_info()[0]
    if nbytes + (8 << 30) <= free:
        return True
    line = (f"{what}: not run, needs {nbytes / 2**30:.1f} GiB + 8 GiB spare, "
            f"{free / 2**30:.1f} GiB free")
    print(f"   {line}")
    NOTES.append(line)
    return False


def bf16_experts(w):
    """Every expert of the shard dequantized to BF16, [E, L, 2I] and [E, I, L] (the
    layouts torch._grouped_mm takes as its second operand); None (said why) where they
    do not fit in device memory or torch has no _grouped_mm."""
    if not hasattr(torch, "_grouped_mm"):
        NOTES.append("torch._grouped_mm: absent from this torch")
        return None
    E = w.w13.shape[0]
    nbytes = 2 * E * (w.w13.shape[1] * w.w13.shape[2] + w.w2.shape[1] * w.w2.shape[2]) * 2
    if not fits(nbytes + (8 << 30), "torch._grouped_mm bf16 (every expert as BF16)"):
        return None
    w13 = torch.empty(E, w.w13.shape[2] * 2, w.w13.shape[1], dtype=torch.bfloat16, device=DEVICE)
    w2 = torch.empty(E, w.w2.shape[2] * 2, w.w2.shape[1], dtype=torch.bfloat16, device=DEVICE)
    for e in range(0, E, 64):
        sl = slice(e, e + 64)
        w13[sl] = mx.dequantize_mxfp4(w.w13[sl], w.w13_scales[sl]).transpose(1, 2).bfloat16()
        w2[sl] = mx.dequantize_mxfp4(w.w2[sl], w.w2_scales[sl]).transpose(1, 2).bfloat16()
    return w13, w2


def grouped_reference(weights, latent, ids, cfg_t, check_b):
    """FP32 rows (pair order) of the first ``check_b`` tokens through the BF16 experts:
    the grouped peer's own function (BF16 activations, BF16 hidden), expert by expert."""
    w13, w2 = weights
    K, I = cfg_t.top_k, cfg_t.intermediate_per_rank
    flat = ids[:check_b].reshape(-1).long()
    rows = torch.empty(flat.numel(), w2.shape[2], dtype=torch.float32, device=latent.device)
    for e in flat.unique().tolist():
        pairs = (flat == e).nonzero().flatten()
        gu = latent[pairs // K].float() @ w13[e].float()
        hidden = reference.situ(gu[:, :I], gu[:, I:], cfg_t.beta, cfg_t.linear_beta)
        rows[pairs] = hidden.bfloat16().float() @ w2[e].float()
    return rows


def grouped_peer(weights, latent, ids, cfg_t, check_b):
    """(seconds, check) of the BF16 grouped-GEMM peer (sort pairs by expert, two grouped
    GEMMs, SiTU between) over the same routing, checked first on the first ``check_b``
    tokens against ``grouped_reference``; None where it cannot run or is wrong."""
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
        got = torch.empty_like(run())
        got[order] = run()  # back to pair order (t * K + k)
        err = rel_err(got[:check_b * K], grouped_reference(weights, latent, ids, cfg_t,
                                                           check_b))
        if not err < 2e-2:
            print(f"!! torch._grouped_mm rel err {err:.2e}: not timed")
            return None
        return bench(run), f"{err:.1e}"
    except Exception as err:
        print(f"   torch._grouped_mm could not run: {type(err).__name__}: {str(err)[:120]}")
        return None


def matmul_ogs_peer(w):
    """triton_kernels' matmul_ogs over shard ``w`` (weights converted once, vLLM's Hopper
    layout on an H200), or None where it cannot run (the reason printed)."""
    nbytes = sum(t.numel() for t in (w.w13, w.w13_scales, w.w2, w.w2_scales))
    if not fits(2 * nbytes, peers.MATMUL_OGS):
        return None
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

def capture_graph(fn, *args, warmups=3):
    """(CUDA graph of one ``fn(*args)`` call, its output), after warm-up calls on a side
    stream (compiles, workspace allocations) as capture requires."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmups):
            fn(*args)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(*args)
    return graph, out


def whole_layer(stock, batches, machine, label="tp1", stock_batches=None):
    """WideMoE vs LatentMoE at T = 1 on this GPU: checked, then timed (eager and graph;
    the stock path at ``stock_batches`` only, all if None), then batch invariance."""
    wide = WideMoE.from_module(stock)
    cfg = stock.cfg
    gen = torch.Generator(device=DEVICE).manual_seed(99)
    for b in batches:
        xs = [torch.randn(b, cfg.hidden, generator=gen, device=DEVICE).bfloat16()
              for _ in range(4)]
        ref = stock(xs[0])
        out = wide(xs[0])
        err = rel_err(out, ref)
        same = (out == ref).float().mean().item()
        print(f"   {label} b={b}: WideMoE vs LatentMoE rel err {err:.2e}, {same:.1%} bitwise")
        if not err < 1e-2:
            print(f"!! {label} b={b}: whole layer wrong: not timed")
            continue
        nb, flops = layer_traffic(stock, xs[0])
        nxt = cycle(xs)
        record(label, b, "layer", "WideMoE eager", bench_eager(lambda: wide(nxt())), nb,
               machine, flops, check=f"{err:.1e}")
        if DEVICE.type == "cuda":
            graph_row(label, b, "WideMoE graph", lambda x: [wide(x)], xs[0], nb, flops,
                      machine)
        if stock_batches is None or b in stock_batches:
            record(label, b, "layer", "LatentMoE (stock)", bench_once(lambda: stock(xs[0])),
                   nb, machine, flops)
        print_rows(label, b)
    batch_invariance(lambda x: [wide(x)], cfg, max(batches), label)


def layer_traffic(stock, x) -> tuple[int, int]:
    """(bytes, FLOPs) the whole layer must move and compute for the rows ``x``: the
    experts its tokens route to, the dense weights, x in and the output out."""
    cfg, b = stock.cfg, x.shape[0]
    per_expert = (stock.w13[0].numel() + stock.w13_scales[0].numel() + stock.w2[0].numel()
                  + stock.w2_scales[0].numel())
    dense = (stock.gate_weight.numel() + stock.latent_down.numel() + stock.latent_up.numel()
             + stock.shared_gate_up.numel() + stock.shared_down.numel()) * 2
    logits = reference.mm_f32(x, stock.gate_weight)
    ids, _ = reference.route(logits, stock.e_score_correction_bias, cfg.top_k, True, 1.0)
    touched = torch.unique(ids).numel()
    nb = touched * per_expert + dense + 2 * b * cfg.hidden * 2
    flops = 2 * b * (dense // 2 + cfg.top_k * 3 * cfg.latent * cfg.expert_intermediate)
    return nb, flops


def same_bits(outs) -> bool:
    """Whether every rank's output has rank 0's bits."""
    return all(torch.equal(o.view(torch.int16), outs[0].view(torch.int16)) for o in outs)


def simulated_layer(stock, world, batches, machine):
    """T simulated ranks of the layer on this GPU (``SimulatedGroup``): every rank's
    output checked for the same bits and against the stock path, the group's CUDA graph
    checked against eager and timed (the T ranks' work in series), then batch invariance
    on every rank."""
    group = SimulatedGroup(stock, world)
    label = f"sim{world}"
    gen = torch.Generator(device=DEVICE).manual_seed(98)
    for b in batches:
        x = torch.randn(b, stock.cfg.hidden, generator=gen, device=DEVICE).bfloat16()
        outs = group(x)
        err = rel_err(outs[0], stock(x))
        print(f"   {label} b={b}: rank 0 vs LatentMoE rel err {err:.2e}, every rank "
              f"{'the same bits' if same_bits(outs) else 'DIFFERENT bits'}")
        if not (err < 1e-2 and same_bits(outs)):
            print(f"!! {label} b={b}: simulated layer wrong: not timed")
            continue
        nb, flops = layer_traffic(stock, x)
        if DEVICE.type == "cuda":
            graph_row(label, b, "SimulatedGroup graph", group, x, nb, flops, machine)
        else:
            record(label, b, "layer", "SimulatedGroup graph", dry_time(lambda: group(x)), nb,
                   machine, flops, check=f"{err:.1e}")
        print_rows(label, b)
    batch_invariance(group, stock.cfg, max(batches), label)


def graph_row(label, b, impl, layer, x, nb, flops, machine) -> None:
    """The CUDA graph of one ``layer(x)`` call (every rank's output), checked against
    eager (and every rank against rank 0), then its replay timed as row ``impl``."""
    try:
        static = x.clone()
        graph, ys = capture_graph(layer, static)
        graph.replay()
        torch.cuda.synchronize()
        check = graph_check(ys[0], layer(static)[0], lambda: layer(static)[0])
        if not same_bits(ys):
            check += ", ranks differ in the graph"
        if check != "= eager":
            print(f"!! {label} b={b}: the graph's output {check}")
        record(label, b, "layer", impl, bench_eager(graph.replay), nb, machine, flops,
               check=check)
        del graph, ys
    except Exception as err:
        print(f"   graph capture failed: {type(err).__name__}: {str(err)[:200]}")


def graph_check(replayed, eager, eager_again) -> str:
    """"= eager" where the graph's output has the bits of an eager call on the same input;
    else how many elements differ, by how much, and whether a second eager call
    (``eager_again()``, made only then) agrees with the first (if not, the layer itself
    is not reproducible at this width, graph or not)."""
    if torch.equal(replayed, eager):
        return "= eager"
    differ = (replayed.view(torch.int16) != eager.view(torch.int16))
    delta = (replayed.float() - eager.float()).abs().max().item()
    again = "equal" if torch.equal(eager, eager_again()) else "differ"
    return (f"!= eager ({differ.sum().item()} of {differ.numel()} elements in "
            f"{differ.any(dim=1).sum().item()} rows, max |diff| {delta:.2e}; two eager "
            f"calls {again})")


def batch_invariance(layer, cfg, widest, label):
    """Whether row 7's output has the same bits alone, inside 65 rows and inside
    ``widest`` rows, on every rank (``layer(x)``: every rank's output; the layer compiled
    above for these widths: milliseconds)."""
    if widest < 65:
        return
    x = torch.randn(widest, cfg.hidden, generator=torch.Generator(device=DEVICE).manual_seed(5),
                    device=DEVICE).bfloat16()
    rows = [o[row:row + 1] for run, row in ((x[7:8], 0), (x[:65], 7), (x, 7))
            for o in layer(run)]
    equal = same_bits(rows)
    line = (f"batch invariance ({label}, whole layer, E = {cfg.num_experts}): row 7 alone / "
            f"in 65 rows / in {widest} rows, every rank: "
            f"{'bitwise equal' if equal else 'DIFFER'}")
    print(f"   {line}")
    NOTES.append(line)


# ------------------------------------------------------------------------------ output

def print_rows(shape, b, impl=None):
    for r in ROWS:
        if r["shape"] == shape and r["b"] == b and impl in (None, r["impl"]):
            print(f"   {r['shape']:>5} {r['b']:>5} {r['stage']:<18} {r['impl']:<34} "
                  f"{r['us']:>9.1f} us  floor {r['floor_us']:>8.1f} us  "
                  f"{r['of_copy_bw']:>6.1%} of copy BW  {r['check']}  {r['after']}", flush=True)


def speedups(r) -> str:
    """For one of our rows: each peer's time over ours at the same shape, b and stage
    (> 1: we are faster)."""
    if r["impl"] not in OURS:
        return ""
    peers_ = [q for q in ROWS if (q["shape"], q["b"], q["stage"]) == (r["shape"], r["b"], r["stage"])
              and q["impl"] not in OURS]
    return "; ".join(f"{q['us'] / r['us']:.2f}x vs {q['impl']}" for q in peers_)


def table_lines() -> list[str]:
    lines = ["| shape | b | stage | impl | µs | floor µs | floor/time | TB/s | speed-up | check "
             "| SM clock, power after |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in ROWS:
        lines.append(f"| {r['shape']} | {r['b']} | {r['stage']} | {r['impl']} | {r['us']:.1f} "
                     f"| {r['floor_us']:.1f} | {r['floor_us'] / r['us']:.0%} | "
                     f"{r['bw_TBps']:.2f} | {speedups(r)} | {r['check']} | {r['after']} |")
    return lines


def write_outputs(out_dir: pathlib.Path, machine: Machine, with_plot: bool = True):
    out_dir.mkdir(parents=True, exist_ok=True)
    for r in ROWS:
        r["speedup"] = speedups(r)
    with open(out_dir / "results.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(ROWS[0]))
        writer.writeheader()
        writer.writerows(ROWS)
    lines = [machine.line(), "", "Floor: bytes over the copy bandwidth, or FLOPs over the "
             "BF16 matmul rate where larger; speed-up: the peer's time over ours.", ""]
    lines += table_lines() + [""] + [f"- {n}" for n in NOTES]
    (out_dir / "results.md").write_text("\n".join(lines) + "\n")
    if not with_plot:
        return
    try:
        plot(out_dir / "layer.png", machine)
    except ImportError:
        print("(matplotlib absent: no plot)")


def plot(path, machine):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = list(dict.fromkeys(r["shape"] for r in ROWS))
    stages = list(dict.fromkeys(r["stage"] for r in ROWS))
    fig, axes = plt.subplots(len(shapes), len(stages), figsize=(3.6 * len(stages),
                             3.2 * len(shapes)), squeeze=False)
    for row, shape in enumerate(shapes):
        for col, stage in enumerate(stages):
            ax = axes[row][col]
            sel = [r for r in ROWS if r["shape"] == shape and r["stage"] == stage]
            if not sel:
                ax.axis("off")
                continue
            for impl in dict.fromkeys(r["impl"] for r in sel):
                pts = sorted((r["b"], r["us"]) for r in sel if r["impl"] == impl)
                ax.plot(*zip(*pts), marker="o", label=impl)
            # The floor of the stage itself: the fewest bytes any implementation must move.
            floor = {}
            for r in sel:
                floor[r["b"]] = min(floor.get(r["b"], float("inf")), r["floor_us"])
            ax.plot(*zip(*sorted(floor.items())), "k--", label="floor")
            ax.set_title(f"{shape} {stage}", fontsize=9)
            ax.set_xlabel("batch rows")
            ax.set_ylabel("µs")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.legend(fontsize=5)
    fig.suptitle(machine.line(), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def summary():
    print()
    for line in table_lines():
        print(line)
    for n in NOTES:
        print(f"- {n}")


def dims(tp: int) -> WideMoEConfig:
    """Production dims (tiny ones in a dry run, where T <= 4)."""
    return WideMoEConfig.tiny(tp=tp, wide_rows=128) if DRY else WideMoEConfig.kimi_k3(tp=tp)


def free_memory() -> None:
    gc.collect()
    if DEVICE.type == "cuda":
        torch.cuda.empty_cache()


def shape_part(stock, tp, label, args, layer_batches, machine) -> None:
    """``--shapes tpN``: the whole layer first at tp1, then rank 0's stages."""
    if tp == 1 and not args.experts_only:
        whole_layer(stock, layer_batches, machine, stock_batches=args.stock_batches)
        free_memory()
        if args.layer_only:
            return
    stage_rank(stock, dims(tp), 0, args.batches, machine, label,
               with_peers=not args.no_peers, experts_only=args.experts_only)


def rank0_part(args, machine) -> int:
    """``--rank0``: rank 0's whole layer of each shape (benchmarks/rank0.py), its files
    rewritten after every width (a run stopped by its timeout keeps them); the exit
    status, 1 where a shape raised or a width failed."""
    run = rank0.Rank0Run(sys.modules[__name__], machine, pathlib.Path(args.out))
    for label in args.shapes:
        cfg = dims(int(label[2:]))
        t0 = time.time()
        try:
            run.shape(label, cfg, [b for b in args.batches if b <= cfg.wide_rows])
        except Exception as err:  # the other shapes still run; the status says it failed
            traceback.print_exc()
            run.failed(f"{label} raised {type(err).__name__}: {str(err)[:300]}")
        print(f"# {label} done in {time.time() - t0:.0f} s", flush=True)
    run.write()
    for line in run.markdown(run.rows()):
        print(line)
    return run.exit_status()


def keep_rows_on_sigterm(out_dir: pathlib.Path, machine) -> None:
    """On SIGTERM (``timeout``'s signal), write the rows timed so far, then exit 124:
    a run stopped inside a part keeps the part's finished rows too."""
    def stop(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        print(f"# SIGTERM: writing the {len(ROWS)} rows timed so far", flush=True)
        if ROWS:
            write_outputs(out_dir, machine, with_plot=False)
        sys.exit(124)

    signal.signal(signal.SIGTERM, stop)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", type=int, nargs="+", default=None,
                   help="widths (default: 65 128 256 512 1024; with --rank0, rank0.WIDTHS)")
    # tp1 last: its stock layer's calls take seconds, so a run cut short keeps the others
    p.add_argument("--shapes", nargs="+", default=["tp8", "tp16", "tp1"])
    p.add_argument("--layer-batches", type=int, nargs="+", default=None,
                   help="whole-layer widths at tp1 (default: 1 and every --batches width)")
    p.add_argument("--stock-batches", type=int, nargs="+", default=None,
                   help="widths at which the stock LatentMoE is timed (default: all)")
    p.add_argument("--simulated", type=int, nargs="+", default=[],
                   help="T simulated ranks of the whole layer on this GPU (e.g. 2), at the "
                        "whole-layer widths")
    p.add_argument("--no-peers", action="store_true")
    p.add_argument("--experts-only", action="store_true",
                   help="time only the experts rows (ours and the peers); no whole layer")
    p.add_argument("--layer-only", action="store_true",
                   help="at tp1, the whole layer alone (no rank stages)")
    p.add_argument("--rank0", action="store_true",
                   help="rank 0's whole layer of each --shapes tpN, peers pre-filled, beside "
                        "its floor and the seed's figures (benchmarks/rank0.py)")
    p.add_argument("--dry-run", action="store_true",
                   help="tiny dims on the CPU (interpreter), untimed: checks the script")
    p.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    args = p.parse_args(argv)
    for label in args.shapes:
        if not (label.startswith("tp") and label[2:].isdigit()):
            p.error(f"--shapes takes tpN (N = tensor-parallel size), got {label!r}")
    if args.layer_only and args.experts_only:
        p.error("--layer-only and --experts-only leave nothing to time together")
    if args.rank0 and "tp1" in args.shapes:
        p.error("--rank0 times a rank of T > 1: give --shapes tpN with N > 1")
    if args.rank0:
        args.batches = args.batches or rank0.WIDTHS
    args.batches = args.batches or [65, 128, 256, 512, 1024]
    layer_batches = args.layer_batches or sorted({1, *args.batches})
    machine = header()
    if args.rank0:
        return rank0_part(args, machine)
    keep_rows_on_sigterm(pathlib.Path(args.out), machine)
    if not args.no_peers:
        for name, status in peers.availability().items():
            print(f"# peer {name}: {status}")
    t0 = time.time()
    stock = LatentMoE(dims(1), seed=0, device=DEVICE)
    print(f"# stock layer built in {time.time() - t0:.0f} s")
    parts, failures = [], []
    for label in args.shapes:
        parts.append((label, lambda tp=int(label[2:]), label=label: shape_part(
            stock, tp, label, args, layer_batches, machine)))
    for world in args.simulated:
        parts.append((f"sim{world}", lambda world=world: simulated_layer(
            stock, world, layer_batches, machine)))
    for label, part in parts:
        t0 = time.time()
        try:
            part()
        except Exception as err:  # the other parts still run; the status says it failed
            traceback.print_exc()
            failures.append(f"{label} raised {type(err).__name__}: {str(err)[:300]}")
        free_memory()
        print(f"# {label} done in {time.time() - t0:.0f} s", flush=True)
        if ROWS:  # after every part: a run stopped by a timeout keeps what finished
            write_outputs(pathlib.Path(args.out), machine)
    if ROWS:
        summary()
    for what in failures:
        print(f"# failed: {what}", flush=True)
    return rank0.exit_status(failures)


if __name__ == "__main__":
    sys.exit(main())
