"""One stage a file: each holds its ``@triton.jit`` body, its launch wrapper and its
tuning key (``KERNEL``, ``DEFAULT``, ``SPACE``, ``shape_key``); the routed experts, the
largest stage, are a package of one concern a module (``experts/``). ``bits.py`` holds the
FP32/BF16 bit conversions that several stages share, ``situ.py`` the activation that the
routed and the shared experts share, ``pdl.py`` the programmatic dependent launch from
the experts' down kernel to finalize. The front GEMM (``front.py``) also carries every
other dense linear (the shared expert's, ``shared.py``; the tail's up-projection,
``tail.py``), each under its own tuning name. ``compat.py`` gives Triton's interpreter
Triton 3.9's definitions on the older Tritons that pyproject admits."""

import contextlib
import os

import numpy as np
import torch

# Decided once, as ``triton.jit`` decides at import whether the kernels run interpreted.
_INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

# Before any kernel is defined or launched. compat replaces definitions in Triton's
# interpreter module itself, so every interpreted kernel of the process, not only
# these, runs under them from here on.
if _INTERPRETED:
    from .compat import match_interpreter_to_triton_3_9

    match_interpreter_to_triton_3_9()


def check_device(device) -> None:
    """Raise RuntimeError naming ``TRITON_INTERPRET=1`` where ``device`` is a CPU and the
    kernels were defined for a GPU: ``triton.jit`` chooses Triton's interpreter (the only
    way they run on a CPU) as each kernel is defined, from the environment at import, and
    their first launch would otherwise fail deep inside Triton."""
    if torch.device(device).type == "cpu" and not _INTERPRETED:
        raise RuntimeError(
            f"device {device}: the kernels run on a CPU only in Triton's interpreter, and "
            f"they were imported without it; set TRITON_INTERPRET=1 in the environment "
            f"before wide_moe_triton is imported (e.g. TRITON_INTERPRET=1 python ...), or "
            f"use a CUDA device")


def quiet():
    """A context for a launch: in Triton's interpreter, numpy's floating-point warnings
    off within it (its numpy arithmetic warns where Inf or NaN operands meet, e.g. Inf
    inputs, which a GPU computes silently and the caller gets as Inf or NaN outputs);
    elsewhere nothing. Scoped to the launch, never numpy's global state."""
    return np.errstate(all="ignore") if _INTERPRETED else contextlib.nullcontext()
