"""Parallel layouts: where the layers and ranks go (megatron-core's split), and every layout that cannot run
refused in one line before anything starts (train_rl.prepare, the converter, the trainer group)."""
import os
import subprocess
import sys

import pytest

from tests.bad_input_helpers import refused
from tests.test_bad_inputs import args_for, ckpt  # noqa: F401  (the fixture: a 2-layer checkpoint, 1 MTP layer)
from vime.errors import UserError
from vime.models.hf_format import read_config
from vime.parallel_layout import ParallelLayout

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GLM = os.path.join(REPO, "checkpoints", "tiny-glm4-moe-mtp")  # 5 decoder layers + 1 MTP layer


def megatron_stage_counts(num_layers, pp, first=None, last=None):
    """Decoder layers per stage as megatron-core 0.16.1 builds them (its own get_num_layers_to_build)."""
    from types import SimpleNamespace

    from megatron.core.transformer.transformer_block import get_num_layers_to_build

    cfg = SimpleNamespace(pipeline_model_parallel_layout=None, num_layers=num_layers, pipeline_model_parallel_size=pp,
                          num_layers_in_first_pipeline_stage=first, num_layers_in_last_pipeline_stage=last,
                          account_for_embedding_in_pipeline_split=False, account_for_loss_in_pipeline_split=False,
                          virtual_pipeline_model_parallel_size=None)
    return [get_num_layers_to_build(cfg, pp_rank=r) for r in range(pp)]


@pytest.mark.parametrize("layers, pp, first, last", [
    (7, 1, None, None), (6, 2, None, None), (5, 2, None, 2), (5, 2, 3, None), (5, 2, 3, 2), (7, 3, None, 1),
    (7, 3, 3, None), (8, 4, 1, 1)])
def test_stages_hold_the_layers_megatron_core_builds_on_them(layers, pp, first, last):
    layout = ParallelLayout(pp=pp, first_stage_layers=first, last_stage_layers=last)
    layout.check()
    counts = layout.stage_layer_counts(layers)
    assert counts == megatron_stage_counts(layers, pp, first, last)
    assert [list(layout.stage_layers(layers, s)) for s in range(pp)] == \
        [list(range(sum(counts[:s]), sum(counts[:s + 1]))) for s in range(pp)]


def test_ranks_are_numbered_as_megatron_core_numbers_them():
    from megatron.core.parallel_state import RankGenerator

    layout = ParallelLayout(tp=2, pp=2, dp=2)
    ranks = RankGenerator(tp=2, ep=1, dp=2, pp=2, cp=1, order="tp-cp-ep-dp-pp")
    for dp_group in ranks.get_ranks("dp"):  # the ranks of one group share the index of every other dimension
        assert len({layout.pp_rank(r) for r in dp_group}) == 1
        assert [layout.dp_rank(r) for r in dp_group] == [0, 1]
    for pp_group in ranks.get_ranks("pp"):
        assert [layout.pp_rank(r) for r in pp_group] == [0, 1]
        assert len({layout.dp_rank(r) for r in pp_group}) == 1


def layout_error(layout, model=None, ranks=None):
    with pytest.raises(UserError) as err:
        layout.check_world(ranks) if ranks is not None else layout.check_model(model) if model else layout.check()
    assert "\n" not in str(err.value)
    return str(err.value)


@pytest.mark.parametrize("layout, needles", [
    (ParallelLayout(pp=6), ["--pipeline-model-parallel-size 6", "more stages than its 5 decoder layers",
                            "MTP layer", "at most 5"]),
    (ParallelLayout(pp=2), ["--pipeline-model-parallel-size 2 does not divide the model's 5 decoder layers",
                            "--decoder-last-pipeline-num-layers 2"]),
    (ParallelLayout(pp=2, first_stage_layers=3, last_stage_layers=3), ["add up to 6", "5 decoder layers"]),
    (ParallelLayout(pp=2, first_stage_layers=5), ["--decoder-first-pipeline-num-layers 5", "leave 0",
                                                  "at least 1"]),
    (ParallelLayout(pp=3, first_stage_layers=2), ["leave 3", "other 2 pipeline stages", "equal number"]),
    (ParallelLayout(tp=2), ["--tensor-model-parallel-size 2", "mixture-of-experts", "add --sequence-parallel"]),
])
def test_a_layout_the_model_cannot_be_split_into_is_one_line(layout, needles):
    message = layout_error(layout, read_config(GLM))
    assert all(n in message for n in needles), message


def test_stage_counts_without_stages_and_ranks_that_are_not_tp_pp_dp_are_one_line():
    message = layout_error(ParallelLayout(last_stage_layers=2))
    assert "--decoder-last-pipeline-num-layers 2" in message and "--pipeline-model-parallel-size 2 or more" in message
    message = layout_error(ParallelLayout(tp=2, pp=2, dp=2), ranks=4)
    assert "gives 4 trainer ranks" in message and "needs 8" in message


@pytest.mark.parametrize("extra, needles", [
    (["--pipeline-model-parallel-size", 3], ["--pipeline-model-parallel-size 3", "2 decoder layers", "MTP layer"]),
    (["--pipeline-model-parallel-size", 2, "--decoder-first-pipeline-num-layers", 1,
      "--decoder-last-pipeline-num-layers", 2], ["add up to 3"]),
    (["--decoder-first-pipeline-num-layers", 1], ["--decoder-first-pipeline-num-layers 1",
                                                  "--pipeline-model-parallel-size 2 or more"]),
    (["--decoder-last-pipeline-num-layers", 0], ["--decoder-last-pipeline-num-layers 0", ">= 1"]),
    (["--tensor-model-parallel-size", 2, "--actor-num-gpus-per-node", 3],
     ["--actor-num-gpus-per-node 3 over the 2 trainer rank(s)", "1.5 GPU each", "at most 2 or a multiple"]),
])
def test_train_rl_refuses_a_layout_before_anything_starts(ckpt, tmp_path, extra, needles):  # noqa: F811
    refused(args_for(ckpt, tmp_path, *extra), *needles)


def test_the_converter_refuses_a_layout_the_model_cannot_be_split_into(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "checkpoint_convert.hf_to_torch_dist", "--hf-checkpoint", GLM,
                           "--save", str(tmp_path / "o"), "--mtp-num-layers", "1",
                           "--pipeline-model-parallel-size", "2"], capture_output=True, text=True, cwd=REPO,
                          env=dict(os.environ, PYTHONPATH=REPO), timeout=300)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr[-2000:]
    assert proc.stderr.startswith("error: --pipeline-model-parallel-size 2 does not divide")
