"""The online run's sync into vLLM's DFlash drafter: new draft tensors, sent as `dflash.<checkpoint name>`,
reloaded in place. Afterwards vLLM accepts per position exactly what the cache-free reference of vLLM's
DFlash computation (tests/dflash_fixtures.py) accepts with the NEW draft, its readable draft parameters
(the norms) read back as sent, and the guard's draft checksum covers them.
One vLLM start (20-60 s on 2 busy cores): slow.
"""
import pytest
import torch

pytest.importorskip("vllm")

from dflash_fixtures import DRAFT, TARGET, load_reference, reference_acceptance  # noqa: E402
from fp32_bounds import reduction_rtol  # noqa: E402
from rollout.sampling_params import SamplingParams  # noqa: E402
from rollout.task import make_prompts  # noqa: E402
from rollout.tokenizer import TextCodec  # noqa: E402
from vime.sample import samples_for_prompts  # noqa: E402

pytestmark = pytest.mark.slow
K, MAX_NEW = 3, 32


@pytest.fixture(scope="module")
def backend():
    from rollout.vllm.backend import VLLMBackend

    b = VLLMBackend(TARGET, {"method": "dflash", "model": DRAFT, "num_speculative_tokens": K}, max_batch_size=256)
    yield b
    b.close()


def changed_draft():
    """The shipped draft's tensors with its MLP, context projection, key projection and norms changed."""
    _, state, _ = load_reference()
    changed = dict(state)
    for name in ("layers.0.mlp.down_proj.weight", "fc.weight", "layers.0.self_attn.k_proj.weight"):
        changed[name] = state[name] * 0.7
    for name in ("norm.weight", "hidden_norm.weight", "layers.0.self_attn.k_norm.weight"):
        changed[name] = state[name] * 1.25
    return changed


def test_a_draft_reloaded_in_place_is_the_one_vllm_drafts_with(backend):
    from vime.models.dflash import DFLASH

    target, state, cfg = load_reference()
    codec = TextCodec(TARGET)
    prompts = [codec.encode_prompt(r["prompt"], 1) for r in make_prompts(8, seed=5)]
    changed = changed_draft()
    backend.load_weights([(DFLASH.wire_prefix + k, v) for k, v in changed.items()], version=1)
    readback = backend.weights.readback_stats
    norm = changed["norm.weight"]
    # the worker sums in float64, the reference in fp32: one fp32 reduction over the norm's terms
    assert torch.allclose(readback[DFLASH.wire_prefix + "norm.weight"].float(),
                          torch.tensor([float(norm.sum()), float(norm.pow(2).sum())]),
                          rtol=reduction_rtol(norm.numel(), 1), atol=0)
    assert backend.fingerprint()["draft"] is not None
    new, old = (target, changed, cfg), (target, state, cfg)
    total, differs = [0] * K, False
    for prompt in prompts:
        samples = samples_for_prompts([prompt])
        backend.generate(samples, SamplingParams(temperature=0, max_new_tokens=MAX_NEW))
        got = backend.stats()["spec"]["accepted_per_pos"]
        got = got + [0] * (K - len(got))
        _, expected = reference_acceptance(new, prompt, samples[0].response_ids, MAX_NEW, past_end=True)
        assert got == expected, (prompt, got, expected)
        differs |= reference_acceptance(old, prompt, samples[0].response_ids, MAX_NEW, past_end=True)[1] != expected
        total = [a + b for a, b in zip(total, got)]
    assert total[0] > 0 and differs  # accepted, and the old draft would have accepted otherwise: not vacuous
