"""The embedded models tide-bench trains (and the tests reuse their pieces): Llama-style decoders,
a Qwen3-MoE-style decoder (grouped expert tensors, top-k routing) and a Wan-style diffusion
transformer (DiT blocks with adaLN modulation, self- and cross-attention).

Every config is a frozen dataclass with the same small interface, which is all fsdp_bench uses:
  validate()                    clear errors for impossible shapes
  params()                      parameter count, from the shapes (equals the built model's)
  build()                       the nn.Module; its fsdp_units(expert_shard_dim) lists the
                                submodules fully_shard wraps, inner first (the root comes last)
  batch(batch, seq, generator, device) -> tuple of inputs and target
  loss(model, batch)            the scalar training loss
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


def _require_positive(cfg, names) -> None:
    for name in names:
        if getattr(cfg, name) < 1:
            raise ValueError(f"{type(cfg).__name__}: {name} = {getattr(cfg, name)}, expected >= 1")


class _ConfigBase:
    family = ""
    # Whether a CUDA step runs its forward + backward under torch.use_deterministic_algorithms.
    deterministic_backward = False

    def as_dict(self) -> dict:
        return asdict(self)


# ---- shared pieces ---------------------------------------------------------------------------

class RMSNorm(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(x.dtype) * self.weight


class Attention(nn.Module):
    """Multi-head attention with grouped KV heads (GQA when kv_heads < heads), self- or
    cross-attention (keys and values from `context`), and optional q/k RMSNorm: "head" normalises
    each head (Qwen3), "full" the whole projection (Wan)."""

    QK_NORMS = (None, "head", "full")

    def __init__(self, dim: int, heads: int, kv_heads: int, head_dim: int, *, bias: bool = False,
                 qk_norm: str | None = None):
        super().__init__()
        if qk_norm not in self.QK_NORMS:
            raise ValueError(f"Attention: qk_norm = {qk_norm!r}, expected one of {self.QK_NORMS}")
        self.heads, self.kv_heads, self.head_dim, self.qk_norm = heads, kv_heads, head_dim, qk_norm
        self.q_proj = nn.Linear(dim, heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(dim, kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(dim, kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(heads * head_dim, dim, bias=bias)
        if qk_norm is not None:
            q_dim, k_dim = (head_dim, head_dim) if qk_norm == "head" else (heads * head_dim, kv_heads * head_dim)
            self.q_norm, self.k_norm = RMSNorm(q_dim), RMSNorm(k_dim)

    @staticmethod
    def params(dim: int, heads: int, kv_heads: int, head_dim: int, bias: bool, qk_norm) -> int:
        q, kv = heads * head_dim, kv_heads * head_dim
        n = 2 * dim * q + 2 * dim * kv
        if bias:
            n += q + 2 * kv + dim
        if qk_norm == "head":
            n += 2 * head_dim
        elif qk_norm == "full":
            n += q + kv
        return n

    def forward(self, x, context=None, causal: bool = False):
        b, s, _ = x.shape
        kv_in = x if context is None else context
        q, k, v = self.q_proj(x), self.k_proj(kv_in), self.v_proj(kv_in)
        if self.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(b, s, self.heads, self.head_dim)
        k = k.view(b, kv_in.shape[1], self.kv_heads, self.head_dim)
        v = v.view(b, kv_in.shape[1], self.kv_heads, self.head_dim)
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        rep = self.heads // self.kv_heads
        q = q.transpose(1, 2)
        k = k.transpose(1, 2).repeat_interleave(rep, 1)
        v = v.transpose(1, 2).repeat_interleave(rep, 1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, self.heads * self.head_dim))


class Block(nn.Module):
    """A layer that recomputes its forward in the backward pass when checkpointed."""

    def __init__(self, checkpointed: bool):
        super().__init__()
        self.checkpointed = checkpointed

    def forward(self, *args):
        if self.checkpointed:
            return checkpoint(self._forward, *args, use_reentrant=False)
        return self._forward(*args)


def _token_batch(vocab: int, batch: int, seq: int, generator, device) -> tuple:
    # drawn where the generator lives: fsdp_bench's is on the GPU (no host RNG, no H2D copy)
    return (torch.randint(0, vocab, (batch, seq), generator=generator, device=generator.device).to(device),)


def _next_token_loss(model, batch: tuple):
    (tokens,) = batch
    logits = model(tokens)
    return F.cross_entropy(logits.view(-1, logits.shape[-1]), tokens.roll(-1, 1).view(-1))


class _LayerUnits:
    """fsdp_units for models whose only inner FSDP units are their layers."""

    def fsdp_units(self, expert_shard_dim: int = 0) -> list:
        return [(layer, None) for layer in self.layers]


# ---- Llama-style decoder ---------------------------------------------------------------------

@dataclass(frozen=True)
class LlamaConfig(_ConfigBase):
    dim: int = 256
    layers: int = 4
    heads: int = 8
    kv_heads: int = 2
    hidden: int = 688
    vocab: int = 1000
    tied: bool = False
    checkpointed: bool = False
    family = "llama"

    def validate(self) -> None:
        _require_positive(self, ("dim", "layers", "heads", "kv_heads", "hidden", "vocab"))
        if self.dim % self.heads or self.heads % self.kv_heads:
            raise ValueError(f"LlamaConfig: dim {self.dim}, heads {self.heads}, kv_heads {self.kv_heads}: "
                             "expected dim divisible by heads and heads by kv_heads")

    def params(self) -> int:
        hd = self.dim // self.heads
        layer = (Attention.params(self.dim, self.heads, self.kv_heads, hd, False, None)
                 + 3 * self.dim * self.hidden + 2 * self.dim)
        return self.layers * layer + self.vocab * self.dim * (1 if self.tied else 2) + self.dim

    def build(self) -> nn.Module:
        return LlamaModel(self)

    def batch(self, batch: int, seq: int, generator, device) -> tuple:
        return _token_batch(self.vocab, batch, seq, generator, device)

    def loss(self, model, batch: tuple):
        return _next_token_loss(model, batch)


class DecoderLayer(Block):
    def __init__(self, c: LlamaConfig):
        super().__init__(c.checkpointed)
        self.attn_norm, self.mlp_norm = RMSNorm(c.dim), RMSNorm(c.dim)
        self.attn = Attention(c.dim, c.heads, c.kv_heads, c.dim // c.heads)
        self.gate_proj = nn.Linear(c.dim, c.hidden, bias=False)
        self.up_proj = nn.Linear(c.dim, c.hidden, bias=False)
        self.down_proj = nn.Linear(c.hidden, c.dim, bias=False)

    def _forward(self, x):
        x = x + self.attn(self.attn_norm(x), causal=True)
        h = self.mlp_norm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class LlamaModel(_LayerUnits, nn.Module):
    def __init__(self, c: LlamaConfig):
        super().__init__()
        c.validate()
        self.config = c
        self.embed = nn.Embedding(c.vocab, c.dim)
        self.layers = nn.ModuleList(DecoderLayer(c) for _ in range(c.layers))
        self.norm = RMSNorm(c.dim)
        self.head = nn.Linear(c.dim, c.vocab, bias=False)
        if c.tied:
            self.head.weight = self.embed.weight

    def forward(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x)).float()


# ---- Qwen3-MoE-style decoder -----------------------------------------------------------------

@dataclass(frozen=True)
class Qwen3MoeConfig(_ConfigBase):
    dim: int = 2048
    layers: int = 2
    heads: int = 32
    kv_heads: int = 4
    head_dim: int = 128
    experts: int = 128
    expert_hidden: int = 768
    top_k: int = 8
    vocab: int = 32000
    checkpointed: bool = False
    # Each expert a module of three nn.Linear (gate, up, down), as Hugging Face MoE models keep
    # them: 3 x experts params per layer's experts group instead of 3 grouped tensors.
    experts_as_modules: bool = False
    # Routing without a host sync, so a step can be captured in a CUDA graph: every expert runs
    # every routed slot and each slot keeps its own expert's row (experts x the expert FLOPs).
    capturable: bool = False
    family = "qwen3-moe"

    def validate(self) -> None:
        _require_positive(self, ("dim", "layers", "heads", "kv_heads", "head_dim", "experts",
                                 "expert_hidden", "top_k", "vocab"))
        if self.heads % self.kv_heads:
            raise ValueError(f"Qwen3MoeConfig: heads {self.heads}, kv_heads {self.kv_heads}: "
                             "expected heads divisible by kv_heads")
        if self.top_k > self.experts:
            raise ValueError(f"Qwen3MoeConfig: top_k {self.top_k} > experts {self.experts}: "
                             "a token cannot be routed to more experts than there are")

    def params(self) -> int:
        attn = Attention.params(self.dim, self.heads, self.kv_heads, self.head_dim, False, "head")
        moe = self.dim * self.experts + 3 * self.experts * self.dim * self.expert_hidden
        return self.layers * (attn + moe + 2 * self.dim) + 2 * self.vocab * self.dim + self.dim

    def build(self) -> nn.Module:
        return Qwen3MoeModel(self)

    def batch(self, batch: int, seq: int, generator, device) -> tuple:
        return _token_batch(self.vocab, batch, seq, generator, device)

    def loss(self, model, batch: tuple):
        return _next_token_loss(model, batch)


class GroupedExperts(nn.Module):
    """`experts` SwiGLU MLPs stored as three grouped tensors (w1, w3: [E, dim, hidden]; w2:
    [E, hidden, dim]), each one nn.Parameter, as torchtitan stores them. forward takes the routed
    tokens sorted by expert and the per-expert counts; one matmul chain per expert."""

    def __init__(self, experts: int, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(experts, dim, hidden))
        self.w2 = nn.Parameter(torch.empty(experts, hidden, dim))
        self.w3 = nn.Parameter(torch.empty(experts, dim, hidden))
        for w, fan_in in ((self.w1, dim), (self.w2, hidden), (self.w3, dim)):
            nn.init.uniform_(w, -fan_in ** -0.5, fan_in ** -0.5)  # nn.Linear's bound

    def forward(self, x_sorted, counts: list):
        # unbind: one backward (a stack), not one full-size zero gradient per expert
        outs = [(F.silu(xe @ w1) * (xe @ w3)) @ w2
                for xe, w1, w2, w3 in zip(x_sorted.split(counts), self.w1.unbind(0), self.w2.unbind(0),
                                          self.w3.unbind(0))]
        return torch.cat(outs)


class ModuleExperts(nn.Module):
    """`experts` SwiGLU MLPs, each its own module of three bias-free nn.Linear (gate_proj, up_proj:
    dim -> hidden; down_proj: hidden -> dim), as Hugging Face MoE models keep them: a layer's
    experts group holds 3 x experts params. forward as GroupedExperts'."""

    def __init__(self, experts: int, dim: int, hidden: int):
        super().__init__()
        self.experts = nn.ModuleList(
            nn.ModuleDict({"gate_proj": nn.Linear(dim, hidden, bias=False),
                           "up_proj": nn.Linear(dim, hidden, bias=False),
                           "down_proj": nn.Linear(hidden, dim, bias=False)})
            for _ in range(experts))

    def forward(self, x_sorted, counts: list):
        outs = [e["down_proj"](F.silu(e["gate_proj"](xe)) * e["up_proj"](xe))
                for xe, e in zip(x_sorted.split(counts), self.experts)]
        return torch.cat(outs)


