"""DFlash fixtures: the shipped tiny Qwen2 target and its DFlash draft, and an independent torch
reference of what vLLM's DFlash path computes, written from vLLM 0.32's source
(model_executor/models/qwen3_dflash.py, v1/spec_decode/dflash.py) with plain tensor ops and
the target's states from transformers, sharing no code with mtp/dflash.py or the engine.

vLLM's semantics, as the reference spells them out. With tokens x_0..x_{n-1} known:
- context: for every position p < n-1, c_p = RMSNorm_hidden(fc(cat(h^{t+1}_p for t in
  target_layer_ids))), h^{t+1} being transformers' hidden_states[t+1] (the output of layer t);
  each draft layer's K/V of c_p: k_norm per head, then rotary at p (`precompute_and_store_context_kv`);
- query: the block [x_{n-1}, mask x k] at positions n-1 .. n-1+k (`copy_and_expand_dflash_inputs`),
  embedded with the target's embedding (shared), through Qwen3 decoder layers whose attention sees
  all context keys and all block keys (non-causal metadata), final norm, the target's head;
- drafts: argmax of the logits at block slots 1..k (`token_indices_to_sample` skips the bonus slot).
"""
import os

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGET = os.path.join(REPO, "checkpoints", "tiny-qwen2")
DRAFT = os.path.join(REPO, "checkpoints", "tiny-qwen2-dflash")


def _rms(x, weight, eps):
    x64 = x.double()
    return (x64 / torch.sqrt(x64.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


def _neox_rotary(x, positions, theta):
    """x [T, heads, D] rotated at positions [T]: halves (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin)."""
    d = x.shape[-1]
    freq = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    angle = positions.double()[:, None] * freq[None, :]
    cos, sin = angle.cos()[:, None, :].to(x.dtype), angle.sin()[:, None, :].to(x.dtype)
    x1, x2 = x[..., :d // 2], x[..., d // 2:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


def reference_block_logits(target_hf, state, cfg, ids):
    """[k+1, V] logits of the block after the known tokens `ids`, recomputed from scratch.

    target_hf: transformers' Qwen2ForCausalLM; state: the draft's tensors by checkpoint name;
    cfg: the draft's config.json as a dict."""
    dflash = cfg["dflash_config"]
    states = reference_block_states(target_hf, state, cfg, ids, dflash["target_layer_ids"],
                                    [dflash["mask_token_id"]] * (cfg["block_size"] - 1))
    return states @ target_hf.lm_head.weight.T.detach()


def reference_block_states(target_hf, state, cfg, ids, target_layer_ids, fill):
    """[1 + len(fill), H] final-normed states of the block [ids[-1]] + fill at positions n-1 ..., over
    the context of `ids` (every position before the newest token), recomputed from scratch."""
    eps, theta = cfg["rms_norm_eps"], cfg["rope_parameters"]["rope_theta"]
    heads, kv_heads, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    n, k = len(ids), len(fill)
    with torch.no_grad():
        out = target_hf(torch.tensor([ids]), output_hidden_states=True)
        # transformers' last entry is after the final norm: vLLM's id L is the raw stream, so stay below it
        assert max(target_layer_ids) + 1 < target_hf.config.num_hidden_layers
        aux = torch.cat([out.hidden_states[t + 1][0, :n - 1] for t in target_layer_ids], -1)
        ctx = _rms(aux @ state["fc.weight"].T, state["hidden_norm.weight"], eps)
        ctx_pos, blk_pos = torch.arange(n - 1), torch.arange(n - 1, n + k)
        block = torch.tensor([ids[-1]] + list(fill))
        x = target_hf.model.embed_tokens.weight[block]
        for i in range(cfg["num_hidden_layers"]):
            w = {name[len(f"layers.{i}."):]: t for name, t in state.items() if name.startswith(f"layers.{i}.")}

            def keys_values(h, positions):
                kk = _rms((h @ w["self_attn.k_proj.weight"].T).view(-1, kv_heads, d), w["self_attn.k_norm.weight"], eps)
                return _neox_rotary(kk, positions, theta), (h @ w["self_attn.v_proj.weight"].T).view(-1, kv_heads, d)

            h = _rms(x, w["input_layernorm.weight"], eps)
            q = _rms((h @ w["self_attn.q_proj.weight"].T).view(-1, heads, d), w["self_attn.q_norm.weight"], eps)
            q = _neox_rotary(q, blk_pos, theta)
            k_ctx, v_ctx = keys_values(ctx, ctx_pos)
            k_blk, v_blk = keys_values(h, blk_pos)
            keys, values = torch.cat([k_ctx, k_blk]), torch.cat([v_ctx, v_blk])
            group = heads // kv_heads
            attn = torch.stack([torch.softmax(q[:, j] @ keys[:, j // group].T / d ** 0.5, -1) @ values[:, j // group]
                                for j in range(heads)], 1)
            x = x + attn.reshape(k + 1, heads * d) @ w["self_attn.o_proj.weight"].T
            h = _rms(x, w["post_attention_layernorm.weight"], eps)
            gate, up = h @ w["mlp.gate_proj.weight"].T, h @ w["mlp.up_proj.weight"].T
            x = x + (torch.nn.functional.silu(gate) * up) @ w["mlp.down_proj.weight"].T
        return _rms(x, state["norm.weight"], eps)


def load_reference(draft_dir=DRAFT):
    """(transformers target, draft tensors, draft config dict) for `reference_block_logits`."""
    import json

    from safetensors.torch import load_file
    from transformers import Qwen2ForCausalLM

    target = Qwen2ForCausalLM.from_pretrained(TARGET, torch_dtype=torch.float32).eval()
    with open(os.path.join(draft_dir, "config.json")) as f:
        cfg = json.load(f)
    return target, load_file(os.path.join(draft_dir, "model.safetensors")), cfg


def reference_acceptance(reference, prompt, response, max_new_tokens, past_end=False):
    """(drafted, accepted) per draft position of greedy DFlash decoding of `response`, every block
    recomputed from scratch. A draft the verify accepted counts even where a stop token ends the
    response before it (vLLM's definition). `past_end`: vLLM drafts a whole block past the length
    budget too and counts it; the embedded engine never drafts what it may not emit."""
    target, state, cfg = reference
    return greedy_acceptance(target, cfg["block_size"] - 1, prompt, response, max_new_tokens, past_end,
                             lambda ids: reference_block_logits(target, state, cfg, ids)[1:].argmax(-1).tolist())


def greedy_acceptance(target, k, prompt, response, max_new_tokens, past_end, drafts_after):
    """(drafted, accepted) per draft position of greedy speculative decoding of `response` by a block draft
    of k drafts, `drafts_after(ids)` its k drafts after the known tokens `ids` (recomputed from scratch)."""
    ids = list(prompt) + list(response)
    with torch.no_grad():  # the target's greedy continuation past the response, to judge drafts there
        for _ in range(k + 1):
            ids.append(int(target(torch.tensor([ids])).logits[0, -1].argmax()))
    drafted, accepted = [0] * k, [0] * k
    p, end = len(prompt) + 1, len(prompt) + len(response)  # the prefill emitted the first token
    while p < end:
        budget = k if past_end else min(k, max_new_tokens - (p - len(prompt)) - 1)
        drafts = drafts_after(ids[:p])[:budget]
        a = 0
        while a < budget and ids[p + a] == drafts[a]:
            a += 1
        drafted = [x + (i < budget) for i, x in enumerate(drafted)]
        accepted = [x + (i < a) for i, x in enumerate(accepted)]
        p += a + 1
    return drafted, accepted
