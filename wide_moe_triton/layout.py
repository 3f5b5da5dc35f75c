"""The checkpoint's names for the stock module's weights (DESIGN.md, "Checkpoint").

``LatentMoE`` keeps its experts stacked (``w13`` [E, 2I, L/2], gate rows then up rows;
``w2`` [E, L, I/2]) and the shared gate and up rows in one matrix, the layouts the stock
path and the kernels read. The checkpoint stores one tensor per expert and projection.
``entries`` lists every tensor of one layer with where it lives in the stacked buffers of
a rank's shard and how that rank cuts it out of the whole tensor, so that the state dict,
the loader and the writer read one table.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from .config import MX_BLOCK, WideMoEConfig

U8, BF16, F32 = torch.uint8, torch.bfloat16, torch.float32


@dataclasses.dataclass(frozen=True)
class Entry:
    """One checkpoint tensor of a layer.

    ``name``: its key under the layer's ``mlp.`` prefix; ``shape``/``dtype``: the whole
    tensor as the checkpoint stores it; ``split``: the dimension rank r of T takes the
    r-th T-th of (None: every rank holds it whole); ``buffer``/``index``: where a rank's
    slice lives in the ``LatentMoE`` buffers of that rank."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    split: int | None
    buffer: str
    index: tuple = ()

    def rank_shape(self, world: int) -> tuple[int, ...]:
        """The shape of one rank's slice of T = ``world``."""
        if self.split is None:
            return self.shape
        shape = list(self.shape)
        shape[self.split] //= world
        return tuple(shape)

    def rank_slice(self, rank: int, world: int) -> tuple[slice, ...]:
        """Rank ``rank`` of ``world``'s slice of the whole tensor, one slice a dim."""
        part = self.rank_shape(world)
        return tuple(slice(rank * n, (rank + 1) * n) if d == self.split else slice(0, n)
                     for d, n in enumerate(part))

    def view(self, buffers) -> torch.Tensor:
        """This entry's slice of a rank's stacked buffers (a view)."""
        return buffers[self.buffer][self.index]


def buffers(cfg: WideMoEConfig, world: int = 1) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Name -> (shape, dtype) of the ``LatentMoE`` buffers of one rank of T = ``world``,
    in registration order."""
    H, L, E, I, S = (cfg.hidden, cfg.latent, cfg.num_experts, cfg.expert_intermediate,
                     cfg.shared_intermediate)
    Ir, Sr = I // world, S // world
    return {
        "gate_weight": ((E // world, H), BF16),
        "e_score_correction_bias": ((E,), F32),
        "latent_down": ((L // world, H), BF16),
        "w13": ((E, 2 * Ir, L // 2), U8),
        "w13_scales": ((E, 2 * Ir, L // MX_BLOCK), U8),
        "w2": ((E, L, Ir // 2), U8),
        "w2_scales": ((E, L, Ir // MX_BLOCK), U8),
        "norm_weight": ((L,), BF16),
        "latent_up": ((H // world, L), BF16),
        "shared_gate_up": ((2 * Sr, H), BF16),
        "shared_down": ((H, Sr), BF16),
    }


@functools.lru_cache(maxsize=16)
def entries(cfg: WideMoEConfig, world: int = 1) -> tuple[Entry, ...]:
    """Every checkpoint tensor of one layer, in the checkpoint's order, with its place in
    the buffers of a rank of T = ``world``."""
    H, L, E, I, S = (cfg.hidden, cfg.latent, cfg.num_experts, cfg.expert_intermediate,
                     cfg.shared_intermediate)
    Ir, Sr = I // world, S // world
    out = [
        Entry("gate.weight", (E, H), BF16, 0, "gate_weight"),
        Entry("gate.e_score_correction_bias", (E,), F32, None, "e_score_correction_bias"),
        Entry("shared_experts.gate_proj.weight", (S, H), BF16, 0, "shared_gate_up",
              (slice(0, Sr),)),
        Entry("shared_experts.up_proj.weight", (S, H), BF16, 0, "shared_gate_up",
              (slice(Sr, 2 * Sr),)),
        Entry("shared_experts.down_proj.weight", (H, S), BF16, 1, "shared_down"),
        Entry("routed_expert_down_proj.weight", (L, H), BF16, 0, "latent_down"),
        Entry("routed_expert_norm.weight", (L,), BF16, None, "norm_weight"),
        Entry("routed_expert_up_proj.weight", (H, L), BF16, 0, "latent_up"),
    ]
    # w1 = gate, w3 = up: rows [0, I/T) and [I/T, 2I/T) of the rank's w13; w2 = down.
    for j in range(E):
        for proj, rows in (("w1", slice(0, Ir)), ("w3", slice(Ir, 2 * Ir))):
            out.append(Entry(f"experts.{j}.{proj}.weight_packed", (I, L // 2), U8, 0,
                             "w13", (j, rows)))
            out.append(Entry(f"experts.{j}.{proj}.weight_scale", (I, L // MX_BLOCK), U8, 0,
                             "w13_scales", (j, rows)))
        out.append(Entry(f"experts.{j}.w2.weight_packed", (L, I // 2), U8, 1, "w2", (j,)))
        out.append(Entry(f"experts.{j}.w2.weight_scale", (L, I // MX_BLOCK), U8, 1,
                         "w2_scales", (j,)))
    return tuple(out)
