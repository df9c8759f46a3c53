"""train_rl.py with pipeline-parallel trainers (real Ray actors, megatron-core's schedule on gloo), end to end:
the step-0 losses, grad norms and pushed-weight checksums equal a one-rank run's, and every push
passes --check-weight-update-equal (every tensor of every engine equals the trainer's), on the
embedded engine and on vLLM, for the dense families and the shipped MoE checkpoints with their MTP layer.

Each case is two whole runs (1-3 min each on 2 cores): slow-marked. The default suite checks the same
trainer arithmetic and the gathered weights without Ray (test_trainer_tensor_parallel.py).
"""
import os

import pytest

from tests.conftest import SMALL
from tests.fp32_bounds import close, reduction_rtol
from tests.test_train_rl import base_args, ckpt, metrics, run_train  # noqa: F401  (ckpt: a small MiMo)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHIPPED = os.path.join(REPO, "checkpoints")
COMPARED = ("train/policy_loss", "train/mtp_loss", "train/entropy", "train/grad_norm", "train/mtp_grad_norm",
            "weight_sync/target_checksum", "weight_sync/draft_checksum")


def weight_tensor_count(hf):
    from vime.models.hf_format import load_hf_checkpoint

    return len(load_hf_checkpoint(hf)[1])


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["embedded", "vllm"])
@pytest.mark.parametrize("model, layout", [
    ("tiny-glm4-moe-mtp", ["--pipeline-model-parallel-size", 2, "--decoder-last-pipeline-num-layers", 2]),
    ("tiny-deepseek-v3-mtp", ["--pipeline-model-parallel-size", 2, "--decoder-first-pipeline-num-layers", 2]),
    ("small-mimo", ["--pipeline-model-parallel-size", 2]),
    ("small-mimo", ["--tensor-model-parallel-size", 2, "--pipeline-model-parallel-size", 2]),
], ids=["pp2-glm4-moe", "pp2-deepseek-v3", "pp2-mimo", "tp2-pp2-mimo"])
def test_pipeline_parallel_trainers_train_and_push_what_one_rank_does(ckpt, tmp_path, backend, model,  # noqa: F811
                                                                      layout):
    if backend == "vllm":
        pytest.importorskip("vllm")
    hf = ckpt if model == "small-mimo" else os.path.join(SHIPPED, model)
    common = ["--enable-mtp-training", "--mtp-num-layers", 1, "--check-weight-update-equal", "--use-wandb", "false",
              "--adam-eps", 1e-3, "--rollout-backend", backend]
    runs = {}
    for name, extra in (("one", []), ("layout", layout)):
        out = tmp_path / name
        proc = run_train(*base_args(hf, out, 2, *common, *extra), timeout=1200)
        assert proc.returncode == 0, proc.stderr[-3000:]  # the guard compared every tensor after each push
        runs[name] = metrics(out)
    # the same samples at step 0 (same weights, same seeds); stages reorder only the grad norm's sum over
    # weight tensors (test_trainer_tensor_parallel.py), TP its matmuls' sums (the TP tests' bound)
    rtol = reduction_rtol(weight_tensor_count(hf), 2)
    if "--tensor-model-parallel-size" in layout:
        rtol += reduction_rtol(SMALL["intermediate_size"], 3 * 2 * 2 * SMALL["num_hidden_layers"] + 4)
    one, pp = runs["one"][0], runs["layout"][0]
    for key in COMPARED:
        assert close(pp[key], one[key], rtol), (key, pp[key], one[key])
    assert all(r["weight_sync/draft_stale"] == 0 for r in runs["layout"])
