"""The experts kernels' inner loop as the H200 runs it, counted without a GPU.

    python benchmarks/diagnostics/sass_count.py [wgmma] [wgmma_decode]
        (a Python with Triton 3.6; WIDE=1: the decode's wide-scale variant)
        [--up JSON] [--down JSON] [--block-k-up N] [--block-k-down N]
    python benchmarks/diagnostics/sass_count.py --table autotune_configs/NVIDIA_H200.json
        [--batches 65 256 512 1024] [--clock-ghz 1.8]

``--up`` / ``--down``: lists of configs counted instead of the defaults (as
probe_experts.py takes them); ``--block-k-*``: another reduction step, as
``prepare_weights(block_k_up=...)`` would lay the weights out.

Compiles the up and down kernels ahead of time with Triton 3.6 for sm_90 at TP8
production dims (L 3584, I 384, BLOCK_K as prepare_weights sets it) at DEFAULT_UP /
DEFAULT_DOWN (A_BF16 0 and 1; for "wgmma_decode" the staged path's defaults, A_BF16 1),
pointers specialized 16-aligned as the JIT does, and prints registers, stack (spills),
the ttgir's local_alloc / convert_layout counts and the SASS histogram of the smallest
loop holding HGMMA, per weight element a thread decodes an iteration (loop instructions
x threads / elements), how many instructions lie outside that loop (what a tile or a
program runs once: the pipeline's prologue, SiTU, the MXFP8 rounding, the stores), and
ptxas's advice C7515 where it serializes the kernel's wgmma (Triton 3.9's compile of
the same source does not draw it: this check needs 3.6), and any write to the register
operand of an MMA still in flight (tests/sass_hazards.py).

``--table``: every "wgmma_decode" experts entry of a GPU's table, at the dims of its
shape key (TP8, TP16, TP1), one row a config: instructions a weight element by class
counted dynamically (a block the loop branches over, the down launch's store of a
column tile, counts once a tile, not once a step), the MMA waits a step, the longest
latency-weighted dependency chain a step, registers, spills, shared memory and programs
a SM; then, per batch width, the launch's issue time (warp instructions over 4
schedulers a SM at the given clock, from the tiles a balanced routing makes) beside its
memory floor: the model of benchmarks/NOTES.md, "A model of the experts launches"."""
import collections
import os
import re
import subprocess
import sys
import tempfile
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)  # the repository
sys.path.insert(0, os.path.join(ROOT, "tests"))
import triton
from triton.compiler import ASTSource
from triton.backends.compiler import GPUTarget
from wide_moe_triton.kernels import experts as ex
import sass_hazards  # tests/: writes to an in-flight MMA's register operand

L, I = 3584, 384
WIDE = bool(int(os.environ.get("WIDE", "0")))
CUOBJ = sass_hazards.CUOBJDUMP

