"""Every kernel the layer launches compiles with Triton's compiler for the GPUs it is
tuned for, with no GPU at hand: sm_90 (H200) and sm_100 (B200).

The interpreter runs a kernel as Python, so an error only the compiler sees (returns of
different types from one function, a layout it cannot convert, a register budget) passes
every other test here and first shows on a GPU, where device time is scarce; and no
B200 is at hand at all. This test records the launches of a workload in the
interpreter (the module at tiny dims on one rank and on two simulated ranks, the experts
in every weight layout and activation format, wide scale bytes) and compiles each
distinct specialization in a subprocess without TRITON_INTERPRET, with the launch's
num_warps / num_stages / maxnreg and 16-byte alignment where the JIT would assume it,
INTERPRET False (the kernels' GPU branch), and the experts' STAGED as each target's
launch sets it (``experts.staged_dot``: sm_90 only; elsewhere the STAGED_KEYS at their
neutral values, as the wrapper demands there). Triton's compiler here is 3.9, the H200
machine's 3.6: a pass here is evidence for 3.6, not proof.
"""
import contextlib
import importlib
import inspect
import json
import os
import pathlib
import pkgutil
import subprocess
import sys

import pytest
import torch
import triton.language as tl
from triton.runtime import interpreter
from triton.runtime.jit import mangle_type
from triton.tools.tensor_descriptor import TensorDescriptor

from conftest import DEVICE, poison
from test_experts import (BETA, E, K, L, LINEAR_BETA, WIDE_ROWS, configs, make_ids, make_plan,
                          stock_weights)
from test_sass_hazards import decode_entries
from wide_moe_triton import LatentMoE, SimulatedGroup, WideMoE, WideMoEConfig
from wide_moe_triton import kernels, tuning
from wide_moe_triton.kernels import experts as ex
from wide_moe_triton.kernels import front as front_k
from wide_moe_triton.kernels import mailbox as mailbox_k
from wide_moe_triton.kernels import plan as plan_k

TARGETS = (90, 100)  # compute capabilities: H200 (sm_90), B200 (sm_100)
OPTIONS = ("num_warps", "num_stages", "maxnreg")
POINTER_TYPES = {
    torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16",
    torch.float64: "fp64", torch.int8: "i8", torch.uint8: "u8", torch.int16: "i16",
    torch.int32: "i32", torch.int64: "i64", torch.float8_e4m3fn: "fp8e4nv", torch.bool: "i1",
}

pytestmark = [pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="on a GPU every other test compiles its kernels"),
              pytest.mark.slow]  # a workload in the interpreter, then minutes of compiles


def _is_constexpr(param: inspect.Parameter) -> bool:
    return param.annotation is tl.constexpr or "constexpr" in str(param.annotation)


def launch_spec(fn, args, kwargs) -> dict:
    """What the JIT would compile for this launch: argument types, constexpr values,
    16-divisible pointers and integers (``tt.divisibility``), compile options."""
    params = inspect.signature(fn).parameters
    bound = dict(zip(params, args))
    bound.update({k: v for k, v in kwargs.items() if k not in OPTIONS})
    spec = {"module": fn.__module__, "kernel": fn.__name__, "signature": {},
            "constexprs": {}, "divisible": [],
            "options": {k: kwargs[k] for k in OPTIONS if kwargs.get(k) is not None}}
    for i, (name, param) in enumerate(params.items()):
        value = bound[name] if name in bound else param.default
        if name == "INTERPRET":  # the branch a GPU takes (the interpreter's never compiles)
            spec["constexprs"][name] = False
        elif name.startswith("PDL_"):  # dependent launches: sm_90 and newer (kernels/pdl.py)
            spec["constexprs"][name] = True
        elif name == "STAGED" and value:  # what each GPU takes (experts.staged_dot)
            spec["constexprs"][name] = True
            spec["per_target"] = {name: {str(c): c // 10 == ex.HOPPER
                                         for c in TARGETS}}
        elif _is_constexpr(param) or value is None:
            spec["constexprs"][name] = value
        elif isinstance(value, torch.Tensor):
            spec["signature"][name] = "*" + POINTER_TYPES[value.dtype]
            if value.data_ptr() % 16 == 0:
                spec["divisible"].append(i)
        elif isinstance(value, bool):
            spec["signature"][name] = "i1"
        elif isinstance(value, int):
            spec["signature"][name] = "i32" if -2**31 <= value < 2**31 else "i64"
            if value % 16 == 0:
                spec["divisible"].append(i)
        elif isinstance(value, float):
            spec["signature"][name] = "fp32"
        elif isinstance(value, TensorDescriptor):  # the JIT's own name for its type
            spec["signature"][name] = mangle_type(value)
        else:
            raise TypeError(f"{fn.__name__}: argument {name} of type {type(value)}")
    staged = spec.get("per_target", {}).get("STAGED")
    for name, neutral in ex.STAGED_KEYS.items():
        if staged and name in spec["constexprs"]:  # off the staged path: launched neutral
            value = spec["constexprs"][name]
            spec["per_target"][name] = {c: value if on else neutral
                                        for c, on in staged.items()}
    return spec


