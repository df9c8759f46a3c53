"""Bad inputs to train_rl.py found before any actor starts: one-line UserError naming the flag or file.

Checked in-process through `train_rl.prepare` (exactly what main runs before `ray.init`);
test_train_rl.py proves in a subprocess that such an error is `error: ...`, exit code 2.
"""
import json
import os
import pickle
import shutil

import pytest
from safetensors.torch import load_file, save_file

from rollout.task import make_prompts, write_jsonl
from rollout.tiny_model import make_random_checkpoint
from tests.conftest import SMALL
from train_rl import prepare
from vime.cli_config import load_config
from vime.errors import UserError
from tests.bad_input_helpers import refused  # noqa: F401  (re-exported to the other bad-input tests)

SPEC = '{"method":"mtp","num_speculative_tokens":2}'


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("bad_inputs_ckpt"))
    make_random_checkpoint(path, seed=5, std=0.3, **SMALL)
    write_jsonl(make_prompts(8, seed=1), os.path.join(path, "train.jsonl"))
    return path


def args_for(ckpt, out, *extra):
    return ["--hf-checkpoint", ckpt, "--num-rollout", "2", "--rollout-batch-size", "4", "--n-samples-per-prompt", "4",
            "--global-batch-size", "16", "--micro-batch-size", "8", "--output-dir", str(out),
            "--vllm-speculative-config", SPEC, *map(str, extra)]


def copy_ckpt(ckpt, tmp_path, name="copy"):
    dst = str(tmp_path / name)
    shutil.copytree(ckpt, dst)
    return dst


def test_the_fixture_passes_preflight(ckpt, tmp_path):
    prepare(load_config(args_for(ckpt, tmp_path)))  # the negative control of every case below


@pytest.mark.parametrize("extra, needles", [
    (["--rollout-temperature", 0], ["--rollout-temperature 0", "> 0"]),
    (["--rollout-temperature", -1], ["--rollout-temperature -1"]),
    (["--rollout-top-p", 0.5], ["--rollout-top-p 0.5", "full softmax"]),
    (["--rollout-top-p", 1.5], ["--rollout-top-p 1.5"]),
    (["--rollout-top-k", 5], ["--rollout-top-k 5", "full softmax"]),
    (["--lr", -1], ["--lr -1", ">= 0"]),
    (["--draft-lr", -1], ["--draft-lr -1", ">= 0"]),
    (["--draft-lr-warmup-iters", -1], ["--draft-lr-warmup-iters -1", ">= 0"]),
    (["--kl-loss-type", "k9"], ["--kl-loss-type 'k9'", "k1", "k3"]),
    (["--advantage-estimator", "ppo"], ["--advantage-estimator ppo", "critic", "grpo"]),
    (["--vllm-speculative-config", '{"method":"mtp","num_speculative_tokens":1000}'], ["num_speculative_tokens 1000"]),
    (["--vllm-weight-transfer", "shm"], ["--vllm-weight-transfer 'shm'", "reload", "nccl"]),
    (["--vllm-weight-transfer", "nccl"], ["--vllm-weight-transfer nccl", "--rollout-backend vllm"]),
    (["--expert-model-parallel-size", 2, "--data-parallel-size", 2],
     ["--expert-model-parallel-size 2", "dense model", "no routed experts", "drop the flag"]),
    (["--expert-tensor-parallel-size", 2, "--data-parallel-size", 2],
     ["--expert-tensor-parallel-size 2", "dense model", "drop the flag"]),
])
def test_flags_refused(ckpt, tmp_path, extra, needles):
    refused(args_for(ckpt, tmp_path, *extra), *needles)


@pytest.mark.parametrize("text", ["一加二等于", "12+3=🙂", "ABC+1="])
def test_prompt_characters_outside_the_vocabulary_are_an_error_not_pad(ckpt, tmp_path, text):
    data = str(tmp_path / "p.jsonl")
    write_jsonl([{"prompt": "1+2=", "label": "3"}, {"prompt": text, "label": "3"}], data)
    refused(args_for(ckpt, tmp_path, "--prompt-data", data), data, "line 2", "not in the model's vocabulary")


