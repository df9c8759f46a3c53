"""The engine's fast forward: the same math as rollout/embedded/model.py on fused plain tensors.

Every family's trunk runs here: the q/k/v bias (Qwen2, MiMo, GLM-4.5) and the per-head q/k
norm (Qwen3) are optional parts of a layer's weights; partial rotary (GLM-4.5) rotates the first
channels only; a layer's attention may be multi-head latent attention over the latent cache
(DeepSeek-V3: `MLAWeights`, absorbed projections, rollout/embedded/mla.py) and its MLP a
mixture of experts (`MoEWeights`: the router in fp32, each chosen expert's packed weights).

Per decoder layer it runs 4 matmuls instead of 7 (q|k|v and gate|up fused), no nn.Module
dispatch, and a grouped-query attention written as two batched matmuls that read the KV
cache without expanding it per head. The module forward in model.py stays the reference;
tests check this path against it. Fused weights are rebuilt after every weight load.
Every matmul against a weight (trunk, MTP layers, eh_proj, LM head) goes through
rollout/embedded/linear.py, whose prepacked backend costs about the same for 1 or 4 rows.
"""
import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from mtp.layer import combine_embedding_and_hidden, zero_embedding_at_position_0
from rollout.embedded.linear import PackedWeight, linear, pack, pick_backend
from rollout.embedded.mla import MLA_NORM_EPS, MLAttention, absorbed_attention, split_kv_b
from rollout.embedded.moe import MoE, routed_experts
from rollout.embedded.primitives import apply_rotary
from vime.models.moe_routing import route


@dataclass
class MLAWeights:
    """One layer's multi-head latent attention, packed: x -> [q (latent) ; kv latent ; rope key] in one matmul."""

    a: PackedWeight  # cat(q_a_proj or q_proj, kv_a_proj_with_mqa)
    q_width: int  # leading output columns of `a` that belong to the query path
    q_a_norm: Optional[torch.Tensor]  # q LoRA's RMSNorm (None without q LoRA)
    q_b: Optional[PackedWeight]
    kv_a_norm: torch.Tensor
    w_uk: torch.Tensor  # [H, nope, R]: kv_b_proj's key half, folded into the query
    w_uv: torch.Tensor  # [H, v, R]: kv_b_proj's value half, applied after attention
    o: PackedWeight
    scale: float


@dataclass
class MoEWeights:
    """One layer's mixture of experts: fp32 router, packed experts (gate|up fused) and shared experts."""

    router: torch.Tensor  # [E, H] fp32
    bias: torch.Tensor  # [E] e_score_correction_bias
    gate_up: list  # PackedWeight per expert
    down: list
    shared_gate_up: Optional[PackedWeight]
    shared_down: Optional[PackedWeight]
    config: object  # MoEConfig
    record_as: Optional[int] = None  # which MoE decoder layer it is, for the route recorder (None: an MTP layer's)


@dataclass
class LayerWeights:
    """One decoder layer's weights, packed for the fast inference path. Grouped-query attention
    and a dense MLP use the flat fields; `mla` / `moe` replace them where the layer has those."""

    ln1: torch.Tensor
    qkv: Optional[PackedWeight]
    qkv_bias: Optional[torch.Tensor]  # families with q/k/v bias
    qk_norm: Optional[torch.Tensor]  # [heads + kv_heads, head_dim]: q_norm rows, then k_norm rows
    o: Optional[PackedWeight]
    ln2: torch.Tensor
    gate_up: Optional[PackedWeight]
    down: Optional[PackedWeight]
    mla: Optional[MLAWeights] = None
    moe: Optional[MoEWeights] = None


def _cat_or_none(tensors):
    return None if tensors[0] is None else torch.cat(tensors).detach()


def _gqa_fields(a, backend):
    qk_norm = None
    if hasattr(a.q_norm, "weight"):  # nn.Identity in families without q/k norm
        qk_norm = torch.cat([a.q_norm.weight.expand(a.n_heads, -1), a.k_norm.weight.expand(a.n_kv, -1)]).detach()
    return dict(qkv=pack(torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]), backend),
                qkv_bias=_cat_or_none([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias]),
                qk_norm=qk_norm, o=pack(a.o_proj.weight, backend))


