"""Finalize: each token's K expert rows, weighted and summed, rounded once to BF16.

``out[t] = bf16(sum_k fp32(w[t, k]) * fp32(rows[t*K + k]))``, k in slot order, as an
FMA chain from +0 with one round-to-nearest-even at the end: bit-identical to
``reference.finalize``. Memory bound (it reads ``b*K*L`` BF16 and writes ``b*L``): a
program loads all K rows of its column chunk before the first FMA, so K loads are in
flight at once rather than one per link of the chain.

The kernel can also advance the layer's call counter (``generation``): finalize is the
last kernel of a layer call, and the next call reads the counter's parity.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..checks import check_tensor
from ..tuning import config_for
from . import quiet
from .bits import bf16_bits_to_f32, f32_to_bf16_bits
from .pdl import dependent_launch, wait_for_previous_grid

KERNEL = "finalize"
# 2 warps x 32 lanes x 8 columns = 512 columns: one 16-byte load per lane per row, and
# L = 3584 is exactly 7 chunks.
DEFAULT = {"BLOCK_T": 1, "BLOCK_L": 512, "num_warps": 2}
SPACE = [{"BLOCK_T": t, "BLOCK_L": l, "num_warps": w}
         for t in (1, 2, 4) for l in (256, 512, 1024, 2048) for w in (1, 2, 4, 8)
         if t * l // (32 * w) in (2, 4, 8, 16)]


def shape_key(L: int, K: int) -> str:
    return f"L{L}_K{K}"


@triton.jit
def _load_pairs(rows_ptr, w_ptr, t, c, mask, t_ok, L, K: tl.constexpr):
    """(K row chunks as BF16 bits [BLOCK_T, BLOCK_L], K FP32 weights [BLOCK_T]) of
    tokens ``t``, all loads issued before any is used."""
    chunks = ()
    weights = ()
    for k in tl.static_range(K):
        pair = t.to(tl.int64) * K + k
        # Read once: keep them from evicting data that later kernels reuse.
        chunks = chunks + (tl.load(rows_ptr + pair[:, None] * L + c[None, :], mask=mask,
                                   other=0, eviction_policy="evict_first"),)
        weights = weights + (bf16_bits_to_f32(tl.load(w_ptr + pair, mask=t_ok, other=0)),)
    return chunks, weights


@triton.jit
def _finalize_kernel(rows_ptr, w_ptr, out_ptr, gen_ptr, b, L, K: tl.constexpr,
                     BLOCK_T: tl.constexpr, BLOCK_L: tl.constexpr, HAS_GEN: tl.constexpr,
                     PDL_WAIT: tl.constexpr):
    """One program per (BLOCK_T tokens, BLOCK_L columns); column chunks of a token are
    neighbours in launch order, so its K rows stream from DRAM in order. PDL_WAIT: the
    launch is a dependent one (``pdl``), started while the kernel that writes ``rows``
    may still run."""
    wait_for_previous_grid(PDL_WAIT)
    pid = tl.program_id(0)
    chunks_per_token = tl.cdiv(L, BLOCK_L)
    t = (pid // chunks_per_token) * BLOCK_T + tl.arange(0, BLOCK_T)
    c = (pid % chunks_per_token) * BLOCK_L + tl.arange(0, BLOCK_L)
    t_ok = t < b
    mask = t_ok[:, None] & (c < L)[None, :]
    chunks, weights = _load_pairs(rows_ptr, w_ptr, t, c, mask, t_ok, L, K)
    acc = tl.zeros((BLOCK_T, BLOCK_L), tl.float32)
    for k in tl.static_range(K):
        acc = tl.fma(weights[k][:, None], bf16_bits_to_f32(chunks[k]), acc)
    tl.store(out_ptr + t[:, None].to(tl.int64) * L + c[None, :], f32_to_bf16_bits(acc),
             mask=mask)
    if HAS_GEN:
        if pid == 0:
            tl.atomic_add(gen_ptr, 1, sem="relaxed")


def _check_config(cfg: dict) -> None:
    for name in ("BLOCK_T", "BLOCK_L", "num_warps"):
        v = cfg.get(name)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1 or v & (v - 1):
            raise ValueError(f"finalize config {name} must be a power of two, got {v!r}")


def finalize(rows: torch.Tensor, weights: torch.Tensor, *, out: torch.Tensor | None = None,
             generation: torch.Tensor | None = None, config: dict | None = None) -> torch.Tensor:
    """``out[t] = bf16(sum_k fp32(weights[t, k]) * fp32(rows[t*K + k]))``, k = 0..K-1 in
    order, an FMA chain from 0 with one round-to-nearest-even: BF16 [b, L],
    bit-identical to ``reference.finalize``.

    ``rows``: BF16 [b*K, L] (pair t*K + k is token t's slot k). ``weights``: BF16 [b, K].
    ``out``: a BF16 [b, L] buffer to write. ``generation``: the layer's int32 [1] call
    counter; the kernel adds one to it (a b = 0 call launches nothing and leaves it
    alone, as no other stage of such a call runs either). ``config``: launch parameters,
    missing keys from ``DEFAULT`` (default: the tuned table for this GPU).

    On GPUs of compute capability 9.0 and newer the kernel is launched as a dependent of
    the one ahead of it in the stream (``pdl``): started early, it waits for that one's
    completion before its first load, so the results are those of a plain launch.
    """
    check_tensor("weights", weights, torch.bfloat16, ("b", "K"))
    b, K = weights.shape
    if K == 0:
        raise ValueError("weights must have at least one column (K >= 1)")
    check_tensor("rows", rows, torch.bfloat16, (b * K, "L"), weights.device)
    L = rows.shape[1]
    if L == 0:
        raise ValueError("rows must have at least one column (L >= 1)")
    if out is None:
        out = torch.empty(b, L, dtype=torch.bfloat16, device=rows.device)
    check_tensor("out", out, torch.bfloat16, (b, L), rows.device)
    if generation is not None:
        check_tensor("generation", generation, torch.int32, (1,), rows.device)
    if b == 0:
        return out
    run = resolve(b, L, K, generation is not None, rows.device, config)
    return launch(run, rows, weights, out, generation)


def resolve(b: int, L: int, K: int, has_generation: bool, device,
            config: dict | None = None) -> tuple:
    """(grid, arguments but the tensors) of ``finalize`` at b >= 1 tokens: ``config`` as
    given (missing keys from ``DEFAULT``) or the tuned one, checked."""
    cfg = config_for(KERNEL, shape_key(L, K), b, DEFAULT, device, given=config)
    _check_config(cfg)
    pdl = dependent_launch(device)
    return ((triton.cdiv(b, cfg["BLOCK_T"]) * triton.cdiv(L, cfg["BLOCK_L"]),),
            dict(b=b, L=L, K=K, BLOCK_T=cfg["BLOCK_T"], BLOCK_L=cfg["BLOCK_L"],
                 HAS_GEN=has_generation, PDL_WAIT=pdl, num_warps=cfg["num_warps"],
                 launch_pdl=pdl))


def launch(run: tuple, rows: torch.Tensor, weights: torch.Tensor, out: torch.Tensor,
           generation: torch.Tensor | None) -> torch.Tensor:
    """``finalize`` of checked arguments with a resolved launch (``resolve``); returns
    ``out``."""
    grid, args = run
    with quiet():
        _finalize_kernel[grid](rows_ptr=rows.view(torch.int16),
                               w_ptr=weights.view(torch.int16), out_ptr=out.view(torch.int16),
                               gen_ptr=generation if generation is not None else out, **args)
    return out
