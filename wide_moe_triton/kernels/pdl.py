"""Programmatic dependent launch (PDL, compute capability 9.0 and newer), for the launch
that follows the experts' down kernel: finalize.

A kernel launched with ``launch_pdl`` may be started by the GPU before the kernel ahead
of it in the stream has finished, as soon as every program of that one has called
``allow_dependent_launch`` (or exited); it must then call ``wait_for_previous_grid``
before its first load, which returns once the kernel ahead has completed and its writes
are visible. So the dependent's launch latency (0.7-0.9 µs on the H200) runs under the
last wave of the kernel ahead instead of after it: at b = 65 that is a third of
finalize's time (NOTES: Dependent launch). Only the order of events at the
boundary changes, never what a kernel reads: results are bitwise the same.

A kernel calls ``allow_dependent_launch`` as its programs start: all of its programs
have been placed on SMs by then, so the dependent's programs only take the places its
finished ones leave.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from .front import _interpreting

MIN_CAPABILITY = 9


def dependent_launch(device) -> bool:
    """Whether launches on ``device`` use PDL: a CUDA GPU of compute capability 9.0 or
    newer running compiled kernels (Triton's interpreter runs no PTX)."""
    device = torch.device(device)
    return (device.type == "cuda" and not _interpreting()
            and torch.cuda.get_device_capability(device)[0] >= MIN_CAPABILITY)


@triton.jit
def wait_for_previous_grid(PDL: tl.constexpr):
    """With PDL: wait until the kernel ahead in the stream has completed and its writes
    are visible; in a kernel launched with ``launch_pdl``, before any load."""
    if PDL:
        gdc_wait()


@triton.jit
def allow_dependent_launch(PDL: tl.constexpr):
    """With PDL: the next kernel in the stream, if launched with ``launch_pdl``, may start
    (it still waits for this one to complete before it reads, ``wait_for_previous_grid``)."""
    if PDL:
        gdc_launch_dependents()
