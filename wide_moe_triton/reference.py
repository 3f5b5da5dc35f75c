"""``LatentMoE``: the stock path, in plain PyTorch, read as the definition of the layer.

Every rounding point the Triton path has is here too (docs/design.md): BF16 linears with
FP32 accumulation, FP32 router logits, the latent rounded once to BF16, MXFP8
activations and hidden, MXFP4 experts, a one-rounding FP32 finalize, an FP32 RMSNorm.
Only accumulation orders may differ between this module and ``WideMoE``.

The functions below the module are the per-stage references the tests compare the
kernels with; the module's ``forward`` is nothing but their composition.
"""

from __future__ import annotations

import hashlib

import torch
from torch import nn

from . import layout, mx
from .checks import check_input, check_tensor
from .config import MX_BLOCK, WideMoEConfig


def mm_f32(a: torch.Tensor, b_t: torch.Tensor) -> torch.Tensor:
    """``a @ b_t.T`` of BF16 operands with FP32 accumulation and FP32 output (the
    products of BF16 values are exact in FP32, so only the summation order varies)."""
    if a.is_cuda:
        return torch.mm(a, b_t.t(), out_dtype=torch.float32)
    return a.float() @ b_t.float().t()


def situ(g: torch.Tensor, u: torch.Tensor, beta: float, linear_beta: float | None):
    """SiTU in FP32: ``beta * tanh(g / beta) * sigmoid(g) * u'``, with
    ``u' = linear_beta * tanh(u / linear_beta)`` when linear_beta is set, else ``u``."""
    g, u = g.float(), u.float()
    if linear_beta is not None:
        u = linear_beta * torch.tanh(u / linear_beta)
    return beta * torch.tanh(g / beta) * torch.sigmoid(g) * u


def shared_expert(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, beta: float,
                  linear_beta: float | None) -> torch.Tensor:
    """BF16 [b, H]: ``down(situ(gate(x), up(x)))`` with BF16 linears (FP32 accumulation,
    BF16 out), SiTU in FP32 rounded once to BF16. ``gate_up`` [2S, H] holds the gate
    rows then the up rows; with a TP shard of both, the result is that rank's partial."""
    S = down.shape[1]
    gu = torch.nn.functional.linear(x, gate_up)
    h = situ(gu[:, :S], gu[:, S:], beta, linear_beta)
    return torch.nn.functional.linear(h.to(torch.bfloat16), down)


def router_scores(logits: torch.Tensor) -> torch.Tensor:
    """FP32 sigmoid of FP32 logits, correctly rounded (computed in FP64, rounded once),
    so that every implementation selects over the same FP32 numbers."""
    return torch.sigmoid(logits.double()).float()


