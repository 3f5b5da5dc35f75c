"""The shared experts of one rank: ``bf16(down_r . bf16(situ(g, u)))`` with
``g = bf16(gate_r . x)`` and ``u = bf16(up_r . x)`` (``reference.shared_expert``).

Two launches of the front GEMM (kernels/front.py), so that the shared expert gets its
reduction order, fixed per shape and never per batch width, instead of the order of a
BLAS kernel picked per batch width (which made a token's output depend on its batch on
the H200):

- gate/up (``linear_situ``, tuning kernel ``shared_gate_up``): the gate and up rows
  interleaved once at load (``interleave_gate_up``), so that every output tile holds both
  inputs of its SiTU; each sum is rounded to BF16, then SiTU in FP32 is rounded once
  into the hidden [b, S/T];
- down (``linear``, tuning kernel ``shared_down``): the hidden times the down rows,
  rounded once to BF16: the rank's partial [b, H].

The rounding points are the stock path's (BF16 linears with FP32 accumulation and BF16
outputs, SiTU in FP32 rounded once): only accumulation orders differ. Both launches run
one after the other on one stream, so one split-K workspace serves both.
"""

from __future__ import annotations

import torch

from ..checks import check_tensor
from . import front

KERNEL_GATE_UP = "shared_gate_up"
KERNEL_DOWN = "shared_down"


def interleave_gate_up(gate_up: torch.Tensor) -> torch.Tensor:
    """The stock ``shared_gate_up`` [2S, H] (gate rows, then up rows) with its rows
    interleaved, BF16 [2S, H]: row 2j is gate row j, row 2j+1 up row j."""
    check_tensor("gate_up", gate_up, torch.bfloat16, (None, None), contiguous=False)
    if gate_up.shape[0] % 2:
        raise ValueError(f"gate_up must have an even number of rows (gate rows then up "
                         f"rows), got {gate_up.shape[0]}")
    gate, up = gate_up.chunk(2)
    return torch.stack([gate, up], dim=1).reshape(gate_up.shape).contiguous()


def max_workspace_numel(rows: int, S: int, H: int, device=None) -> int:
    """FP32 elements of a split-K workspace serving both launches at up to ``rows`` rows
    (S: this rank's shared intermediate, H: hidden)."""
    return max(front.max_workspace_numel(rows, 2 * S, H, device, KERNEL_GATE_UP),
               front.max_workspace_numel(rows, H, S, device, KERNEL_DOWN))


def resolve(b: int, S: int, H: int, beta: float, linear_beta: float | None,
            device) -> tuple[front.GemmLaunch, front.GemmLaunch]:
    """The tuned launches (gate/up, down) of ``shared_expert`` at b >= 1 rows, S this
    rank's shared intermediate, H hidden."""
    return (front.resolve(b, 2 * S, H, front.EPI_SITU, KERNEL_GATE_UP, device, None, beta,
                          linear_beta),
            front.resolve(b, H, S, front.EPI_BF16, KERNEL_DOWN, device))


def launch(runs: tuple[front.GemmLaunch, front.GemmLaunch], x: torch.Tensor,
           gate_up_pairs: torch.Tensor, down: torch.Tensor, hidden: torch.Tensor,
           out: torch.Tensor, workspace: torch.Tensor) -> torch.Tensor:
    """``shared_expert`` for arguments already checked against ``runs`` (``resolve``):
    writes ``hidden`` then ``out``, returns ``out``."""
    front.launch(runs[0], x, gate_up_pairs, hidden, workspace)
    return front.launch(runs[1], hidden, down, out, workspace)


def shared_expert(x: torch.Tensor, gate_up_pairs: torch.Tensor, down: torch.Tensor,
                  beta: float, linear_beta: float | None, *,
                  hidden: torch.Tensor | None = None, out: torch.Tensor | None = None,
                  workspace: torch.Tensor | None = None, config_gate_up: dict | None = None,
                  config_down: dict | None = None) -> torch.Tensor:
    """This rank's shared-expert partial, BF16 [b, H], for x BF16 [b, H].

    ``gate_up_pairs``: BF16 [2S, H] from ``interleave_gate_up``. ``down``: BF16 [H, S]
    (the stock ``shared_down``'s layout). ``beta``, ``linear_beta``: SiTU's. ``hidden``:
    a BF16 [b, S] buffer for the activation (default: allocated). ``out``: a BF16 [b, H]
    buffer (default: allocated). ``workspace``: as in ``front.front_gemm``, for both
    launches. ``config_gate_up``/``config_down``: launch configs (default: the tuned
    tables of ``shared_gate_up``/``shared_down``)."""
    check_tensor("x", x, torch.bfloat16, ("b", "H"))
    check_tensor("gate_up_pairs", gate_up_pairs, torch.bfloat16, ("2S", x.shape[1]),
                 x.device)
    S = gate_up_pairs.shape[0] // 2
    check_tensor("down", down, torch.bfloat16, (x.shape[1], S), x.device)
    if hidden is not None:
        check_tensor("hidden", hidden, torch.bfloat16, (x.shape[0], S), x.device,
                     contiguous=False)
    hidden = front.linear_situ(x, gate_up_pairs, beta, linear_beta, out=hidden,
                               kernel=KERNEL_GATE_UP, workspace=workspace,
                               config=config_gate_up)
    return front.linear(hidden, down, out=out, kernel=KERNEL_DOWN, workspace=workspace,
                        config=config_down)
