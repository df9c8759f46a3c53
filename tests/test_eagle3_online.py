"""Online EAGLE-3 training does what it is for: the draft trained beside the policy on the policy's own
rollouts accepts more drafts on held-out prompts than the same draft left frozen (the control arm),
measured by the embedded engine's speculative decoding. End to end on both backends (real Ray,
megatron-core, vLLM): after every sync the rollout's draft equals the trainer's, and
`scripts/export_draft.py` writes exactly the checkpoint's draft as a directory the engines load.
All slow: the online loop trains for minutes on two cores.
"""
import json
import math
import os
import subprocess
import sys

import pytest
import torch

from eagle3_fixtures import DRAFT, REPO, TARGET

pytestmark = pytest.mark.slow
SPEC = json.dumps({"method": "eagle3", "model": DRAFT, "num_speculative_tokens": 3})
K, MAX_NEW = 3, 16


def initial_draft(path, seed=0):
    """A barely trained EAGLE-3 draft for the shipped target (what online training starts from):
    the target's head and final norm, everything else small random weights."""
    from mtp.eagle3 import Eagle3Draft
    from vime.models.eagle3 import draft_config_for_target, save_draft
    from vime.models.hf_format import load_hf_checkpoint

    cfg, state, _ = load_hf_checkpoint(TARGET)
    torch.manual_seed(seed)
    draft = Eagle3Draft(draft_config_for_target(cfg))
    with torch.no_grad():
        for p in draft.parameters():
            if p.dim() == 2:
                torch.nn.init.normal_(p, std=0.02)
        draft.lm_head.weight.copy_(state["lm_head.weight"])
        draft.norm.weight.copy_(state["model.norm.weight"])
    save_draft(path, draft.cfg, draft.state_dict())
    return {"method": "eagle3", "model": path, "num_speculative_tokens": K}


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


def two_proportion_z(a1, n1, a0, n0):
    """One-sided two-proportion z statistic of a1/n1 > a0/n0 (pooled variance)."""
    p = (a1 + a0) / (n1 + n0)
    return (a1 / n1 - a0 / n0) / math.sqrt(p * (1 - p) * (1 / n1 + 1 / n0))


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


def run_online(tmp_path, backend):
    out, save = tmp_path / "run", tmp_path / "save"
    cmd = [sys.executable, "train_rl.py", "--hf-checkpoint", TARGET, "--vllm-speculative-config", SPEC,
           "--enable-draft-training", "--rollout-backend", backend, "--num-rollout", "2", "--output-dir", str(out),
           "--save", str(save), "--save-interval", "2", "--check-weight-update-equal", "--progress", "false"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900,
                          env=dict(os.environ, WANDB_MODE="offline", WANDB_SILENT="true"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in open(out / "metrics.jsonl")], str(save)


@pytest.mark.parametrize("backend", ["embedded", "vllm"])
def test_the_online_draft_reaches_the_rollout_every_step_and_exports(tmp_path, backend):
    from safetensors.torch import load_file

    metrics, save = run_online(tmp_path, backend)
    for m in metrics:
        assert m["weight_sync/draft_checksum"] != 0.0  # the draft is in the guard's comparison
        assert m["weight_sync/draft_checksum"] == m["weight_sync/worker_draft_checksum"]
        assert m["weight_sync/draft_stale"] == 0
    out = tmp_path / "exported"
    proc = subprocess.run([sys.executable, "scripts/export_draft.py", "--load", save, "--out", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    from trainer.drafts import saved_draft_state_file
    from vime.checkpointing import check_loadable

    _, iteration = check_loadable(save)
    saved = torch.load(saved_draft_state_file(os.path.join(iteration, "model")), weights_only=False)["draft"]
    exported = load_file(str(out / "model.safetensors"))
    assert exported.keys() == saved.keys() and all(torch.equal(exported[k], saved[k]) for k in saved)
    from rollout.embedded.engine_builder import build_engine

    build_engine(TARGET, {"method": "eagle3", "model": str(out), "num_speculative_tokens": 3})  # loads and checks
