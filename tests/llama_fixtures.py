"""Llama checkpoints made by transformers itself (`LlamaConfig` + `LlamaForCausalLM.save_pretrained`), and the
greedy comparison against transformers that accepts a divergence only at a near-tie.

The checkpoints are what a user downloads, not what vime writes: transformers' config.json (its
`rope_parameters`, `head_dim`, `tie_word_embeddings`) and its safetensors (no `lm_head.weight` when
tied), plus the tiny task's character tokenizer so that text prompts work.
"""
import torch

from fp32_bounds import forward_depth, longest_reduction, max_abs_logit, model_logprob_bound, reduction_rtol
from rollout.task import BOS, EOS, PAD
from rollout.tokenizer import build_tokenizer, save_tokenizer

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16, "rope_theta": 10000.0}
# a small Llama: GQA 4 heads / 2 KV heads of head_dim 24 (not hidden / heads = 16: a free head_dim)
SMALL_LLAMA = dict(vocab_size=32, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=24, max_position_embeddings=128, rms_norm_eps=1e-5)


def make_llama(path, seed=0, std=0.2, tie=True, rope=None, **overrides):
    """A random LlamaForCausalLM saved by transformers into `path` (with the character tokenizer); returns
    the transformers model (eval, fp32). `std` is transformers' initializer_range: larger gives peaked,
    varied next-token distributions; norm weights are moved off 1 so that each norm matters."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**{**SMALL_LLAMA, **overrides}, tie_word_embeddings=tie, rope_parameters=rope,
                         initializer_range=std, bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(torch.randn(p.shape) * std)
    model.save_pretrained(str(path))
    save_tokenizer(build_tokenizer(), str(path))
    return model


def hf_greedy(model, prompt, max_new, eos=EOS):
    """transformers' greedy tokens after `prompt`, up to `eos` or max_new (full forward each step)."""
    ids, out = list(prompt), []
    with torch.no_grad():
        for _ in range(max_new):
            tok = int(model(torch.tensor([ids])).logits[0, -1].argmax())
            out.append(tok)
            ids.append(tok)
            if tok == eos:
                break
    return out


def near_tie_gap_bound(cfg, context, max_abs_logit):
    """The largest top-two logit gap at which two fp32 forwards of the model of `cfg` (a ModelConfig) that
    differ only in reduction order can pick different greedy tokens. Each side's logits are within
    eps = reduction_rtol(longest sum, forward depth) * max|logit| of the exact ones (Higham's worst case,
    tests/fp32_bounds.py). If side A picks i and side B picks j, then l_A[i] >= l_A[j] and so
    l_B[j] - l_B[i] <= (e_B[j] - e_A[j]) - (e_B[i] - e_A[i]) <= 4 eps; the reference's own top-two gap is
    no larger than l_B[j] - l_B[i]. A larger gap at a divergence is a real difference."""
    return 4 * reduction_rtol(longest_reduction(cfg, context), forward_depth(cfg.num_hidden_layers)) * max_abs_logit


def divergence(model, prompt, got, want):
    """None when `got` == `want` (token lists after `prompt`), else (index of the first difference, the
    reference `model`'s top-two logit gap there, its largest |logit| there)."""
    if got == want:
        return None
    t = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    with torch.no_grad():
        logits = model(torch.tensor([list(prompt) + want[:t]])).logits[0, -1]
    top = logits.topk(2).values
    return t, float(top[0] - top[1]), float(logits.abs().max())


def assert_greedy_equal_up_to_a_near_tie(model, cfg, prompt, got, want):
    """`got` (ours) equals `want` (transformers' greedy output), or first differs where the reference's
    top-two logits are within the derived bound (after which the two sequences are free to differ)."""
    found = divergence(model, prompt, got, want)
    if found is None:
        return
    t, gap, scale = found
    bound = near_tie_gap_bound(cfg, len(prompt) + t + 1, scale)
    assert gap <= bound, f"greedy tokens differ at step {t}: the reference's top-two gap {gap:.3g} > {bound:.3g}"


def assert_trainer_agrees_with_rollout(checkpoint, samples):
    """The trainer's (megatron-core, one forward at temperature 1) log-probs of the sampled responses equal the
    rollout's within the fp32 bound of two forwards that differ in reduction order only."""
    from trainer.batch import build_batch
    from trainer.config import TrainerConfig
    from trainer.trainer import Trainer
    from vime.models.hf_format import read_config

    for s in samples:
        s.advantage = 1.0
    batch = build_batch(samples)
    got = Trainer(TrainerConfig(temperature=1.0), checkpoint).compute_logprobs(batch)
    response = batch.loss_mask.bool()
    bound = model_logprob_bound(read_config(checkpoint), batch.tokens.shape[1], max_abs_logit(checkpoint, samples))
    assert (got[response] - batch.rollout_logprobs[response]).abs().max().item() <= bound