def compile_kernel(kind, cfg, layout="wgmma"):
    dec = ex.LAYOUT_DECODE.get(layout, 0) if hasattr(ex, "LAYOUT_DECODE") else 0
    if kind == "up":
        fn = ex._experts_up_kernel
        sig = {n: t for n, t in zip(
            ["q_ptr", "qs_ptr", "qv_ptr", "counts_ptr", "pairs_ptr", "generation_ptr", "w_ptr",
             "ws_ptr", "h_ptr", "hs_ptr", "hv_ptr", "num_experts", "wide_rows", "beta",
             "linear_beta"],
            ["*u8", "*u8", "*bf16", "*i32", "*i32", "*i32", "*u8", "*u8", "*u8", "*u8", "*bf16",
             "i32", "i32", "fp32", "fp32"])}
        bk = ex.reduction_block(L, ex.BLOCK_K_UP)
        const = dict(LATENT=L, INTER=I, TOP_K=16, HAS_LINEAR_BETA=True, A_BF16=cfg["A_BF16"],
                     STORE_VALUES=0, BLOCK_K=bk)
        if cfg.get("TMA"):  # the descriptors' types, as the JIT names them
            word_box, scale_box = ex.tma_boxes(cfg["BLOCK_N"], bk)
            sig["w_desc"] = f"tensordesc<i32{word_box}>"
            sig["ws_desc"] = f"tensordesc<u8{scale_box}>"
        else:
            const.update(w_desc=None, ws_desc=None)
    else:
        fn = ex._experts_down_kernel
        sig = {n: t for n, t in zip(
            ["h_ptr", "hs_ptr", "hv_ptr", "counts_ptr", "pairs_ptr", "generation_ptr", "w_ptr",
             "ws_ptr", "rows_ptr", "num_experts", "wide_rows"],
            ["*u8", "*u8", "*bf16", "*i32", "*i32", "*i32", "*u8", "*u8", "*i16", "i32", "i32"])}
        bk = ex.reduction_block(I, ex.BLOCK_K_DOWN)
        const = dict(LATENT=L, INTER=I, A_BF16=cfg["A_BF16"], BLOCK_K=bk, PDL_TRIGGER=True)
    dec = layout == "wgmma_decode"
    if dec:
        sig["w_ptr"] = "*i32"
    const.update(DECODE=dec, STAGED=dec, WIDE_SCALES=WIDE, INTERPRET=False)  # sm_90: staged_dot
    const.update(ROW_BLOCK=64, WGMMA_ORDER=True, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"],
                 NUM_STAGES=cfg["num_stages"],
                 **{k: cfg.get(k, v) for k, v in ex.STAGED_KEYS.items()})
    const.update(ex._layout_constexprs(layout) if hasattr(ex, "_layout_constexprs") else {})
    for k in list(const):
        if k not in fn.arg_names:
            del const[k]
    for k in fn.arg_names:
        if k not in sig and k not in const:
            raise SystemExit(f"missing {k}")
    opts = dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    if cfg.get("maxnreg"):
        opts["maxnreg"] = cfg["maxnreg"]
    # as the JIT specializes: 16-aligned pointers, int args divisible by 16 (E 896, wide rows)
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n, t in sig.items()
             if t.startswith("*") or n in ("num_experts", "wide_rows")}
    src = ASTSource(fn, signature={k: v for k, v in sig.items()}, constexprs=const, attrs=attrs)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)
    return k, bk

def serialized_wgmma(k):
    """ptxas's advice C7515 for the kernel's PTX, or None: with it ptxas waits for each
    wgmma before the next one issues (the down launch did, while its accumulator was
    zeroed inside the MMA pipeline: NOTES, "Column tiles in the down launch"). Triton's
    compile does not show it; ptxas says it only when verbose."""
    from triton.backends.nvidia.compiler import get_ptxas
    ptx = k.asm["ptx"]
    target = re.search(r"^\.target\s+(\w+)", ptx, re.M).group(1)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        done = subprocess.run([get_ptxas(90).path, f"-arch={target}", "-v", path, "-o",
                               os.path.join(tmp, "kernel.cubin")],
                              capture_output=True, text=True, check=True)
    advice = [line for line in done.stderr.splitlines() if "C7515" in line]
    return advice[0] if advice else None


def _cuobjdump(flag, path):
    return subprocess.run([CUOBJ, flag, path], capture_output=True, text=True).stdout


