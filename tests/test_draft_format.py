"""The external-draft format, for every external kind (each kind's shipped draft for the shipped Qwen2
target, `checkpoints/tiny-qwen2-<kind>`): a draft whose model.safetensors disagrees with its config.json
(a tensor missing, one too many, one of another shape) is refused before anything loads, in one line
that names the tensor and the config key behind it (train_rl.py: `error: ...`, exit 2, before any actor
starts; the engine, the trainer and the export likewise); what is saved loads back unchanged."""
import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from draft_kind_fixtures import edited_draft
from tests.bad_input_helpers import refused
from train_rl import prepare
from vime.cli_config import load_config
from vime.errors import UserError
from vime.models.draft_kinds import EXTERNAL_KINDS
from vime.models.hf_format import read_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGET = os.path.join(REPO, "checkpoints", "tiny-qwen2")
BACKENDS = ("embedded", "vllm")  # both run the same checks of an external draft before any actor starts


def shipped(kind):
    return os.path.join(REPO, "checkpoints", f"tiny-qwen2-{kind.name}")


def spec_of(kind, draft):
    k = kind.read_config(shipped(kind)).num_drafts if kind.block else 3
    return {"method": kind.name, "model": str(draft), "num_speculative_tokens": k}


def args_for(out, kind, draft, backend="embedded", target=TARGET):
    return ["--hf-checkpoint", target, "--num-rollout", "2", "--output-dir", str(out), "--rollout-backend", backend,
            "--vllm-speculative-config", json.dumps(spec_of(kind, draft))]


def a_layer_tensor(state):
    """The name of one decoder-layer MLP tensor of a draft's state."""
    return next(n for n in sorted(state) if n.endswith("mlp.up_proj.weight"))


@pytest.fixture(params=EXTERNAL_KINDS, ids=lambda k: k.name)
def kind(request):
    return request.param


def test_the_shipped_drafts_hold_exactly_what_their_config_describes(kind):
    cfg = kind.read_config(shipped(kind))
    kind.check_directory(shipped(kind), read_config(TARGET), spec_of(kind, "")["num_speculative_tokens"])
    _, state = kind.load(shipped(kind))
    assert state and all(t.dtype == torch.float32 for t in state.values())
    assert cfg.hidden_size == read_config(TARGET).hidden_size


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_directory_that_is_not_a_draft_of_the_kind_is_refused_on_both_backends(tmp_path, kind, backend):
    refused(args_for(tmp_path, kind, TARGET, backend), TARGET, f"{kind.title} draft", "make one with",
            kind.format.make)
    nowhere = tmp_path / "nowhere"
    refused(args_for(tmp_path, kind, nowhere, backend), str(nowhere), "no such directory")
    draft = edited_draft(tmp_path, kind)
    (draft / "model.safetensors").unlink()
    refused(args_for(tmp_path, kind, draft, backend), str(draft), "model.safetensors is missing")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("key, value, needle", [("hidden_size", 256, "hidden size 256"), ("vocab_size", 64, "vocab_size 64")])
def test_a_draft_of_another_width_or_vocabulary_than_the_target_is_refused(tmp_path, kind, key, value, needle, backend):
    both = {"hidden_size": ("hidden_size", "target_hidden_size"), "vocab_size": ("vocab_size", "draft_vocab_size")}
    draft = edited_draft(tmp_path, kind, config=lambda raw: raw.update({k: value for k in both[key]}))
    refused(args_for(tmp_path, kind, draft, backend), str(draft), needle, str(getattr(read_config(TARGET), key)))


