"""Transformer blocks whose math is the same in every model vime runs (the policy trunk, its MTP
layers, the external drafts), so that each is written once: SwiGLU, and the pieces every external
draft is built of (the shape fields of its config, RMSNorm, neox rotary, grouped-query attention)."""
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


class SwiGLU(nn.Module):
    """SwiGLU feed-forward block: down(silu(gate(x)) * up(x)), with the HF/vLLM parameter names.
    `intermediate_size` overrides the config's (an MoE expert's width)."""

    def __init__(self, cfg, intermediate_size=None):
        super().__init__()
        width = intermediate_size or cfg.intermediate_size
        self.gate_proj = nn.Linear(cfg.hidden_size, width, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, width, bias=False)
        self.down_proj = nn.Linear(width, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


@dataclass(frozen=True, kw_only=True)
class DraftShape:
    """The fields of an external draft's config.json that every kind has (its layers' widths, its
    vocabulary, the width of the target states it reads); each kind's config adds its own."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    target_hidden_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 256


def rms(x, weight, eps):
    """RMSNorm in fp32, scaled in the input dtype (vLLM's RMSNorm on CPU)."""
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


class Norm(nn.Module):
    """An RMSNorm scale (named `<norm>.weight`, as the checkpoint stores it); `norm` is how it normalises
    (a subclass may compute it otherwise: the engine's models follow their own reference)."""

    norm = staticmethod(rms)

    def __init__(self, dim, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return self.norm(x, self.weight, self.eps)


def rotate(x, positions, theta):
    """Neox-style rotary embedding of x [B, heads, Q, D] at positions [B, Q]."""
    d = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.int64, device=x.device).float() / d))
    freqs = positions.float()[..., None] * inv_freq
    emb = torch.cat([freqs, freqs], -1)
    cos, sin = emb.cos().unsqueeze(1).to(x.dtype), emb.sin().unsqueeze(1).to(x.dtype)
    half = d // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin


def causal_attention(q, k, v, positions):
    """Attention over the same sequence, causal by position (no cache: training, references)."""
    mask = positions[:, None, None, :] <= positions[:, None, :, None]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])


class DraftAttention(nn.Module):
    """A draft layer's grouped-query attention projections (no bias): q/k/v read `in_width` inputs,
    heads get a per-head RMSNorm on q and k where `qk_norm` (Qwen3), then neox rotary. Each kind's
    subclass says what the queries attend over."""

    def __init__(self, cfg, in_width, qk_norm=False):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.cfg = cfg
        self.q_proj = nn.Linear(in_width, cfg.num_attention_heads * d, bias=False)
        self.k_proj = nn.Linear(in_width, cfg.num_key_value_heads * d, bias=False)
        self.v_proj = nn.Linear(in_width, cfg.num_key_value_heads * d, bias=False)
        self.o_proj = nn.Linear(cfg.num_attention_heads * d, h, bias=False)
        if qk_norm:
            self.q_norm = Norm(d, cfg.rms_norm_eps)
            self.k_norm = Norm(d, cfg.rms_norm_eps)
        self.qk_norm = qk_norm

    def _heads(self, x, proj, n, norm):
        """x [B, Q, in] -> [B, n, Q, D] through `proj`, normed per head by `norm` where the layer has one."""
        b, q_len, _ = x.shape
        out = proj(x).view(b, q_len, n, self.cfg.head_dim).transpose(1, 2)
        return norm(out) if self.qk_norm else out

    def query(self, x, positions):
        """x [B, Q, in] -> rotated queries [B, heads, Q, D]."""
        c = self.cfg
        return rotate(self._heads(x, self.q_proj, c.num_attention_heads, getattr(self, "q_norm", None)), positions,
                      c.rope_theta)

    def key_value(self, x, positions):
        """x [B, T, in] -> rotated keys and values [B, kv_heads, T, D]."""
        c = self.cfg
        k = self._heads(x, self.k_proj, c.num_key_value_heads, getattr(self, "k_norm", None))
        v = self.v_proj(x).view(*x.shape[:2], c.num_key_value_heads, c.head_dim).transpose(1, 2)
        return rotate(k, positions, c.rope_theta), v

    def output(self, attn):
        """[B, heads, Q, D] attention output -> [B, Q, H]."""
        return self.o_proj(attn.transpose(1, 2).flatten(2))
