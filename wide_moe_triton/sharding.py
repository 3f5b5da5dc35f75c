"""How ``WideMoE`` splits the stock module's weights over T tensor-parallel ranks.

Rank r of T holds: its E/T router rows and L/T latent-down rows (packed together for the
front GEMM), its I/T columns of every expert (gate and up rows of W13, the matching
columns of W2), its S/T shared-expert columns, and its H/T output columns of the latent
up-projection. Every slice is whole MX blocks (``WideMoEConfig`` checks the divisibility).
"""

from __future__ import annotations

import dataclasses

import torch

from .config import MX_BLOCK


def _rows(t: torch.Tensor, rank: int, world: int, dim: int = 0) -> torch.Tensor:
    n = t.shape[dim] // world
    return t.narrow(dim, rank * n, n)


def _gate_up_rows(t: torch.Tensor, rank: int, world: int, dim: int) -> torch.Tensor:
    """This rank's gate rows and its up rows of a [.., 2n, ..] gate-then-up tensor."""
    gate, up = t.chunk(2, dim=dim)
    return torch.cat([_rows(gate, rank, world, dim), _rows(up, rank, world, dim)], dim=dim)


@dataclasses.dataclass
class RankShard:
    """One rank's weights, in the stock layouts (contiguous)."""

    rank: int
    world: int
    gate_weight: torch.Tensor      # [E/T, H] this rank's router rows
    latent_down: torch.Tensor      # [L/T, H]
    bias: torch.Tensor             # [E] FP32, every rank routes over all experts
    w13: torch.Tensor              # [E, 2I/T, L/2]
    w13_scales: torch.Tensor       # [E, 2I/T, L/32]
    w2: torch.Tensor               # [E, L, I/(2T)]
    w2_scales: torch.Tensor        # [E, L, I/(32T)]
    norm_weight: torch.Tensor      # [L]
    latent_up: torch.Tensor        # [H/T, L] this rank's output columns
    shared_gate_up: torch.Tensor   # [2S/T, H]
    shared_down: torch.Tensor      # [H, S/T]


def shard(stock, rank: int, world: int) -> RankShard:
    """Rank ``rank`` of ``world``'s weights out of a stock ``LatentMoE``: sliced out of a
    whole layer, or taken as they are from a module that holds that rank's shard."""
    if not 0 <= rank < world:
        raise ValueError(f"rank must be in [0, {world}), got {rank}")
    if not stock.whole:
        return _held(stock, rank, world)
    stock.cfg.replace(tp=world)  # raises unless every dim divides into whole MX blocks
    c = lambda t: t.contiguous()  # noqa: E731
    inter = stock.w2.shape[2] * 2
    w2_cols = _rows(stock.w2, rank, world, dim=2)
    assert (inter // world) % MX_BLOCK == 0
    return RankShard(
        rank=rank, world=world,
        gate_weight=c(_rows(stock.gate_weight, rank, world)),
        latent_down=c(_rows(stock.latent_down, rank, world)),
        bias=c(stock.e_score_correction_bias.float()),
        w13=c(_gate_up_rows(stock.w13, rank, world, dim=1)),
        w13_scales=c(_gate_up_rows(stock.w13_scales, rank, world, dim=1)),
        w2=c(w2_cols),
        w2_scales=c(_rows(stock.w2_scales, rank, world, dim=2)),
        norm_weight=c(stock.norm_weight),
        latent_up=c(_rows(stock.latent_up, rank, world)),
        shared_gate_up=c(_gate_up_rows(stock.shared_gate_up, rank, world, dim=0)),
        shared_down=c(_rows(stock.shared_down, rank, world, dim=1)),
    )


def _held(stock, rank: int, world: int) -> RankShard:
    """The shard a ``LatentMoE`` loaded for one rank holds (its buffers are already that
    rank's slices in the stock layouts)."""
    if (stock.rank, stock.world) != (rank, world):
        raise ValueError(f"this LatentMoE holds rank {stock.rank} of {stock.world}'s "
                         f"shard, not rank {rank} of {world}'s")
    return RankShard(
        rank=rank, world=world, gate_weight=stock.gate_weight,
        latent_down=stock.latent_down, bias=stock.e_score_correction_bias,
        w13=stock.w13, w13_scales=stock.w13_scales, w2=stock.w2, w2_scales=stock.w2_scales,
        norm_weight=stock.norm_weight, latent_up=stock.latent_up,
        shared_gate_up=stock.shared_gate_up, shared_down=stock.shared_down)
