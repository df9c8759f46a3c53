"""The building blocks every attention and layer of the engine's models share: RMSNorm, rotary
tables and their application (full, partial or on interleaved channel pairs), causal attention."""
import torch
import torch.nn.functional as F
from torch import nn

from mtp.blocks import Norm
from vime.models.rope import rotary_inv_freq


def rms_norm(x, weight, eps):
    """Qwen3 RMSNorm: normalise in fp32, scale in the input dtype."""
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


class RMSNorm(Norm):
    """Root-mean-square layer norm with a learned scale, computed as Qwen3's `rms_norm`."""

    norm = staticmethod(rms_norm)


def apply_rotary(x, cos, sin, interleaved=False):
    """Rotate the first cos.shape[-1] channels of x (the rest pass: partial rotary); cos/sin hold
    cat(freqs, freqs). `interleaved`: channel pairs are (2i, 2i+1) (DeepSeek's layout) and come out
    as [evens ; odds], which leaves every q.k product unchanged; else pairs are (i, i + half)."""
    rot = cos.shape[-1]
    part = x if rot == x.shape[-1] else x[..., :rot]
    if interleaved:
        half_cos, half_sin = cos[..., :rot // 2], sin[..., :rot // 2]
        even, odd = part[..., 0::2], part[..., 1::2]
        rotated = torch.cat([even * half_cos - odd * half_sin, odd * half_cos + even * half_sin], dim=-1)
    else:
        half = rot // 2
        rotated = part * cos + torch.cat([-part[..., half:], part[..., :half]], dim=-1) * sin
    return rotated if rot == x.shape[-1] else torch.cat([rotated, x[..., rot:]], dim=-1)


class Rotary(nn.Module):
    """RoPE cos/sin tables of `rotary_dim` channels indexed by absolute position (plain, YaRN or Llama 3)."""

    def __init__(self, rotary_dim, theta, max_positions, yarn=None, interleaved=False, llama3=None):
        super().__init__()
        inv_freq, attention_factor = rotary_inv_freq(rotary_dim, theta, yarn, llama3)
        freqs = torch.arange(max_positions).float()[:, None] * inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos", emb.cos() * attention_factor, persistent=False)
        self.register_buffer("sin", emb.sin() * attention_factor, persistent=False)
        self.interleaved = interleaved

    def forward(self, x, positions):
        """x [B, heads, Q, D], positions [B, Q]."""
        cos = self.cos[positions].unsqueeze(1).to(x.dtype)
        sin = self.sin[positions].unsqueeze(1).to(x.dtype)
        return apply_rotary(x, cos, sin, self.interleaved)


def sdpa_attention(q, k, v, q_positions, k_positions, scale=None):
    """Causal-by-position attention. q [B,H,Q,D], k/v [B,KV,L,D], positions [B,Q] / [B,L] or [L]."""
    if k_positions.dim() == 1:
        k_positions = k_positions.unsqueeze(0)
    mask = k_positions[:, None, None, :] <= q_positions[:, None, :, None]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1], scale=scale)
