"""A real language model end to end (CI's end-to-end command, `python -m pytest -m e2e`): SmolLM2-135M-Instruct
built from the package registry by scripts/get_smollm2.py, then on chat prompts through its own template:

- the embedded engine's greedy output equals transformers' token for token, a divergence accepted only where
  transformers' top-two logits are within the derived near-tie bound (tests/llama_fixtures.py);
- greedy speculative decoding equals plain decoding token for token, with log-probs within the fp32 bound;
- the trainer (megatron-core) and the rollout agree on the responses' log-probs within the fp32 bound.

Building the model takes about a minute (the registry, then 20-50 s of dequantising); a second run finds it.
"""
import os
import subprocess
import sys

import pytest
import torch

from fp32_bounds import max_abs_logit, max_logprob_diff, model_logprob_bound
from llama_fixtures import assert_greedy_equal_up_to_a_near_tie, assert_trainer_agrees_with_rollout, hf_greedy

pytestmark = pytest.mark.e2e
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHECKPOINT = os.path.join(REPO, "checkpoints", "smollm2-135m-instruct")
QUESTIONS = ("What is 23 + 48?", "What is 7 + 5? Put the final answer in \\boxed{}.", "Name a primary color.")
MAX_NEW = 24


@pytest.fixture(scope="module")
def checkpoint():
    proc = subprocess.run([sys.executable, os.path.join("scripts", "get_smollm2.py")], cwd=REPO, capture_output=True,
                          text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return CHECKPOINT


@pytest.fixture(scope="module")
def chat_prompts(checkpoint):
    from rollout.tokenizer import TextCodec

    codec = TextCodec(checkpoint)
    return [codec.chat_prompt_ids([{"role": "user", "content": q}]) for q in QUESTIONS]


@pytest.fixture(scope="module")
def plain(checkpoint, chat_prompts):
    """(engine config, the embedded engine's greedy samples) without speculation."""
    from rollout.embedded.engine import EngineConfig
    from rollout.embedded.engine_builder import build_engine
    from rollout.sampling_params import SamplingParams
    from vime.sample import samples_for_prompts

    engine = build_engine(checkpoint, None, EngineConfig(max_batch_size=4, max_len=128))
    return engine.cfg, engine.generate(samples_for_prompts(chat_prompts),
                                       SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW))


def test_the_checkpoint_is_smollm2_as_the_registry_ships_it(checkpoint):
    from vime.models.hf_format import read_config

    cfg = read_config(checkpoint)
    assert (cfg.family, cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
            cfg.vocab_size, cfg.tie_word_embeddings) == ("llama", 30, 576, 9, 3, 49152, True)


def test_the_embedded_engine_greedy_equals_transformers_on_chat_prompts(checkpoint, plain):
    from transformers import AutoModelForCausalLM

    cfg, samples = plain
    hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    for s in samples:
        assert s.response_ids, "the engine generated nothing"
        assert_greedy_equal_up_to_a_near_tie(hf, cfg, s.prompt_ids, s.response_ids,
                                             hf_greedy(hf, s.prompt_ids, MAX_NEW, eos=cfg.eos_token_id))


@pytest.mark.parametrize("spec", [{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                                   "prompt_lookup_max": 3}], ids=["ngram"])
def test_greedy_speculative_decoding_equals_plain_decoding(checkpoint, chat_prompts, plain, spec):
    from rollout.embedded.engine import EngineConfig
    from rollout.embedded.engine_builder import build_engine
    from rollout.sampling_params import SamplingParams
    from rollout.spec_stats import aggregate_spec_stats
    from vime.sample import samples_for_prompts

    _, want = plain
    got = build_engine(checkpoint, spec, EngineConfig(max_batch_size=4, max_len=128)).generate(
        samples_for_prompts(chat_prompts), SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW))
    assert [s.response_ids for s in got] == [s.response_ids for s in want]
    context = max(len(s.prompt_ids) + len(s.response_ids) for s in want)
    from vime.models.hf_format import read_config

    assert max_logprob_diff(got, want) <= model_logprob_bound(read_config(checkpoint), context,
                                                              max_abs_logit(checkpoint, want))
    assert aggregate_spec_stats(got)["spec_draft_tokens"] > 0  # it really drafted


def test_trainer_and_rollout_logprobs_agree_within_the_fp32_bound(checkpoint, chat_prompts):
    from rollout.embedded.engine import EngineConfig
    from rollout.embedded.engine_builder import build_engine
    from rollout.sampling_params import SamplingParams
    from vime.sample import samples_for_prompts

    samples = build_engine(checkpoint, None, EngineConfig(max_batch_size=6, max_len=128)).generate(
        samples_for_prompts(chat_prompts, n=2), SamplingParams(temperature=1.0, max_new_tokens=16, seed=1))
    assert_trainer_agrees_with_rollout(checkpoint, samples)


def test_two_rl_steps_of_the_recipe_add_fresh_mtp_layers_train_them_and_sync_them(checkpoint, tmp_path):
    """The recipe (configs/experiment/smollm2_math.yaml), shrunk to two steps of 8 responses: SmolLM2 gets one
    fresh MTP layer, warmed up on its own answers, which then drafts (some drafts accepted), trains online and
    reaches the engine with the trunk after every step (the guard's checksums agree)."""
    import json

    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "train_rl.py", "experiment=smollm2_math", "--hf-checkpoint", checkpoint,
                           "--num-rollout", "2", "--rollout-batch-size", "4", "--n-samples-per-prompt", "2",
                           "--global-batch-size", "8", "--rollout-max-response-len", "16", "--mtp-warmup-steps", "20",
                           "--output-dir", str(out), "--use-wandb", "false", "--progress", "false"],
                          cwd=REPO, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "has no MTP layers: adding 1 fresh one(s)" in proc.stdout
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["rollout/step"] for r in rows] == [0, 1]
    assert all(r["rollout/num_samples"] == 8 and 0 <= r["rollout/reward"] <= 1 for r in rows)
    assert sum(r["rollout/spec_accepted_tokens"] for r in rows) > 0
    assert all(r["weight_sync/worker_draft_checksum"] == r["weight_sync/draft_checksum"] for r in rows)
