"""A real run (Ray, megatron-core on gloo, the embedded engine) of a chat checkpoint with
--apply-chat-template, --rm-type math (the process pool inside the rollout actor) and held-out
evaluation: it completes with the sync guard passing, and eval/* rows appear at step 0 and every
--eval-interval steps, and only then."""
import os

import pytest

from rollout.task import TASK_VARIANTS, chat_prompt_rows, write_jsonl
from rollout.tiny_model import make_random_chat_checkpoint
from tests.conftest import SMALL
from tests.test_train_rl import REPO, metrics, run_train


@pytest.mark.slow
def test_chat_math_run_evaluates_at_step_zero_and_every_interval(tmp_path):
    pytest.importorskip("math_verify")
    ckpt = str(tmp_path / "chat")
    make_random_chat_checkpoint(ckpt, seed=1, std=0.3, **SMALL)
    draw = TASK_VARIANTS["add"].draw_problem
    write_jsonl(chat_prompt_rows(draw, 32, 1), os.path.join(ckpt, "train.jsonl"))
    write_jsonl(chat_prompt_rows(draw, 3, 2), os.path.join(ckpt, "eval.jsonl"))
    out = tmp_path / "out"
    # relative to the driver's directory, as a user types it (the actors run in the job's copy of the code)
    eval_file = os.path.relpath(os.path.join(ckpt, "eval.jsonl"), REPO)
    proc = run_train("--hf-checkpoint", ckpt, "--apply-chat-template", "--input-key", "messages", "--rm-type", "math",
                     "--eval-prompt-data", eval_file, "--eval-interval", 2,
                     "--n-samples-per-eval-prompt", 2, "--num-rollout", 4, "--rollout-batch-size", 4,
                     "--n-samples-per-prompt", 4, "--global-batch-size", 16, "--micro-batch-size", 8,
                     "--rollout-max-response-len", 12, "--enable-mtp-training", "--mtp-num-layers", 1,
                     "--output-dir", out, "--progress", "false")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = metrics(out)
    assert [r["rollout/step"] for r in rows if "eval/reward" in r] == [0, 2]
    for r in rows:
        if "eval/reward" in r:
            assert r["eval/num_samples"] == 3 * 2
            assert 0 <= r["eval/pass@2"] <= 1 and r["eval/reward_timeouts"] == 0
        assert r["rollout/reward_timeouts"] == 0 and r["rollout/reward_unparsable_labels"] == 0
