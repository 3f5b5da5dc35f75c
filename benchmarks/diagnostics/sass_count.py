"""The experts kernels' inner loop as the H200 runs it, counted without a GPU.

    python benchmarks/diagnostics/sass_count.py [wgmma] [wgmma_decode]
        (a Python with Triton 3.6; WIDE=1: the decode's wide-scale variant)
        [--up JSON] [--down JSON] [--block-k-up N] [--block-k-down N]

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
operand of an MMA still in flight (tests/sass_hazards.py)."""
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

def report(kind, cfg, layout="wgmma", show=False):
    k, bk = compile_kernel(kind, cfg, layout)
    sass = sass_of(k)
    body = loops_by_labels(sass)
    h = hist(body)
    # weight elements a thread decodes per iteration: the loop runs once per thread
    elems = cfg["BLOCK_N"] * bk * (2 if kind == "up" else 1) / (32 * cfg["num_warps"])
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
    args = p.parse_args(argv)
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
