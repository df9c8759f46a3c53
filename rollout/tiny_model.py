"""The tiny MiMo-family (or Qwen3, GLM-4.5 MoE, DeepSeek-V3 MoE + MLA) model with MTP that vime
tests and demos on: config, random init, and pretraining.

`scripts/make_tiny_model.py` is the command line; tests call `make_random_checkpoint` for a
seconds-fast fixture. Pretraining trains the trunk on a corpus mixing the `direct` and the
(rare) `trace` answer format, and the MTP layers on the `direct` format only: the draft
knows the pretraining distribution, not the one RL will move the policy to.
"""
import dataclasses
import math
import random
import time

import torch
import torch.nn.functional as F

from vime.models.hf_format import ModelConfig, save_hf_checkpoint
from vime.models.moe_mla_config import MLAConfig, MoEConfig
from vime.models.moe_routing import tokens_per_expert, update_expert_bias
from vime.models.rope import YarnScaling
from mtp.loss import mtp_loss
from rollout.embedded.model import CausalLMWithMTP
from rollout.embedded.moe import MoE
from rollout.task import (ANSWER_FORMATS, BOS, DEFAULT_TASK_VARIANT, EOS, PAD, TASK_VARIANTS, boxed_answer,
                          chat_messages, multi_prompt_text)
from rollout.tokenizer import CHAT_IM_END, TextCodec, build_tokenizer, save_tokenizer

# Shaped like real MTP models: the MTP layer (one decoder layer + input_proj) is <= 15 % of a
# decode step's FLOPs (MiMo-7B: 1 MTP layer over 36), so drafting is cheap next to verifying.
# head_dim 32: vLLM's CPU attention refuses 16. Untied head, as MiMo-7B.
TINY_CONFIG = ModelConfig(
    vocab_size=32, hidden_size=128, intermediate_size=320, num_hidden_layers=7,
    num_attention_heads=4, num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6,
    rope_theta=10000.0, max_position_embeddings=256, tie_word_embeddings=False,
    num_nextn_predict_layers=1, bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD, family="mimo",
)


# The MoE families at about the MiMo model's size and decode cost: one dense layer, then MoE
# layers of 8 experts (2 routed per token, group-limited in the DeepSeek model) + one shared
# expert, each 64 wide (2 routed + 1 shared ~ 0.6 of the dense MLP's 320). DeepSeek's MLA latent
# is 64 + 16 rope channels for 8 heads of 16 + 16 (q/k) and 16 (v): 0.21 of an expanded cache.
# (vLLM's CPU MLA kernel compiles only the 512 + 64 latent: at that size the model would be
# several times larger and slower to pretrain on a CPU, so the shipped one runs on the embedded engine.)
_TINY_MOE = MoEConfig(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, n_shared_experts=1,
                      first_k_dense_replace=1, routed_scaling_factor=2.5)
TINY_FAMILY_CONFIGS = {
    "glm4_moe": dataclasses.replace(
        TINY_CONFIG, family="glm4_moe", num_hidden_layers=5, attention_bias=True, use_qk_norm=False,
        partial_rotary_factor=0.5, moe=_TINY_MOE),
    "deepseek_v3": dataclasses.replace(
        TINY_CONFIG, family="deepseek_v3", num_hidden_layers=5, num_attention_heads=8, num_key_value_heads=8,
        head_dim=32, moe=dataclasses.replace(_TINY_MOE, n_group=4, topk_group=2),
        mla=MLAConfig(kv_lora_rank=64, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16, q_lora_rank=64),
        rope_yarn=YarnScaling(factor=4.0, original_max_position_embeddings=64, mscale=1.0, mscale_all_dim=1.0)),
}


def tiny_config(family):
    """The tiny model's config for `family` (the MiMo shape for the dense families)."""
    return TINY_FAMILY_CONFIGS.get(family) or dataclasses.replace(TINY_CONFIG, family=family)