@pytest.mark.parametrize("family", ["mimo", "glm4_moe", "deepseek_v3"])
def test_only_the_vllm_backend_refuses_a_target_whose_vllm_model_returns_no_aux_hidden_states(tmp_path, kind, family):
    """vLLM 0.32's MiMo, GLM-4.5 and DeepSeek-V3 models return no aux hidden states: one line on the vLLM
    backend; the embedded engine computes them for every family (the shipped draft fits the MiMo model)."""
    target = os.path.join(REPO, "checkpoints", f"tiny-{family.replace('_', '-')}-mtp")
    refused(args_for(tmp_path, kind, shipped(kind), "vllm", target), f"method '{kind.name}'",
            f"({family}) does not", "qwen2 (Qwen2ForCausalLM)", "--rollout-backend embedded")
    if family == "mimo":
        prepare(load_config(args_for(tmp_path, kind, shipped(kind), "embedded", target)))


def test_a_missing_layer_tensor_is_named_with_the_keys_that_imply_it(tmp_path, kind):
    missing = a_layer_tensor(load_file(os.path.join(shipped(kind), "model.safetensors")))
    draft = edited_draft(tmp_path, kind, tensors=lambda state: state.pop(missing))
    refused(args_for(tmp_path, kind, draft), str(draft), f"first: {missing}", "intermediate_size", "are missing")


def test_a_mis_shaped_tensor_is_named_with_the_key_that_disagrees(tmp_path, kind):
    cfg = kind.read_config(shipped(kind))
    draft = edited_draft(tmp_path, kind, config=lambda raw: raw.update(intermediate_size=cfg.intermediate_size + 8))
    refused(args_for(tmp_path, kind, draft), str(draft), "has shape", "intermediate_size",
            str(cfg.intermediate_size + 8))


def test_a_tensor_the_config_does_not_describe_is_refused(tmp_path, kind):
    draft = edited_draft(tmp_path, kind, tensors=lambda state: state.update({"stray.weight": torch.zeros(2)}))
    refused(args_for(tmp_path, kind, draft), str(draft), "the config does not describe", "stray.weight")


def test_a_draft_saved_loads_back_unchanged_and_one_that_disagrees_with_its_config_is_not_written(tmp_path, kind):
    cfg, state = kind.load(shipped(kind))
    kind.save(str(tmp_path / "copy"), cfg, state)
    again_cfg, again = kind.load(str(tmp_path / "copy"))
    assert again_cfg == cfg and again.keys() == state.keys() and all(torch.equal(again[n], state[n]) for n in state)
    broken = dict(state)
    broken.pop(a_layer_tensor(state))
    with pytest.raises(UserError, match="are missing"):
        kind.save(str(tmp_path / "broken"), cfg, broken)
    assert not (tmp_path / "broken").exists()


def test_train_rl_refuses_a_dflash_draft_with_more_layers_than_weights_in_one_line_exit_2(tmp_path):
    """num_hidden_layers 2 over one layer of weights: what loading would find only after minutes."""
    dflash = next(k for k in EXTERNAL_KINDS if k.name == "dflash")
    draft = edited_draft(tmp_path, dflash, config=lambda raw: raw.update(num_hidden_layers=2))
    proc = subprocess.run([sys.executable, "train_rl.py", *args_for(tmp_path, dflash, draft)], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "layers.1." in errors[0] and "implied by num_hidden_layers" in errors[0], errors[0]


def test_the_engine_and_the_trainer_refuse_a_misfit_draft_before_loading_it(tmp_path, kind):
    from rollout.embedded.engine_builder import build_engine
    from trainer.drafts import DRAFT_TRAINERS

    missing = a_layer_tensor(load_file(os.path.join(shipped(kind), "model.safetensors")))
    draft = edited_draft(tmp_path, kind, tensors=lambda state: state.pop(missing))
    spec = spec_of(kind, draft)
    with pytest.raises(UserError, match=f"first: {missing}"):
        build_engine(TARGET, spec)
    from trainer.config import TrainerConfig
    from vime.spec_config import parse_spec_config

    cfg = TrainerConfig(enable_draft_training=True, speculative_config=parse_spec_config(spec))
    with pytest.raises(UserError, match=f"first: {missing}"):
        DRAFT_TRAINERS[kind.name](cfg, None, read_config(TARGET))  # refused before it touches the policy