def test_a_prompt_row_without_a_label_is_an_error(ckpt, tmp_path):
    data = str(tmp_path / "p.jsonl")
    write_jsonl([{"prompt": "1+2=", "label": "3"}, {"prompt": "1+3="}], data)
    refused(args_for(ckpt, tmp_path, "--prompt-data", data), data, "line 2 has no label 'label'", "--label-key")


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_weights_with_nan_or_inf_are_an_error_naming_the_file(ckpt, tmp_path, value):
    broken = copy_ckpt(ckpt, tmp_path)
    weights = os.path.join(broken, "model.safetensors")
    state = load_file(weights)
    state["model.layers.0.mlp.up_proj.weight"][3, 5] = value
    save_file(state, weights)
    refused(args_for(broken, tmp_path), weights, "model.layers.0.mlp.up_proj.weight", "NaN or inf")


@pytest.mark.parametrize("edit, needles", [
    ({"hidden_size": "128"}, ["'hidden_size' must be an integer", "'128'"]),
    ({"num_hidden_layers": -1}, ["'num_hidden_layers' must be an integer >= 1", "-1"]),
    ({"num_attention_heads": 0}, ["'num_attention_heads'"]),
    ({"rms_norm_eps": "tiny"}, ["'rms_norm_eps' must be a number"]),
    ({"num_nextn_predict_layers": 0}, ["holds 1 MTP layers", "num_nextn_predict_layers=0"]),
])
def test_bad_config_json_values_name_the_file_and_key(ckpt, tmp_path, edit, needles):
    broken = copy_ckpt(ckpt, tmp_path)
    cfg_file = os.path.join(broken, "config.json")
    raw = json.load(open(cfg_file))
    raw.update(edit)
    json.dump(raw, open(cfg_file, "w"))
    refused(args_for(broken, tmp_path, "--vllm-speculative-config", "none"), broken, *needles)


def test_training_fewer_mtp_layers_than_the_checkpoint_drafts_with_is_refused(tmp_path):
    two = str(tmp_path / "two_mtp")
    make_random_checkpoint(two, seed=5, num_nextn_predict_layers=2, **SMALL)
    write_jsonl(make_prompts(8, seed=1), os.path.join(two, "train.jsonl"))
    prepare(load_config(args_for(two, tmp_path, "--enable-mtp-training", "--mtp-num-layers", 2)))  # control
    refused(args_for(two, tmp_path, "--enable-mtp-training", "--mtp-num-layers", 1),
            "--mtp-num-layers 1", "has 2 MTP layers", "--mtp-num-layers 2")


def test_save_and_output_dir_must_be_writable(ckpt, tmp_path):
    # /proc refuses new files even for root, unlike a chmod-ed directory
    refused(args_for(ckpt, tmp_path, "--save", "/proc/vime_ckpts"), "--save /proc/vime_ckpts", "cannot write")
    refused(args_for(ckpt, "/proc/vime_out"), "--output-dir /proc/vime_out", "cannot write")
    if os.geteuid() != 0:
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o555)
        refused(args_for(ckpt, tmp_path, "--save", ro / "ck"), "--save", "cannot write")


def test_unknown_hydra_key_suggests_the_closest():
    with pytest.raises(UserError) as err:
        load_config(["rollout.rollout_temprature=0.5"])
    assert "rollout.rollout_temperature" in str(err.value) and "\n" not in str(err.value)


