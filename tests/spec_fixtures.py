"""Models for the speculative-decoding tests, built in well under a second.

`markov_model`: a random model that mostly follows a fixed token permutation (next =
perm(t)) with context-dependent noise from its random layers, and MTP weights crafted to
predict perm(t+1) from the embedding of t+1 alone. Its greedy outputs vary, and its MTP
draft is right often but not always, so speculative tests see both acceptances and
rejections. `tiny_vocab_model`: 5-token vocabulary, no EOS, peaked-but-random
distributions for exact distribution tests.
"""
import dataclasses
import itertools

import pytest
import torch

from mtp.sampling import processed_logprobs
from vime.models.hf_format import save_hf_checkpoint
from rollout.embedded.model import CausalLMWithMTP
from rollout.tiny_model import TINY_CONFIG
from rollout.tokenizer import build_tokenizer, save_tokenizer

SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16)


def random_model(cfg, seed, std):
    torch.manual_seed(seed)
    model = CausalLMWithMTP(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, std)
    return model


def markov_model(seed=0, noise=0.12, mtp_noise=0.0, **overrides):
    """mtp_noise > 0 adds random weight to the MTP layers' hidden input, attention and MLP,
    so their drafts also depend on the hidden state they are fed and on their own cache."""
    cfg = dataclasses.replace(TINY_CONFIG, tie_word_embeddings=False, **{**SMALL, **overrides})
    model = random_model(cfg, seed, noise)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        emb = torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g)
        model.model.embed_tokens.weight.copy_(emb)
        # one long cycle over the non-special tokens, so outputs neither loop early nor stop
        order = 3 + torch.randperm(cfg.vocab_size - 3, generator=g)
        perm = torch.full((cfg.vocab_size,), int(order[0]))
        perm[order] = order.roll(-1)
        head = torch.zeros(cfg.vocab_size, cfg.hidden_size)
        head.index_add_(0, perm, emb)  # logit j is high when perm(t) = j
        model.lm_head.weight.copy_(head * 0.3)
        for k in range(cfg.num_nextn_predict_layers):
            layer = model.mtp_layer(k)
            eye = torch.eye(cfg.hidden_size)
            layer.eh_proj.weight.copy_(torch.cat([eye, torch.zeros_like(eye)], 1))
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
            if mtp_noise:
                for w in (layer.eh_proj.weight[:, cfg.hidden_size:], layer.self_attn.o_proj.weight,
                          layer.mlp.down_proj.weight):
                    w.add_(mtp_noise * torch.randn(w.shape, generator=g))
    return model


def tiny_vocab_model(seed=0, vocab=5, family=TINY_CONFIG.family, tie_word_embeddings=True):
    cfg = dataclasses.replace(TINY_CONFIG, vocab_size=vocab, eos_token_id=None, bos_token_id=0, pad_token_id=0,
                              tie_word_embeddings=tie_word_embeddings, family=family, **SMALL)
    return random_model(cfg, seed, 0.35)


def exact_joint(model, prompt=(0, 3, 1), steps=3):
    """{(t1, .., t_steps): p} the exact joint of the first `steps` tokens after `prompt` at temperature 1,
    enumerated over the (tiny) vocabulary."""
    v = model.cfg.vocab_size
    probs = {}
    with torch.inference_mode():
        for prefix in itertools.chain.from_iterable(itertools.product(range(v), repeat=n) for n in range(steps)):
            ids = torch.tensor([list(prompt) + list(prefix)])
            logits = model.logits(model(ids, torch.arange(ids.shape[1])[None]))[0, -1]
            probs[prefix] = processed_logprobs(logits, 1.0).exp()
    joint = {}
    for cell in itertools.product(range(v), repeat=steps):
        p = 1.0
        for i in range(steps):
            p *= float(probs[cell[:i]][cell[i]])
        joint[cell] = p
    return joint


def sampled_counts(target, proposer, method, n, prompt=(0, 3, 1), k_policy=None):
    """({first 3 tokens: count} of n temperature-1 samples after `prompt` drafted by `proposer` and
    verified by `method` (drafts per step chosen by `k_policy`, default all), the acceptance rate)."""
    from rollout.embedded.engine import Engine, EngineConfig
    from rollout.sampling_params import SamplingParams
    from vime.sample import samples_for_prompts

    engine = Engine(target, EngineConfig(max_batch_size=n, max_len=16, rejection_sample_method=method),
                    proposer=proposer)
    engine.k_policy = k_policy or engine.k_policy
    samples = engine.generate(samples_for_prompts([list(prompt)] * n),
                              SamplingParams(temperature=1.0, max_new_tokens=3, seed=7))
    counts = {}
    for s in samples:
        counts[tuple(s.response_ids[:3])] = counts.get(tuple(s.response_ids[:3]), 0) + 1
    return counts, sum(s.spec.accepted_tokens for s in samples) / sum(s.spec.draft_tokens for s in samples)


