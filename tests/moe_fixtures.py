"""Tiny random GLM-4.5 (MoE) and DeepSeek-V3 (MoE + MLA) checkpoints written by transformers' own
classes, plus MTP layers in the public layout, and transformers' MTP layer as the draft reference.

A model with L + k decoder layers is built and saved by transformers (public per-expert tensor
names); its last k layers become the MTP layers' decoder blocks under `model.layers.{L+j}`,
next to random `enorm`, `hnorm`, `eh_proj`, `shared_head.norm` and (unless GLM-4.6 style)
copies of the embedding and output head; config.json then declares L layers and
`num_nextn_predict_layers` k. Weights are drawn wider than transformers' init (std 0.3; router
and correction bias random too) so greedy outputs vary and expert choices depend on the bias.
"""
import json
import os

import torch
from safetensors.torch import load_file, save_file

VOCAB = 32  # the task tokenizer's vocabulary

GLM_TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=32, moe_intermediate_size=32, n_routed_experts=8,
                num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, n_group=2, topk_group=1,
                routed_scaling_factor=2.5, norm_topk_prob=True, attention_bias=True, use_qk_norm=True,
                partial_rotary_factor=0.5, rms_norm_eps=1e-5)
DEEPSEEK_TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                     moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
                     first_k_dense_replace=1, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                     norm_topk_prob=True, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8,
                     qk_nope_head_dim=16, v_head_dim=16, rms_norm_eps=1e-6,
                     topk_method="noaux_tc", scoring_func="sigmoid",  # as DeepSeek-V3's config (vLLM reads them)
                     # DeepSeek-V3's YaRN block (factor 40 over 4096 there), scaled to the tiny context
                     rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                      "original_max_position_embeddings": 32, "beta_fast": 32, "beta_slow": 1,
                                      "mscale": 1.0, "mscale_all_dim": 1.0})

# the MLA latent vLLM's CPU kernel is built for (kv_lora_rank + qk_rope_head_dim); the rest stays tiny
VLLM_CPU_MLA = dict(kv_lora_rank=512, qk_rope_head_dim=64)


def _config(family, num_layers, **overrides):
    from transformers import DeepseekV3Config, Glm4MoeConfig

    base = dict(GLM_TINY if family == "glm4_moe" else DEEPSEEK_TINY)
    base.update(overrides)
    base.update(vocab_size=VOCAB, max_position_embeddings=128, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                tie_word_embeddings=False, num_hidden_layers=num_layers)
    cls = Glm4MoeConfig if family == "glm4_moe" else DeepseekV3Config
    return cls(**base)


def _randomise(model, seed, std):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if p.dim() == 1 and name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * noise)  # norm weights near one, not exactly
            elif name.endswith("e_score_correction_bias"):
                p.copy_(0.1 * noise)
            else:
                p.copy_(std * noise)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=g))


def write_checkpoint(path, family, seed=0, std=0.3, num_mtp_layers=1, head_copies=True, **overrides):
    """A tiny random `family` checkpoint with MTP layers in the public layout; returns the number of trunk layers."""
    from transformers import AutoModelForCausalLM

    from rollout.tokenizer import build_tokenizer, save_tokenizer

    trunk_layers = overrides.pop("num_hidden_layers", 2)
    config = _config(family, trunk_layers + num_mtp_layers, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomise(model, seed, std)
    model.save_pretrained(path)
    state = load_file(os.path.join(path, "model.safetensors"))
    g = torch.Generator().manual_seed(seed + 1)
    h = config.hidden_size
    for k in range(num_mtp_layers):
        prefix = f"model.layers.{trunk_layers + k}"
        state[f"{prefix}.enorm.weight"] = 1 + 0.1 * torch.randn(h, generator=g)
        state[f"{prefix}.hnorm.weight"] = 1 + 0.1 * torch.randn(h, generator=g)
        state[f"{prefix}.eh_proj.weight"] = std * torch.randn(h, 2 * h, generator=g)
        state[f"{prefix}.shared_head.norm.weight"] = 1 + 0.1 * torch.randn(h, generator=g)
        if head_copies:
            state[f"{prefix}.shared_head.head.weight"] = state["lm_head.weight"].clone()
            state[f"{prefix}.embed_tokens.weight"] = state["model.embed_tokens.weight"].clone()
    save_file(state, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json")) as f:
        raw = json.load(f)
    raw.update(num_hidden_layers=trunk_layers, num_nextn_predict_layers=num_mtp_layers)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(raw, f, indent=2)
    save_tokenizer(build_tokenizer(), path)
    return trunk_layers


def transformers_trunk(path):
    """transformers' model of the checkpoint's trunk (it leaves the MTP layers out)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def transformers_mtp_layer(path, trunk, k=0):
    """transformers' MTP layer k (`MtpLayer`: enorm, hnorm, eh_proj, the decoder block, post norm)
    holding the checkpoint's MTP weights; the decoder block is the (L+k)-layer model's layer L+k."""
    from transformers import AutoModelForCausalLM
    from transformers.modeling_layers import MtpModel

    config = trunk.config
    mtp = MtpModel(trunk, config.num_nextn_predict_layers).eval()
    state = load_file(os.path.join(path, "model.safetensors"))
    layer = config.num_hidden_layers + k
    # the decoder block in transformers' in-memory layout (fused experts): load the whole
    # checkpoint as a model with L + k + 1 layers and take its layer L + k
    import copy
    big_config = copy.deepcopy(config)
    big_config.num_hidden_layers = layer + 1
    big = AutoModelForCausalLM.from_pretrained(path, config=big_config, dtype=torch.float32)
    target = mtp.layers[k]
    target.mtp_block.load_state_dict(big.model.layers[layer].state_dict())
    with torch.no_grad():
        target.enorm.weight.copy_(state[f"model.layers.{layer}.enorm.weight"])
        target.hnorm.weight.copy_(state[f"model.layers.{layer}.hnorm.weight"])
        target.eh_proj.weight.copy_(state[f"model.layers.{layer}.eh_proj.weight"])
        target.post_norm.weight.copy_(state[f"model.layers.{layer}.shared_head.norm.weight"])
    return mtp
