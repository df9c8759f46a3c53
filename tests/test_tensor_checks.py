"""Every checkpoint vime reads is held against its config before anything loads: the policy's HF
checkpoint with its MTP layers (for the engine, the trainer, the converters and generate alike) and
a torch_dist checkpoint (for --load and torch_dist_to_hf). A missing, extra or mis-shaped tensor is
one line naming the config key that disagrees; the unchanged checkpoint is each case's control."""
import json
import os
import shutil

import pytest

from checkpoint_convert import hf_to_torch_dist, torch_dist_to_hf
from rollout import generate
from tests.bad_input_helpers import refused
from tests.test_bad_inputs import args_for, fake_checkpoint
from tests.test_bad_inputs_tools import refusal
from train_rl import prepare
from vime.cli_config import load_config
from vime.config import REPO_ROOT
from vime.errors import UserError
from vime.models.hf_format import inspect_hf_checkpoint

GLM = os.path.join(REPO_ROOT, "checkpoints", "tiny-glm4-moe-mtp")  # 8 routed + 1 shared expert, 64 wide
DEEPSEEK = os.path.join(REPO_ROOT, "checkpoints", "tiny-deepseek-v3-mtp")
MIMO = os.path.join(REPO_ROOT, "checkpoints", "tiny-mimo-mtp")


def edited(src, dst, **changes):
    """A copy of checkpoint `src` whose config.json has `changes`; nested keys as "rope_parameters.x"."""
    shutil.copytree(src, dst)
    path = os.path.join(dst, "config.json")
    cfg = json.load(open(path))
    cfg.update(changes)
    json.dump(cfg, open(path, "w"))
    return str(dst)


@pytest.mark.parametrize("src", [GLM, DEEPSEEK, MIMO])
def test_the_shipped_checkpoints_hold_exactly_what_their_configs_imply(src):
    inspect_hf_checkpoint(src)  # the control of every case below


@pytest.mark.parametrize("src, changes, needles", [
    # the shared experts the file holds, which the config says are not there
    (GLM, {"n_shared_experts": 0}, ["the config does not describe (first: model.layers.1.mlp.shared_experts.",
                                    "check n_shared_experts"]),
    (GLM, {"n_routed_experts": 4, "n_group": 1, "topk_group": 1},
     ["the config does not describe (first: model.layers.1.mlp.experts.4.", "check n_routed_experts",
      "model.layers.1.mlp.gate.weight has shape [8, 128] but the config (n_routed_experts, hidden_size) gives [4, 128]"]),
    (GLM, {"n_routed_experts": 16}, ["are missing (first: model.layers.1.mlp.experts.8.gate_proj.weight, implied by "
                                     "n_routed_experts, moe_intermediate_size, hidden_size)"]),
    (GLM, {"moe_intermediate_size": 32}, ["gives [32, 128]", "(n_routed_experts, moe_intermediate_size, hidden_size)"]),
    (GLM, {"first_k_dense_replace": 2}, ["check first_k_dense_replace"]),
    (DEEPSEEK, {"kv_lora_rank": 32}, ["kv_a_proj_with_mqa.weight has shape", "(kv_lora_rank, qk_rope_head_dim, "
                                                                              "hidden_size)"]),
    (MIMO, {"tie_word_embeddings": True}, ["the config does not describe (first: lm_head.weight; check "
                                           "tie_word_embeddings)"]),
    (MIMO, {"intermediate_size": 96}, ["(intermediate_size, hidden_size) gives [96, "]),
], ids=["glm-no-shared", "glm-fewer-experts", "glm-more-experts", "glm-expert-width", "glm-dense-layers",
        "deepseek-latent", "mimo-tied-head", "mimo-mlp-width"])
def test_a_config_that_disagrees_with_its_tensors_is_refused_before_any_actor_naming_the_key(
        tmp_path, src, changes, needles):
    bad = edited(src, tmp_path / "bad", **changes)
    refused(args_for(bad, tmp_path), f"{bad}/model.safetensors disagrees with config.json: ", *needles,
            "fix config.json or re-convert the weights")