class MoE(nn.Module):
    """Top-k softmax routing (weights renormalised over the chosen k, as Qwen3 does) to grouped
    experts. Deterministic on every device: tokens are permuted (not scattered with duplicates),
    so no gradient is an atomic sum."""

    def __init__(self, c: Qwen3MoeConfig):
        super().__init__()
        self.top_k, self.num_experts, self.capturable = c.top_k, c.experts, c.capturable
        self.router = nn.Linear(c.dim, c.experts, bias=False)
        self.experts = (ModuleExperts if c.experts_as_modules else GroupedExperts)(
            c.experts, c.dim, c.expert_hidden)

    def forward(self, x):
        b, s, d = x.shape
        x = x.reshape(b * s, d)
        probs = F.softmax(self.router(x).float(), dim=-1)
        weights, chosen = probs.topk(self.top_k, dim=-1)                  # [T, k]
        weights = weights / weights.sum(-1, keepdim=True)
        flat = chosen.flatten()                                           # slot i: token i // k
        if self.capturable:
            slots = x.unsqueeze(1).expand(b * s, self.top_k, d).reshape(-1, d)
            n = slots.shape[0]
            every = self.experts(slots.repeat(self.num_experts, 1), [n] * self.num_experts)
            y = every.view(self.num_experts, n, d)[flat, torch.arange(n, device=flat.device)]
            y = y.view(b * s, self.top_k, d)
            return (y * weights.unsqueeze(-1).to(y.dtype)).sum(1).view(b, s, d)
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        slots = x.unsqueeze(1).expand(b * s, self.top_k, d).reshape(-1, d)
        y = self.experts(slots[order], counts)
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        y = y[inverse].view(b * s, self.top_k, d)
        return (y * weights.unsqueeze(-1).to(y.dtype)).sum(1).view(b, s, d)