def _mla_fields(a, backend):
    q_first = a.q_a_proj.weight if a.mla.q_lora_rank else a.q_proj.weight
    w_uk, w_uv = split_kv_b(a.kv_b_proj.weight.detach(), a.mla, a.n_heads)
    lora = bool(a.mla.q_lora_rank)
    mla = MLAWeights(
        a=pack(torch.cat([q_first, a.kv_a_proj_with_mqa.weight]), backend), q_width=q_first.shape[0],
        q_a_norm=a.q_a_layernorm.weight.detach() if lora else None,
        q_b=pack(a.q_b_proj.weight, backend) if lora else None,
        kv_a_norm=a.kv_a_layernorm.weight.detach(), w_uk=w_uk, w_uv=w_uv, o=pack(a.o_proj.weight, backend),
        scale=a.scale)
    return dict(qkv=None, qkv_bias=None, qk_norm=None, o=None, mla=mla)


def _dense_mlp_fields(m, backend):
    return dict(gate_up=pack(torch.cat([m.gate_proj.weight, m.up_proj.weight]), backend),
                down=pack(m.down_proj.weight, backend))


def _moe_fields(m, backend):
    def gate_up(expert):
        return pack(torch.cat([expert.gate_proj.weight, expert.up_proj.weight]), backend)
    shared = getattr(m, "shared_experts", None)
    moe = MoEWeights(
        router=m.gate.weight.detach().float(), bias=m.gate.e_score_correction_bias.detach(),
        gate_up=[gate_up(e) for e in m.experts], down=[pack(e.down_proj.weight, backend) for e in m.experts],
        shared_gate_up=gate_up(shared) if shared is not None else None,
        shared_down=pack(shared.down_proj.weight, backend) if shared is not None else None, config=m.moe)
    return dict(gate_up=None, down=None, moe=moe)


def fuse_layer(layer, backend="dense"):
    a, m = layer.self_attn, layer.mlp
    attention = _mla_fields(a, backend) if isinstance(a, MLAttention) else _gqa_fields(a, backend)
    mlp = _moe_fields(m, backend) if isinstance(m, MoE) else _dense_mlp_fields(m, backend)
    return LayerWeights(ln1=layer.input_layernorm.weight.detach(), ln2=layer.post_attention_layernorm.weight.detach(),
                        **attention, **mlp)


