"""Every external draft kind trains online on a mixture-of-experts target (the shipped tiny GLM-4.5 MoE
model, which vLLM 0.32 cannot draft for) on the embedded engine: a draft made for it by the kind's maker
script, then 3 RL steps of train_rl.py (real Ray, megatron-core) that train it beside the policy, sync it
to the engine every step (the guard compares the engine's draft with the trainer's) and log its
acceptance and its losses. A maker run and an RL run per kind: slow."""
import os
import subprocess
import sys

import pytest

from online_draft_fixtures import REPO, run_online
from vime.models.draft_kinds import EXTERNAL_KINDS

GLM = os.path.join(REPO, "checkpoints", "tiny-glm4-moe-mtp")
K, STEPS = 3, 3


@pytest.mark.slow
@pytest.mark.parametrize("kind", EXTERNAL_KINDS, ids=lambda kind: kind.name)
def test_an_external_draft_trains_online_on_the_glm_moe_model_and_logs_acceptance_every_step(tmp_path, kind):
    draft = str(tmp_path / "draft")
    block = ["--block-size", str(K + (0 if kind.anchor_drafts else 1))] if kind.block else []
    subprocess.run([sys.executable, kind.format.make, "--target", GLM, "--out", draft, *block], cwd=REPO, check=True,
                   capture_output=True, timeout=600)
    spec = {"method": kind.name, "model": draft, "num_speculative_tokens": K}
    metrics, _ = run_online(tmp_path, "embedded", spec, target=GLM, steps=STEPS)
    assert [m["rollout/step"] for m in metrics] == list(range(STEPS))
    for m in metrics:
        assert 1.0 <= m["rollout/spec_accept_length"] <= K + 1  # logged, within what a verify can emit
        assert m["rollout/spec_draft_tokens"] > 0
        assert m["weight_sync/draft_checksum"] != 0.0  # the draft is in the guard's comparison
        assert m["weight_sync/draft_checksum"] == m["weight_sync/worker_draft_checksum"]
        assert m["weight_sync/draft_stale"] == 0
        assert m["train/draft_1_loss"] > 0 and m["train/draft_grad_norm"] > 0  # it trained beside the policy
