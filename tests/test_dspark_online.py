"""Online DSpark training does what it is for: the DSpark draft trained beside the policy on the policy's
own rollouts accepts more drafts on held-out prompts than the same draft left frozen (the control arm),
measured by the embedded engine's speculative decoding. End to end through train_rl.py (real Ray,
megatron-core, the embedded engine: vLLM's CPU build cannot draft DSpark): after every sync the
rollout's draft equals the trainer's (the guard compares them), the block and per-slot acceptance are
logged, and `scripts/export_draft.py` writes exactly the checkpoint's draft as a directory the engine
loads. Bad training inputs are one line.
"""
import json
import subprocess
import sys

import pytest
import torch

from online_draft_fixtures import REPO, TARGET, assert_online_beats_frozen, trained_and_exported
from tests.bad_input_helpers import refused

K = 3


def initial_draft(path, seed=0):
    """A DSpark draft for the shipped target with no training (what online training starts from):
    the target's final norm, everything else small random weights (scripts/make_dspark_draft.py)."""
    subprocess.run([sys.executable, "scripts/make_dspark_draft.py", "--target", TARGET, "--out", path,
                    "--block-size", str(K), "--markov-rank", "8", "--seed", str(seed)], cwd=REPO, check=True,
                   capture_output=True)
    return {"method": "dspark", "model": path, "num_speculative_tokens": K}


@pytest.mark.slow
def test_the_online_draft_accepts_more_on_held_out_prompts_than_the_frozen_draft(tmp_path):
    """Four RL steps of online training, then the held-out comparison (online_draft_fixtures)."""
    assert_online_beats_frozen(initial_draft(str(tmp_path / "draft")))


@pytest.mark.slow
def test_the_online_draft_reaches_the_rollout_every_step_and_exports(tmp_path):
    from rollout.embedded.engine_builder import build_engine

    spec = initial_draft(str(tmp_path / "draft"))
    out, exported, initial = trained_and_exported(tmp_path, "embedded", spec, "dspark", K)
    for head in ("markov_head.markov_w1.weight", "confidence_head.proj.weight"):
        assert not torch.equal(exported[head], initial[head])  # the heads trained too
    build_engine(TARGET, dict(spec, model=out))  # loads and fits the target


def test_dspark_loss_weights_are_refused_for_another_kind_and_the_single_loss_type_for_dspark():
    from dflash_fixtures import DRAFT as DFLASH_DRAFT
    from dspark_fixtures import DRAFT

    dflash = json.dumps({"method": "dflash", "model": DFLASH_DRAFT, "num_speculative_tokens": 3})
    refused(["--hf-checkpoint", TARGET, "--enable-draft-training", "--vllm-speculative-config", dflash,
             "--draft-l1-weight", "0.5"], "--draft-l1-weight", "DSpark", "--draft-loss-type")
    dspark = json.dumps({"method": "dspark", "model": DRAFT, "num_speculative_tokens": 3})
    refused(["--hf-checkpoint", TARGET, "--enable-draft-training", "--vllm-speculative-config", dspark,
             "--draft-loss-type", "tv"], "--draft-loss-type tv", "--draft-ce-weight")
    refused(["--hf-checkpoint", TARGET, "--enable-draft-training", "--vllm-speculative-config", dspark,
             "--draft-confidence-weight", "-1"], "--draft-confidence-weight -1.0: must be >= 0")