def decode_flops_per_token(cfg):
    """(trunk, one MTP layer) multiply-adds per token of a decode step (attention scores excluded:
    they are the same per layer and small at these lengths)."""
    h, d = cfg.hidden_size, cfg.head_dim
    attn = h * (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * d + cfg.num_attention_heads * d * h
    layer = attn + 3 * h * cfg.intermediate_size
    head = h * cfg.vocab_size
    return cfg.num_hidden_layers * layer + head, layer + 2 * h * h + head


def init_model(cfg, seed, std=0.02):
    """A randomly initialised model (normal(std) matrices, unit norms), deterministic in `seed`."""
    torch.manual_seed(seed)
    model = CausalLMWithMTP(cfg)
    for name, p in model.named_parameters():
        if p.dim() == 2:
            torch.nn.init.normal_(p, std=std)
        elif name.endswith(".bias"):
            torch.nn.init.normal_(p, std=std)
    return model


def make_random_checkpoint(path, cfg=TINY_CONFIG, seed=0, std=0.02, tokenizer="chars", **overrides):
    """Write a random-weight HF checkpoint (with tokenizer) and return its ModelConfig.

    `family="qwen3"` (or any ModelConfig field) overrides the tiny MiMo config. A larger
    `std` gives peaked, varied next-token distributions (useful in tests); q/k/v biases
    and norm weights get `std` noise too, so a test sees them matter. `tokenizer=None` leaves
    the directory's tokenizer files as they are."""
    if cfg is TINY_CONFIG and "family" in overrides:  # the family's own tiny shape (MoE, MLA)
        cfg = tiny_config(overrides["family"])
    cfg = dataclasses.replace(cfg, **overrides)
    model = init_model(cfg, seed, std)
    with torch.no_grad():  # norm weights away from 1, so a test sees which hidden state is normed where
        for name, p in model.named_parameters():
            if p.dim() == 1 and not name.endswith(".bias"):
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(seed)) * std)
    if tokenizer == "chars":
        save_tokenizer(build_tokenizer(), path)
    save_hf_checkpoint(path, cfg, model.state_dict())
    return cfg


def slip_one_digit(rng, answer):
    """`answer` with one digit replaced by a different one (an arithmetic slip)."""
    digits = list(answer)
    i = rng.randrange(len(digits))
    digits[i] = rng.choice([d for d in "0123456789" if d != digits[i] and not (i == 0 and d == "0")] or ["1"])
    return "".join(digits)


def plain_sequence(codec, operands, answer):
    """The character model's sequence: BOS prompt answer EOS."""
    return [BOS] + codec.encode(multi_prompt_text(operands) + answer) + [EOS]


def chat_sequence(codec, operands, answer):
    """The chat model's sequence: the chat template's generation prompt (ids as the rollout makes
    them), the answer with its sum in \\boxed{}, then <|im_end|> (the chat model's EOS)."""
    return codec.chat_prompt_ids(chat_messages(operands)) + codec.encode(boxed_answer(answer)) + [CHAT_IM_END]


SEQUENCE_FORMATS = {"plain": plain_sequence, "chat": chat_sequence}


def corpus_example(rng, codec, trace_fraction, direct_error_rate, variant=DEFAULT_TASK_VARIANT, fmt_name="plain"):
    """(token ids, is_trace) of one pretraining sequence of `variant`'s problems: BOS prompt answer EOS.

    Direct answers in the corpus are often wrong (`direct_error_rate`): like unverified web
    text, they teach the format but not reliable sums, so sampled direct answers stay right
    only about (1 - rate) of the time, however long the model trains; trace answers are
    always right. This leaves RL room to improve and a reason to change format."""
    operands = TASK_VARIANTS[variant].draw_problem(rng)
    fmt = "trace" if rng.random() < trace_fraction else "direct"
    answer = ANSWER_FORMATS[fmt](operands)
    if fmt == "direct" and rng.random() < direct_error_rate:
        answer = "#" + slip_one_digit(rng, answer[1:])
    return SEQUENCE_FORMATS[fmt_name](codec, operands, answer), fmt == "trace"


def corpus_batch(rng, codec, batch_size, trace_fraction, direct_error_rate, variant=DEFAULT_TASK_VARIANT,
                 fmt_name="plain"):
    rows = [corpus_example(rng, codec, trace_fraction, direct_error_rate, variant, fmt_name)
            for _ in range(batch_size)]
    width = max(len(ids) for ids, _ in rows)
    tokens = torch.full((batch_size, width), PAD)
    for i, (ids, _) in enumerate(rows):
        tokens[i, :len(ids)] = torch.tensor(ids)
    mask = (tokens != PAD).float()
    is_trace = torch.tensor([t for _, t in rows])
    return tokens, mask, is_trace


def pretrain_loss(model, tokens, mask, is_trace):
    """(next-token CE, MTP CE): the MTP loss counts only `direct`-format sequences."""
    positions = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
    hidden, mtp_input = model.forward_states(tokens, positions)
    logits = model.logits(hidden[:, :-1])
    lm_mask = mask[:, 1:]
    lm = (F.cross_entropy(logits.transpose(1, 2), tokens[:, 1:], reduction="none") * lm_mask).sum() / lm_mask.sum()
    mtp_mask = mask * (~is_trace).float()[:, None]
    mtp_h = model.mtp_forward(0, tokens[:, 1:], mtp_input[:, :-1], positions[:, :-1])
    mtp = mtp_loss(model.logits(mtp_h), tokens, mtp_mask, depth=1)
    return lm, mtp


def balance_experts(model, rate):
    """DeepSeek-V3's auxiliary-loss-free balancing after an optimiser step: every MoE layer's
    correction bias moves `rate` towards the experts its last batch under-used."""
    for module in model.modules():
        if isinstance(module, MoE) and module.last_indices is not None:
            load = tokens_per_expert(module.last_indices, module.moe.n_routed_experts)
            with torch.no_grad():
                update_expert_bias(module.gate.e_score_correction_bias, load, rate)