def sass_of(k):
    """SASS of a compiled kernel; sets k.res = (registers, stack/local bytes)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(k.asm["cubin"])
        path = f.name
    res = _cuobjdump("--dump-resource-usage", path)
    field = lambda name: re.search(name + r":(\d+)", res).group(1)  # noqa: E731
    k.res = (int(field("REG")), f"{field('STACK')}B stack, local {field('LOCAL')}")
    return _cuobjdump("--dump-sass", path)

def loops_by_labels(sass):
    """The shortest loop of the kernel that holds an HGMMA (its inner reduction loop)."""
    loops = sass_hazards.mma_loops(sass_hazards.instructions(sass))
    return min((body for _, body in loops), key=len) if loops else []

def hist(body):
    c = collections.Counter()
    for ins in body:
        ins = re.sub(r"^@!?U?P\w+\s+", "", ins)
        op = ins.split()[0]
        c[op.split(".")[0]] += 1
    return c

def weight_elements(kind, cfg, bk):
    """Weight elements a thread decodes a reduction step (an iteration of the loop): the
    up program's gate and up rows, the down program's rows, over its threads."""
    return cfg["BLOCK_N"] * bk * (2 if kind == "up" else 1) / (32 * cfg["num_warps"])


def report(kind, cfg, layout="wgmma", show=False):
    k, bk = compile_kernel(kind, cfg, layout)
    sass = sass_of(k)
    body = loops_by_labels(sass)
    h = hist(body)
    elems = weight_elements(kind, cfg, bk)
    ttgir = k.asm["ttgir"]
    n_local = ttgir.count("ttg.local_alloc"); n_cvt = ttgir.count("ttg.convert_layout")
    print(f"{kind} {layout} {cfg} BK={bk}: regs {k.res[0]} spills {k.res[1]}; loop "
          f"{len(body)} instr / {elems} weight elems = {len(body) / elems:.2f} per elem; "
          f"ttgir local_alloc {n_local} convert_layout {n_cvt}")
    print("   " + "  ".join(f"{op} {n / elems:.3f}" for op, n in h.most_common(16)))
    spills = sass.count("STL") + sass.count("LDL")
    print(f"   spill ops in loop: {h['STL'] + h['LDL']}, in kernel: {spills}; "
          f"outside the loop (once a tile or a program): "
          f"{len(sass_hazards.instructions(sass)) - len(body)} instr")
    advice = serialized_wgmma(k)
    if advice:
        print(f"   SERIALIZED WGMMA: {advice}")
    hazards, _, _ = sass_hazards.kernel_hazards(sass)
    if hazards:  # tests/sass_hazards.py: wrong results that depend on timing
        print(f"   {len(hazards)} WRITES TO AN IN-FLIGHT MMA'S A REGISTERS, first "
              f"{hazards[0].writer!r} over {hazards[0].mma!r}")
    if show:  # the listings, for reading
        for ext, text in (("ttgir", ttgir), ("sass", sass), ("ptx", k.asm["ptx"])):
            with open(f"{kind}_{layout}.{ext}", "w") as f:
                f.write(text)
    return len(body) / elems

# ------------------------------------------------------------------ the table's model
# Issue latencies in cycles for the dependency chain (Hopper, leads from published
# microbenchmarks: Luo et al., "Benchmarking and Dissecting the Nvidia Hopper GPU
# Architecture", 2024): shared and local memory about 30, the FP16/BF16 pair and
# integer multiply-add units about 5, the other integer and logic units about 4.
LATENCY = {"LDS": 30, "LDL": 30, "HMUL2": 5, "HFMA2": 5, "IMAD": 5}
SCHEDULERS = 4            # warp schedulers a Hopper SM, one instruction a cycle each
SMS = 132
REGISTERS_A_SM = 65536
SHARED_A_SM = 228 * 1024  # bytes a SM, 1 KB of it reserved a program
_REGISTER = re.compile(r"\bR(\d+)\b(?:\.64)?")


def loop_with_addresses(insts):
    """(address, instruction) of the shortest loop holding an HGMMA (the reduction loop,
    ``loops_by_labels``' with its addresses) of a kernel's ``sass_hazards.instructions``."""
    loops = sass_hazards.mma_loops(insts)
    if not loops:
        return []
    start, body = min(loops, key=lambda loop: len(loop[1]))
    first = next(i for i, (a, _) in enumerate(insts) if a >= start)
    return insts[first:first + len(body)]


def branched_over(loop):
    """Addresses of the loop's instructions that a forward branch inside it can skip:
    code that runs on some iterations only (the down launch's store of a column tile
    runs on the last step of each tile)."""
    skipped = set()
    for address, ins in loop:
        m = sass_hazards._BRANCH.search(ins)
        if m and int(m.group(1), 16) > address:
            target = int(m.group(1), 16)
            skipped |= {a for a, _ in loop if address < a < target}
    return skipped


def instruction_class(ins):
    """What an instruction of the reduction loop is for, by its opcode: the weights'
    decode (logic, shifts, byte permutes and the scale's multiply-adds), the scale
    multiply (HMUL2), the MMA and its synchronisation, shared/global copies, spills, the
    uniform datapath (descriptors, loop counters), or other (addresses, predicates)."""
    op = re.sub(r"^@!?U?P\w+\s+", "", ins).split()[0]
    base = op.split(".")[0]
    if base in ("LOP3", "SHF", "PRMT", "SGXT") or op.startswith("IMAD.SHL"):
        return "decode"
    if base == "IMAD" and "0x3f003f00" in ins:
        return "decode"      # a scale byte to its BF16 pair of powers of two
    if base in ("HMUL2", "HFMA2"):
        return "scale"
    if base in ("HGMMA", "WARPGROUP"):
        return "mma"
    if base in ("STL", "LDL"):
        return "spill"
    if base in ("LDS", "LDGSTS", "LDGDEPBAR", "DEPBAR", "BAR", "LDG", "STG", "STS"):
        return "memory"
    if base.startswith("U") and base not in ("UTMALDG",):
        return "uniform"
    return "other"


def dependency_chain(body):
    """The longest latency-weighted chain of register dependencies (cycles) through one
    pass of the loop body in program order: the least time a step takes for one warp
    however many other warps are there to fill its gaps. An MMA's wait counts as the
    MMAs of the step it waits for (their issue is on the chain), not their latency."""
    ready = {}
    longest = 0
    for ins in body:
        text = re.sub(r"^@!?U?P\w+\s+", "", ins)
        parts = text.split(None, 1)
        if len(parts) < 2:
            continue
        op, operands = parts
        base = op.split(".")[0]
        written = sass_hazards.written_registers(text)
        first = operands.split(",")[0]
        sources = operands[len(first):] if written else operands
        regs = [int(r) for r in _REGISTER.findall(sources)]
        start = max((ready.get(r, 0) for r in regs), default=0)
        done = start + LATENCY.get(base, 4)
        for r in written:
            ready[r] = done
        longest = max(longest, done)
    return longest


def occupancy(registers, shared, threads):
    """Programs a SM, from registers (allocated 8 a thread, in 256-register units a warp)
    and shared memory."""
    per_warp = -(-registers * 32 // 256) * 256
    by_registers = REGISTERS_A_SM // (per_warp * (threads // 32))
    by_shared = SHARED_A_SM // (shared + 1024)
    return max(0, min(by_registers, by_shared, 32))


def balanced_counts(b, num_experts=896, top_k=16, seed=0):
    """Pairs an expert of b tokens that each pick top_k distinct experts uniformly: the
    benchmarks' balanced routing, as counts."""
    import torch
    g = torch.Generator().manual_seed(seed)
    ids = torch.rand(b, num_experts, generator=g).topk(top_k, dim=1).indices
    return torch.bincount(ids.flatten(), minlength=num_experts).tolist()


def tiles(counts, block_m, half_tile):
    """(full tiles, half tiles) of the routing lists, as the kernels walk them."""
    full = half = 0
    for c in counts:
        last = c % block_m
        if half_tile and 0 < last <= block_m // 2:
            full += c // block_m
            half += 1
        else:
            full += -(-c // block_m)
    return full, half


def table_rows(path):
    """(kernel, shape key, TP, inter, buckets, config, the shape's buckets) of every
    "wgmma_decode" experts entry of a GPU table, one row a distinct (kernel, shape,
    config): ``buckets`` those whose entry is the config."""
    import json
    table = json.load(open(path))
    tp_of_inter = {384: 8, 192: 16, 3072: 1}
    rows = {}
    for kernel in ("experts_up", "experts_down"):
        for shape, buckets in table["kernels"].get(kernel, {}).items():
            if not shape.endswith("_decode"):
                continue
            inter = int(re.search(r"_I(\d+)_", shape).group(1))
            for bucket, cfg in buckets.items():
                key = (kernel, shape, json.dumps(cfg, sort_keys=True))
                rows.setdefault(key, [kernel, shape, tp_of_inter.get(inter), inter, [], cfg,
                                      list(buckets)])
                rows[key][4].append(int(bucket))
    return list(rows.values())


def counted(kind, cfg, inter):
    """The loop of one config at latent L and intermediate ``inter`` as the model reads it."""
    global I
    I = inter
    k, bk = compile_kernel(kind, cfg, "wgmma_decode")
    insts = sass_hazards.instructions(sass_of(k))
    loop = loop_with_addresses(insts)
    skipped = branched_over(loop)
    steps_a_tile = inter // bk if kind == "down" and cfg.get("COLS", 1) > 1 else 1
    threads = 32 * cfg["num_warps"]
    elems = weight_elements(kind, cfg, bk)
    weight = {a: (1 / steps_a_tile if a in skipped else 1.0) for a, _ in loop}
    by_class = collections.Counter()
    for a, ins in loop:
        by_class[instruction_class(ins)] += weight[a]
    every_step = [x for a, x in loop if a not in skipped]
    return dict(
        bk=bk, regs=k.res[0], stack=k.res[1].split("B")[0], shared=k.metadata.shared,
        programs=occupancy(k.res[0], k.metadata.shared, threads),
        per_step=sum(weight.values()), elems=elems,
        by_class={c: n / elems for c, n in by_class.items()},
        waits=sum("WARPGROUP.DEPBAR" in x for x in every_step),
        chain=dependency_chain(every_step),
        outside=len(insts) - len(loop))


def launch_model(kind, cfg, c, inter, b, clock_ghz, num_experts=896, latent=L):
    """(issue µs, floor µs) of one launch at width b: warp instructions over the SMs'
    schedulers at clock_ghz, and the launch's bytes (the touched experts' weights and
    scales, activations in and out) over 4.27 TB/s, the H200's measured copy rate."""
    counts = balanced_counts(b, num_experts)
    full, half = tiles(counts, cfg["BLOCK_M"], cfg.get("HALF_TILE", 0))
    touched = sum(1 for n in counts if n)
    if kind == "up":
        programs_a_tile = inter // cfg["BLOCK_N"]
        steps = latent // c["bk"]
        weight_bytes = 2 * inter * latent * (1 / 2 + 1 / 32)
        # each token's latent row read once; each pair's hidden codes, scales, values out
        act_bytes = b * latent * 2 + b * 16 * inter * (1 + 2 + 1 / 32)
    else:
        programs_a_tile = latent // (cfg["BLOCK_N"] * cfg.get("COLS", 1))
        steps = cfg.get("COLS", 1) * inter // c["bk"]
        weight_bytes = inter * latent * (1 / 2 + 1 / 32)
        act_bytes = b * 16 * (inter * 2 + latent * 2)
    warps = cfg["num_warps"]
    # a half tile issues the same instructions (its MMAs are narrower, not fewer)
    instructions = (full + half) * programs_a_tile * warps * (steps * c["per_step"]
                                                              + c["outside"])
    issue_us = instructions / (SMS * SCHEDULERS) / (clock_ghz * 1e3)
    floor_us = (touched * weight_bytes + act_bytes) / 4.27e6
    return issue_us, floor_us


def table_report(path, batches, clock_ghz):
    """Print the model's table for every decode experts entry of a GPU table."""
    classes = ("decode", "scale", "mma", "memory", "uniform", "spill", "other")
    print("| kernel | TP | buckets | config | regs | stack B | smem KB | programs/SM | "
          "instr/elem " + " ".join(classes) + " = total | MMA waits/step | chain cycles/step |")
    print("|---" * 10 + "|")
    models = []
    from wide_moe_triton import tuning

    for kernel, shape, tp, inter, buckets, cfg, shape_buckets in table_rows(path):
        kind = kernel.split("_")[1]
        c = counted(kind, cfg, inter)
        short = (f"{cfg['BLOCK_M']}x{cfg['BLOCK_N']} w{cfg['num_warps']} s{cfg['num_stages']}"
                 f" r{cfg.get('maxnreg', 0)}" + "".join(
                     f" {k}{cfg[k]}" for k in ("COLS", "HALF_TILE") if cfg.get(k)))
        split = " ".join(f"{c['by_class'].get(k, 0):.2f}" for k in classes)
        print(f"| {kind} | {tp} | {','.join(map(str, buckets))} | {short} | {c['regs']} | "
              f"{c['stack']} | {c['shared'] / 1024:.0f} | {c['programs']} | {split} = "
              f"{c['per_step'] / c['elems']:.2f} | {c['waits']} | {c['chain']} |")
        for b in batches:
            if int(tuning.bucket_for(b, shape_buckets)) not in buckets:
                continue  # width b reads another bucket's config
            models.append((kind, tp, b, short, *launch_model(kind, cfg, c, inter, b,
                                                            clock_ghz)))
    print(f"\n| launch | TP | b | config | issue µs at {clock_ghz} GHz | floor µs | "
          "issue / floor |")
    print("|---" * 7 + "|")
    for kind, tp, b, short, issue, floor in sorted(models, key=lambda m: (m[0], m[1], m[2])):
        print(f"| {kind} | {tp} | {b} | {short} | {issue:.0f} | {floor:.0f} | "
              f"{issue / floor:.2f} |")


def main(argv=None) -> None:
    import argparse
    import json
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("layouts", nargs="*", default=["wgmma"])
    p.add_argument("--up", type=json.loads, metavar="JSON", help="up configs to count")
    p.add_argument("--down", type=json.loads, metavar="JSON", help="down configs to count")
    p.add_argument("--block-k-up", type=int, help="the up weights' reduction step")
    p.add_argument("--block-k-down", type=int, help="the down weights' reduction step")
    p.add_argument("--table", metavar="JSON", help="count every decode experts entry of "
                   "this GPU table, with the launch model at --batches")
    p.add_argument("--batches", type=int, nargs="+", default=[65, 256, 512, 1024])
    p.add_argument("--clock-ghz", type=float, default=1.8,
                   help="the SM clock of the model's issue time (the H200 ran the experts "
                   "at 1.74-1.96 GHz)")
    args = p.parse_args(argv)
    if args.table:
        table_report(args.table, args.batches, args.clock_ghz)
        return
    ex.BLOCK_K_UP = args.block_k_up or ex.BLOCK_K_UP
    ex.BLOCK_K_DOWN = args.block_k_down or ex.BLOCK_K_DOWN
    given = (args.up, args.down)
    for layout in args.layouts:
        if any(given):  # only the lists given
            for kind, configs in zip(("up", "down"), given):
                for cfg in configs or ():
                    report(kind, cfg, layout)
            continue
        defaults = ((ex.DEFAULT_UP_STAGED, ex.DEFAULT_DOWN_STAGED) if layout == "wgmma_decode"
                    else (ex.DEFAULT_UP, ex.DEFAULT_DOWN))
        for kind, cfg in zip(("up", "down"), defaults):
            for a in ((1,) if layout == "wgmma_decode" else (0, 1)):
                report(kind, dict(cfg, A_BF16=a), layout)


if __name__ == "__main__":
    main()