class Qwen3MoeLayer(Block):
    def __init__(self, c: Qwen3MoeConfig):
        super().__init__(c.checkpointed)
        self.attn_norm, self.mlp_norm = RMSNorm(c.dim), RMSNorm(c.dim)
        self.attn = Attention(c.dim, c.heads, c.kv_heads, c.head_dim, qk_norm="head")
        self.moe = MoE(c)

    def _forward(self, x):
        x = x + self.attn(self.attn_norm(x), causal=True)
        return x + self.moe(self.mlp_norm(x))


class Qwen3MoeModel(nn.Module):
    def __init__(self, c: Qwen3MoeConfig):
        super().__init__()
        c.validate()
        self.config = c
        self.embed = nn.Embedding(c.vocab, c.dim)
        self.layers = nn.ModuleList(Qwen3MoeLayer(c) for _ in range(c.layers))
        self.norm = RMSNorm(c.dim)
        self.head = nn.Linear(c.dim, c.vocab, bias=False)

    def fsdp_units(self, expert_shard_dim: int = 0) -> list:
        """Each layer's experts as their own unit (torchtitan's wrapping: the router and attention
        stay with the layer), sharded on `expert_shard_dim`; then the layer."""
        from torch.distributed.tensor import Shard

        placement = None if expert_shard_dim == 0 else (lambda p, _s=Shard(expert_shard_dim): _s)
        units = []
        for layer in self.layers:
            units += [(layer.moe.experts, placement), (layer, None)]
        return units

    forward = LlamaModel.forward


