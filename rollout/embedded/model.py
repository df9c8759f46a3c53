"""The decoder-only transformer with MTP layers of every family, written for inference
(and reused to pretrain).

The family (vime/models/families.py) and the config set the trunk flavour — plain GQA (Llama),
q/k/v bias (Qwen2, MiMo, GLM-4.5), per-head q/k norm (Qwen3, GLM-4.5 with use_qk_norm), partial rotary (GLM-4.5),
multi-head latent attention with YaRN (DeepSeek-V3, mla.py), mixture-of-experts layers after
the first dense ones (GLM-4.5, DeepSeek-V3, moe.py) — and which hidden state the first MTP layer reads.
Module names equal vime's canonical HF names, so an HF state dict loads with
`load_state_dict` unchanged. One attention function serves the
full-sequence forward (no cache) and the cached ragged forward used by prefill, decode
and speculative verification: every call passes token positions, and with a cache each
row may bring a different number of new tokens.
"""
import torch
from torch import nn

from mtp.layer import combine_embedding_and_hidden, zero_embedding_at_position_0
from mtp.blocks import SwiGLU
from rollout.embedded.mla import MLAttention
from rollout.embedded.moe import MoE
from rollout.embedded.primitives import RMSNorm, Rotary, rms_norm, sdpa_attention  # noqa: F401 (re-exported)


class Attention(nn.Module):
    """Grouped-query self-attention with rotary positions (q/k norm or q/k/v bias per family)."""

    def __init__(self, cfg):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, d
        self.q_proj = nn.Linear(h, self.n_heads * d, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(h, self.n_kv * d, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(h, self.n_kv * d, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.n_heads * d, h, bias=False)
        norm = (lambda: RMSNorm(d, cfg.rms_norm_eps)) if cfg.qk_norm else nn.Identity
        self.q_norm, self.k_norm = norm(), norm()

    def forward(self, x, positions, rotary, cache=None):
        """x [B,Q,H]. With `cache` (a KVCache view for this layer) new K/V are written first."""
        b, q_len, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, q_len, self.n_heads, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(b, q_len, self.n_kv, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, q_len, self.n_kv, self.head_dim).transpose(1, 2)
        q, k = rotary(q, positions), rotary(k, positions)
        if cache is None:
            out = sdpa_attention(q, k, v, positions, positions)
        else:
            out = cache.attend(q, k, v, positions)
        return self.o_proj(out.transpose(1, 2).reshape(b, q_len, -1))



ATTENTIONS = {"gqa": Attention, "mla": MLAttention}  # keyed by ModelFamily.attention


class DecoderLayer(nn.Module):
    """Pre-norm transformer layer: attention then MLP (dense, or MoE from first_k_dense_replace on),
    each with a residual. `index` numbers the layer (MTP layers continue after the trunk's)."""

    def __init__(self, cfg, index=0):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = ATTENTIONS[cfg.model_family.attention](cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MoE(cfg) if cfg.moe and cfg.moe.is_moe_layer(index) else SwiGLU(cfg)

    def forward(self, x, positions, rotary, cache=None):
        x = x + self.self_attn(self.input_layernorm(x), positions, rotary, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class SharedHead(nn.Module):
    """An MTP layer's final norm before the output head it shares with the trunk."""

    def __init__(self, cfg):
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class MTPLayer(DecoderLayer):
    """DeepSeek-V3 style MTP layer: eh_proj(cat(enorm(emb), hnorm(h))) -> decoder layer -> norm."""

    def __init__(self, cfg, index):
        super().__init__(cfg, index)
        self.zero_first_embedding = cfg.model_family.mtp_zero_embedding_at_position_0
        self.enorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.shared_head = SharedHead(cfg)

    def forward(self, embeds, hidden, positions, rotary, cache=None):
        """embeds: embedding of token t+1; hidden: previous depth's output at t. Returns the
        normalised hidden state that both feeds the shared LM head and the next depth."""
        if self.zero_first_embedding:
            embeds = zero_embedding_at_position_0(embeds, positions)
        x = combine_embedding_and_hidden(embeds, hidden, self.enorm, self.hnorm, self.eh_proj)
        return self.shared_head.norm(super().forward(x, positions, rotary, cache))


class Trunk(nn.Module):
    """Token embedding, the decoder layers, then the MTP layers stored after them, and the final norm."""

    def __init__(self, cfg):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        n = cfg.num_hidden_layers
        self.layers = nn.ModuleList([DecoderLayer(cfg, i) for i in range(n)] +
                                    [MTPLayer(cfg, n + k) for k in range(cfg.num_nextn_predict_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class CausalLMWithMTP(nn.Module):
    """Trunk + MTP layers of any family. `forward` returns final-normed hidden states, `logits`
    applies the head, `forward_states` also returns the hidden state the first MTP layer reads."""

    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.model = Trunk(cfg)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary = Rotary(cfg.rotary_dim, cfg.rope_theta, cfg.max_position_embeddings + 64, cfg.rope_yarn,
                             interleaved=bool(cfg.mla and cfg.mla.rope_interleave), llama3=cfg.rope_llama3)

    @property
    def num_mtp_layers(self):
        return self.cfg.num_nextn_predict_layers

    def mtp_layer(self, k):
        return self.model.layers[self.cfg.num_hidden_layers + k]

    def head_weight(self):
        return self.model.embed_tokens.weight if self.cfg.tie_word_embeddings else self.lm_head.weight

    def logits(self, hidden):
        return hidden @ self.head_weight().t()

    def forward(self, tokens, positions, caches=None):
        """Trunk hidden states after the final norm. caches: per-layer KV views or None."""
        return self.forward_states(tokens, positions, caches)[0]

    def trunk(self, tokens, positions, caches=None):
        """The last decoder layer's output, before the final norm."""
        x = self.model.embed_tokens(tokens)
        for i in range(self.cfg.num_hidden_layers):
            x = self.model.layers[i](x, positions, self.rotary, caches[i] if caches else None)
        return x

    def aux_hidden_states(self, tokens, positions, layer_ids):
        """[B, Q, len(layer_ids) * H]: the residual stream before each target layer in `layer_ids`
        (id i: after i layers; vLLM's EAGLE-3 aux hidden states), concatenated in id order."""
        x = self.model.embed_tokens(tokens)
        aux = []
        for i in range(self.cfg.num_hidden_layers):
            if i in layer_ids:
                aux.append(x)
            x = self.model.layers[i](x, positions, self.rotary)
        if self.cfg.num_hidden_layers in layer_ids:
            aux.append(x)
        return torch.cat(aux, -1)

    def forward_states(self, tokens, positions, caches=None):
        """(final-normed hidden states, the hidden states the first MTP layer reads)."""
        x = self.trunk(tokens, positions, caches)
        normed = self.model.norm(x)
        return normed, (x if self.cfg.model_family.mtp_reads_pre_norm_hidden else normed)

    def mtp_forward(self, k, next_tokens, hidden, positions, cache=None):
        """MTP depth k: hidden at position t (+ token t+1) -> hidden predicting token t+2+k."""
        embeds = self.model.embed_tokens(next_tokens)
        return self.mtp_layer(k)(embeds, hidden, positions, self.rotary, cache)
