"""The routed experts: ``rows[p] = bf16(W2_e . mxfp8(situ(W13_e . q[t])))`` for every
listed (token t, slot k) pair p = t*K + k routed to expert e (``reference.expert_rows``).

Two launches, both with grid (expert, column tile), both building their row tiles on the
device from the routing lists (no host sync, CUDA-graph capturable):

- ``up``   (E, cdiv(I, BLOCK_N)): for each tile of BLOCK_M pairs of expert e, gathers the
  tokens' MXFP8 plan rows, computes BLOCK_N gate and BLOCK_N up columns with one dot a
  reduction step over the tile's 2*BLOCK_N weight rows (E2M1 weights x E4M3
  activations, exact products, see below; FP32 accumulation) over L, applies SiTU in
  FP32 and quantizes the hidden to MXFP8 per 32 columns (``plan.mxfp8_tile``) into the
  workspace at row p.
- ``down`` (E, cdiv(L, BLOCK_N)): same list walk; the dot of W2_e with the hidden rows
  over I, rounded once to BF16 into ``rows`` at row p.

Each program streams its weight slice once per tile of BLOCK_M pairs, so an expert with
at most BLOCK_M pairs streams its weights once per call; an expert no pair chose costs
one load of its count.

How the weights stream on Hopper ("NOTES: <heading>", here and in the modules, names the
section of benchmarks/NOTES.md that gives the measurement, its date and its command):

- Swap-AB: the weights are the MMA's left operand, so that a weight tile fills the
  tensor cores' 64-row side and the handful of tokens an expert gets their narrow side
  (16 or more), instead of a token tile padded to 64 rows.
- Hopper has no MX tensor cores: the E2M1 tile is upcast to BF16 in registers and feeds
  wgmma's register operand. The tiled layouts (``ExpertWeights``) order each row's
  bytes the way that operand's threads take them and store each (64 rows x one
  reduction step) tile contiguously, so tiles arrive as wide, contiguous, asynchronous
  copies (NOTES: Weight layout).
- "wgmma_decode", the Hopper default, also permutes the bits of each 4-byte word so
  that our own decode is a few shifts and masks (``_bf16_pairs``), about a third fewer
  instructions than Triton's E2M1 table lookup (NOTES: Weight layout), and on Hopper
  multiplies the exact BF16 tiles with ``tl.dot`` (``staged_dot``), whose operands the
  compiler's pipeliner stages in shared memory asynchronously: the gathered activation
  rows then feed the MMA from shared memory with no store through registers, no fence
  and one barrier less a step (``_reduce_staged``, ``_bf16_weights_dot``). "wgmma"
  feeds the E2M1 codes to ``tl.dot_scaled``, whose activation operand the pipeliner
  does not stage (``_reduce_prefetched``). NOTES: Exact decode instead of dot_scaled
  on Hopper.
- ``maxnreg`` (a register cap, per config) buys resident warps to hide latency (NOTES:
  Weight layout).
- The staged path's MMAs take the decoded weights from registers: each step waits for
  its MMAs before the next step decodes into those registers (``_settled``), which
  Triton 3.6 does not ensure by itself (NOTES: Register-operand wait).

Reproducibility: an output row of an MMA depends only on its own input row and on the
order of the reduction, which is fixed by BLOCK_K (chosen per shape, at
``prepare_weights``, never per batch width). So rows do not depend on the claim order
within a list nor on which other tokens share the batch; only the launch config
(CONFIG_KEYS, and STAGED_KEYS on the staged path) varies with the batch-width bucket.
(On a GPU, Triton may pick a different MMA instruction for another BLOCK_M, a half
tile or num_warps; that it sums a row in the same order is the hardware's property,
which tests/test_experts.py checks bit for bit.)

``A_BF16`` (a config choice, 0/1; 1 for "wgmma_decode"): feed the activations to the
dot as E4M3 codes with their scales, or as their BF16 values, computed once ahead (the
plan's by ``_plan_values_kernel``, the hidden's by the up kernel, into the workspace).
E4M3 times an E8M0 scale is exact in BF16 for scale bytes 3..246, i.e. for every block
whose amax is at least 2**-116 (below that, BF16's subnormals run out): DESIGN.md's
exact upcast. Both variants feed the same BF16 products to the same FP32 MMA; which one
streams faster is measured.

The package, one concern a module (every name importers use is re-exported here):

- ``layout``: the weight formats and their encoding (``prepare_weights``,
  ``ExpertWeights``), and which format and which dot a device takes.
- ``configs``: the launch configs: defaults, search spaces, priors, and their checks.
- ``tiles``: the ``@triton.jit`` bodies, kernels and helpers in one module, since a jit
  function finds the functions it calls among its own module's globals.
- this module: the launcher (``experts``), its workspace and the host-built routing
  lists; ``only_launch`` and the benchmarks swap the kernel handles here.
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import torch
import triton
from triton.tools.tensor_descriptor import TensorDescriptor

from ...checks import check_tensor
from ...config import MX_BLOCK
from ...tuning import config_for
from ..front import _interpreting
from .. import quiet
from ..pdl import dependent_launch
# Re-exported: importers name these as ``experts.X``.
from .configs import (  # noqa: F401
    CONFIG_KEYS, DEFAULT_DOWN, DEFAULT_DOWN_DECODE, DEFAULT_DOWN_STAGED, DEFAULT_UP,
    DEFAULT_UP_DECODE, DEFAULT_UP_STAGED, KERNEL_DOWN, KERNEL_UP, PRIORS_DOWN,
    PRIORS_DOWN_DECODE, PRIORS_DOWN_STAGED, PRIORS_UP, PRIORS_UP_DECODE, PRIORS_UP_STAGED,
    SPACE_DOWN, SPACE_UP, STAGED_KEYS, Tuning, _check_config, _check_configs, _tuning,
    config_rows, shape_key, tuning)
from .layout import (  # noqa: F401
    BF16_PAIR_FIELDS, BLOCK_K_DOWN, BLOCK_K_UP, HOPPER, LAYOUTS, ROW_BLOCK, TILED_LAYOUTS,
    ExpertWeights, _encode_rows, decode_words, default_layout, encode_words, lane_order,
    prepare_weights, reduction_block, staged_dot, tile, untile, word_code)
from .tiles import (  # noqa: F401
    _decoded_weights, _experts_down_kernel, _experts_up_kernel, _plan_values_kernel)


# --------------------------------------------------------------------------- workspace

class Workspace(NamedTuple):
    """Buffers between the stages of the experts, row p = pair t*K + k, row t = token.

    ``h_codes`` uint8 [P, I] and ``h_scales`` uint8 [P, I/32]: the MXFP8 hidden (E4M3,
    E8M0), the layer's rounding point; ``h_values`` bf16 [P, I]: the same values in BF16
    (exact), written for a down launch that takes BF16 activations; ``q_values`` bf16
    [R, L]: the plan's values in BF16, for an up launch that does."""

    h_codes: torch.Tensor
    h_scales: torch.Tensor
    h_values: torch.Tensor
    q_values: torch.Tensor