# ---- --load of a checkpoint directory --------------------------------------------------------------
def fake_checkpoint(root, step=2, mtp_trained=True, latest=True, model_config=None):
    """A --load layout whose .metadata indexes one .distcp file, with its manifest (as a save leaves it)."""
    from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    from vime.manifest import write_manifest

    model = os.path.join(root, f"iter_{step:07d}", "model")
    os.makedirs(model)
    open(os.path.join(model, "__0_0.distcp"), "wb").write(b"x" * 100)
    meta = Metadata(state_dict_metadata={}, storage_data={MetadataIndex("w"): _StorageInfo("__0_0.distcp", 0, 100)})
    pickle.dump(meta, open(os.path.join(model, ".metadata"), "wb"))
    meta = {"mtp_num_layers": 1, "mtp_trained": mtp_trained, "has_optimizer": True}
    json.dump(dict(meta, model_config=model_config) if model_config else meta,
              open(os.path.join(model, "vime_meta.json"), "w"))
    json.dump({"step": step, "data_cursor": 0}, open(os.path.join(model, "..", "loop_state.json"), "w"))
    write_manifest(os.path.dirname(model))
    if latest:
        open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w").write(json.dumps({"step": step}))
    return model


def test_a_complete_checkpoint_passes(ckpt, tmp_path):
    fake_checkpoint(str(tmp_path / "ck"))
    prepare(load_config(args_for(ckpt, tmp_path, "--load", tmp_path / "ck", "--num-rollout", 4,
                                   "--enable-mtp-training", "--mtp-num-layers", 1)))


def _missing_iter(root, model):
    shutil.rmtree(os.path.dirname(model))


def _truncated(root, model):
    with open(os.path.join(model, "__0_0.distcp"), "r+b") as f:
        f.truncate(40)


def _no_metadata(root, model):
    os.remove(os.path.join(model, ".metadata"))


def _pickled_loop_state(root, model):
    open(os.path.join(model, "..", "loop_state.json"), "wb").write(pickle.dumps({"step": 2}))


def _no_manifest(root, model):
    os.remove(os.path.join(model, "..", "manifest.json"))


@pytest.mark.parametrize("damage, needle", [
    (_pickled_loop_state, "loop_state.json has 2"),
    (_missing_iter, "iter_0000002 (its directory is missing)"),
    (_truncated, "model/__0_0.distcp has 40 bytes, the manifest says 100"),
    (_no_metadata, "model/.metadata is missing"),
    (_no_manifest, "manifest.json is missing"),
])
def test_a_broken_load_checkpoint_is_refused(ckpt, tmp_path, damage, needle):
    root = str(tmp_path / "ck")
    damage(root, fake_checkpoint(root))
    refused(args_for(ckpt, tmp_path, "--load", root, "--num-rollout", 4, "--enable-mtp-training",
                     "--mtp-num-layers", 1), f"--load {root}: no valid checkpoint there", needle,
            "run without --load")


def test_load_at_or_past_num_rollout_is_refused(ckpt, tmp_path):
    root = str(tmp_path / "ck")
    fake_checkpoint(root, step=4)
    refused(args_for(ckpt, tmp_path, "--load", root, "--num-rollout", 2, "--enable-mtp-training",
                     "--mtp-num-layers", 1), "step 4", "--num-rollout 2")


def test_resuming_an_mtp_trained_checkpoint_without_the_mtp_flags_is_refused(ckpt, tmp_path):
    root = str(tmp_path / "ck")
    fake_checkpoint(root, mtp_trained=True)
    refused(args_for(ckpt, tmp_path, "--load", root, "--num-rollout", 4), "--enable-mtp-training --mtp-num-layers 1")


def test_mtp_layers_asked_of_a_checkpoint_without_any_are_refused_saying_what_to_do_instead(tmp_path):
    import re

    no_mtp = str(tmp_path / "no_mtp")
    make_random_checkpoint(no_mtp, seed=5, num_nextn_predict_layers=0, **SMALL)
    write_jsonl(make_prompts(8, seed=1), os.path.join(no_mtp, "train.jsonl"))
    message = refused(args_for(no_mtp, tmp_path, "--mtp-num-layers", 1), "--mtp-num-layers 1: ",
                      "has no MTP layers to load; add fresh ones with --enable-mtp-training",
                      "or drop --mtp-num-layers")
    other = re.search(r"--vllm-speculative-config '([^']+)'", message).group(1)
    prepare(load_config(args_for(no_mtp, tmp_path, "--vllm-speculative-config", other))).release()  # as advised
