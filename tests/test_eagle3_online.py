"""Online EAGLE-3 training does what it is for: the draft trained beside the policy on the policy's own
rollouts accepts more drafts on held-out prompts than the same draft left frozen (the control arm),
measured by the embedded engine's speculative decoding. End to end on both backends (real Ray,
megatron-core, vLLM): after every sync the rollout's draft equals the trainer's, and
`scripts/export_draft.py` writes exactly the checkpoint's draft as a directory the engines load, for a draft of
the whole vocabulary and one of a reduced vocabulary.
All slow: the online loop trains for minutes on two cores.
"""
import pytest
import torch

from eagle3_fixtures import DRAFT, TARGET, save_reduced_shipped_draft
from online_draft_fixtures import assert_online_beats_frozen, export_draft, run_online

pytestmark = pytest.mark.slow
SPEC = {"method": "eagle3", "model": DRAFT, "num_speculative_tokens": 3}
K = 3


def initial_draft(path, seed=0):
    """A barely trained EAGLE-3 draft for the shipped target (what online training starts from):
    the target's head and final norm, everything else small random weights."""
    from mtp.eagle3 import Eagle3Draft
    from vime.models.eagle3 import EAGLE3, draft_config_for_target
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
    EAGLE3.save(path, draft.cfg, draft.state_dict())
    return {"method": "eagle3", "model": path, "num_speculative_tokens": K}


def test_the_online_draft_accepts_more_on_held_out_prompts_than_the_frozen_draft(tmp_path):
    """Four RL steps of online training, then the held-out comparison (online_draft_fixtures)."""
    assert_online_beats_frozen(initial_draft(str(tmp_path / "draft")))


@pytest.mark.parametrize("backend", ["embedded", "vllm"])
@pytest.mark.parametrize("vocab", ["whole", "reduced"])
def test_the_online_draft_reaches_the_rollout_every_step_and_exports(tmp_path, backend, vocab):
    """The shipped draft, and the same cut down to a reduced vocabulary (its tables stay as loaded: only
    what trains is synced, and the export keeps them)."""
    spec = SPEC if vocab == "whole" else dict(SPEC, model=save_reduced_shipped_draft(tmp_path / "reduced"))
    metrics, save = run_online(tmp_path, backend, spec)
    for m in metrics:
        assert m["weight_sync/draft_checksum"] != 0.0  # the draft is in the guard's comparison
        assert m["weight_sync/draft_checksum"] == m["weight_sync/worker_draft_checksum"]
        assert m["weight_sync/draft_stale"] == 0
    saved, exported = export_draft(save, tmp_path / "exported")
    saved = saved["draft"]
    assert exported.keys() == saved.keys() and all(torch.equal(exported[k], saved[k]) for k in saved)
    if vocab == "reduced":
        from vime.models.eagle3 import EAGLE3

        _, initial = EAGLE3.load(spec["model"])
        assert all(torch.equal(exported[k], initial[k]) for k in ("d2t", "t2d"))
    from rollout.embedded.engine_builder import build_engine

    build_engine(TARGET, {"method": "eagle3", "model": str(tmp_path / "exported"), "num_speculative_tokens": 3})
