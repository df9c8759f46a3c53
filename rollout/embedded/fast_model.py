"""The engine's fast forward: the same math as rollout/embedded/model.py on fused plain tensors.

Every family's trunk runs here: the q/k/v bias (Qwen2, MiMo) and the per-head q/k norm
(Qwen3) are optional parts of a layer's weights.

Per decoder layer it runs 4 matmuls instead of 7 (q|k|v and gate|up fused), no nn.Module
dispatch, and a grouped-query attention written as two batched matmuls that read the KV
cache without expanding it per head. The module forward in model.py stays the reference;
tests check this path against it. Fused weights are rebuilt after every weight load.
Every matmul against a weight (trunk, MTP layers, eh_proj, LM head) goes through
rollout/embedded/linear.py, whose prepacked backend costs about the same for 1 or 4 rows.
"""
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from mtp.layer import combine_embedding_and_hidden, zero_embedding_at_position_0
from rollout.embedded.linear import PackedWeight, linear, pack, pick_backend


@dataclass
class LayerWeights:
    """One decoder layer's weights, packed for the fast inference path."""

    ln1: torch.Tensor
    qkv: PackedWeight
    qkv_bias: Optional[torch.Tensor]  # families with q/k/v bias
    qk_norm: Optional[torch.Tensor]  # [heads + kv_heads, head_dim]: q_norm rows, then k_norm rows
    o: PackedWeight
    ln2: torch.Tensor
    gate_up: PackedWeight
    down: PackedWeight


def _cat_or_none(tensors):
    return None if tensors[0] is None else torch.cat(tensors).detach()


def fuse_layer(layer, backend="dense"):
    a, m = layer.self_attn, layer.mlp
    qk_norm = None
    if hasattr(a.q_norm, "weight"):  # nn.Identity in families without q/k norm
        qk_norm = torch.cat([a.q_norm.weight.expand(a.n_heads, -1), a.k_norm.weight.expand(a.n_kv, -1)]).detach()
    return LayerWeights(
        ln1=layer.input_layernorm.weight.detach(),
        qkv=pack(torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]), backend),
        qkv_bias=_cat_or_none([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias]),
        qk_norm=qk_norm, o=pack(a.o_proj.weight, backend),
        ln2=layer.post_attention_layernorm.weight.detach(),
        gate_up=pack(torch.cat([m.gate_proj.weight, m.up_proj.weight]), backend),
        down=pack(m.down_proj.weight, backend))


