"""Sampled speculative decoding on vLLM keeps the policy's distribution.

vLLM (CPU build) with MTP k = 2 samples two tokens after one task prompt, N times with
distinct seeds; the joint of (token 1, token 2) must fit the exact one, computed by
transformers' Qwen2ForCausalLM on the same trunk, by a chi-square test at false-alarm rate
1e-3. Token 2 is always decided by the rejection sampler (verified against the drafts made
after token 1). The shipped pretrained model is used because its distributions are peaked: a
sampler that distorts them is visible, where a random model's near-uniform ones would hide it.
Negative control: the same counts against the policy at temperature 1.3 are rejected.
"""
import pytest
import torch

pytest.importorskip("vllm")

from vime.sample import samples_for_prompts  # noqa: E402
from rollout.sampling_params import SamplingParams  # noqa: E402
from rollout.task import EOS  # noqa: E402
from rollout.tokenizer import TextCodec  # noqa: E402
from spec_fixtures import chi_square_p_value  # noqa: E402
from vime.config import DEFAULT_TINY_MODEL  # noqa: E402

N, ALPHA, PROMPT = 4000, 1e-3, "37+58="


@pytest.fixture(scope="module")
def vllm_samples():
    from rollout.vllm.backend import VLLMBackend

    backend = VLLMBackend(DEFAULT_TINY_MODEL, {"method": "mtp", "num_speculative_tokens": 2}, max_batch_size=256)
    try:
        prompt = TextCodec(DEFAULT_TINY_MODEL).encode_prompt(PROMPT, 1)
        samples = samples_for_prompts([prompt], n=N)
        backend.generate(samples, SamplingParams(temperature=1.0, max_new_tokens=4))
        drafted = backend.stats()["spec"]["draft_tokens"]
    finally:
        backend.close()
    return prompt, samples, drafted


def exact_joint(prompt, temperature):
    """{(t1, t2): p} of the first two tokens; a first EOS ends the response: {(EOS,): p}."""
    from transformers import Qwen2ForCausalLM

    model = Qwen2ForCausalLM.from_pretrained(DEFAULT_TINY_MODEL, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        p1 = torch.softmax(model(torch.tensor([prompt])).logits[0, -1].double() / temperature, -1)
        vocab = p1.numel()
        second = torch.tensor([prompt + [t] for t in range(vocab)])
        p2 = torch.softmax(model(second).logits[:, -1].double() / temperature, -1)
    joint = {(t1, t2): float(p1[t1] * p2[t1, t2]) for t1 in range(vocab) if t1 != EOS for t2 in range(vocab)}
    joint[(EOS,)] = float(p1[EOS])
    return joint


def observed_joint(samples):
    counts = {}
    for s in samples:
        key = tuple(s.response_ids[:1]) if s.response_ids[0] == EOS else tuple(s.response_ids[:2])
        counts[key] = counts.get(key, 0) + 1
    return counts


def test_vllm_sampled_speculative_tokens_follow_the_policy(vllm_samples):
    prompt, samples, drafted = vllm_samples
    assert drafted > 0  # speculation really ran
    assert chi_square_p_value(observed_joint(samples), exact_joint(prompt, 1.0), N) > ALPHA


def test_the_distribution_test_rejects_a_distorted_policy(vllm_samples):
    prompt, samples, _ = vllm_samples
    assert chi_square_p_value(observed_joint(samples), exact_joint(prompt, 1.3), N) < ALPHA