class Recording(list):
    """The specs of the launches seen, in order. Inside ``without_running`` a launch is
    recorded and not run: the experts workload only needs its launches' specs (other
    tests check what those launches compute), and running it costs the interpreter
    minutes."""

    running = True

    @contextlib.contextmanager
    def without_running(self):
        self.running = False
        try:
            yield
        finally:
            self.running = True


@pytest.fixture
def recorded(monkeypatch):
    """A ``Recording`` of every kernel launched while the fixture is active."""
    specs = Recording()
    run = interpreter.InterpretedFunction.run

    def recording_run(self, *args, grid, warmup, **kwargs):
        specs.append(launch_spec(self.fn, args, kwargs))
        if specs.running:
            return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    monkeypatch.setattr(interpreter.InterpretedFunction, "run", recording_run)
    return specs


def run_module_workload():
    """WideMoE at tiny dims: one rank at a narrow and a wider batch, and two simulated
    ranks (the mailbox's publish and polled paths)."""
    cfg = WideMoEConfig.tiny(wide_rows=64)
    stock = LatentMoE(cfg, seed=0, device=DEVICE)
    wide = WideMoE.from_module(stock)
    gen = torch.Generator().manual_seed(0)
    for b in (1, 33):
        wide(torch.randn(b, cfg.hidden, generator=gen).bfloat16())
    SimulatedGroup(stock, 2)(torch.randn(5, cfg.hidden, generator=gen).bfloat16())


def run_stage_workload():
    """Paths the module does not take by default: the front GEMM split along K over
    programs (reduce kernel) and in groups of 1-8 segments a program, the plan on its own
    (BF16 and FP32 input) and polled from a mailbox."""
    gen = torch.Generator().manual_seed(1)
    x, packed = (torch.randn(n, 512, generator=gen).bfloat16() for n in (6, 40))
    one = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=32, SPLIT_K=1, SPLIT_GRID=0, num_warps=4,
               num_stages=3)
    for split_k, grid, group in ((2, 0, 1), (8, 1, 1), (8, 1, 2), (8, 1, 8), (6, 1, 4)):
        front_k.front_gemm(x, packed, config={**one, "SPLIT_K": split_k, "SPLIT_GRID": grid,
                                               "GROUP": group})
    for dtype in (torch.bfloat16, torch.float32):
        plan_k.quantize_mxfp8(torch.randn(5, 64, generator=gen).to(dtype))
    latent, experts, wide_rows, rows = 64, 16, 8, 3
    box = mailbox_k.empty_mailbox((wide_rows, latent, experts), DEVICE)
    generation = torch.zeros(1, dtype=torch.int32)
    front = torch.randn(rows, experts + latent, generator=gen)
    mailbox_k.publish(front, mailbox_k.mailbox_table([box]), 0, 1, generation, latent,
                      experts, wide_rows=wide_rows)
    plan_k.quantize_mxfp8_mailbox(box, generation, rows, latent=latent, world=1,
                                  error=mailbox_k.new_error_record(DEVICE))