# ---- Wan-style diffusion transformer ---------------------------------------------------------

@dataclass(frozen=True)
class WanConfig(_ConfigBase):
    dim: int = 5120
    layers: int = 2
    heads: int = 40
    ffn: int = 13824
    freq_dim: int = 256
    text_dim: int = 4096
    text_len: int = 512
    patch_in: int = 64  # latent channels x patch volume (Wan: 16 x 1 x 2 x 2)
    checkpointed: bool = False
    family = "wan"
    # Its cross-attention sums each query's gradient over 512 text tokens, several key tiles:
    # every fused SDPA backward (cuDNN, flash, memory-efficient) adds the tiles with atomics, in no
    # fixed order, unless deterministic algorithms are on (flash, ordered; cuDNN is then not chosen).
    deterministic_backward = True

    def validate(self) -> None:
        _require_positive(self, ("dim", "layers", "heads", "ffn", "freq_dim", "text_dim", "text_len",
                                 "patch_in"))
        if self.dim % self.heads:
            raise ValueError(f"WanConfig: dim {self.dim}, heads {self.heads}: expected dim divisible by heads")
        if self.freq_dim % 2:
            raise ValueError(f"WanConfig: freq_dim {self.freq_dim}: expected even (cos and sin halves)")

    def params(self) -> int:
        d = self.dim
        attn = Attention.params(d, self.heads, self.heads, d // self.heads, True, "full")
        block = 2 * attn + 2 * d + (2 * d * self.ffn + self.ffn + d) + 6 * d  # + cross-attn norm, ffn, modulation
        root = ((self.patch_in + 1) * d                                  # patch embedding
                + (self.text_dim + 1) * d + (d + 1) * d                  # text embedding
                + (self.freq_dim + 1) * d + (d + 1) * d                  # time embedding
                + (d + 1) * 6 * d                                        # time projection
                + (d + 1) * self.patch_in + 2 * d)                       # head + its modulation
        return self.layers * block + root

    def build(self) -> nn.Module:
        return WanModel(self)

    def batch(self, batch: int, seq: int, generator, device) -> tuple:
        on = {"generator": generator, "device": generator.device}  # see _token_batch
        latents = torch.randn(batch, seq, self.patch_in, **on)
        timesteps = torch.randint(0, 1000, (batch,), **on)
        context = torch.randn(batch, self.text_len, self.text_dim, **on)
        target = torch.randn(batch, seq, self.patch_in, **on)
        return tuple(t.to(device) for t in (latents, timesteps, context, target))

    def loss(self, model, batch: tuple):
        latents, timesteps, context, target = batch
        return F.mse_loss(model(latents, timesteps, context), target.flatten(0, 1))


def _layer_norm(x):
    return F.layer_norm(x.float(), (x.shape[-1],), eps=1e-6).type_as(x)


def _sinusoidal(freq_dim: int, t):
    half = freq_dim // 2
    freqs = torch.pow(10000.0, -torch.arange(half, device=t.device, dtype=torch.float64) / half)
    args = t.double().unsqueeze(1) * freqs
    return torch.cat([torch.cos(args), torch.sin(args)], dim=1).float()


class WanBlock(Block):
    """Wan's attention block: adaLN-modulated self-attention and FFN (shift, scale, gate from the
    time embedding plus the block's own [1, 6, dim] modulation), cross-attention to the text."""

    def __init__(self, c: WanConfig):
        super().__init__(c.checkpointed)
        hd = c.dim // c.heads
        self.self_attn = Attention(c.dim, c.heads, c.heads, hd, bias=True, qk_norm="full")
        self.cross_norm = nn.LayerNorm(c.dim, eps=1e-6)
        self.cross_attn = Attention(c.dim, c.heads, c.heads, hd, bias=True, qk_norm="full")
        self.ffn = nn.Sequential(nn.Linear(c.dim, c.ffn), nn.GELU(approximate="tanh"), nn.Linear(c.ffn, c.dim))
        self.modulation = nn.Parameter(torch.randn(1, 6, c.dim) / c.dim ** 0.5)

    def _forward(self, x, e, context):
        shift1, scale1, gate1, shift2, scale2, gate2 = (self.modulation + e).chunk(6, dim=1)
        x = x + self.self_attn(_layer_norm(x) * (1 + scale1) + shift1) * gate1
        x = x + self.cross_attn(self.cross_norm(x), context)
        return x + self.ffn(_layer_norm(x) * (1 + scale2) + shift2) * gate2


class WanModel(_LayerUnits, nn.Module):
    def __init__(self, c: WanConfig):
        super().__init__()
        c.validate()
        self.config = c
        self.patch_embed = nn.Linear(c.patch_in, c.dim)
        self.text_embedding = nn.Sequential(nn.Linear(c.text_dim, c.dim), nn.GELU(approximate="tanh"),
                                            nn.Linear(c.dim, c.dim))
        self.time_embedding = nn.Sequential(nn.Linear(c.freq_dim, c.dim), nn.SiLU(), nn.Linear(c.dim, c.dim))
        self.time_projection = nn.Sequential(nn.SiLU(), nn.Linear(c.dim, 6 * c.dim))
        self.layers = nn.ModuleList(WanBlock(c) for _ in range(c.layers))
        self.head = nn.Linear(c.dim, c.patch_in)
        self.head_modulation = nn.Parameter(torch.randn(1, 2, c.dim) / c.dim ** 0.5)

    def forward(self, latents, timesteps, context):
        c = self.config
        x = self.patch_embed(latents)
        e = self.time_embedding(_sinusoidal(c.freq_dim, timesteps).to(x.dtype))
        e6 = self.time_projection(e).unflatten(1, (6, c.dim))
        context = self.text_embedding(context)
        for layer in self.layers:
            x = layer(x, e6, context)
        shift, scale = (self.head_modulation + e.unsqueeze(1)).chunk(2, dim=1)
        x = (_layer_norm(x) * (1 + scale) + shift).flatten(0, 1)
        # [batch * seq, patch_in]: a 2-D head output is no view (FSDP2 warns about returned views)
        return self.head(x).float()


PRESETS = {
    "tiny": LlamaConfig(dim=64, layers=2, heads=4, kv_heads=2, hidden=176, vocab=256),
    "cpu": LlamaConfig(),
    # 8B-shaped layers (hidden 4096, intermediate 14336, 8 KV heads of 128), a few of them.
    "8b-layers": LlamaConfig(dim=4096, layers=4, heads=32, kv_heads=8, hidden=14336, vocab=32000),
    # 70B-shaped layers (hidden 8192, intermediate 28672, 8 KV heads of 128).
    "70b-layers": LlamaConfig(dim=8192, layers=2, heads=64, kv_heads=8, hidden=28672, vocab=32000),
    # Qwen3-30B-A3B-shaped layers (hidden 2048; 128 experts of intermediate 768, top-8; GQA 32/4
    # heads of 128 with q/k RMSNorm); vocab reduced from 151 936.
    "qwen3-moe-layers": Qwen3MoeConfig(),
    "qwen3-moe-tiny": Qwen3MoeConfig(dim=64, layers=2, heads=4, kv_heads=2, head_dim=16, experts=8,
                                     expert_hidden=32, top_k=2, vocab=256),
    # Wan2.2-14B-shaped DiT blocks (dim 5120, FFN 13824, 40 heads, text dim 4096, 512 text tokens).
    "wan-layers": WanConfig(),
    "wan-tiny": WanConfig(dim=64, layers=2, heads=4, ffn=176, freq_dim=32, text_dim=48, text_len=16,
                          patch_in=16),
}
