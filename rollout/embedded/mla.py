"""Multi-head latent attention (DeepSeek-V3) with a latent KV cache.

Per token MLA projects the hidden state to a compressed KV latent c (`kv_lora_rank`, RMS-normed)
and one rope key k_r (`qk_rope_head_dim`) that every head shares; each head's key is
[W_uk c ; k_r] and its value W_uv c, with W_uk / W_uv the two halves of `kv_b_proj`. The cache
therefore holds only [c ; k_r] per token and layer — `MLAConfig.latent_width` values instead of
`heads x (qk_head_dim + v_head_dim)` for expanded K/V.

Two exact ways to attend over that cache:
- `MLAttention` (the module path, the reference): expand K/V from the cached latents, then
  ordinary attention — what transformers does.
- `absorbed_attention` (the engine's fast path): fold W_uk into the query (q_nope W_uk . c equals
  q_nope . W_uk c) and W_uv after the weighted sum of latents, so K/V are never expanded; the
  cost per cached token is one dot product of latent_width per head.
Both differ only by the order of fp32 sums.
"""
import torch
from torch import nn

from rollout.embedded.primitives import RMSNorm, sdpa_attention
from vime.models.rope import yarn_softmax_scale

# the q and kv latents' RMSNorm epsilon: DeepSeek's reference and transformers fix it at 1e-6
# whatever rms_norm_eps says (DeepSeek-V3's rms_norm_eps is 1e-6 too)
MLA_NORM_EPS = 1e-6


class MLAttention(nn.Module):
    """MLA with the HF parameter names; attends through a latent cache view when given one."""

    def __init__(self, cfg):
        super().__init__()
        m, h, heads = cfg.mla, cfg.hidden_size, cfg.num_attention_heads
        self.mla, self.n_heads = m, heads
        if m.q_lora_rank:
            self.q_a_proj = nn.Linear(h, m.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(m.q_lora_rank, MLA_NORM_EPS)
            self.q_b_proj = nn.Linear(m.q_lora_rank, heads * m.qk_head_dim, bias=False)
        else:
            self.q_proj = nn.Linear(h, heads * m.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(h, m.latent_width, bias=False)
        self.kv_a_layernorm = RMSNorm(m.kv_lora_rank, MLA_NORM_EPS)
        self.kv_b_proj = nn.Linear(m.kv_lora_rank, heads * (m.qk_nope_head_dim + m.v_head_dim), bias=False)
        self.o_proj = nn.Linear(heads * m.v_head_dim, h, bias=False)
        self.scale = yarn_softmax_scale(m.qk_head_dim, cfg.rope_yarn)

    def query(self, x):
        """[B, Q, heads, qk_head_dim]."""
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if self.mla.q_lora_rank else self.q_proj(x)
        return q.unflatten(-1, (self.n_heads, self.mla.qk_head_dim))

    def expand(self, entries):
        """Cached [c ; k_r] entries [B, L, W] -> per-head keys [B, H, L, qk] and values [B, H, L, v]."""
        m = self.mla
        latent, k_rope = entries.split([m.kv_lora_rank, m.qk_rope_head_dim], dim=-1)
        kv = self.kv_b_proj(latent).unflatten(-1, (self.n_heads, -1)).transpose(1, 2)
        k_nope, values = kv.split([m.qk_nope_head_dim, m.v_head_dim], dim=-1)
        k_rope = k_rope[:, None].expand(-1, self.n_heads, -1, -1)
        return torch.cat([k_nope, k_rope], dim=-1), values

    def forward(self, x, positions, rotary, cache=None):
        """x [B, Q, H]; with `cache` (a latent KVCache layer view) the new entries are written first."""
        m = self.mla
        b, q_len, _ = x.shape
        q_nope, q_rope = self.query(x).transpose(1, 2).split([m.qk_nope_head_dim, m.qk_rope_head_dim], dim=-1)
        q = torch.cat([q_nope, rotary(q_rope, positions)], dim=-1)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([m.kv_lora_rank, m.qk_rope_head_dim], dim=-1)
        entries = torch.cat([self.kv_a_layernorm(latent), rotary(k_rope[:, None], positions)[:, 0]], dim=-1)
        if cache is None:
            k_positions = positions
        else:
            entries, k_positions = cache.exchange_latent(entries)
        keys, values = self.expand(entries)
        out = sdpa_attention(q, keys, values, positions, k_positions, scale=self.scale)
        return self.o_proj(out.transpose(1, 2).reshape(b, q_len, -1))


def split_kv_b(kv_b_weight, mla, num_heads):
    """kv_b_proj's weight [H*(nope+v), R] -> (W_uk [H, nope, R], W_uv [H, v, R])."""
    per_head = kv_b_weight.view(num_heads, mla.qk_nope_head_dim + mla.v_head_dim, mla.kv_lora_rank)
    return per_head[:, :mla.qk_nope_head_dim].contiguous(), per_head[:, mla.qk_nope_head_dim:].contiguous()


def absorbed_attention(q_nope, q_rope, entries, mask, w_uk, w_uv, scale):
    """Attention over cached latents without expanding K/V.

    q_nope [B, Q, H, nope], q_rope [B, Q, H, rope] (rotated), entries [B, L, R + rope] (the cache),
    mask [B, Q, L] (key visible), w_uk [H, nope, R], w_uv [H, v, R] -> [B, Q, H, v]."""
    b, q_len, heads, _ = q_nope.shape
    rank = w_uk.shape[-1]
    q_latent = torch.einsum("bqhd,hdr->bqhr", q_nope, w_uk)
    q_cat = torch.cat([q_latent, q_rope], dim=-1).reshape(b, q_len * heads, -1)
    scores = (q_cat @ entries.transpose(1, 2)).view(b, q_len, heads, -1) * scale  # [B, Q, H, L]
    probs = torch.softmax(scores.masked_fill(~mask[:, :, None], float("-inf")), dim=-1)
    out_latent = probs.view(b, q_len * heads, -1) @ entries[..., :rank]  # [B, Q*H, R]
    return torch.einsum("bqhr,hvr->bqhv", out_latent.view(b, q_len, heads, rank), w_uv)


def kv_bytes_per_token(cfg, element_size=4):
    """(latent cache, expanded K/V cache) bytes per token over all decoder layers."""
    m = cfg.mla
    layers = cfg.num_hidden_layers
    return (layers * m.latent_width * element_size,
            layers * m.expanded_width(cfg.num_attention_heads) * element_size)
