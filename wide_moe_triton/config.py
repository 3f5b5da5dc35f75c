"""The layer's dimensions and constants, validated once at construction."""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
import os

MX_BLOCK = 32  # OCP MX v1.0: one shared E8M0 scale per 32 elements along the reduction
# The float fields, each a finite number > 0 (linear_beta may be None): a NaN or an Inf
# there passes every later check and makes every output NaN. Beside each, the Hugging
# Face field ``from_hf_config`` reads it from.
FLOAT_FIELDS = {"routed_scaling_factor": "routed_scaling_factor",
                "beta": "activation_situ_beta", "linear_beta": "activation_situ_linear_beta",
                "rms_eps": "rms_norm_eps"}


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
        for name in FLOAT_FIELDS:
            value = getattr(self, name)
            if name == "linear_beta" and value is None:
                continue
            if not is_number(value):
                raise TypeError(f"WideMoEConfig.{name} must be a number, got {value!r}")
            if not finite_positive(value):
                raise ValueError(f"WideMoEConfig.{name} must be a finite number > 0, got "
                                 f"{value!r}")

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

    @classmethod
    def from_hf_config(cls, path_or_dict, tp: int = 1, wide_rows: int = 1024) -> "WideMoEConfig":
        """The MoE layer of a Hugging Face ``config.json`` (a path to it or to its
        directory, or the parsed dict; Kimi-K3 keeps the text model's fields under
        ``text_config``). A config this layer cannot serve (another router activation,
        several expert groups, another activation, no latent, no latent norm) raises
        ValueError naming the field and its value."""
        f = hf_text_config(path_or_dict)

        def need(name, kind):
            value = f.get(name)
            ok = isinstance(value, kind) and not (kind is not bool and isinstance(value, bool))
            if not ok:
                raise ValueError(f"config field {name} = {value!r}: expected "
                                 f"{' or '.join(k.__name__ for k in _tuple(kind))}")
            return value

        def refuse(name, value, why):
            raise ValueError(f"config field {name} = {value!r}: {why}")

        if f.get("routed_expert_hidden_size") is None:
            refuse("routed_expert_hidden_size", None, "this layer needs the latent (the "
                   "routed experts run in a latent of that width)")
        if need("moe_router_activation_func", str) != "sigmoid":
            refuse("moe_router_activation_func", f["moe_router_activation_func"],
                   "only the sigmoid router is served")
        if f.get("use_grouped_topk"):
            for name in ("num_expert_group", "topk_group"):
                if need(name, int) != 1:
                    refuse(name, f[name], "only one expert group is served (plain top-k)")
        if need("hidden_act", str) != "situ":
            refuse("hidden_act", f["hidden_act"], "only SiTU experts are served")
        if need("latent_moe_use_norm", bool) is not True:
            refuse("latent_moe_use_norm", False, "this layer norms the latent (RMSNorm)")
        inter, shared = need("moe_intermediate_size", int), need("num_shared_experts", int)
        if shared < 1:
            refuse("num_shared_experts", shared, "this layer has shared experts")
        if "activation_situ_linear_beta" not in f:
            refuse("activation_situ_linear_beta", None, "required (null: the up input "
                   "is not clamped)")

        def positive(name):
            value = need(name, (int, float))
            if not finite_positive(value):
                refuse(name, value, "must be a finite number > 0")
            return float(value)

        floats = {field: None if name == "activation_situ_linear_beta" and f[name] is None
                  else positive(name) for field, name in FLOAT_FIELDS.items()}
        return cls(hidden=need("hidden_size", int), latent=need("routed_expert_hidden_size", int),
                   num_experts=need("num_experts", int), top_k=need("num_experts_per_token", int),
                   expert_intermediate=inter, shared_intermediate=inter * shared,
                   renormalize=need("moe_renormalize", bool), tp=tp, wide_rows=wide_rows,
                   **floats)

    def hf_config(self) -> dict:
        """The Hugging Face text-config fields ``from_hf_config`` reads, for this layer
        (the whole layer: ``tp`` and ``wide_rows`` are not the model's)."""
        if self.shared_intermediate % self.expert_intermediate:
            raise ValueError(f"shared_intermediate ({self.shared_intermediate}) must be a "
                             f"whole number of experts of {self.expert_intermediate}")
        return {
            "hidden_size": self.hidden, "routed_expert_hidden_size": self.latent,
            "num_experts": self.num_experts, "num_experts_per_token": self.top_k,
            "moe_intermediate_size": self.expert_intermediate,
            "num_shared_experts": self.shared_intermediate // self.expert_intermediate,
            "routed_scaling_factor": self.routed_scaling_factor,
            "moe_renormalize": self.renormalize, "moe_router_activation_func": "sigmoid",
            "use_grouped_topk": True, "num_expert_group": 1, "topk_group": 1,
            "hidden_act": "situ", "activation_situ_beta": self.beta,
            "activation_situ_linear_beta": self.linear_beta, "rms_norm_eps": self.rms_eps,
            "latent_moe_use_norm": True,
        }

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


def hf_text_config(path_or_dict) -> dict:
    """The text model's fields of a Hugging Face config (a ``config.json``, its directory,
    or the parsed dict): its ``text_config`` where it has one, else the config itself. A
    file that is not a JSON object raises ValueError naming it; a missing one, the
    OSError (which names it)."""
    if isinstance(path_or_dict, dict):
        config = path_or_dict
    else:
        path = os.fspath(path_or_dict)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        with open(path, "rb") as f:
            try:
                config = json.loads(f.read())
            except (UnicodeDecodeError, json.JSONDecodeError) as err:
                raise ValueError(f"{path}: not JSON ({err})") from None
        if not isinstance(config, dict):
            raise ValueError(f"{path}: holds a JSON {type(config).__name__}, not an object "
                             f"of config fields")
    text = config.get("text_config")
    return text if isinstance(text, dict) else config


def is_number(value) -> bool:
    """A real number, not a bool (Python's bool is an int)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def finite_positive(value) -> bool:
    """``value`` (a real number) is finite and > 0."""
    try:
        return math.isfinite(value) and value > 0
    except OverflowError:  # an int beyond a float's range
        return False


def _tuple(kind):
    return kind if isinstance(kind, tuple) else (kind,)