def resample_from_p(probs, drafts, draft_probs, n_acc, draft_counts, u):
    """A wrong residual for the negative controls: after a rejection, sample p itself, not (p - q)+."""
    from mtp import rejection

    return rejection.sample_with_uniforms(rejection._row_select(probs, n_acc), u)


def alternating_k():
    """A k policy drafting 2 and 0 tokens in turn: a proposer defers every other step and catches
    up over it at the next (the MTP proposer's deferral, which EAGLE-3 reuses)."""
    from rollout.embedded.spec_policy import FixedK

    class Alternating(FixedK):
        def __init__(self):
            super().__init__(2)
            self.steps = 0

        def choose(self, batch_size):
            self.steps += 1
            return 2 * (self.steps % 2)
    return Alternating()


def qwen2_draft_specs():
    """A speculative config of every proposer with device draft steps (and n-gram's host drafts) on
    the shipped tiny Qwen2 target: each external kind's shipped draft, the target as its own draft model."""
    from draft_kind_fixtures import TARGET, shipped_spec
    from vime.models.draft_kinds import EXTERNAL_KINDS

    return [shipped_spec(kind) for kind in EXTERNAL_KINDS] + [
        {"method": "draft_model", "num_speculative_tokens": 2, "model": TARGET},
        {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 4}]


def hf_first_two_joint(checkpoint, prompt, temperature):
    """{(t1, t2): p} of the first two tokens after `prompt` by transformers' Qwen2ForCausalLM at
    `temperature`; a first EOS ends the response: {(EOS,): p}."""
    from transformers import Qwen2ForCausalLM

    from rollout.task import EOS

    model = Qwen2ForCausalLM.from_pretrained(checkpoint, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        p1 = torch.softmax(model(torch.tensor([prompt])).logits[0, -1].double() / temperature, -1)
        vocab = p1.numel()
        p2 = torch.softmax(model(torch.tensor([prompt + [t] for t in range(vocab)])).logits[:, -1].double()
                           / temperature, -1)
    joint = {(t1, t2): float(p1[t1] * p2[t1, t2]) for t1 in range(vocab) if t1 != EOS for t2 in range(vocab)}
    joint[(EOS,)] = float(p1[EOS])
    return joint


def first_two_counts(samples):
    """{(t1, t2) or (EOS,): count} of the samples' first two response tokens (the cells of hf_first_two_joint)."""
    from rollout.task import EOS

    counts = {}
    for s in samples:
        key = tuple(s.response_ids[:1]) if s.response_ids[0] == EOS else tuple(s.response_ids[:2])
        counts[key] = counts.get(key, 0) + 1
    return counts


def chi_square_p_value(counts, exact, n):
    """Chi-square goodness of fit of `n` observed outcomes (`counts`: outcome -> count) to the
    exact probabilities (`exact`: outcome -> p); cells expected below 5 are pooled into one."""
    from scipy.stats import chisquare

    small = [c for c in exact if exact[c] * n < 5]
    big = [c for c in exact if c not in small]
    obs = [counts.get(c, 0) for c in big] + [sum(counts.get(c, 0) for c in small)]
    exp = [exact[c] * n for c in big] + [sum(exact[c] for c in small) * n]
    total = sum(exp)
    return chisquare(obs, [e * sum(obs) / total for e in exp]).pvalue


def save_checkpoint(model, path):
    save_tokenizer(build_tokenizer(), path)
    save_hf_checkpoint(path, model.cfg, model.state_dict())
    return path


@pytest.fixture(scope="module", autouse=False)
def one_thread():
    """These models are tiny: one intra-op thread is as fast and does not collapse when the
    machine's cores are shared with other jobs (spinning OpenMP threads did, 100x)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def check_sampled_drafts_keep_the_target_distribution(target, proposer, method, n, alpha, k_policy=None):
    """A draft kind's sampled speculative output: both the accept and the residual paths are taken
    often, and the first tokens' counts pass the chi-square test against the exact joint."""
    counts, rate = sampled_counts(target, proposer, method, n, k_policy=k_policy)
    assert 0.1 < rate < 0.9  # both the accept and the residual paths are sampled often
    assert chi_square_p_value(counts, exact_joint(target), n) > alpha


def check_the_test_rejects_resampling_from_p(target, proposer, n, alpha, monkeypatch):
    """Negative control of the distribution test: a residual that resamples p itself is caught."""
    from mtp import rejection

    monkeypatch.setattr(rejection, "_residual_sample", resample_from_p)
    counts, _ = sampled_counts(target, proposer, "probabilistic", n)
    assert chi_square_p_value(counts, exact_joint(target), n) < alpha
