"""Compile recorded kernel launches (``test_compile.py``) with Triton's compiler, no GPU:

    python tests/compile_specs.py SPECS.json

SPECS.json holds {"targets": [90, 100], "specs": [...]}, each spec a kernel's module and
name, its argument types, constexpr values (those in "per_target" by target), 16-divisible
argument indices and options.
Every sm_90 compile's SASS is also searched for writes to the register operand of an MMA
still in flight (``sass_hazards``): each kernel that has one is a failure.
Prints one JSON line last: {"compiled": n, "failures": ["kernel sm_X {...}: error", ...],
"register_mmas": {kernel: MMAs with a register operand in its sm_90 SASS, summed}}.
Must run without TRITON_INTERPRET, so that ``triton.jit`` builds compilable functions."""
import importlib
import json
import multiprocessing
import os
import sys
from concurrent.futures import ProcessPoolExecutor

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

import sass_hazards  # this folder is on sys.path: the script runs from it
from wide_moe_triton.kernels.experts import HOPPER


def compile_spec(spec: dict, capability: int):
    fn = getattr(importlib.import_module(spec["module"]), spec["kernel"])
    attrs = {(i,): [["tt.divisibility", 16]] for i in spec["divisible"]}
    # Constexprs a launch sets by the GPU it runs on: this target's value.
    constexprs = dict(spec["constexprs"])
    constexprs.update({name: by_target[str(capability)]
                       for name, by_target in spec.get("per_target", {}).items()})
    src = ASTSource(fn, signature=spec["signature"], constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", capability, 32),
                          options=spec["options"])


def register_hazards(kernel) -> tuple[str | None, int]:
    """(a description of the kernel's first write to an in-flight MMA's register operand,
    or None; how many MMAs with a register operand its SASS holds)."""
    found, register_mmas, _ = sass_hazards.kernel_hazards(
        sass_hazards.sass_of(kernel.asm["cubin"]))
    if not found:
        return None, register_mmas
    return (f"{len(found)} writes to the A registers of an MMA still in flight, first "
            f"{found[0].writer!r} over {found[0].mma!r} ({found[0].where})"), register_mmas


def compile_job(job) -> tuple[str, int, str | None]:
    """Compile one (spec, capability): (kernel name, register-operand MMAs in its sm_90
    SASS, a failure line or None)."""
    spec, capability = job
    name = spec["kernel"]
    what = {k: spec[k] for k in ("constexprs", "per_target", "options") if k in spec}
    try:
        kernel = compile_spec(spec, capability)
        if capability // 10 != HOPPER:
            return name, 0, None
        hazard, mmas = register_hazards(kernel)
        return name, mmas, hazard and f"{name} sm_{capability} {what}: {hazard}"
    except Exception as e:  # every failure is reported, none stops the others
        return name, 0, f"{name} sm_{capability} {what}: {type(e).__name__}: {str(e)[-1500:]}"


def main(path: str) -> None:
    assert "TRITON_INTERPRET" not in os.environ, "run without TRITON_INTERPRET"
    todo = json.loads(open(path).read())
    jobs = [(spec, capability) for spec in todo["specs"] for capability in todo["targets"]]
    # One compile a core: each is a single-threaded pass pipeline plus ptxas. Forked
    # before any compile, so the workers share only the imports.
    workers = min(len(jobs), len(os.sched_getaffinity(0))) or 1
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork")) as pool:
        done = list(pool.map(compile_job, jobs))
    failures = [failure for _, _, failure in done if failure]
    register_mmas = {}
    for name, mmas, _ in done:
        register_mmas[name] = register_mmas.get(name, 0) + mmas
    print(json.dumps({"compiled": len(done), "failures": failures,
                      "register_mmas": register_mmas}))


if __name__ == "__main__":
    main(sys.argv[1])
