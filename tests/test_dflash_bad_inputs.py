"""Bad DFlash inputs to train_rl.py: one line naming the flag and the draft, found before any actor
starts, on both rollout backends (vLLM's own validation would accept a misfit draft and fail later
inside its engine process); a subprocess shows `error: ...`, exit 2."""
import json
import shutil
import subprocess
import sys

import pytest

from dflash_fixtures import DRAFT, REPO, TARGET
from tests.bad_input_helpers import refused


def args_for(out, draft=DRAFT, backend="embedded", k=3):
    spec = {"method": "dflash", "num_speculative_tokens": k}
    if draft is not None:
        spec["model"] = draft
    return ["--hf-checkpoint", TARGET, "--num-rollout", "2", "--output-dir", str(out), "--rollout-backend", backend,
            "--vllm-speculative-config", json.dumps(spec)]


@pytest.mark.parametrize("backend", ["embedded", "vllm"])
def test_dflash_without_a_draft_is_refused(tmp_path, backend):
    refused(args_for(tmp_path, draft=None, backend=backend), "method 'dflash' needs \"model\"", "make_dflash_draft.py")


@pytest.mark.parametrize("backend", ["embedded", "vllm"])
def test_a_block_size_the_draft_was_not_built_for_is_refused(tmp_path, backend):
    refused(args_for(tmp_path, backend=backend, k=7), DRAFT, "num_speculative_tokens 7", "blocks of 4")


@pytest.mark.parametrize("backend", ["embedded", "vllm"])
def test_a_draft_reading_layers_the_target_lacks_is_refused(tmp_path, backend):
    out = tmp_path / "draft"
    shutil.copytree(DRAFT, out)
    raw = json.loads((out / "config.json").read_text())
    raw["dflash_config"]["target_layer_ids"] = [1, 3, 9]
    (out / "config.json").write_text(json.dumps(raw))
    refused(args_for(tmp_path, draft=str(out), backend=backend), str(out), "target_layer_ids [1, 3, 9]", "7 layers")


def test_a_top_level_block_size_that_disagrees_with_dflash_config_is_refused_naming_both(tmp_path):
    out = tmp_path / "draft"
    shutil.copytree(DRAFT, out)
    raw = json.loads((out / "config.json").read_text())
    raw["block_size"], raw["dflash_config"]["block_size"] = 5, 4
    (out / "config.json").write_text(json.dumps(raw))
    refused(args_for(tmp_path, draft=str(out)), str(out), "gives block_size 5 and dflash_config.block_size 4",
            "make them equal")


def test_train_rl_prints_one_error_line_and_exits_2(tmp_path):
    proc = subprocess.run([sys.executable, "train_rl.py", *args_for(tmp_path, k=2)], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "num_speculative_tokens 2" in errors[0], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("argv, needle", [
    (["--arms", "online:k=7"], "built for k = 3"),  # the shipped draft drafts blocks of 4 only
    (["--arms", "online:draft=medusa"], "draft= is one of"),
    (["--arms", "online:k=seven"], "k= takes an integer"),
    # draft_layers= shapes a draft the run makes, and only a kind whose maker takes it
    (["--arms", "online:k=7:draft_layers=2"], "give --draft-warmup-steps N"),
    (["--arms", "online:draft=eagle3:draft_layers=2", "--draft-warmup-steps", "2"], "eagle3 draft takes no draft_layers="),
])
def test_the_drift_benchmark_refuses_a_draft_arm_it_cannot_run_in_one_line(tmp_path, argv, needle):
    """rl_arms.py drift checks every arm's draft kind and k before any run starts: exit 2, one line."""
    proc = subprocess.run([sys.executable, "scripts/bench/rl_arms.py", "drift", "--draft", "dflash",
                           "--out", str(tmp_path), *argv], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().count("\n") == 0 and needle in proc.stderr and "Traceback" not in proc.stderr
    assert not any(tmp_path.iterdir())  # nothing started
