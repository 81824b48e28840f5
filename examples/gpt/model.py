"""A compact GPT: causal decoder-only transformer, built locally from a config.

Token + learned position embeddings, pre-LN blocks (causal self-attention, GELU MLP),
a final LayerNorm and an LM head tied to the token embedding (GPT-2 layout).
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Callable, ContextManager, Optional

import torch
import torch.utils.checkpoint
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int
    seq_len: int = 64
    d_model: int = 512
    n_layer: int = 6
    n_head: int = 8
    mlp_ratio: int = 4

    def __post_init__(self) -> None:
        if self.d_model % self.n_head:
            raise ValueError(f"d_model {self.d_model} is not a multiple of n_head {self.n_head}")


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)  # one GEMM for q, k and v
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        # (b, t, 3d) -> 3 x (b, heads, t, d_head)
        q, k, v = self.qkv(x).view(b, t, 3, self.n_head, d // self.n_head).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model)
        self.proj = nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """``whole(param)``: a context in which ``param`` is whole, for the init (a model built
    partitioned, under ``deepspeed.zero.Init``: ``GatheredParameters([param],
    modifier_rank=0)``; on the host, the same values as built whole). ``checkpoint``: each
    block's activations recomputed in backward instead of kept (activation checkpointing)."""

    def __init__(self, cfg: GPTConfig, seed: int = 0,
                 whole: Optional[Callable[[nn.Parameter], ContextManager]] = None,
                 checkpoint: bool = False) -> None:
        super().__init__()
        self.cfg = cfg
        self.checkpoint = checkpoint
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.reset_parameters(seed, whole or (lambda p: contextlib.nullcontext()))

    @torch.no_grad()
    def reset_parameters(self, seed: int,
                         whole: Callable[[nn.Parameter], ContextManager]) -> None:
        """GPT-2 init from private generators: the weights depend on ``seed`` and on where
        the params are made. On the host, one generator draws every param in turn (built whole,
        or under zero.Init on the CPU: the same values). On a GPU (zero.Init), each param draws
        from a generator of its own there, seeded by ``seed`` and its index: a 13 B model's
        draws on one host thread took over 5 minutes; on its GPU they take a moment."""
        gen = torch.Generator().manual_seed(seed)
        # Residual projections are scaled down so the residual stream's variance does not
        # grow with depth.
        resid_std = 0.02 / math.sqrt(2 * self.cfg.n_layer)
        for i, (name, p) in enumerate(self.named_parameters()):
            with whole(p):
                if name.endswith("bias"):
                    nn.init.zeros_(p)
                elif ".ln" in name or name.startswith("ln_"):
                    nn.init.ones_(p)
                else:
                    std = resid_std if name.endswith("proj.weight") else 0.02
                    if p.device.type == "cpu":
                        p.copy_(torch.empty(p.shape, device="cpu").normal_(0.0, std, generator=gen))
                    else:  # fp32 draws (torch.normal: zero.Init makes torch.empty's in its dtype)
                        own = torch.Generator(device=p.device).manual_seed(seed * 1_000_003 + i)
                        p.copy_(torch.normal(0.0, std, tuple(p.shape), generator=own,
                                             device=p.device, dtype=torch.float32))

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Logits (batch, seq, vocab) for token ids (batch, seq)."""
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        for block in self.blocks:
            if self.checkpoint and torch.is_grad_enabled():
                x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        # Tied LM head: the output projection reuses the token embedding matrix.
        return F.linear(self.ln_f(x), self.tok_emb.weight)