def pretrain(model, steps, batch_size=64, lr=3e-3, trace_fraction=0.2, seed=0, log_every=100, log=print,
             direct_error_rate=0.6, variant=DEFAULT_TASK_VARIANT, codec=None, fmt_name="plain", balance_rate=1e-3,
             device="cpu", autocast_dtype=None, seconds=None):
    """AdamW with cosine decay on the synthetic corpus; returns the final (lm, mtp) loss.
    MoE layers balance their experts with the correction bias (`balance_rate` per step).

    `codec` and `fmt_name` (a SEQUENCE_FORMATS key) pick the tokenizer and the sequence layout:
    the character model's plain text (default) or the chat model's template and boxed answers.
    `device`: where the model (already there) and its batches compute; `autocast_dtype` (e.g. bf16
    on a GPU) the matmuls' dtype under torch.autocast, the weights staying fp32; `seconds`: a time
    budget instead of a step count — the cosine runs over the budget, training stops when it is spent
    (`steps` is then a bound)."""
    rng = random.Random(seed)
    codec = codec or TextCodec(tokenizer=build_tokenizer())
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, betas=(0.9, 0.98))
    start = time.time()
    if seconds is None:
        decay = lambda s: 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps))  # noqa: E731
    else:
        decay = lambda s: 0.5 * (1 + math.cos(math.pi * min((time.time() - start) / seconds, 1.0)))  # noqa: E731
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 50) * decay(s))
    autocast = torch.autocast(torch.device(device).type, dtype=autocast_dtype, enabled=autocast_dtype is not None)
    for step in range(steps):
        batch = [t.to(device) for t in corpus_batch(rng, codec, batch_size, trace_fraction, direct_error_rate,
                                                    variant, fmt_name)]
        with autocast:
            lm, mtp = pretrain_loss(model, *batch)
        opt.zero_grad()
        (lm + mtp).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        balance_experts(model, balance_rate)
        last = step == steps - 1 or seconds is not None and time.time() - start >= seconds
        if step % log_every == 0 or last:
            log(f"step {step:5d}  lm {lm.item():.4f}  mtp {mtp.item():.4f}  {time.time() - start:.0f}s")
        if last:
            break
    return lm.item(), mtp.item()


# ------------------------------------------------------------------ the chat model
def chat_corpus(n, seed, variant=DEFAULT_TASK_VARIANT):
    """Texts the chat model's BPE is trained on: rendered conversations in both answer formats."""
    from rollout.tokenizer import CHAT_TEMPLATE  # noqa: F401  (the texts below follow its ChatML layout)

    rng = random.Random(seed)
    out = []
    for _ in range(n):
        operands = TASK_VARIANTS[variant].draw_problem(rng)
        fmt = rng.choice(sorted(ANSWER_FORMATS))
        out.append(f"<|im_start|>user\n{multi_prompt_text(operands)}<|im_end|>\n<|im_start|>assistant\n"
                   f"{boxed_answer(ANSWER_FORMATS[fmt](operands))}<|im_end|>\n")
    return out


def transplant_embeddings(model, char_state, codec):
    """Warm start from the character model: every weight but the vocabulary's is copied; a BPE token
    that is one of the character vocabulary's symbols takes that symbol's embedding and head row
    (the chat template's <|im_end|> takes <eos>'s, \\boxed{'s first token '#''s)."""
    from rollout.task import CHARS

    state = model.state_dict()
    for name, value in char_state.items():
        if name not in ("model.embed_tokens.weight", "lm_head.weight"):
            state[name] = value
    pairs = [(codec.encode(c), 3 + i) for i, c in enumerate(CHARS)]
    pairs += [([CHAT_IM_END], EOS), (codec.encode("\\boxed{")[:1], 3 + CHARS.index("#"))]
    for ids, src in pairs:
        if len(ids) == 1:
            for name in ("model.embed_tokens.weight", "lm_head.weight"):
                state[name][ids[0]] = char_state[name][src]
    model.load_state_dict(state)


def make_random_chat_checkpoint(path, seed=0, std=0.02, corpus_size=2000, **overrides):
    """A random-weight chat model (byte-level BPE with the chat template) for seconds-fast tests."""
    from rollout.tokenizer import CHAT_PAD, build_bpe_tokenizer, save_chat_tokenizer

    tok = build_bpe_tokenizer(chat_corpus(corpus_size, seed))
    save_chat_tokenizer(tok, path)
    return make_random_checkpoint(path, seed=seed, std=std, vocab_size=tok.get_vocab_size(), bos_token_id=None,
                                  eos_token_id=CHAT_IM_END, pad_token_id=CHAT_PAD, tokenizer=None, **overrides)