def run_experts_workload(recorded: Recording):
    """The experts in every weight layout and activation format (the up and the down
    launch's set apart), at the default and the wide-tile configs, and decode-layout
    weights with scale bytes above 128, in 32-row tiles ending in a half tile and with
    the up weights read through TMA descriptors."""
    inter, b = 32, 9
    ids, (q, qs) = make_ids("random", b, 0), make_plan(b, 0)
    w13, w13_s, w2, w2_s = stock_weights(inter)
    lifted = tuple((s.int() + 40).clamp(max=254).to(torch.uint8) for s in (w13_s, w2_s))
    variants = [(layout, (w13, w13_s, w2, w2_s), a_bf16, wide, {})
                for layout in ex.LAYOUTS for a_bf16 in ((0, 0), (1, 0), (0, 1), (1, 1))
                for wide in (False, True)
                if layout != "wgmma_decode" or a_bf16 == (1, 1)]
    variants.append(("wgmma_decode", (w13, lifted[0], w2, lifted[1]), (1, 1), False, {}))
    # 32-row tiles ending in a half tile (HALF_TILE: both tile heights in one kernel)
    variants.append(("wgmma_decode", (w13, w13_s, w2, w2_s), (1, 1), False,
                     dict(BLOCK_M=32, HALF_TILE=1)))
    # the up weights through TMA descriptors (I a multiple of the 64-row tiles)
    tma_stock = stock_weights(2 * ex.ROW_BLOCK)
    variants.append(("wgmma_decode", tma_stock, (1, 1), False, dict(TMA=1)))
    with recorded.without_running():
        for variant in variants:
            launch_experts(recorded, ids, q, qs, *variant)


def launch_experts(recorded, ids, q, qs, layout, stock, a_bf16, wide, keys):
    """One experts call over ``ids`` in ``layout`` (the up/down launches' A_BF16, wide
    configs, extra config ``keys``), which ``recorded`` sees launch both kernels."""
    before = len(recorded)
    weights = ex.prepare_weights(*stock, layout=layout)
    counts, pairs, gen = ex.routing_lists(ids, E, WIDE_ROWS)
    rows = poison(torch.empty(ids.shape[0] * K, L, dtype=torch.bfloat16))
    up, down = configs(a_bf16, wide, layout)
    down_keys = {k: v for k, v in keys.items() if k != "TMA"}  # an up-launch key
    ex.experts(q, qs, weights, counts, pairs, gen, K, BETA, LINEAR_BETA, rows=rows,
               config_up=dict(up, **keys), config_down=dict(down, **down_keys))
    launched = {spec["kernel"] for spec in recorded[before:]}
    assert {"_experts_up_kernel", "_experts_down_kernel"} <= launched, (layout, a_bf16, keys)


def compile_all(specs, tmp_path, targets=TARGETS) -> dict:
    """Compile each distinct spec for each target in a subprocess (no TRITON_INTERPRET);
    returns compile_specs.py's report: one line a failure (an error, or on sm_90 a write
    to the register operand of an MMA in flight), and the register-operand MMAs seen."""
    distinct = list({json.dumps(s, sort_keys=True): s for s in specs}.values())
    path = tmp_path / "specs.json"
    path.write_text(json.dumps({"targets": list(targets), "specs": distinct}))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")
    here = pathlib.Path(__file__).parent
    # the script's own folder leads its sys.path, not the repository's: name the
    # package's root, so that a checkout which was never pip-installed runs it too
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(here.parent),
                                                      env.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, str(here / "compile_specs.py"), str(path)],
                          env=env, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(done.stdout.splitlines()[-1])
    assert report["compiled"] == len(distinct) * len(targets), report
    return report