def make_workspace(rows: int, top_k: int, latent: int, inter: int, device) -> Workspace:
    """An uninitialized workspace for batches of up to ``rows`` tokens (e.g. wide_rows,
    so that one allocation serves every batch width, CUDA graphs included)."""
    pairs = rows * top_k
    empty = lambda *shape, dtype: torch.empty(*shape, dtype=dtype, device=device)  # noqa: E731
    return Workspace(empty(pairs, inter, dtype=torch.uint8),
                     empty(pairs, inter // MX_BLOCK, dtype=torch.uint8),
                     empty(pairs, inter, dtype=torch.bfloat16),
                     empty(rows, latent, dtype=torch.bfloat16))


# ------------------------------------------------------------------------ routing lists

def routing_lists(ids: torch.Tensor, num_experts: int, wide_rows: int, *, generation: int = 0,
                  generator: torch.Generator | None = None):
    """Routing lists as the route kernel leaves them, built on the host (a test and
    reference helper): (counts int32 [2, E], pairs int32 [2, E, wide_rows], generation
    int32 [1]) for ``ids`` [b, K], claimed in parity ``generation & 1``. The other parity
    is empty, unused list entries are -1. With ``generator``, each list's order is a
    random permutation (as atomic claims leave it); else pairs ascend."""
    b, top_k = ids.shape
    if b > wide_rows:
        raise ValueError(f"b ({b}) must be <= wide_rows ({wide_rows})")
    device = ids.device
    parity = generation & 1
    counts = torch.zeros(2, num_experts, dtype=torch.int32, device=device)
    pairs = torch.full((2, num_experts, wide_rows), -1, dtype=torch.int32, device=device)
    flat = ids.reshape(-1).long().cpu()
    for e in range(num_experts):
        members = (flat == e).nonzero().squeeze(1)
        if generator is not None:
            members = members[torch.randperm(len(members), generator=generator)]
        counts[parity, e] = len(members)
        pairs[parity, e, :len(members)] = members.to(device=device, dtype=torch.int32)
    gen = torch.tensor([generation], dtype=torch.int32, device=device)
    return counts, pairs, gen



# ----------------------------------------------------------------------------- launcher

def _check_workspace(workspace, b: int, top_k: int, latent: int, inter: int,
                     device) -> Workspace:
    if not isinstance(workspace, Workspace):
        raise TypeError(f"workspace must be a Workspace (from make_workspace), got "
                        f"{type(workspace).__name__}")
    check_tensor("workspace.h_codes", workspace.h_codes, torch.uint8, (None, inter), device)
    pairs = workspace.h_codes.shape[0]
    check_tensor("workspace.h_scales", workspace.h_scales, torch.uint8,
                 (pairs, inter // MX_BLOCK), device)
    check_tensor("workspace.h_values", workspace.h_values, torch.bfloat16, (pairs, inter),
                 device)
    check_tensor("workspace.q_values", workspace.q_values, torch.bfloat16, (None, latent),
                 device)
    if pairs < b * top_k:
        raise ValueError(f"workspace.h_codes must have >= b*K = {b * top_k} rows, got {pairs}")
    if workspace.q_values.shape[0] < b:
        raise ValueError(f"workspace.q_values must have >= b = {b} rows, got "
                         f"{workspace.q_values.shape[0]}")
    return workspace



def tma_boxes(block_n: int, block_k: int, row_block: int = ROW_BLOCK):
    """The box shapes of ``_weight_descriptors`` for up programs of ``block_n`` hidden
    columns and steps of ``block_k``: (words, scales)."""
    blocks = block_n // row_block
    return ([1, 2, blocks, row_block, block_k // 8],
            [1, 2, blocks, 1, row_block * block_k // MX_BLOCK])


def _weight_descriptors(weights: ExpertWeights, block_n: int):
    """Tensor-memory-accelerator descriptors of the up weights for programs of ``block_n``
    hidden columns (``_tma_weights``): w13's words as [E, 2 (gate, up), I / row_block,
    steps * row_block, words a row a step] and its scales as [E, 2, I / row_block, steps,
    row_block * scales a row a step], each the tiled order of ``ExpertWeights`` seen as
    5 dimensions; one box of each is a program's step: the tiles of its gate rows and of
    its up rows. For "wgmma_decode" weights (the staged path, ``_check_staged_keys``)
    whose I is a multiple of row_block (else a tile would hold gate and up rows;
    BLOCK_N always is one) and whose scales of a tile's step fit a box's 256 bytes a
    dimension (the hardware's limit: BLOCK_K <= 128)."""
    E, I, rb, bk = weights.num_experts, weights.inter, weights.row_block, weights.block_k_up
    word_box, scale_box = tma_boxes(block_n, bk, rb)
    if I % rb:
        raise ValueError(f"config_up['TMA'] needs I ({I}) a multiple of the weights' row "
                         f"block ({rb})")
    if scale_box[-1] > 256:
        raise ValueError(f"config_up['TMA'] needs the up reduction step ({bk}) at most "
                         f"{256 * MX_BLOCK // rb}: a box holds at most 256 bytes of a row")
    steps = weights.latent // bk
    words = weights.w13.view(torch.int32).view(E, 2, I // rb, steps * rb, word_box[-1])
    scales = weights.w13_scales.view(E, 2, I // rb, steps, scale_box[-1])
    return (TensorDescriptor.from_tensor(words, word_box),
            TensorDescriptor.from_tensor(scales, scale_box))


def _launch_options(config: dict) -> dict:
    """Compiler options of a config: warps, pipeline depth, and a register cap (maxnreg,
    0 = the compiler's choice), which trades registers for resident warps: the weight
    upcast is a long chain of dependent integer ops whose latency only other warps hide."""
    options = dict(num_warps=config["num_warps"], num_stages=config["num_stages"])
    if config.get("maxnreg"):
        options["maxnreg"] = config["maxnreg"]
    return options


class _NoLaunch:
    """A kernel handle whose launches do nothing."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


@contextlib.contextmanager
def only_launch(kind: str):
    """Within: ``experts`` launches only its ``kind`` kernel ("up" or "down") and skips the
    other, so that one launch can be timed alone (the tuner, the benchmarks). The skipped
    launch's outputs keep what an earlier call wrote (down reads the hidden the last up
    launch left in the workspace). It swaps module globals: not for concurrent callers."""
    global _experts_up_kernel, _experts_down_kernel
    if kind not in ("up", "down"):
        raise ValueError(f"kind must be 'up' or 'down', got {kind!r}")
    saved = _experts_up_kernel, _experts_down_kernel
    if kind == "up":
        _experts_down_kernel = _NoLaunch()
    else:
        _experts_up_kernel = _NoLaunch()
    try:
        yield
    finally:
        _experts_up_kernel, _experts_down_kernel = saved


def experts(q: torch.Tensor, q_scales: torch.Tensor, weights: ExpertWeights,
            counts: torch.Tensor, pairs: torch.Tensor, generation: torch.Tensor,
            top_k: int, beta: float, linear_beta: float | None, *,
            rows: torch.Tensor | None = None, workspace: Workspace | None = None,
            config_up: dict | None = None, config_down: dict | None = None) -> torch.Tensor:
    """``rows[t*K + k] = bf16(W2_e . mxfp8(situ(W13_e . q[t])))`` for every pair listed
    in this call's parity of the routing lists; BF16 [b*K, L].

    q/q_scales: the MXFP8 plan, uint8 [b, L] / [b, L/32]. weights: ``prepare_weights``'s
    result. counts int32 [2, E], pairs int32 [2, E, R], generation int32 [1]: the routing
    lists; the kernels use parity ``generation[0] & 1``, read on the device, and expert
    e's pairs ``pairs[p, e, :counts[p, e]]`` in any order (each pair p < b*K listed
    exactly once, as the route kernel guarantees: rows of unlisted pairs are not written).
    beta/linear_beta: SiTU's parameters (linear_beta None: u' = u).

    rows: the output buffer (BF16 [b*K, L]), allocated if None. workspace: the buffers
    between the stages (``make_workspace`` for >= b tokens), allocated if None; pass both
    for CUDA graphs. config_up/config_down: launch configs (``CONFIG_KEYS``; on the staged
    path also ``STAGED_KEYS``, COLS for the down launch only), else the tuned ones for
    batch width b. The reduction steps are the weights'
    (``prepare_weights``)."""
    if not isinstance(weights, ExpertWeights):
        raise TypeError(f"weights must be an ExpertWeights (from prepare_weights), got "
                        f"{type(weights).__name__}")
    E, L, inter = weights.num_experts, weights.latent, weights.inter
    device = weights.device
    check_tensor("q", q, torch.uint8, ("b", L), device)
    b = q.shape[0]
    check_tensor("q_scales", q_scales, torch.uint8, (b, L // MX_BLOCK), device)
    check_tensor("counts", counts, torch.int32, (2, E), device)
    check_tensor("pairs", pairs, torch.int32, (2, E, None), device)
    check_tensor("generation", generation, torch.int32, (1,), device)
    wide_rows = pairs.shape[2]
    if not isinstance(top_k, int) or isinstance(top_k, bool) or not 1 <= top_k <= E:
        raise ValueError(f"top_k must be an int in [1, {E}], got {top_k!r}")
    if not beta > 0 or (linear_beta is not None and not linear_beta > 0):
        raise ValueError(f"beta ({beta}) and linear_beta ({linear_beta}) must be positive")
    num_pairs = b * top_k
    if rows is None:
        rows = torch.empty(num_pairs, L, dtype=torch.bfloat16, device=device)
    check_tensor("rows", rows, torch.bfloat16, (num_pairs, L), device)
    if workspace is None:
        workspace = make_workspace(b, top_k, L, inter, device)
    ws = _check_workspace(workspace, b, top_k, L, inter, device)
    run = resolve(weights, b, top_k, wide_rows, beta, linear_beta, config_up, config_down)
    if num_pairs == 0:
        return rows
    return launch(run, q, q_scales, counts, pairs, generation, rows, ws)


class ExpertsLaunch(NamedTuple):
    """One ``experts`` call's launches, resolved once for its (weights, b): the grids
    and every argument of the up and down kernels but the call's tensors (the weights
    and their TMA descriptors are bound)."""

    plan_values: tuple | None  # (grid, block): the plan's exact BF16 values, for A_BF16
    up_grid: tuple
    up: dict
    down_grid: tuple
    down: dict


def resolve(weights: ExpertWeights, b: int, top_k: int, wide_rows: int, beta: float,
            linear_beta: float | None, config_up: dict | None = None,
            config_down: dict | None = None) -> ExpertsLaunch:
    """The launches of ``experts`` over ``weights`` at b tokens of ``top_k`` pairs, lists
    of ``wide_rows`` (checked arguments): the configs as given or the tuned ones for
    batch width b, checked."""
    E, L, inter = weights.num_experts, weights.latent, weights.inter
    device = weights.device
    decode = weights.layout == "wgmma_decode"
    tune = tuning(weights.layout, device)
    key = shape_key(L, inter, E) + tune.suffix
    staged = decode and staged_dot(device)
    cfg_up, cfg_down = _check_configs(
        config_up if config_up is not None else
        config_for(KERNEL_UP, key, b, tune.default_up, device),
        config_down if config_down is not None else
        config_for(KERNEL_DOWN, key, b, tune.default_down, device), decode, staged)
    tma = cfg_up.get("TMA", 0)
    w_desc, ws_desc = _weight_descriptors(weights, cfg_up["BLOCK_N"]) if tma else (None, None)
    tiles = dict(ROW_BLOCK=weights.row_block, WGMMA_ORDER=weights.layout in TILED_LAYOUTS,
                 DECODE=decode, STAGED=staged,
                 INTERPRET=_interpreting())
    codes = (lambda t: t.view(torch.int32)) if decode else (lambda t: t)
    up = dict(
        w_ptr=codes(weights.w13), ws_ptr=weights.w13_scales, w_desc=w_desc, ws_desc=ws_desc,
        num_experts=E, wide_rows=wide_rows, beta=float(beta),
        linear_beta=float(linear_beta) if linear_beta is not None else 1.0,
        LATENT=L, INTER=inter, TOP_K=top_k, HAS_LINEAR_BETA=linear_beta is not None,
        A_BF16=cfg_up["A_BF16"], STORE_VALUES=cfg_down["A_BF16"], **tiles,
        WIDE_SCALES=weights.wide_scales_up,
        BLOCK_M=cfg_up["BLOCK_M"], BLOCK_N=cfg_up["BLOCK_N"], BLOCK_K=weights.block_k_up,
        NUM_STAGES=cfg_up["num_stages"], MASK_ROWS=cfg_up.get("MASK_ROWS", 0),
        HALF_TILE=cfg_up.get("HALF_TILE", 0), TMA=tma, **_launch_options(cfg_up))
    cols = cfg_down.get("COLS", 1)
    down = dict(
        w_ptr=codes(weights.w2), ws_ptr=weights.w2_scales, num_experts=E,
        wide_rows=wide_rows, LATENT=L, INTER=inter, A_BF16=cfg_down["A_BF16"], **tiles,
        WIDE_SCALES=weights.wide_scales_down,
        BLOCK_M=cfg_down["BLOCK_M"], BLOCK_N=cfg_down["BLOCK_N"],
        BLOCK_K=weights.block_k_down, NUM_STAGES=cfg_down["num_stages"], COLS=cols,
        MASK_ROWS=cfg_down.get("MASK_ROWS", 0), HALF_TILE=cfg_down.get("HALF_TILE", 0),
        PDL_TRIGGER=dependent_launch(device),
        **_launch_options(cfg_down))
    block = reduction_block(L, 512)
    plan_values = ((b, L // block), block) if cfg_up["A_BF16"] else None
    return ExpertsLaunch(plan_values, (E, triton.cdiv(inter, cfg_up["BLOCK_N"])),
                         up, (E, triton.cdiv(triton.cdiv(L, cfg_down["BLOCK_N"]), cols)), down)


def launch(run: ExpertsLaunch, q: torch.Tensor, q_scales: torch.Tensor, counts: torch.Tensor,
           pairs: torch.Tensor, generation: torch.Tensor, rows: torch.Tensor,
           ws: Workspace) -> torch.Tensor:
    """``experts`` of checked arguments (at least one pair) with a resolved launch
    (``resolve``); returns ``rows``."""
    with quiet():
        if run.plan_values is not None:
            # q_values[:b] = the exact BF16 values of the MXFP8 plan (the up launch's A_BF16).
            grid, block = run.plan_values
            _plan_values_kernel[grid](q, q_scales, ws.q_values, COLS=q.shape[1], BLOCK=block,
                                      num_warps=4)
        _experts_up_kernel[run.up_grid](
            q_ptr=q, qs_ptr=q_scales, qv_ptr=ws.q_values, counts_ptr=counts, pairs_ptr=pairs,
            generation_ptr=generation, h_ptr=ws.h_codes, hs_ptr=ws.h_scales, hv_ptr=ws.h_values,
            **run.up)
        _experts_down_kernel[run.down_grid](
            h_ptr=ws.h_codes, hs_ptr=ws.h_scales, hv_ptr=ws.h_values, counts_ptr=counts,
            pairs_ptr=pairs, generation_ptr=generation, rows_ptr=rows.view(torch.int16),
            **run.down)
    return rows
