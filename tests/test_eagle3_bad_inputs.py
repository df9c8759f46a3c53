"""Bad EAGLE-3 inputs to train_rl.py: one line naming the flag and the directory, found by the
preflight (before any actor starts) on both rollout backends; a subprocess shows `error: ...`, exit 2."""
import json
import os
import shutil
import subprocess
import sys

import pytest

from eagle3_fixtures import DRAFT, REPO, TARGET
from train_rl import prepare
from vime.cli_config import load_config
from tests.bad_input_helpers import refused  # noqa: F401  (re-exported to the other bad-input tests)

MIMO = os.path.join(REPO, "checkpoints", "tiny-mimo-mtp")


def args_for(out, target=TARGET, draft=DRAFT, backend="embedded"):
    spec = {"method": "eagle3", "num_speculative_tokens": 3}
    if draft is not None:
        spec["model"] = draft
    return ["--hf-checkpoint", target, "--num-rollout", "2", "--output-dir", str(out), "--rollout-backend", backend,
            "--vllm-speculative-config", json.dumps(spec)]


def misfit_draft(tmp_path, **changes):
    out = tmp_path / "draft"
    shutil.copytree(DRAFT, out)
    raw = json.loads((out / "config.json").read_text())
    raw.update(changes)
    (out / "config.json").write_text(json.dumps(raw))
    return str(out)


def test_the_shipped_pair_passes_the_embedded_preflight(tmp_path):
    prepare(load_config(args_for(tmp_path)))  # the negative control of every case below


@pytest.mark.parametrize("backend", ["embedded", "vllm"])
def test_eagle3_without_a_draft_is_refused(tmp_path, backend):
    refused(args_for(tmp_path, draft=None, backend=backend), "method 'eagle3' needs \"model\"", "make_eagle3_draft.py")


def test_train_rl_prints_one_error_line_and_exits_2(tmp_path):
    proc = subprocess.run([sys.executable, "train_rl.py", *args_for(tmp_path, draft=TARGET)], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "is not an EAGLE-3 draft" in errors[0], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


def test_draft_training_without_an_external_draft_is_refused(tmp_path):
    refused(["--hf-checkpoint", TARGET, "--output-dir", str(tmp_path), "--enable-draft-training",
             "--vllm-speculative-config", "none"], "--enable-draft-training", "eagle3", "no speculation")
    refused(["--hf-checkpoint", TARGET, "--output-dir", str(tmp_path), "--enable-draft-training",
             "--vllm-speculative-config", '{"method":"ngram","num_speculative_tokens":2}'],
            "--enable-draft-training", "method 'ngram'")


def test_an_mtp_method_with_draft_training_is_refused(tmp_path):
    refused(["--hf-checkpoint", MIMO, "--output-dir", str(tmp_path), "--enable-draft-training",
             "--vllm-speculative-config", '{"method":"mtp","num_speculative_tokens":2}'],
            "method 'mtp' drafts with the policy's own MTP layers", "--enable-mtp-training")


def test_the_shipped_pair_with_draft_training_passes_the_preflight(tmp_path):
    prepare(load_config(args_for(tmp_path) + ["--enable-draft-training"]))


def test_bad_draft_training_settings_are_refused(tmp_path):
    base = args_for(tmp_path) + ["--enable-draft-training"]
    refused(base + ["--draft-loss-type", "kl"], "--draft-loss-type 'kl'", "ce", "soft_ce")
    refused(base + ["--draft-distill-topk", "4"], "--draft-distill-topk", "soft_ce")
    refused(base + ["--draft-steps-per-rollout", "1", "--draft-replay-batches", "2"], "--draft-replay-batches",
            "--draft-steps-per-rollout 1")
    refused(base + ["--draft-steps-per-rollout", "0"], "--draft-steps-per-rollout 0", ">= 1")
    refused(base + ["--draft-ttt-steps", "0"], "--draft-ttt-steps 0", ">= 1")
    refused(base + ["--draft-ttt-steps", "1000"], "--draft-ttt-steps 1000: the rollout drafts num_speculative_tokens "
            "3 tokens a step", "pass --draft-ttt-steps 3 or less")
    # the negative control: each setting accepted alone, the bound itself included
    prepare(load_config(base + ["--draft-loss-type", "soft_ce", "--draft-distill-topk", "4",
                                  "--draft-steps-per-rollout", "1", "--draft-replay-batches", "0",
                                  "--draft-ttt-steps", "3"]))
