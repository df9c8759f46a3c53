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

pytest.importorskip("vllm")

from vime.sample import samples_for_prompts  # noqa: E402
from rollout.sampling_params import SamplingParams  # noqa: E402
from rollout.tokenizer import TextCodec  # noqa: E402
from spec_fixtures import chi_square_p_value, first_two_counts, hf_first_two_joint  # noqa: E402
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


def test_vllm_sampled_speculative_tokens_follow_the_policy(vllm_samples):
    prompt, samples, drafted = vllm_samples
    assert drafted > 0  # speculation really ran
    assert chi_square_p_value(first_two_counts(samples), hf_first_two_joint(DEFAULT_TINY_MODEL, prompt, 1.0), N) > ALPHA


def test_the_distribution_test_rejects_a_distorted_policy(vllm_samples):
    prompt, samples, _ = vllm_samples
    assert chi_square_p_value(first_two_counts(samples), hf_first_two_joint(DEFAULT_TINY_MODEL, prompt, 1.3), N) < ALPHA