def route(logits: torch.Tensor, bias: torch.Tensor, top_k: int, renormalize: bool,
          scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-K experts of each row and their BF16 weights.

    Selection ranks ``sigmoid(logits) + bias`` (FP32) in descending order, ties to the
    lower expert id; a NaN ranks as -inf (so ids stay in [0, E)). Slot k of the output
    is the k-th in that order. Weights are the unbiased sigmoid of the chosen experts,
    divided by their FP32 sum taken in slot order when ``renormalize``, times ``scale``,
    rounded once to BF16. A row with a NaN among its chosen scores gets NaN weights.
    """
    scores = router_scores(logits)
    choice = scores + bias.float()
    choice = torch.where(torch.isnan(choice), torch.full_like(choice, -torch.inf), choice)
    order = torch.sort(choice, dim=-1, descending=True, stable=True).indices[:, :top_k]
    chosen = torch.gather(scores, 1, order)
    if renormalize:
        total = chosen[:, 0].clone()
        for k in range(1, top_k):
            total = total + chosen[:, k]
        chosen = chosen / total[:, None]
    weights = (chosen * torch.tensor(scale, dtype=torch.float32)).to(torch.bfloat16)
    return order.to(torch.int32), weights


def expert_rows(q: torch.Tensor, q_scales: torch.Tensor, ids: torch.Tensor,
                w13: torch.Tensor, w13_scales: torch.Tensor, w2: torch.Tensor,
                w2_scales: torch.Tensor, beta: float, linear_beta: float | None,
                hidden_out: dict | None = None) -> torch.Tensor:
    """``rows[t*K + k] = W2_e . mxfp8(situ(W13_e . q[t]))`` for e = ids[t, k], BF16.

    q/q_scales: the MXFP8 plan [b, L] / [b, L/32]. w13 [E, 2I, L/2] packed E2M1 (gate
    rows then up rows), w13_scales [E, 2I, L/32]; w2 [E, L, I/2], w2_scales [E, L, I/32].
    ``hidden_out``, if given, receives {pair: (codes, scales)} of the MXFP8 hidden."""
    b, top_k = ids.shape
    inter = w2.shape[2] * 2
    latent = mx.dequantize_mxfp8(q, q_scales)
    rows = torch.empty(b * top_k, q.shape[1], dtype=torch.bfloat16, device=q.device)
    flat = ids.reshape(-1).long()
    for e in torch.unique(flat).tolist():
        pairs = (flat == e).nonzero().squeeze(1)
        tokens = pairs // top_k
        w13_e = mx.dequantize_mxfp4(w13[e], w13_scales[e])
        gate_up = latent[tokens] @ w13_e.t()
        h = situ(gate_up[:, :inter], gate_up[:, inter:], beta, linear_beta)
        h_codes, h_scales = mx.quantize_mxfp8(h)
        if hidden_out is not None:
            for i, p in enumerate(pairs.tolist()):
                hidden_out[p] = (h_codes[i], h_scales[i])
        w2_e = mx.dequantize_mxfp4(w2[e], w2_scales[e])
        rows[pairs] = (mx.dequantize_mxfp8(h_codes, h_scales) @ w2_e.t()).to(torch.bfloat16)
    return rows


def finalize(rows: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``out[t] = bf16(sum_k fp32(w[t, k]) * fp32(rows[t*K + k]))``, k in order, as an
    FMA chain with one rounding at the end (the FMA is emulated exactly in FP64: the
    product of a BF16 pair is exact in FP64, and so is its FP32-rounded sum)."""
    b, top_k = weights.shape
    r = rows.reshape(b, top_k, -1).double()
    w = weights.double()
    acc = torch.zeros(b, rows.shape[1], dtype=torch.float32, device=rows.device)
    for k in range(top_k):
        acc = (w[:, k, None] * r[:, k] + acc.double()).float()
    return acc.to(torch.bfloat16)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``bf16(x * rsqrt(mean(x^2) + eps) * weight)`` in FP32, one rounding."""
    xf = x.float()
    inv = torch.rsqrt(xf.square().mean(dim=-1, keepdim=True) + eps)
    return (xf * inv * weight.float()).to(torch.bfloat16)


class LatentMoE(nn.Module):
    """The stock latent-MoE layer: the whole layer (rank 0 of 1), or the weights of rank
    ``rank`` of ``world`` tensor-parallel ranks (a checkpoint loaded per rank; only
    ``WideMoE`` runs it). For a whole layer ``cfg.tp`` only tells ``WideMoE`` how to
    shard it.

    Buffers (the layouts the stock path and the kernels read; a shard holds its slices):
    ``gate_weight`` [E, H] BF16 router, ``e_score_correction_bias`` [E] FP32,
    ``latent_down`` [L, H] BF16, ``w13``/``w13_scales`` and ``w2``/``w2_scales`` the MXFP4
    experts (see ``expert_rows``), ``norm_weight`` [L] BF16, ``latent_up`` [H, L] BF16,
    ``shared_gate_up`` [2S, H] BF16 (gate rows then up rows), ``shared_down`` [H, S] BF16.

    ``state_dict()`` and ``load_state_dict`` speak the checkpoint's names, shapes and
    dtypes (``layout.entries``: ``gate.weight``, ``experts.j.w1.weight_packed``, ...), as
    views of these buffers.

    ``weights``: the buffers by name (``layout.buffers(cfg, world)``'s shapes and dtypes),
    taken as they are; without it, random weights of the whole layer drawn from ``seed``.
    """

    def __init__(self, cfg: WideMoEConfig, seed: int = 0, device: str | torch.device = "cpu",
                 *, weights: dict[str, torch.Tensor] | None = None, rank: int = 0,
                 world: int = 1):
        super().__init__()
        if not 0 <= rank < world:
            raise ValueError(f"rank must be in [0, {world}), got {rank}")
        # A shard's dims must split into whole MX blocks: replace(tp=world) checks it.
        self.cfg = cfg if world == 1 else cfg.replace(tp=world)
        self.rank, self.world = rank, world
        if weights is None:
            if world != 1:
                raise ValueError("random weights are drawn for the whole layer only "
                                 "(world = 1)")
            weights = _random_weights(cfg, seed, torch.device(device))
        expected = layout.buffers(self.cfg, world)
        if set(weights) != set(expected):
            raise ValueError(f"weights must hold exactly {sorted(expected)}, got "
                             f"{sorted(weights)}")
        for name, (shape, dtype) in expected.items():
            check_tensor(name, weights[name], dtype, shape)
            self.register_buffer(name, weights[name])

    @property
    def whole(self) -> bool:
        """Whether this module holds the whole layer (not one rank's shard)."""
        return self.world == 1

    # The checkpoint's names: views of the stacked buffers (see ``layout``).

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        for e in layout.entries(self.cfg, self.world):
            t = e.view(self._buffers)
            destination[prefix + e.name] = t if keep_vars else t.detach()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict,
                              missing_keys, unexpected_keys, error_msgs):
        # Every tensor is checked before any is copied: a refused state dict leaves the
        # module as it was.
        found, errors = [], []
        ours = layout.entries(self.cfg, self.world)
        for e in ours:
            key = prefix + e.name
            if key not in state_dict:
                missing_keys.append(key)
                continue
            value, shape = state_dict[key], e.rank_shape(self.world)
            if not isinstance(value, torch.Tensor) or value.dtype != e.dtype or \
                    tuple(value.shape) != shape:
                got = (f"{value.dtype} {list(value.shape)}" if isinstance(value, torch.Tensor)
                       else type(value).__name__)
                errors.append(f"{key}: expected {e.dtype} {list(shape)}, got {got}")
                continue
            found.append((e, value))
        names = {prefix + e.name for e in ours}
        if strict:
            unexpected_keys.extend(k for k in state_dict if k.startswith(prefix)
                                   and k not in names)
        error_msgs.extend(errors)
        if errors or (strict and len(found) < len(ours)):
            return
        with torch.no_grad():
            for e, value in found:
                e.view(self._buffers).copy_(value)

    def _check_whole(self) -> None:
        if not self.whole:
            raise ValueError(f"this LatentMoE holds rank {self.rank} of {self.world}'s "
                             f"shard: run the layer through WideMoE or SimulatedGroup")

    def shared_expert(self, x: torch.Tensor) -> torch.Tensor:
        """BF16 [b, H]: the fused shared experts (see ``shared_expert``)."""
        return shared_expert(x, self.shared_gate_up, self.shared_down, self.cfg.beta,
                             self.cfg.linear_beta)

    def routed_latent(self, x: torch.Tensor) -> torch.Tensor:
        """BF16 [b, L]: the routed experts' latent output before the norm."""
        self._check_whole()
        cfg = self.cfg
        logits = mm_f32(x, self.gate_weight)
        latent = mm_f32(x, self.latent_down).to(torch.bfloat16)
        ids, weights = route(logits, self.e_score_correction_bias, cfg.top_k,
                             cfg.renormalize, cfg.routed_scaling_factor)
        q, q_scales = mx.quantize_mxfp8(latent)
        rows = expert_rows(q, q_scales, ids, self.w13, self.w13_scales, self.w2,
                           self.w2_scales, cfg.beta, cfg.linear_beta)
        return finalize(rows, weights)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [b, H] BF16 -> [b, H] BF16 (any b, 0 included; x may be non-contiguous)."""
        self._check_whole()
        x = check_input(x, self.cfg.hidden, self.gate_weight.device)
        if x.shape[0] == 0:
            return torch.empty(0, self.cfg.hidden, dtype=torch.bfloat16, device=x.device)
        shared = self.shared_expert(x)
        normed = rms_norm(self.routed_latent(x), self.norm_weight, self.cfg.rms_eps)
        return (shared.float() + mm_f32(normed, self.latent_up)).to(torch.bfloat16)


def _random_weights(cfg: WideMoEConfig, seed: int, device: torch.device) -> dict:
    """The whole layer's buffers, drawn from ``seed`` on ``device``."""
    gen = torch.Generator(device=device).manual_seed(seed)
    H, L, E, I, S = (cfg.hidden, cfg.latent, cfg.num_experts, cfg.expert_intermediate,
                     cfg.shared_intermediate)

    def normal(*shape, std=1.0, mean=0.0):
        return torch.randn(*shape, generator=gen, device=device) * std + mean

    bf16 = torch.bfloat16
    # Standard deviations keep every activation near unit scale: no E4M3 overflow
    # before the scale, no all-zero MX blocks, SiTU away from its saturation.
    w = {"gate_weight": normal(E, H, std=H ** -0.5).to(bf16),
         "e_score_correction_bias": normal(E, std=0.05),
         "latent_down": normal(L, H, std=H ** -0.5).to(bf16)}
    w13, w13_s, w2, w2_s = [], [], [], []
    chunk = max(1, (1 << 28) // (2 * I * L))  # bound the FP32 draw to 1 GiB
    for start in range(0, E, chunk):
        n = min(chunk, E - start)
        p, s = mx.quantize_mxfp4(normal(n, 2 * I, L, std=L ** -0.5))
        w13.append(p), w13_s.append(s)
        p, s = mx.quantize_mxfp4(normal(n, L, I, std=I ** -0.5))
        w2.append(p), w2_s.append(s)
    w.update(w13=torch.cat(w13), w13_scales=torch.cat(w13_s), w2=torch.cat(w2),
             w2_scales=torch.cat(w2_s))
    w["norm_weight"] = normal(L, std=0.1, mean=1.0).to(bf16)
    w["latent_up"] = normal(H, L, std=L ** -0.5).to(bf16)
    w["shared_gate_up"] = normal(2 * S, H, std=H ** -0.5).to(bf16)
    w["shared_down"] = normal(H, S, std=S ** -0.5).to(bf16)
    return w


# ----------------------------------------------------------------------------- rank shards
# ``random_shard`` draws random weights block by block, each block from its own seed, so
# that a rank draws only its own slices and the whole layer (world = 1) is the ranks'
# slices side by side, for every T: a rank never holds the whole layer to cut its shard
# out of it. A block is the smallest slice any T takes: a router row, 32 rows (or 32
# columns of I and S) of a matrix TP cuts, an expert's 32 rows of gate or up or 32
# columns of down. These weights differ from ``LatentMoE(cfg, seed)``'s, which come
# from one stream.

def _block_seed(seed: int, name: str, *index: int) -> int:
    """The seed of block ``index`` of tensor ``name`` (a 63-bit hash)."""
    text = "/".join([str(seed), name, *map(str, index)]).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") >> 1


class _BlockDraw:
    """Normal draws of blocks on ``device``, each from its own seed."""

    def __init__(self, seed: int, device: torch.device):
        self.seed, self.device = seed, device
        self.gen = torch.Generator(device=device)

    def normal(self, shape, std: float, name: str, *index: int, mean: float = 0.0):
        self.gen.manual_seed(_block_seed(self.seed, name, *index))
        return torch.randn(*shape, generator=self.gen, device=self.device) * std + mean

    def rows(self, name: str, blocks: range, width: int, std: float, *expert: int):
        """Blocks of 32 rows of ``width`` stacked: [32 * len(blocks), width]."""
        return torch.cat([self.normal((MX_BLOCK, width), std, name, *expert, j) for j in blocks])

    def columns(self, name: str, blocks: range, height: int, std: float, *expert: int):
        """Blocks of 32 columns of ``height`` side by side: [height, 32 * len(blocks)]."""
        return torch.cat([self.normal((height, MX_BLOCK), std, name, *expert, j)
                          for j in blocks], dim=1)


def random_shard(cfg: WideMoEConfig, seed: int = 0, rank: int = 0, world: int = 1,
                 device: str | torch.device = "cpu",
                 draw_device: str | torch.device | None = None) -> "LatentMoE":
    """Rank ``rank`` of ``world``'s shard of a random layer (``world`` = 1: the whole
    layer), drawn block by block (see above) on ``draw_device`` (default ``device``) and
    kept on ``device``: a rank draws and holds only its own slices, and the whole layer's
    weights are the shards' side by side. The bits depend on the draw device's generator
    (a CPU's and a GPU's differ), not on where they are kept: a whole layer on the CPU
    drawn on a GPU equals that GPU's ranks' shards. The experts are drawn and quantized
    one at a time, so the draw device holds at most one expert's FP32 weights."""
    if not isinstance(world, int) or world < 1 or not isinstance(rank, int) or \
            not 0 <= rank < world:
        raise ValueError(f"rank must be in [0, world) and world >= 1, got rank {rank!r} of "
                         f"world {world!r}")
    cfg.replace(tp=world)  # raises unless every slice is whole MX blocks
    device = torch.device(device)
    draw = _BlockDraw(seed, torch.device(draw_device) if draw_device is not None else device)
    H, L, E, I, S = (cfg.hidden, cfg.latent, cfg.num_experts, cfg.expert_intermediate,
                     cfg.shared_intermediate)

    def mine(n: int) -> range:  # this rank's blocks of 32 of a dim TP cuts in T
        return range(rank * n // world // MX_BLOCK, (rank + 1) * n // world // MX_BLOCK)

    bf16 = lambda t: t.to(torch.bfloat16).to(device)  # noqa: E731
    per_rank = E // world
    w = {"gate_weight": bf16(torch.stack([draw.normal((H,), H ** -0.5, "gate", e) for e in
                                          range(rank * per_rank, (rank + 1) * per_rank)])),
         "e_score_correction_bias": draw.normal((E,), 0.05, "bias").to(device),
         "latent_down": bf16(draw.rows("latent_down", mine(L), H, H ** -0.5))}
    w.update(_random_experts(cfg, draw, mine(I), device))
    w["norm_weight"] = bf16(draw.normal((L,), 0.1, "norm", mean=1.0))
    w["latent_up"] = bf16(draw.rows("latent_up", mine(H), L, L ** -0.5))
    w["shared_gate_up"] = bf16(torch.cat([draw.rows("shared_gate", mine(S), H, H ** -0.5),
                                          draw.rows("shared_up", mine(S), H, H ** -0.5)]))
    w["shared_down"] = bf16(draw.columns("shared_down", mine(S), H, S ** -0.5))
    return LatentMoE(cfg, weights=w, rank=rank, world=world)


def _random_experts(cfg: WideMoEConfig, draw: _BlockDraw, blocks: range, device) -> dict:
    """This rank's MXFP4 experts (``blocks``: its blocks of 32 along I), an expert at a
    time into buffers on ``device``."""
    E, L, I = cfg.num_experts, cfg.latent, cfg.expert_intermediate
    rows = MX_BLOCK * len(blocks)
    u8 = lambda *shape: torch.empty(*shape, dtype=torch.uint8, device=device)  # noqa: E731
    w13, w13_s = u8(E, 2 * rows, L // 2), u8(E, 2 * rows, L // MX_BLOCK)
    w2, w2_s = u8(E, L, rows // 2), u8(E, L, rows // MX_BLOCK)
    for e in range(E):
        gate_up = torch.cat([draw.rows("w1", blocks, L, L ** -0.5, e),
                             draw.rows("w3", blocks, L, L ** -0.5, e)])
        packed, scales = mx.quantize_mxfp4(gate_up)
        w13[e].copy_(packed), w13_s[e].copy_(scales)
        packed, scales = mx.quantize_mxfp4(draw.columns("w2", blocks, L, I ** -0.5, e))
        w2[e].copy_(packed), w2_s[e].copy_(scales)
    return {"w13": w13, "w13_scales": w13_s, "w2": w2, "w2_scales": w2_s}