class FastForward:
    """Callable like `CausalLMWithMTP.forward(tokens, positions, caches)` for cached ragged batches."""

    def __init__(self, model, linear_backend="auto"):
        self.model = model
        self.requested_backend = linear_backend
        cfg = model.cfg
        self.eps, self.n_heads, self.n_kv, self.head_dim = (cfg.rms_norm_eps, cfg.num_attention_heads,
                                                           cfg.num_key_value_heads, cfg.head_dim)
        self.refresh()

    def refresh(self):
        """Re-fuse and re-pack after the model's weights changed (or moved device/dtype)."""
        m = self.model
        weight = m.head_weight()
        self.backend = pick_backend(weight.device, weight.dtype, self.requested_backend)
        self.layers = [fuse_layer(l, self.backend) for l in m.model.layers]
        self.head = pack(weight, self.backend)
        self.eh_proj = [pack(m.mtp_layer(k).eh_proj.weight, self.backend) for k in range(m.num_mtp_layers)]

    def logits(self, hidden):
        """Twin of `CausalLMWithMTP.logits` on the packed LM head."""
        return linear(hidden, self.head)

    def norm(self, x, w):
        return F.rms_norm(x, (x.shape[-1],), w, self.eps)

    def rope(self, x, cos, sin):
        half = x.shape[-1] // 2
        return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin

    def layer(self, w, x, cos, sin, cache):
        b, q_len, _ = x.shape
        h, d = self.n_heads, self.head_dim
        nqk = (h + self.n_kv) * d
        qkv = linear(self.norm(x, w.ln1), w.qkv)
        if w.qkv_bias is not None:
            qkv = qkv + w.qkv_bias
        # q and k heads side by side: one norm and one rotary call serve both
        qk = qkv[..., :nqk].unflatten(-1, (-1, d))
        if w.qk_norm is not None:
            qk = F.rms_norm(qk, (d,), eps=self.eps) * w.qk_norm
        qk = self.rope(qk, cos, sin)
        v = qkv[..., nqk:].unflatten(-1, (self.n_kv, d))
        attn = cache.attend_bqhd(qk[:, :, :h], qk[:, :, h:], v)
        x = x + linear(attn.reshape(b, q_len, h * d), w.o)
        gate, up = linear(self.norm(x, w.ln2), w.gate_up).chunk(2, dim=-1)
        return x + linear(F.silu(gate) * up, w.down)

    def __call__(self, tokens, positions, caches):
        return self.states(tokens, positions, caches)[0]

    def states(self, tokens, positions, caches, aux_layers=()):
        """Fast twin of `CausalLMWithMTP.forward_states`: (final-normed hidden, MTP input hidden);
        with `aux_layers` (an EAGLE-3 draft's), the second is the concatenated aux hidden states
        instead (twin of `CausalLMWithMTP.aux_hidden_states`)."""
        m = self.model
        x = F.embedding(tokens, m.model.embed_tokens.weight)
        cos = m.rotary.cos[positions].unsqueeze(2)
        sin = m.rotary.sin[positions].unsqueeze(2)
        aux = []
        for i in range(m.cfg.num_hidden_layers):
            if i in aux_layers:
                aux.append(x)
            x = self.layer(self.layers[i], x, cos, sin, caches[i])
        if m.cfg.num_hidden_layers in aux_layers:
            aux.append(x)
        normed = self.norm(x, m.model.norm.weight)
        if aux_layers:
            return normed, torch.cat(aux, -1)
        return normed, (x if m.cfg.model_family.mtp_reads_pre_norm_hidden else normed)

    def mtp(self, k, next_tokens, hidden, positions, cache):
        """Fast twin of `CausalLMWithMTP.mtp_forward` (same inputs and output)."""
        m = self.model
        layer = m.mtp_layer(k)
        embeds = F.embedding(next_tokens, m.model.embed_tokens.weight)
        if layer.zero_first_embedding:
            embeds = zero_embedding_at_position_0(embeds, positions)
        x = combine_embedding_and_hidden(embeds, hidden, lambda e: self.norm(e, layer.enorm.weight),
                                         lambda h: self.norm(h, layer.hnorm.weight),
                                         lambda eh: linear(eh, self.eh_proj[k]))
        cos = m.rotary.cos[positions].unsqueeze(2)
        sin = m.rotary.sin[positions].unsqueeze(2)
        x = self.layer(self.layers[m.cfg.num_hidden_layers + k], x, cos, sin, cache)
        return self.norm(x, layer.shared_head.norm.weight)


def gqa_attention(q, keys, values, mask):
    """q [B,Q,H,D]; keys/values [B,L,KV,D] (any strides); mask [B,Q,L] bool -> [B,Q,H,D].

    Heads of one KV group share the K/V reads: q is viewed as [B,KV,G*Q,D], no K/V copies."""
    b, q_len, h, d = q.shape
    kv = keys.shape[2]
    g = h // kv
    qg = q.view(b, q_len, kv, g, d).permute(0, 2, 3, 1, 4).reshape(b, kv, g * q_len, d)
    scores = (qg @ keys.permute(0, 2, 3, 1)) * (d ** -0.5)  # [B, KV, G*Q, L]
    scores = scores.view(b, kv, g, q_len, -1).masked_fill(~mask[:, None, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).view(b, kv, g * q_len, -1)
    out = probs @ values.permute(0, 2, 1, 3)  # [B, KV, G*Q, D]
    return out.view(b, kv, g, q_len, d).permute(0, 3, 1, 2, 4).reshape(b, q_len, h, d)
