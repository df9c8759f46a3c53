"""What the online tests of every external draft kind share: the online-vs-frozen experiment on the
embedded engine (the same initial draft, trained beside the policy or left frozen, judged on held-out
prompts) and a short train_rl.py run that trains the draft online and syncs it every step.
"""
import json
import math
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGET = os.path.join(REPO, "checkpoints", "tiny-qwen2")
MAX_NEW = 16


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


def online_and_frozen_acceptance(spec, steps=4):
    """((accepted, drafted) of the online draft, of the frozen one) on 32 held-out prompts after `steps`
    RL steps: the embedded engine samples the policy's rollouts with the draft, the trainer trains the
    draft beside the policy (its steps and replay at the kind's defaults; the policy's lr is 0, so both
    arms draft for the same target) and the engine receives the trainer's weights each step."""
    from rollout.backend import EmbeddedBackend
    from rollout.sampling_params import SamplingParams
    from vime.spec_config import parse_spec_config
    from trainer.batch import build_batch
    from trainer.config import TrainerConfig
    from trainer.trainer import Trainer
    from vime.sample import samples_for_prompts

    held_text, held = prompt_ids(32, seed=999)
    frozen, online = EmbeddedBackend(TARGET, spec, 64), EmbeddedBackend(TARGET, spec, 64)
    trainer = Trainer(TrainerConfig(lr=0.0, enable_draft_training=True, speculative_config=parse_spec_config(spec)),
                      TARGET)
    for step in range(steps):
        text, prompts = prompt_ids(8, seed=100 + step)
        assert not set(text) & set(held_text)  # held out: no training prompt is evaluated
        samples = online.generate(samples_for_prompts(prompts, n=4),
                                  SamplingParams(temperature=1.0, max_new_tokens=MAX_NEW, seed=step))
        for s in samples:
            s.advantage = 0.0
        trainer.train_step(build_batch(samples))
        online.load_weights([(k, v.detach().clone()) for k, v in trainer.named_hf_weights()], version=step + 1)
    return acceptance(online, held), acceptance(frozen, held)


def run_online(tmp_path, backend, spec, target=TARGET, steps=2):
    """(metrics per step, --save directory) of a `steps`-step train_rl.py run on `target` training the
    draft of `spec` online on `backend`, the guard on (--check-weight-update-equal)."""
    out, save = tmp_path / "run", tmp_path / "save"
    cmd = [sys.executable, "train_rl.py", "--hf-checkpoint", target, "--vllm-speculative-config", json.dumps(spec),
           "--enable-draft-training", "--rollout-backend", backend, "--num-rollout", str(steps), "--output-dir",
           str(out), "--save", str(save), "--save-interval", str(steps), "--check-weight-update-equal", "--progress",
           "false"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900,
                          env=dict(os.environ, WANDB_MODE="offline", WANDB_SILENT="true"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in open(out / "metrics.jsonl")], str(save)


def export_draft(save, out):
    """scripts/export_draft.py on a --save directory; (the checkpoint's draft state, the exported tensors)."""
    import torch
    from safetensors.torch import load_file

    from trainer.drafts import saved_draft_state_file
    from vime.checkpointing import resolve_load

    proc = subprocess.run([sys.executable, "scripts/export_draft.py", "--load", save, "--out", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    _, iteration, _ = resolve_load(save)
    saved = torch.load(saved_draft_state_file(os.path.join(iteration, "model")), weights_only=False)
    return saved, load_file(os.path.join(str(out), "model.safetensors"))


def assert_online_beats_frozen(spec, steps=4):
    """On 32 held-out prompts greedy decoding accepts a larger share of the online draft's tokens than
    of the frozen draft's (online_and_frozen_acceptance), by a one-sided two-proportion z-test at z > 3."""
    (a1, n1), (a0, n0) = online_and_frozen_acceptance(spec, steps)
    assert n1 > 0 and n0 > 0
    assert two_proportion_z(a1, n1, a0, n0) > 3, (a1, n1, a0, n0)


def trained_and_exported(tmp_path, backend, spec, kind, block_size):
    """A 2-step online run of `spec` (run_online) whose every step synced the draft (the guard compared it,
    none stale) and logged its block and per-position figures, then its draft exported (export_draft) and
    checked to be the checkpoint's; returns (the exported directory, its tensors, the initial draft's)."""
    import torch
    from safetensors.torch import load_file

    k = spec["num_speculative_tokens"]
    metrics, save = run_online(tmp_path, backend, spec)
    for m in metrics:
        assert m["weight_sync/draft_checksum"] != 0.0  # the draft is in the guard's comparison
        assert m["weight_sync/draft_checksum"] == m["weight_sync/worker_draft_checksum"]
        assert m["weight_sync/draft_stale"] == 0
        assert m["rollout/spec_block_size"] == block_size
        assert [f"rollout/spec_accept_rate_pos_{i}" in m for i in range(k)] == [True] * k
        assert [f"train/draft_{i}_loss" in m for i in range(1, k + 1)] == [True] * k
    out = tmp_path / "exported"
    saved, exported = export_draft(save, out)
    assert saved["kind"] == kind
    assert exported.keys() == saved["draft"].keys() and all(torch.equal(exported[n], saved["draft"][n]) for n in exported)
    return str(out), exported, load_file(os.path.join(spec["model"], "model.safetensors"))
