"""A draft whose head equals the target's (a new EAGLE-3 draft: `scripts/make_eagle3_draft.py --warmup-steps 0`
starts it as the target's copy) is served on vLLM with a head of its own: a push of the trained draft leaves
vLLM's target head the trainer's and its draft head the pushed one (vLLM would otherwise share the target's
module with the drafter, and the draft's push would land in the target).

One vLLM start on 2 busy cores (20-60 s): the slow run.
"""
import os
import sys

import pytest
import torch

pytest.importorskip("vllm")

from eagle3_fixtures import REPO, TARGET  # noqa: E402
from vime import weight_sync  # noqa: E402
from vime.models.eagle3 import EAGLE3  # noqa: E402
from vime.models.hf_format import load_hf_checkpoint  # noqa: E402

pytestmark = pytest.mark.slow


def draft_with_the_targets_head(out):
    """A whole-vocabulary EAGLE-3 draft as the maker makes it without warm-up: the target's head and final norm."""
    sys.path.insert(0, os.path.join(REPO, "scripts"))
    import make_eagle3_draft as maker

    maker.main(["--target", TARGET, "--out", out, "--warmup-steps", "0"])
    return {"method": "eagle3", "model": out, "num_speculative_tokens": 2}


def test_a_push_into_a_draft_whose_head_was_the_targets_leaves_vllms_target_head_the_trainers(tmp_path):
    from rollout.vllm.backend import VLLMBackend

    spec = draft_with_the_targets_head(str(tmp_path / "draft"))
    _, target, _ = load_hf_checkpoint(TARGET)
    _, draft = EAGLE3.load(spec["model"])
    assert torch.equal(draft["lm_head.weight"], target["lm_head.weight"])  # the case vLLM shares
    trained = dict(draft, **{"lm_head.weight": draft["lm_head.weight"] * 1.25})  # what a step made of the head
    sent = list(target.items()) + [(EAGLE3.wire_prefix + n, t) for n, t in trained.items()]
    backend = VLLMBackend(TARGET, spec, max_batch_size=8)
    try:
        backend.load_weights(sent, version=1)
        held = backend.digests()
    finally:
        backend.close()
    expected = weight_sync.digests([("lm_head.weight", target["lm_head.weight"]),
                                    (EAGLE3.wire_prefix + "lm_head.weight", trained["lm_head.weight"])])
    assert held["lm_head.weight"] == expected["lm_head.weight"]  # the target's head is the trainer's
    assert held[EAGLE3.wire_prefix + "lm_head.weight"] == expected[EAGLE3.wire_prefix + "lm_head.weight"]