def test_every_launched_kernel_compiles_for_h200_and_b200(recorded, tmp_path):
    run_module_workload()
    run_stage_workload()
    run_experts_workload(recorded)
    launched = {s["kernel"] for s in recorded}
    stages = [importlib.import_module(f"{kernels.__name__}.{m.name}")
              for m in pkgutil.iter_modules(kernels.__path__)]
    wanted = {name for module in stages for name, obj in vars(module).items()
              if name.endswith("_kernel") and isinstance(obj, interpreter.InterpretedFunction)}
    assert wanted <= launched, f"the workload never launched {sorted(wanted - launched)}"
    assert len(wanted) >= 10, sorted(wanted)
    report = compile_all(recorded, tmp_path)
    assert not report["failures"], "\n".join(report["failures"])
    # the search for MMA register hazards saw the experts' register-operand MMAs
    assert all(report["register_mmas"].get(k, 0) > 0
               for k in ("_experts_up_kernel", "_experts_down_kernel")), report["register_mmas"]


def table_spec(recorded_spec: dict, latent: int, inter: int, config: dict,
               partner: dict) -> dict:
    """A recorded experts launch (tiny dims) rewritten to a tuned table entry: dims L and
    I, launch ``config`` and, for the up launch, the down config of the same width
    (``partner``: whether the up launch stores BF16 values)."""
    up = recorded_spec["kernel"] == "_experts_up_kernel"
    spec = json.loads(json.dumps(recorded_spec))
    values = dict(LATENT=latent, INTER=inter, TOP_K=WideMoEConfig.kimi_k3().top_k,
                  ROW_BLOCK=ex.ROW_BLOCK, NUM_STAGES=config["num_stages"],
                  BLOCK_K=ex.reduction_block(latent if up else inter,
                                             ex.BLOCK_K_UP if up else ex.BLOCK_K_DOWN),
                  **{k: config.get(k, ex.STAGED_KEYS.get(k, 0))
                     for k in ("BLOCK_M", "BLOCK_N", "A_BF16", *ex.STAGED_KEYS)})
    if up:
        values["STORE_VALUES"] = partner["A_BF16"]
    for name, value in values.items():
        if name in spec["constexprs"]:
            spec["constexprs"][name] = value
        if name in spec.get("per_target", {}):
            spec["per_target"][name] = {c: value for c in spec["per_target"][name]}
    spec["options"] = {k: config[k] for k in OPTIONS if config.get(k)}
    return spec


def test_h200_table_experts_leave_no_mma_register_operand_in_flight(recorded, tmp_path):
    """Every experts config of the shipped H200 table (decode layout: the Hopper path whose
    MMAs take the weights from registers), at its production dims, compiled for sm_90:
    no instruction writes the A registers of an MMA still in flight (sass_hazards.py;
    without ``experts._settled`` Triton 3.6 leaves such writes in the up and down loops:
    NOTES, "Register-operand wait")."""
    ids, plan = make_ids("random", 9, 0), make_plan(9, 0)
    with recorded.without_running():
        for keys, inter in (({}, 32), (dict(TMA=1), 2 * ex.ROW_BLOCK)):  # TMA: whole tiles
            launch_experts(recorded, ids, *plan, "wgmma_decode", stock_weights(inter), (1, 1),
                           False, keys)
    decode = {}
    for spec in recorded:
        c = spec["constexprs"]
        if c.get("DECODE") and spec["kernel"] in ("_experts_up_kernel", "_experts_down_kernel"):
            decode.setdefault((spec["kernel"], c.get("TMA", 0)), spec)
    table = tuning.load_table("NVIDIA H200")["kernels"]
    specs = []
    for latent, inter, up, down in decode_entries(table):
        specs.append(table_spec(decode[("_experts_up_kernel", up.get("TMA", 0))], latent,
                                inter, up, down))
        specs.append(table_spec(decode[("_experts_down_kernel", 0)], latent, inter, down,
                                down))
    assert len(specs) >= 8, "the table lost its decode-layout experts entries"
    report = compile_all(specs, tmp_path, targets=(90,))
    assert not report["failures"], "\n".join(report["failures"])
    assert report["register_mmas"].get("_experts_up_kernel", 0) > 0, report["register_mmas"]
