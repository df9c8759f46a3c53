"""DSpark fixtures: the shipped tiny Qwen2 target and its DSpark draft, and an independent torch
reference of what vLLM's DSpark path computes, written from vLLM 0.32's source
(model_executor/models/qwen3_dspark.py, v1/worker/gpu/spec_decode/dspark/speculator.py and the
shared DFlash input kernel in v1/worker/gpu/spec_decode/dflash/speculator.py) with plain tensor ops
and the target's states from transformers, sharing no code with mtp/dspark.py or the engine.

vLLM's semantics, as the reference spells them out. With tokens x_0..x_{n-1} known:
- context and backbone: DFlash's (tests/dflash_fixtures.py `reference_block_states`), the block being
  [x_{n-1}, noise x (N-1)] (`sample_from_anchor`: N = num_speculative_tokens query slots, the noise
  token `dspark_noise_token_id`), slot i at position n-1+i;
- drafts: slot i's logits are the target head of its state plus markov_w2 @ markov_w1[prev], prev
  being the token drawn at slot i-1 (x_{n-1} for slot 0); greedy drafting takes their argmax left to
  right (`_sample_sequential`);
- confidence: sigmoid(proj(cat(state_i, markov_w1[prev_i]))) in fp32 (without the Markov embedding
  unless `confidence_head_with_markov`).
"""
import json
import os

import torch

from dflash_fixtures import REPO, TARGET, greedy_acceptance, reference_block_states

DRAFT = os.path.join(REPO, "checkpoints", "tiny-qwen2-dspark")


def record_sizes_at_fixed_prices(engine, k, max_rows):
    """Make a confidence-sized engine's verification sizes follow the confidences, not the machine's timings:
    fixed prices (a verified draft costs 0.6 of a plain step), a measured acceptance of 1 (so whole blocks are
    drafted). Returns the list each step's per-row sizes are appended to."""
    policy = engine.k_policy
    policy.set_costs([1, max_rows], {q: [1.0 + 0.6 * q] * 2 for q in range(k + 1)},
                     {q: [0.1 * (q > 0)] * 2 for q in range(k + 1)})
    policy.corrects_costs = False
    policy.drafted, policy.accepted = [1000.0] * k, [1000.0] * k
    sizes, original = [], engine.proposer.verification_size
    engine.proposer.verification_size = lambda b, c, kk: sizes.extend(original(b, c, kk)) or sizes[-b:]
    return sizes


def load_reference(draft_dir=DRAFT):
    """(transformers target, draft tensors, draft config dict)."""
    from safetensors.torch import load_file
    from transformers import Qwen2ForCausalLM

    target = Qwen2ForCausalLM.from_pretrained(TARGET, torch_dtype=torch.float32).eval()
    with open(os.path.join(draft_dir, "config.json")) as f:
        cfg = json.load(f)
    return target, load_file(os.path.join(draft_dir, "model.safetensors")), cfg


def reference_block(reference, ids):
    """(states [N, H], greedy drafts [N], Markov-corrected logits [N, V], confidences [N] or None) of the
    block after the known tokens `ids`, recomputed from scratch."""
    target, state, cfg = reference
    n = cfg["block_size"]
    states = reference_block_states(target, state, cfg, ids, cfg["target_layer_ids"],
                                    [cfg["dspark_noise_token_id"]] * (n - 1))
    base = states @ target.lm_head.weight.T.detach()
    w1, w2 = state["markov_head.markov_w1.weight"], state["markov_head.markov_w2.weight"]
    prev, drafts, logits, confidences = ids[-1], [], [], []
    for i in range(n):
        slot = base[i] + w2 @ w1[prev]
        if cfg.get("enable_confidence_head"):
            x = torch.cat([states[i], w1[prev]]) if cfg.get("confidence_head_with_markov") else states[i]
            confidences.append(torch.sigmoid(x.float() @ state["confidence_head.proj.weight"][0].float()
                                             + state["confidence_head.proj.bias"][0].float()))
        prev = int(slot.argmax())
        drafts.append(prev)
        logits.append(slot)
    return states, drafts, torch.stack(logits), (torch.stack(confidences) if confidences else None)


def reference_acceptance(reference, prompt, response, max_new_tokens, past_end=False):
    """(drafted, accepted) per draft position of greedy DSpark decoding of `response`, every block
    recomputed from scratch (dflash_fixtures.greedy_acceptance, its counting)."""
    target, _, cfg = reference
    return greedy_acceptance(target, cfg["block_size"], prompt, response, max_new_tokens, past_end,
                             lambda ids: reference_block(reference, ids)[1])
