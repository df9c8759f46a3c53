"""Online DFlash training does what it is for: the block draft trained beside the policy on the policy's
own rollouts accepts more drafts on held-out prompts than the same draft left frozen (the control arm),
measured by the embedded engine's speculative decoding. End to end through train_rl.py (real Ray,
megatron-core, each rollout backend): after every sync the rollout's draft equals the trainer's (the
guard compares them), the block size and per-slot acceptance are logged, and `scripts/export_draft.py`
writes exactly the checkpoint's draft as a directory the engines load. Bad training inputs are one line.
"""
import subprocess
import sys

import pytest
import torch

from online_draft_fixtures import REPO, TARGET, assert_online_beats_frozen, trained_and_exported

K = 3


def initial_draft(path, seed=0):
    """A DFlash draft for the shipped target with no training (what online training starts from):
    the target's final norm, everything else small random weights (scripts/make_dflash_draft.py)."""
    subprocess.run([sys.executable, "scripts/make_dflash_draft.py", "--target", TARGET, "--out", path,
                    "--block-size", str(K + 1), "--seed", str(seed)], cwd=REPO, check=True, capture_output=True)
    return {"method": "dflash", "model": path, "num_speculative_tokens": K}


@pytest.mark.slow
def test_the_online_draft_accepts_more_on_held_out_prompts_than_the_frozen_draft(tmp_path):
    """Four RL steps of online training, then the held-out comparison (online_draft_fixtures)."""
    assert_online_beats_frozen(initial_draft(str(tmp_path / "draft")))


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["embedded", "vllm"])
def test_the_online_draft_reaches_the_rollout_every_step_and_exports(tmp_path, backend):
    from rollout.embedded.engine_builder import build_engine

    spec = initial_draft(str(tmp_path / "draft"))
    out, exported, initial = trained_and_exported(tmp_path, backend, spec, "dflash", K + 1)
    assert any(not torch.equal(exported[k], initial[k]) for k in initial)  # it trained
    build_engine(TARGET, dict(spec, model=out))  # loads and fits the target
    if backend == "vllm":
        assert_plain_vllm_serves(out)


def assert_plain_vllm_serves(draft_dir, n_prompts=6, max_new=24):
    """Plain `vllm.LLM` (no vime code between) serves the exported draft: greedy output equal to
    transformers' greedy decoding, and the drafts accepted per block slot equal to the cache-free
    reference of the exported weights (dflash_fixtures, counted as vLLM counts: whole blocks)."""
    from transformers import Qwen2ForCausalLM

    from dflash_fixtures import load_reference, reference_acceptance
    from vllm_spec_fixtures import hf_greedy, serve, task_prompts, vllm_greedy

    llm = serve(TARGET, {"method": "dflash", "model": draft_dir, "num_speculative_tokens": K})
    hf = Qwen2ForCausalLM.from_pretrained(TARGET, torch_dtype=torch.float32).eval()
    reference = load_reference(draft_dir)
    try:
        total = [0] * K
        for prompt in task_prompts(TARGET)[:n_prompts]:
            tokens, _, accepted = vllm_greedy(llm, prompt, max_new, K)
            assert tokens == hf_greedy(hf, prompt, max_new), prompt
            assert accepted == reference_acceptance(reference, prompt, tokens, max_new, past_end=True)[1], prompt
            total = [a + b for a, b in zip(total, accepted)]
        assert total[0] > 0  # drafts accepted: not vacuous
    finally:
        llm.llm_engine.engine_core.shutdown()
