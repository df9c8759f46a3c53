"""Fresh MTP layers for a model without any (a Llama): drawn as megatron-core draws them, warmed up on the
model's own responses, drafting with greedy output unchanged, added by train_rl.py itself, refused on vLLM.

References: megatron-core's own initialisation of an MTP block (per-tensor sample statistics against the
distribution vime draws from, with bounds from the sampling distribution of a normal sample's mean and
standard deviation), plain decoding (greedy speculative output), an unwarmed draft (negative control of the
warm-up's acceptance).
"""
import importlib.util
import math
import os

import pytest
import torch

from llama_fixtures import make_llama
from mtp.fresh_layers import fresh_mtp_state, init_std, with_mtp_layers
from rollout.embedded.engine import EngineConfig
from rollout.embedded.engine_builder import build_engine
from rollout.sampling_params import SamplingParams
from rollout.spec_stats import aggregate_spec_stats
from rollout.task import make_prompts, write_jsonl
from rollout.tokenizer import TextCodec
from vime.models.hf_format import expected_hf_tensors, read_config
from vime.sample import samples_for_prompts

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
spec = importlib.util.spec_from_file_location("make_mtp_draft", os.path.join(ROOT, "scripts", "make_mtp_draft.py"))
make_mtp_draft = importlib.util.module_from_spec(spec)
spec.loader.exec_module(make_mtp_draft)
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=20)
MTP = {"method": "mtp", "num_speculative_tokens": 2}


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    """A small Llama (no MTP layers) with the tiny task's prompts as its train.jsonl."""
    path = tmp_path_factory.mktemp("fresh_llama")
    make_llama(path, seed=3, std=0.3, num_hidden_layers=3)
    write_jsonl(make_prompts(64, seed=1), os.path.join(path, "train.jsonl"))
    return str(path)


def drafted(target, out, warmup_steps):
    make_mtp_draft.make(make_mtp_draft.parse_args(
        ["--target", target, "--out", out, "--warmup-steps", str(warmup_steps), "--warmup-samples", "128",
         "--max-new-tokens", "20", "--batch-size", "16", "--lr", "3e-3"]), log=lambda line: None)
    return out


@pytest.fixture(scope="module")
def warmed(llama_dir, tmp_path_factory):
    return drafted(llama_dir, str(tmp_path_factory.mktemp("warm") / "ckpt"), warmup_steps=30)


def test_fresh_layers_are_drawn_as_megatron_core_draws_an_mtp_block(llama_dir):
    """megatron-core builds the model with one MTP layer; each of its MTP tensors' sample mean and std match the
    distribution vime draws that tensor from (5 sigma of the sample statistics), norms are ones, and vime's own
    draw passes the same test."""
    from trainer.distributed import ensure_distributed
    from trainer.model import build_model
    from vime.models.megatron_names import megatron_to_hf

    cfg = read_config(llama_dir)
    ensure_distributed()
    model = build_model(cfg, mtp_num_layers=1, seed=5)
    megatron = dict(pair for name, p in model.named_parameters() if name.startswith("mtp.")
                    for pair in megatron_to_hf(name, p.detach(), with_mtp_layers(cfg, 1)))
    shapes = {n: e.shape for n, e in expected_hf_tensors(with_mtp_layers(cfg, 1)).items()}
    ours = fresh_mtp_state(cfg, 1, shapes, seed=0)
    assert set(megatron) == set(ours) and len(ours) > 10
    for name, tensor in list(megatron.items()) + list(ours.items()):
        std = init_std(name.split(".", 3)[3], cfg.num_hidden_layers)
        if std is None:
            assert torch.equal(tensor, torch.ones_like(tensor)), name
            continue
        n = tensor.numel()
        assert abs(tensor.mean().item()) <= 5 * std / math.sqrt(n), name
        assert abs(tensor.std().item() / std - 1) <= 5 / math.sqrt(2 * (n - 1)), name


def test_greedy_decoding_with_fresh_warmed_up_mtp_layers_equals_plain_decoding(llama_dir, warmed):
    codec = TextCodec(llama_dir)
    prompts = [codec.encode_prompt(r["prompt"], 1) for r in make_prompts(8, seed=9)]
    plain = build_engine(llama_dir, None, EngineConfig(max_batch_size=8)).generate(samples_for_prompts(prompts), GREEDY)
    spec = build_engine(warmed, MTP, EngineConfig(max_batch_size=8)).generate(samples_for_prompts(prompts), GREEDY)
    assert [s.response_ids for s in spec] == [s.response_ids for s in plain]
    assert aggregate_spec_stats(spec)["spec_accepted_tokens"] > 0


