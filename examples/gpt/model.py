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


#: The examples' model shapes (examples/deepspeed, examples/fsdp)
MODELS = {  # name: (d_model, n_layer, n_head, vocab_size or None for the data's own)
    "tiny": (64, 2, 4, None),            # ~0.2 M params: tests
    "small": (512, 7, 8, None),          # ~23 M: the smartinf.optim demo's GPT
    "270m": (1024, 21, 16, None),        # 266 M: the CPU head-to-head benchmark
    "gpt2-xl": (1600, 48, 25, 50257),    # 1.56 B: GPT-2 XL's shape
    "3b": (3200, 26, 32, 32000),         # 3.3 B: OpenLLaMA 3B's (the peers' largest here)
    "7b": (4096, 32, 32, 32000),         # 6.57 B: Llama-2 7B's width, depth and vocabulary
    "13b": (5120, 40, 40, 32000),        # 12.7 B: Llama-2 13B's (the blocks GPT-2's)
    "15b": (5120, 47, 40, 32000),        # 15.0 B: 13B's 47 deep, the most one H200 box holds with
                                         # --offload-param (int8 + split: 6 B a param of host memory)
    "30b": (6656, 60, 52, 32000),        # 32.1 B: Llama-1 30B's width, depth and heads
    "65b": (8192, 80, 64, 32000),        # 64.7 B: Llama-1 65B's (params in host memory: --offload-param)
}


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
        if self.ln_f.weight.device.type != "meta":  # (built on "meta": initialised once placed)
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
        for i, (name, p) in enumerate(self.named_parameters()):
            with whole(p):
                if p.device.type == "cpu" and self._std(name):
                    p.copy_(torch.empty(p.shape, device="cpu").normal_(0.0, self._std(name), generator=gen))
                else:
                    p.copy_(self.initial(i, name, p.shape, p.device, seed))

    def _std(self, name: str) -> float:
        """A weight's init std (0: a bias or a LayerNorm's, not drawn). Residual projections
        are scaled down so the residual stream's variance does not grow with depth."""
        if name.endswith("bias") or ".ln" in name or name.startswith("ln_"):
            return 0.0
        return 0.02 / math.sqrt(2 * self.cfg.n_layer) if name.endswith("proj.weight") else 0.02

    def initial(self, i: int, name: str, shape: tuple, device: torch.device, seed: int) -> torch.Tensor:
        """Param ``i`` (``name``)'s whole initial value made on ``device`` from a generator of
        its own there: fp32 draws (torch.normal: zero.Init makes torch.empty's in its dtype);
        a sharded model takes its shard of it (examples/fsdp/train.py)."""
        if not self._std(name):
            fill = 0.0 if name.endswith("bias") else 1.0  # (a LayerNorm's weight)
            return torch.full(tuple(shape), fill, device=device)
        own = torch.Generator(device=device).manual_seed(seed * 1_000_003 + i)
        return torch.normal(0.0, self._std(name), tuple(shape), generator=own, device=device,
                            dtype=torch.float32)

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
