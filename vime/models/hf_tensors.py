"""The tensors an HF checkpoint's config implies: canonical names, shapes and the keys behind them (pure).

`expected_tensors(cfg)` is the one description of vime's HF checkpoint format (GQA or multi-head
latent attention, dense or mixture-of-experts MLPs from `first_k_dense_replace` on with router,
correction bias and shared experts, MTP layers with enorm / hnorm / eh_proj / shared_head.norm):
{canonical name: Expected(shape, config keys)}. The checkpoint reader checks a file's names against
it, the memory plan counts parameters from it, and its shapes are what tensor_check.tensor_mismatch
compares a file's with.
Shapes are HF's: a linear weight is [out features, in features].
"""
from vime.models.tensor_check import Expected


def expected_tensors(cfg, num_mtp_layers=None):
    """{canonical name: Expected} of a complete checkpoint of `cfg` with `num_mtp_layers` MTP layers
    (default: the config's). MTP layer k is `model.layers.{num_hidden_layers + k}`: a decoder layer plus
    its own tensors; its copies of the embedding and output head are not part of the format."""
    n_mtp = cfg.num_nextn_predict_layers if num_mtp_layers is None else num_mtp_layers
    vocab = Expected((cfg.vocab_size, cfg.hidden_size), "vocab_size, hidden_size")
    out = {"model.embed_tokens.weight": vocab, "model.norm.weight": _hidden(cfg)}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = vocab
    for i in range(cfg.num_hidden_layers + n_mtp):
        out.update({f"model.layers.{i}.{s}": e for s, e in layer_tensors(cfg, i).items()})
    for k in range(n_mtp):
        out.update({f"model.layers.{cfg.num_hidden_layers + k}.{s}": e for s, e in mtp_tensors(cfg).items()})
    return out


def expected_tensor_names(cfg, num_mtp_layers=None):
    """Canonical names a complete checkpoint with `num_mtp_layers` MTP layers must hold."""
    return list(expected_tensors(cfg, num_mtp_layers))


def _hidden(cfg):
    return Expected((cfg.hidden_size,), "hidden_size")


def _linear(out_features, in_features, keys):
    return Expected((out_features, in_features), keys)


def layer_tensors(cfg, index):
    """{canonical suffix: Expected} of decoder layer `index` (MTP layers continue the numbering)."""
    return {"input_layernorm.weight": _hidden(cfg), "post_attention_layernorm.weight": _hidden(cfg),
            **attention_tensors(cfg), **mlp_tensors(cfg, index)}


def attention_tensors(cfg):
    """{canonical suffix: Expected} of one layer's attention: multi-head latent or grouped-query."""
    return _latent_attention(cfg) if cfg.mla is not None else _grouped_query_attention(cfg)


def _grouped_query_attention(cfg):
    h, heads, kv, d = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    q_keys, kv_keys = "num_attention_heads, head_dim", "num_key_value_heads, head_dim"
    out = {"self_attn.q_proj.weight": _linear(heads * d, h, f"{q_keys}, hidden_size"),
           "self_attn.k_proj.weight": _linear(kv * d, h, f"{kv_keys}, hidden_size"),
           "self_attn.v_proj.weight": _linear(kv * d, h, f"{kv_keys}, hidden_size"),
           "self_attn.o_proj.weight": _linear(h, heads * d, f"hidden_size, {q_keys}")}
    if cfg.qkv_bias:
        out.update({"self_attn.q_proj.bias": Expected((heads * d,), f"attention_bias, {q_keys}"),
                    "self_attn.k_proj.bias": Expected((kv * d,), f"attention_bias, {kv_keys}"),
                    "self_attn.v_proj.bias": Expected((kv * d,), f"attention_bias, {kv_keys}")})
    if cfg.qk_norm:
        out.update({"self_attn.q_norm.weight": Expected((d,), "use_qk_norm, head_dim"),
                    "self_attn.k_norm.weight": Expected((d,), "use_qk_norm, head_dim")})
    return out


def _latent_attention(cfg):
    mla, h, heads = cfg.mla, cfg.hidden_size, cfg.num_attention_heads
    q_width, q_keys = heads * mla.qk_head_dim, "num_attention_heads, qk_nope_head_dim, qk_rope_head_dim"
    if mla.q_lora_rank:
        out = {"self_attn.q_a_proj.weight": _linear(mla.q_lora_rank, h, "q_lora_rank, hidden_size"),
               "self_attn.q_a_layernorm.weight": Expected((mla.q_lora_rank,), "q_lora_rank"),
               "self_attn.q_b_proj.weight": _linear(q_width, mla.q_lora_rank, f"{q_keys}, q_lora_rank")}
    else:
        out = {"self_attn.q_proj.weight": _linear(q_width, h, f"{q_keys}, hidden_size")}
    out.update({
        "self_attn.kv_a_proj_with_mqa.weight": _linear(mla.latent_width, h,
                                                       "kv_lora_rank, qk_rope_head_dim, hidden_size"),
        "self_attn.kv_a_layernorm.weight": Expected((mla.kv_lora_rank,), "kv_lora_rank"),
        "self_attn.kv_b_proj.weight": _linear(heads * (mla.qk_nope_head_dim + mla.v_head_dim), mla.kv_lora_rank,
                                              "num_attention_heads, qk_nope_head_dim, v_head_dim, kv_lora_rank"),
        "self_attn.o_proj.weight": _linear(h, heads * mla.v_head_dim, "hidden_size, num_attention_heads, v_head_dim"),
    })
    return out


def _swiglu(prefix, width, h, width_keys):
    return {f"{prefix}gate_proj.weight": _linear(width, h, f"{width_keys}, hidden_size"),
            f"{prefix}up_proj.weight": _linear(width, h, f"{width_keys}, hidden_size"),
            f"{prefix}down_proj.weight": _linear(h, width, f"hidden_size, {width_keys}")}


def mlp_tensors(cfg, index):
    """{canonical suffix: Expected} of decoder layer `index`'s MLP: dense, or router + correction bias
    + routed experts + shared experts (from `first_k_dense_replace` on)."""
    moe, h = cfg.moe, cfg.hidden_size
    if moe is None or not moe.is_moe_layer(index):
        return _swiglu("mlp.", cfg.intermediate_size, h, "intermediate_size")
    out = {"mlp.gate.weight": _linear(moe.n_routed_experts, h, "n_routed_experts, hidden_size"),
           "mlp.gate.e_score_correction_bias": Expected((moe.n_routed_experts,), "n_routed_experts")}
    for e in range(moe.n_routed_experts):
        out.update(_swiglu(f"mlp.experts.{e}.", moe.moe_intermediate_size, h, "moe_intermediate_size"))
    if moe.n_shared_experts:
        out.update(_swiglu("mlp.shared_experts.", moe.n_shared_experts * moe.moe_intermediate_size, h,
                           "n_shared_experts, moe_intermediate_size"))
    return out


def mtp_tensors(cfg):
    """{canonical suffix: Expected} of an MTP layer's own tensors (beside its decoder layer)."""
    h = cfg.hidden_size
    return {"enorm.weight": _hidden(cfg), "hnorm.weight": _hidden(cfg),
            "eh_proj.weight": _linear(h, 2 * h, "hidden_size"), "shared_head.norm.weight": _hidden(cfg)}
