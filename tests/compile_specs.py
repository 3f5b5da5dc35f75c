"""Compile recorded kernel launches (``test_compile.py``) with Triton's compiler, no GPU:

    python tests/compile_specs.py SPECS.json

SPECS.json holds {"targets": [90, 100], "specs": [...]}, each spec a kernel's module and
name, its argument types, constexpr values (those in "per_target" by target), 16-divisible
argument indices and options.
Prints one JSON line last: {"compiled": n, "failures": ["kernel sm_X {...}: error", ...]}.
Must run without TRITON_INTERPRET, so that ``triton.jit`` builds compilable functions."""
import importlib
import json
import os
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource


def compile_spec(spec: dict, capability: int) -> None:
    fn = getattr(importlib.import_module(spec["module"]), spec["kernel"])
    attrs = {(i,): [["tt.divisibility", 16]] for i in spec["divisible"]}
    # Constexprs a launch sets by the GPU it runs on: this target's value.
    constexprs = dict(spec["constexprs"])
    constexprs.update({name: by_target[str(capability)]
                       for name, by_target in spec.get("per_target", {}).items()})
    src = ASTSource(fn, signature=spec["signature"], constexprs=constexprs, attrs=attrs)
    triton.compile(src, target=GPUTarget("cuda", capability, 32), options=spec["options"])


def main(path: str) -> None:
    assert "TRITON_INTERPRET" not in os.environ, "run without TRITON_INTERPRET"
    todo = json.loads(open(path).read())
    compiled, failures = 0, []
    for spec in todo["specs"]:
        for capability in todo["targets"]:
            try:
                compile_spec(spec, capability)
            except Exception as e:  # every failure is reported, none stops the others
                what = {k: spec[k] for k in ("constexprs", "per_target", "options")
                        if k in spec}
                failures.append(f"{spec['kernel']} sm_{capability} {what}: "
                                f"{type(e).__name__}: {str(e)[-1500:]}")
            compiled += 1
    print(json.dumps({"compiled": compiled, "failures": failures}))


if __name__ == "__main__":
    main(sys.argv[1])