def test_the_warm_up_is_what_makes_the_fresh_layers_accepted(tmp_path):
    """Negative control: the same fresh layers without the warm-up are accepted less often, by a two-proportion
    z-test at z >= 3 (one-sided p < 0.0014) over the drafts of 48 sampled responses. The target is the shipped
    tiny Qwen2 (trained on the task, no MTP layers), whose responses carry something to learn; a random
    Llama's sampled responses are noise that no draft predicts."""
    target = os.path.join(ROOT, "checkpoints", "tiny-qwen2")
    codec = TextCodec(target)
    prompts = [codec.encode_prompt(r["prompt"], 1) for r in make_prompts(48, seed=10)]
    sampling = SamplingParams(temperature=1.0, max_new_tokens=20, seed=4)

    def accepted_and_drafted(path):
        samples = build_engine(path, MTP, EngineConfig(max_batch_size=48)).generate(samples_for_prompts(prompts),
                                                                                     sampling)
        stats = aggregate_spec_stats(samples)
        return stats["spec_accepted_tokens"], stats["spec_draft_tokens"]

    warm, cold = (drafted(target, str(tmp_path / name), steps) for name, steps in (("warm", 100), ("cold", 0)))
    (a1, n1), (a0, n0) = accepted_and_drafted(warm), accepted_and_drafted(cold)
    pooled = (a1 + a0) / (n1 + n0)
    z = (a1 / n1 - a0 / n0) / math.sqrt(pooled * (1 - pooled) * (1 / n1 + 1 / n0))
    assert z >= 3, (a1, n1, a0, n0, z)


def test_the_maker_keeps_the_trunk_and_refuses_a_checkpoint_that_has_mtp_layers(llama_dir, warmed, capsys):
    from safetensors.torch import load_file

    trunk, made = load_file(os.path.join(llama_dir, "model.safetensors")), load_file(os.path.join(warmed, "model.safetensors"))
    assert all(torch.equal(trunk[n], made[n]) for n in trunk)
    assert read_config(warmed).num_nextn_predict_layers == 1 and read_config(warmed).family == "llama"
    with pytest.raises(SystemExit) as exit_:
        make_mtp_draft.main(["--target", warmed, "--out", os.path.join(os.path.dirname(warmed), "again")])
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 2 and err.count("\n") == 0 and "already has 1 MTP layers" in err


def test_mtp_on_vllm_for_a_llama_is_refused_in_one_line(llama_dir, tmp_path):
    from bad_input_helpers import refused

    refused(["--hf-checkpoint", llama_dir, "--output-dir", str(tmp_path / "out"), "--rollout-backend", "vllm",
             "--enable-mtp-training", "--mtp-num-layers", "1"],
            "method 'mtp' on vLLM needs vLLM's MTP drafter", "LlamaForCausalLM", "--rollout-backend embedded")


@pytest.mark.slow  # a whole train_rl.py run (1-2 min on 2 cores)
def test_train_rl_adds_fresh_warmed_up_mtp_layers_and_trains_them(llama_dir, tmp_path):
    import json
    import subprocess
    import sys

    out = tmp_path / "run"
    env = dict(os.environ, WANDB_MODE="offline")
    proc = subprocess.run([sys.executable, "train_rl.py", "--hf-checkpoint", llama_dir, "--output-dir", str(out),
                           "--enable-mtp-training", "--mtp-num-layers", "1", "--mtp-warmup-steps", "30",
                           "--num-rollout", "2", "--rollout-batch-size", "4", "--n-samples-per-prompt", "2",
                           "--global-batch-size", "8", "--micro-batch-size", "8",
                           "--rollout-max-response-len", "12", "--progress", "false", "--use-wandb", "false"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = [line for line in proc.stdout.splitlines() if "has no MTP layers: adding 1 fresh one" in line]
    assert len(said) == 1 and "megatron-core" in said[0] and "30 steps" in said[0]
    rows = [json.loads(x) for x in open(out / "metrics.jsonl")]
    assert len(rows) == 2 and all(r["rollout/spec_draft_tokens"] > 0 for r in rows)
    assert all("train/mtp_loss" in r for r in rows)
