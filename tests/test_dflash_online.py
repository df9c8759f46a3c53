"""Online DFlash training does what it is for: the block draft trained beside the policy on the policy's
own rollouts accepts more drafts on held-out prompts than the same draft left frozen (the control arm),
measured by the embedded engine's speculative decoding. End to end through train_rl.py (real Ray,
megatron-core, each rollout backend): after every sync the rollout's draft equals the trainer's (the
guard compares them), the block size and per-slot acceptance are logged, and `scripts/export_draft.py`
writes exactly the checkpoint's draft as a directory the engines load. Bad training inputs are one line.
"""
import json
import os
import subprocess
import sys

import pytest
import torch

from online_draft_fixtures import REPO, TARGET, assert_online_beats_frozen, export_draft, run_online
from tests.bad_input_helpers import refused

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
    metrics, save = run_online(tmp_path, backend, spec)
    for m in metrics:
        assert m["weight_sync/draft_checksum"] != 0.0  # the draft is in the guard's comparison
        assert m["weight_sync/draft_checksum"] == m["weight_sync/worker_draft_checksum"]
        assert m["weight_sync/draft_stale"] == 0
        assert m["rollout/spec_block_size"] == K + 1
        assert [f"rollout/spec_accept_rate_pos_{i}" in m for i in range(K)] == [True] * K
        assert [f"train/draft_{i}_loss" in m for i in range(1, K + 1)] == [True] * K
    out = tmp_path / "exported"
    saved, exported = export_draft(save, out)
    assert saved["kind"] == "dflash"
    assert exported.keys() == saved["draft"].keys() and all(torch.equal(exported[k], saved["draft"][k]) for k in exported)
    from safetensors.torch import load_file

    initial = load_file(os.path.join(spec["model"], "model.safetensors"))
    assert any(not torch.equal(exported[k], initial[k]) for k in initial)  # it trained
    build_engine(TARGET, dict(spec, model=str(out)))  # loads and fits the target
    if backend == "vllm":
        assert_plain_vllm_serves(str(out))


def assert_plain_vllm_serves(draft_dir, n_prompts=6, max_new=24):
    """Plain `vllm.LLM` (no vime code between) serves the exported draft: greedy output equal to
    transformers' greedy decoding, and the drafts accepted per block slot equal to the cache-free
    reference of the exported weights (dflash_fixtures, counted as vLLM counts: whole blocks)."""
    from transformers import Qwen2ForCausalLM
    from vllm import LLM
    from vllm import SamplingParams as VSampling

    from dflash_fixtures import load_reference, reference_acceptance
    from online_draft_fixtures import prompt_ids

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    llm = LLM(model=TARGET, speculative_config={"method": "dflash", "model": draft_dir, "num_speculative_tokens": K},
              skip_tokenizer_init=True, dtype="float32", enforce_eager=True, max_model_len=256, seed=0,
              disable_log_stats=False)
    hf = Qwen2ForCausalLM.from_pretrained(TARGET, torch_dtype=torch.float32).eval()
    reference = load_reference(draft_dir)
    try:
        expected = [0] * K
        for prompt in prompt_ids(n_prompts, seed=4242)[1]:
            out = llm.generate([{"prompt_token_ids": list(prompt)}], VSampling(temperature=0, max_tokens=max_new),
                               use_tqdm=False)[0].outputs[0].token_ids
            with torch.no_grad():
                plain = hf.generate(torch.tensor([prompt]), max_new_tokens=len(out), do_sample=False,
                                    eos_token_id=None)[0, len(prompt):].tolist()
            assert list(out) == plain[:len(out)], prompt
            accepted = reference_acceptance(reference, prompt, list(out), max_new, past_end=True)[1]
            expected = [a + b for a, b in zip(expected, accepted)]
        got = next(list(m.values) for m in llm.get_metrics() if m.name == "vllm:spec_decode_num_accepted_tokens_per_pos")
        assert [int(x) for x in got] == expected and expected[0] > 0, (got, expected)
    finally:
        llm.llm_engine.engine_core.shutdown()


def test_the_block_size_is_the_drafts_own_under_training(tmp_path):
    spec = dict(initial_draft(str(tmp_path / "draft")), num_speculative_tokens=5)
    refused(["--hf-checkpoint", TARGET, "--num-rollout", "1", "--output-dir", str(tmp_path / "out"),
             "--vllm-speculative-config", json.dumps(spec), "--enable-draft-training"],
            "num_speculative_tokens 5", "blocks of 4")


def test_draft_ttt_steps_is_refused_for_a_block_draft(tmp_path):
    spec = initial_draft(str(tmp_path / "draft"))
    refused(["--hf-checkpoint", TARGET, "--num-rollout", "1", "--output-dir", str(tmp_path / "out"),
             "--vllm-speculative-config", json.dumps(spec), "--enable-draft-training", "--draft-ttt-steps", "2"],
            "--draft-ttt-steps 2", "DFlash")
