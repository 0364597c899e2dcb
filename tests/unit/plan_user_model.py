"""Example `--model package.module:function` factories for tests/unit/test_plan_trace.py.

`custom_lm` is deliberately not slipstream's Transformer: hand-written attention (no SDPA),
an RMS norm by hand, a SiLU MLP, an untied head and a non-trainable buffer.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from slipstream.config.schema import ModelConfig
from slipstream.models.transformer import Transformer, build_model

TINY_TRANSFORMER = dict(n_layer=2, n_head=4, d_model=64, vocab_size=256, max_seq_len=128)


class _Block(nn.Module):
    def __init__(self, d: int, n_head: int, seq_len: int):
        super().__init__()
        self.n_head = n_head
        self.norm1 = nn.Parameter(torch.ones(d))
        self.norm2 = nn.Parameter(torch.ones(d))
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d, bias=False)
        self.up = nn.Linear(d, 3 * d)
        self.down = nn.Linear(3 * d, d)
        self.register_buffer("mask", torch.ones(seq_len, seq_len, dtype=torch.bool).tril(), persistent=False)

    @staticmethod
    def _rms(x: torch.Tensor, gain: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * gain

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape
        q, k, v = self.qkv(self._rms(x, self.norm1)).split(D, dim=-1)
        q, k, v = (t.view(B, T, self.n_head, D // self.n_head).transpose(1, 2) for t in (q, k, v))
        scores = (q @ k.transpose(-2, -1)) / (D // self.n_head) ** 0.5
        scores = scores.masked_fill(~self.mask[:T, :T], float("-inf"))
        attn = scores.softmax(-1) @ v
        x = x + self.proj(attn.transpose(1, 2).reshape(B, T, D))
        return x + self.down(F.silu(self.up(self._rms(x, self.norm2))))


class CustomLM(nn.Module):
    def __init__(self, vocab: int, d: int, n_layer: int, n_head: int, seq_len: int):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(_Block(d, n_head, seq_len) for _ in range(n_layer))
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def custom_lm(vocab_size: int = 1000, seq_len: int = 128) -> CustomLM:
    """~0.9M parameters at the defaults; gets the planner's vocabulary and sequence length."""
    return CustomLM(vocab_size, d=96, n_layer=4, n_head=4, seq_len=seq_len)


def custom_lm_fixed() -> CustomLM:
    """Takes no arguments: its own vocabulary (2000) and longest sequence (256)."""
    return CustomLM(2000, d=128, n_layer=3, n_head=4, seq_len=256)


def slipstream_tiny() -> Transformer:
    return Transformer(ModelConfig(**TINY_TRANSFORMER))


def slipstream_built_on_gpu() -> Transformer:
    """slipstream's own meta-device build + init, then .cuda() as a GPU script would."""
    return build_model(ModelConfig(**TINY_TRANSFORMER)).cuda()


def meta_lm() -> CustomLM:
    """Built on the meta device and returned there (tied head and embedding)."""
    with torch.device("meta"):
        model = CustomLM(512, d=64, n_layer=2, n_head=4, seq_len=64)
    model.head.weight = model.emb.weight
    return model


class _WideMLPLM(nn.Module):
    def __init__(self, vocab: int, d: int, n_layer: int):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
                                    for _ in range(n_layer))
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for layer in self.layers:
            x = x + layer(x)
        return self.head(x)


def huge_lm() -> nn.Module:
    """~20.7B parameters (83 GB in fp32): only traceable without allocating."""
    return _WideMLPLM(32000, d=8192, n_layer=38)


# --- factories that are wrong --------------------------------------------------------------

NOT_CALLABLE = 42


def returns_int() -> int:
    return 42


def wants_floats() -> nn.Module:
    return nn.Sequential(nn.Linear(32, 32), nn.ReLU())


class _DataDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(100, 16)
        self.head = nn.Linear(16, 100)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        if (idx == 0).any():  # a Python branch on tensor values
            idx = idx + 1
        return self.head(self.emb(idx))


def data_dependent() -> nn.Module:
    return _DataDependent()


def raises() -> nn.Module:
    raise RuntimeError("factory exploded")
