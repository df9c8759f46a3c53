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

from dflash_fixtures import REPO, TARGET
from test_eagle3_online import two_proportion_z
from tests.bad_input_helpers import refused

K, MAX_NEW = 3, 16


def initial_draft(path, seed=0):
    """A DFlash draft for the shipped target with no training (what online training starts from):
    the target's final norm, everything else small random weights (scripts/make_dflash_draft.py)."""
    subprocess.run([sys.executable, "scripts/make_dflash_draft.py", "--target", TARGET, "--out", path,
                    "--block-size", str(K + 1), "--seed", str(seed)], cwd=REPO, check=True, capture_output=True)
    return {"method": "dflash", "model": path, "num_speculative_tokens": K}


def prompt_ids(n, seed):
    from rollout.task import make_prompts
    from rollout.tokenizer import TextCodec

    codec = TextCodec(TARGET)
    rows = make_prompts(n, seed=seed)
    return [r["prompt"] for r in rows], [codec.encode_prompt(r["prompt"], 1) for r in rows]


def acceptance(backend, prompts):
    """(accepted, drafted) draft tokens of greedy speculative decoding of `prompts` by `backend`."""
    from rollout.sampling_params import SamplingParams
    from vime.sample import samples_for_prompts

    samples = backend.generate(samples_for_prompts(prompts), SamplingParams(temperature=0, max_new_tokens=MAX_NEW))
    return sum(s.spec.accepted_tokens for s in samples), sum(s.spec.draft_tokens for s in samples)


@pytest.mark.slow
def test_the_online_draft_accepts_more_on_held_out_prompts_than_the_frozen_draft(tmp_path):
    """Four RL steps: the embedded engine samples the policy's rollouts with the draft, the trainer
    trains the draft beside the policy (its steps and replay at their defaults; the policy's lr is 0,
    so both arms draft for the same target) and the engine receives the trainer's weights each step.
    On 32 held-out prompts, greedy decoding then accepts a larger share of the online draft's tokens
    than of the frozen draft's, by a one-sided two-proportion z-test at z > 3."""
    from rollout.backend import EmbeddedBackend
    from rollout.sampling_params import SamplingParams
    from rollout.spec_config import parse_spec_config
    from trainer.batch import build_batch
    from trainer.config import TrainerConfig
    from trainer.trainer import Trainer
    from vime.sample import samples_for_prompts

    spec = initial_draft(str(tmp_path / "draft"))
    held_text, held = prompt_ids(32, seed=999)
    frozen, online = EmbeddedBackend(TARGET, spec, 64), EmbeddedBackend(TARGET, spec, 64)
    trainer = Trainer(TrainerConfig(lr=0.0, enable_draft_training=True, speculative_config=parse_spec_config(spec)),
                      TARGET)
    for step in range(4):
        text, prompts = prompt_ids(8, seed=100 + step)
        assert not set(text) & set(held_text)  # held out: no training prompt is evaluated
        samples = online.generate(samples_for_prompts(prompts, n=4),
                                  SamplingParams(temperature=1.0, max_new_tokens=MAX_NEW, seed=step))
        for s in samples:
            s.advantage = 0.0
        trainer.train_step(build_batch(samples))
        online.load_weights([(k, v.detach().clone()) for k, v in trainer.named_hf_weights()], version=step + 1)
    (a1, n1), (a0, n0) = acceptance(online, held), acceptance(frozen, held)
    assert n1 > 0 and n0 > 0
    assert two_proportion_z(a1, n1, a0, n0) > 3, (a1, n1, a0, n0)


def run_online(tmp_path, backend, spec):
    out, save = tmp_path / "run", tmp_path / "save"
    cmd = [sys.executable, "train_rl.py", "--hf-checkpoint", TARGET, "--vllm-speculative-config", json.dumps(spec),
           "--enable-draft-training", "--rollout-backend", backend, "--num-rollout", "2", "--output-dir", str(out),
           "--save", str(save), "--save-interval", "2", "--check-weight-update-equal", "--progress", "false"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900,
                          env=dict(os.environ, WANDB_MODE="offline", WANDB_SILENT="true"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in open(out / "metrics.jsonl")], str(save)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["embedded", "vllm"])
def test_the_online_draft_reaches_the_rollout_every_step_and_exports(tmp_path, backend):
    from safetensors.torch import load_file

    from rollout.embedded.engine_builder import build_engine
    from trainer.drafts import saved_draft_state_file
    from vime.checkpointing import check_loadable

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
    proc = subprocess.run([sys.executable, "scripts/export_draft.py", "--load", save, "--out", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    _, iteration = check_loadable(save)
    saved = torch.load(saved_draft_state_file(os.path.join(iteration, "model")), weights_only=False)
    assert saved["kind"] == "dflash"
    exported = load_file(str(out / "model.safetensors"))
    assert exported.keys() == saved["draft"].keys() and all(torch.equal(exported[k], saved["draft"][k]) for k in exported)
    initial = load_file(os.path.join(spec["model"], "model.safetensors"))
    assert any(not torch.equal(exported[k], initial[k]) for k in initial)  # it trained
    build_engine(TARGET, dict(spec, model=str(out)))  # loads and fits the target


def test_the_block_size_is_the_drafts_own_under_training(tmp_path):
    spec = {"method": "dflash", "model": initial_draft(str(tmp_path / "draft"))["model"], "num_speculative_tokens": 5}
    refused(["--hf-checkpoint", TARGET, "--num-rollout", "1", "--output-dir", str(tmp_path / "out"),
             "--vllm-speculative-config", json.dumps(spec), "--enable-draft-training"],
            "num_speculative_tokens 5", "blocks of 4")


def test_draft_ttt_steps_is_refused_for_a_block_draft(tmp_path):
    spec = initial_draft(str(tmp_path / "draft"))
    refused(["--hf-checkpoint", TARGET, "--num-rollout", "1", "--output-dir", str(tmp_path / "out"),
             "--vllm-speculative-config", json.dumps(spec), "--enable-draft-training", "--draft-ttt-steps", "2"],
            "--draft-ttt-steps 2", "DFlash")
