"""The embedded Llama-style model tide-bench trains (and the tests reuse its pieces)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


@dataclass(frozen=True)
class LlamaConfig:
    dim: int = 256
    layers: int = 4
    heads: int = 8
    kv_heads: int = 2
    hidden: int = 688
    vocab: int = 1000
    tied: bool = False
    checkpointed: bool = False

    def validate(self) -> None:
        for name in ("dim", "layers", "heads", "kv_heads", "hidden", "vocab"):
            if getattr(self, name) < 1:
                raise ValueError(f"LlamaConfig: {name} = {getattr(self, name)}, expected >= 1")
        if self.dim % self.heads or self.heads % self.kv_heads:
            raise ValueError(f"LlamaConfig: dim {self.dim}, heads {self.heads}, kv_heads {self.kv_heads}: "
                             "expected dim divisible by heads and heads by kv_heads")

    def params(self) -> int:
        hd = self.dim // self.heads
        layer = 2 * self.dim * self.dim + 2 * self.dim * self.kv_heads * hd + 3 * self.dim * self.hidden + 2 * self.dim
        return self.layers * layer + self.vocab * self.dim * (1 if self.tied else 2) + self.dim

    def as_dict(self) -> dict:
        return asdict(self)


PRESETS = {
    "tiny": LlamaConfig(dim=64, layers=2, heads=4, kv_heads=2, hidden=176, vocab=256),
    "cpu": LlamaConfig(),
    # 8B-shaped layers (hidden 4096, intermediate 14336, 8 KV heads of 128), a few of them.
    "8b-layers": LlamaConfig(dim=4096, layers=4, heads=32, kv_heads=8, hidden=14336, vocab=32000),
    # 70B-shaped layers (hidden 8192, intermediate 28672, 8 KV heads of 128).
    "70b-layers": LlamaConfig(dim=8192, layers=2, heads=64, kv_heads=8, hidden=28672, vocab=32000),
}


class RMSNorm(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(x.dtype) * self.weight


class DecoderLayer(nn.Module):
    def __init__(self, c: LlamaConfig):
        super().__init__()
        self.c, hd = c, c.dim // c.heads
        self.attn_norm, self.mlp_norm = RMSNorm(c.dim), RMSNorm(c.dim)
        self.q_proj = nn.Linear(c.dim, c.dim, bias=False)
        self.k_proj = nn.Linear(c.dim, c.kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(c.dim, c.kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(c.dim, c.dim, bias=False)
        self.gate_proj = nn.Linear(c.dim, c.hidden, bias=False)
        self.up_proj = nn.Linear(c.dim, c.hidden, bias=False)
        self.down_proj = nn.Linear(c.hidden, c.dim, bias=False)

    def _forward(self, x):
        c, (b, s, _) = self.c, x.shape
        hd, rep = c.dim // c.heads, c.heads // c.kv_heads
        h = self.attn_norm(x)
        q = self.q_proj(h).view(b, s, c.heads, hd).transpose(1, 2)
        k = self.k_proj(h).view(b, s, c.kv_heads, hd).transpose(1, 2).repeat_interleave(rep, 1)
        v = self.v_proj(h).view(b, s, c.kv_heads, hd).transpose(1, 2).repeat_interleave(rep, 1)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, c.dim)
        x = x + self.o_proj(att)
        h = self.mlp_norm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))

    def forward(self, x):
        if self.c.checkpointed:
            return checkpoint(self._forward, x, use_reentrant=False)
        return self._forward(x)


class LlamaModel(nn.Module):
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
