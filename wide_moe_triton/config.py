"""The layer's dimensions and constants, validated once at construction."""

from __future__ import annotations

import dataclasses

MX_BLOCK = 32  # OCP MX v1.0: one shared E8M0 scale per 32 elements along the reduction


@dataclasses.dataclass(frozen=True)
class WideMoEConfig:
    """Dimensions of one latent-MoE layer and of this rank's tensor-parallel share.

    ``hidden`` H, ``latent`` L, ``num_experts`` E, ``top_k`` K, ``expert_intermediate`` I
    (per expert, before TP), ``shared_intermediate`` S (the fused shared experts, before
    TP), ``tp`` the tensor-parallel world size T, ``wide_rows`` the widest batch one call
    of the Triton path takes (wider batches are processed in chunks of this many rows).
    """

    hidden: int
    latent: int
    num_experts: int
    top_k: int
    expert_intermediate: int
    shared_intermediate: int
    routed_scaling_factor: float = 1.0
    renormalize: bool = True
    beta: float = 4.0
    linear_beta: float | None = 25.0
    rms_eps: float = 1e-6
    tp: int = 1
    wide_rows: int = 1024

    def __post_init__(self):
        ints = ("hidden", "latent", "num_experts", "top_k", "expert_intermediate",
                "shared_intermediate", "tp", "wide_rows")
        for name in ints:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"WideMoEConfig.{name} must be a positive int, got {value!r}")
        if self.top_k > self.num_experts:
            raise ValueError(f"WideMoEConfig.top_k ({self.top_k}) must be <= num_experts "
                             f"({self.num_experts})")
        # Every per-rank slice is a whole number of MX blocks: the kernels quantize and
        # reduce in blocks of 32 and never straddle two ranks' columns.
        per_rank = {"hidden": self.hidden, "latent": self.latent,
                    "expert_intermediate": self.expert_intermediate,
                    "shared_intermediate": self.shared_intermediate}
        for name, value in per_rank.items():
            if value % (MX_BLOCK * self.tp):
                raise ValueError(f"WideMoEConfig.{name} ({value}) must be a multiple of "
                                 f"32 * tp = {MX_BLOCK * self.tp}")
        if self.num_experts % self.tp:
            raise ValueError(f"WideMoEConfig.num_experts ({self.num_experts}) must be a "
                             f"multiple of tp ({self.tp})")
        if self.beta <= 0 or (self.linear_beta is not None and self.linear_beta <= 0):
            raise ValueError("WideMoEConfig.beta and linear_beta must be positive")
        if not self.rms_eps > 0:
            raise ValueError(f"WideMoEConfig.rms_eps must be positive, got {self.rms_eps}")

    @classmethod
    def kimi_k3(cls, tp: int = 1, wide_rows: int = 1024) -> "WideMoEConfig":
        """Kimi-K3's MoE layer: 896 experts, top-16, I = 3072, two fused shared experts."""
        return cls(hidden=7168, latent=3584, num_experts=896, top_k=16,
                   expert_intermediate=3072, shared_intermediate=6144,
                   routed_scaling_factor=2.827, renormalize=True, beta=4.0,
                   linear_beta=25.0, rms_eps=1e-6, tp=tp, wide_rows=wide_rows)

    @classmethod
    def tiny(cls, tp: int = 1, wide_rows: int = 64) -> "WideMoEConfig":
        """Small enough for Triton's interpreter, yet every stage spans several tiles
        and every per-rank slice is whole MX blocks up to tp = 4."""
        return cls(hidden=256, latent=256, num_experts=16, top_k=4,
                   expert_intermediate=128, shared_intermediate=128,
                   routed_scaling_factor=2.5, renormalize=True, beta=4.0,
                   linear_beta=25.0, rms_eps=1e-6, tp=tp, wide_rows=wide_rows)

    def replace(self, **changes) -> "WideMoEConfig":
        return dataclasses.replace(self, **changes)

    # Rank-local sizes: what one rank of T holds.
    @property
    def experts_per_rank(self) -> int:
        return self.num_experts // self.tp

    @property
    def latent_per_rank(self) -> int:
        return self.latent // self.tp

    @property
    def intermediate_per_rank(self) -> int:
        return self.expert_intermediate // self.tp

    @property
    def shared_per_rank(self) -> int:
        return self.shared_intermediate // self.tp

    @property
    def hidden_per_rank(self) -> int:
        return self.hidden // self.tp

    @property
    def mailbox_columns(self) -> int:
        """BF16 columns of one mailbox row: the latent, then the logits as FP32 words."""
        return self.latent + 2 * self.num_experts