class FastForward:
    """Callable like `CausalLMWithMTP.forward(tokens, positions, caches)` for cached ragged batches."""

    def __init__(self, model, linear_backend="auto"):
        self.model = model
        self.requested_backend = linear_backend
        cfg = model.cfg
        self.eps, self.n_heads, self.n_kv, self.head_dim = (cfg.rms_norm_eps, cfg.num_attention_heads,
                                                           cfg.num_key_value_heads, cfg.head_dim)
        self.refresh()

    def refresh(self, in_place=False):
        """Re-fuse and re-pack after the model's weights changed (or moved device/dtype). in_place:
        write the new values into the fused tensors already there (a captured step graph reads
        those), same device, dtype and shapes."""
        m = self.model
        weight = m.head_weight()
        self.backend = pick_backend(weight.device, weight.dtype, self.requested_backend)
        fused = dict(layers=[fuse_layer(l, self.backend) for l in m.model.layers], head=pack(weight, self.backend),
                     eh_proj=[pack(m.mtp_layer(k).eh_proj.weight, self.backend) for k in range(m.num_mtp_layers)])
        if in_place and getattr(self, "layers", None) is not None:
            for name, value in fused.items():
                _copy_into(getattr(self, name), value)
            return
        self.__dict__.update(fused)
        moe_decoder = [w.moe for w in self.layers[:m.cfg.num_hidden_layers] if w.moe is not None]
        for i, w in enumerate(moe_decoder):  # the MTP layers' routes are the drafter's, never recorded
            w.record_as = i
        self.num_moe_layers = len(moe_decoder)
        self.route_writer = None  # set by the engine around a forward whose routes it records

    def release(self):
        """Drop the fused and packed copies of the weights (the model's weights were released);
        `refresh` makes them again."""
        self.layers = self.head = self.eh_proj = None  # the next refresh fuses them anew

    def logits(self, hidden):
        """Twin of `CausalLMWithMTP.logits` on the packed LM head."""
        return linear(hidden, self.head)

    def norm(self, x, w):
        return F.rms_norm(x, (x.shape[-1],), w, self.eps)

    def layer(self, w, x, cos, sin, cache):
        attention = self.mla_attention if w.mla is not None else self.gqa_attention
        x = x + attention(w, self.norm(x, w.ln1), cos, sin, cache)
        h = self.norm(x, w.ln2)
        return x + (self.moe(w.moe, h) if w.moe is not None else swiglu(h, w.gate_up, w.down))

    def gqa_attention(self, w, x, cos, sin, cache):
        b, q_len, _ = x.shape
        h, d = self.n_heads, self.head_dim
        nqk = (h + self.n_kv) * d
        qkv = linear(x, w.qkv)
        if w.qkv_bias is not None:
            qkv = qkv + w.qkv_bias
        # q and k heads side by side: one norm and one rotary call serve both
        qk = qkv[..., :nqk].unflatten(-1, (-1, d))
        if w.qk_norm is not None:
            qk = F.rms_norm(qk, (d,), eps=self.eps) * w.qk_norm
        qk = apply_rotary(qk, cos, sin)
        v = qkv[..., nqk:].unflatten(-1, (self.n_kv, d))
        attn = cache.attend_bqhd(qk[:, :, :h], qk[:, :, h:], v)
        return linear(attn.reshape(b, q_len, h * d), w.o)

    def mla_attention(self, w, x, cos, sin, cache):
        """MLA over the latent cache with absorbed projections (rollout/embedded/mla.py)."""
        m = self.model.cfg.mla
        b, q_len, _ = x.shape
        a = w.mla
        projected = linear(x, a.a)
        q, kv = projected[..., :a.q_width], projected[..., a.q_width:]
        if a.q_b is not None:
            q = linear(F.rms_norm(q, (q.shape[-1],), a.q_a_norm, MLA_NORM_EPS), a.q_b)
        q_nope, q_rope = q.unflatten(-1, (self.n_heads, m.qk_head_dim)).split(
            [m.qk_nope_head_dim, m.qk_rope_head_dim], dim=-1)
        q_rope = apply_rotary(q_rope, cos, sin, m.rope_interleave)
        latent = F.rms_norm(kv[..., :m.kv_lora_rank], (m.kv_lora_rank,), a.kv_a_norm, MLA_NORM_EPS)
        k_rope = apply_rotary(kv[..., m.kv_lora_rank:], cos[:, :, 0], sin[:, :, 0], m.rope_interleave)
        entries, _ = cache.exchange_latent(torch.cat([latent, k_rope], dim=-1))
        out = absorbed_attention(q_nope, q_rope, entries, cache.step.mask(q_len), a.w_uk, a.w_uv, a.scale)
        return linear(out.reshape(b, q_len, -1), a.o)

    def moe(self, w, x):
        """Routed experts on packed weights plus the shared experts; routing as moe.MoE does it."""
        flat = x.reshape(-1, x.shape[-1])
        weights, indices = route(flat.float() @ w.router.t(), w.bias, w.config)
        if self.route_writer is not None and w.record_as is not None:
            self.route_writer(w.record_as, indices)
        out = routed_experts(flat, weights, indices, lambda e, rows: swiglu(rows, w.gate_up[e], w.down[e]))
        out = out.view_as(x)
        if w.shared_gate_up is not None:
            out = out + swiglu(x, w.shared_gate_up, w.shared_down)
        return out

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


def _copy_into(old, new):
    """Copy every tensor of `new` (fused weights: dataclasses, lists, tensors) into its twin in
    `old`; a tensor that is the same storage (a parameter's own view) is already current."""
    if isinstance(old, torch.Tensor):
        if old.is_mkldnn or old.data_ptr() != new.data_ptr():
            old.copy_(new)
    elif isinstance(old, (list, tuple)):
        for a, b in zip(old, new):
            _copy_into(a, b)
    elif dataclasses.is_dataclass(old):
        for f in dataclasses.fields(old):
            _copy_into(getattr(old, f.name), getattr(new, f.name))


def swiglu(x, gate_up, down):
    """down(silu(gate(x)) * up(x)) with gate|up fused into one packed weight."""
    gate, up = linear(x, gate_up).chunk(2, dim=-1)
    return linear(F.silu(gate) * up, down)


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