def test_generate_and_the_converter_refuse_the_same_checkpoint_with_the_same_line(tmp_path, capsys):
    bad = edited(GLM, tmp_path / "bad", n_shared_experts=0)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "1+2="}\n')
    lines = [refusal(capsys, generate.main, ["--hf-checkpoint", bad, "--prompts", str(prompts),
                                             "--output", str(tmp_path / "o.jsonl")]),
             refusal(capsys, hf_to_torch_dist.main, ["--hf-checkpoint", bad, "--save", str(tmp_path / "td"),
                                                     "--mtp-num-layers", "1"])]
    assert lines[0] == lines[1] and "check n_shared_experts" in lines[0], lines


@pytest.fixture(scope="module")
def glm_torch_dist(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("glm_td") / "td")
    hf_to_torch_dist.main(["--hf-checkpoint", GLM, "--save", out, "--mtp-num-layers", "1"])
    return out


@pytest.mark.parametrize("changes, needles", [
    ({"n_routed_experts": 16}, ["implied by n_routed_experts", "mlp.gate.weight has shape [8, 128] but the config "
                                "(n_routed_experts, hidden_size) gives [16, 128]"]),
    ({"n_shared_experts": 0}, ["check n_shared_experts"]),
    ({"moe_intermediate_size": 32}, ["(n_routed_experts, moe_intermediate_size, hidden_size) gives [32, 128]"]),
], ids=["experts", "shared-experts", "expert-width"])
def test_torch_dist_to_hf_refuses_an_origin_of_the_same_family_with_other_shapes(glm_torch_dist, tmp_path, capsys,
                                                                                 changes, needles):
    origin = edited(GLM, tmp_path / "origin", **changes)
    line = refusal(capsys, torch_dist_to_hf.main, ["--input-dir", glm_torch_dist, "--output-dir",
                                                   str(tmp_path / "hf"), "--origin-hf-dir", origin])
    assert line.startswith(f"error: --origin-hf-dir {origin}: its config.json disagrees with the tensors of "
                           f"--input-dir {glm_torch_dist}: "), line
    assert all(n in line for n in needles) and line.endswith("give the HF directory it was converted from"), line


def test_torch_dist_to_hf_converts_with_the_directory_it_was_converted_from(glm_torch_dist, tmp_path):
    torch_dist_to_hf.main(["--input-dir", glm_torch_dist, "--output-dir", str(tmp_path / "ok"),
                           "--origin-hf-dir", GLM])  # the control, and the refusals' advice as written
    assert inspect_hf_checkpoint(str(tmp_path / "ok")).moe.n_routed_experts == 8


def test_load_of_a_checkpoint_of_another_expert_count_is_refused_naming_the_key(tmp_path):
    import dataclasses

    from vime.models.hf_format import read_config

    saved = dataclasses.asdict(read_config(GLM))
    root = str(tmp_path / "ck")  # as a run with a 16-expert --hf-checkpoint would have saved it
    model = fake_checkpoint(root, mtp_trained=False, model_config=dict(saved, moe=dict(saved["moe"], n_routed_experts=16)))
    with pytest.raises(UserError) as err:
        prepare(load_config(args_for(GLM, tmp_path, "--load", root, "--num-rollout", 4)))
    message = str(err.value)
    assert message.startswith(f"--load {os.path.dirname(model)}: its tensors disagree with --hf-checkpoint {GLM}'s "
                              "config.json: "), message
    assert "check n_routed_experts" in message and "resume with the --hf-checkpoint the run started from" in message
    control = str(tmp_path / "control")
    fake_checkpoint(control, mtp_trained=False, model_config=saved)
    prepare(load_config(args_for(GLM, tmp_path, "--load", control, "--num-rollout", 4))).release()
