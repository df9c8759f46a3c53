"""The Llama family everywhere a family works, on checkpoints transformers itself made (tests/llama_fixtures.py):
tied and untied embeddings, a free head_dim, Llama 3's `rope_type: llama3` scaling.

References: transformers' LlamaForCausalLM (logits, greedy tokens: a divergence only at a near-tie whose bound
the fixture derives), the checkpoint's own bytes (HF -> torch_dist -> HF), the tensors the trainer sends (weight
sync), plain decoding (speculative decoding with each external draft kind). Bad configs: one line each.
"""
import dataclasses
import json
import os

import pytest
import torch
from safetensors.torch import load_file

from checkpoint_convert import hf_to_torch_dist, torch_dist_to_hf
from fp32_bounds import model_logprob_bound
from llama_fixtures import (LLAMA3_ROPE, assert_greedy_equal_up_to_a_near_tie, assert_trainer_agrees_with_rollout,
                            hf_greedy, make_llama)
from mtp.sampling import token_logprobs
from rollout.embedded.engine import EngineConfig
from rollout.embedded.engine_builder import build_engine
from rollout.sampling_params import SamplingParams
from trainer.config import TrainerConfig
from trainer.trainer import Trainer
from trainer_fixtures import make_batch
from vime.errors import UserError
from vime.models.hf_format import read_config
from vime.sample import samples_for_prompts

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=24)
# (tied embeddings, rope scaling): SmolLM2's shape (tied, plain RoPE) and Llama 3.1's (untied, llama3 scaling)
VARIANTS = {"tied": (True, None), "untied_llama3": (False, LLAMA3_ROPE)}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def llama(request, tmp_path_factory):
    """(checkpoint dir, transformers model) of each variant."""
    tie, rope = VARIANTS[request.param]
    path = tmp_path_factory.mktemp(f"llama_{request.param}")
    return str(path), make_llama(path, seed=1, tie=tie, rope=rope)


def prompts(n=6, seed=0, vocab=32):
    g = torch.Generator().manual_seed(seed)
    return [[1] + torch.randint(3, vocab, (3 + 2 * i,), generator=g).tolist() for i in range(n)]


def test_the_llama_config_reads_as_transformers_wrote_it(llama):
    path, hf = llama
    cfg = read_config(path)
    assert cfg.family == "llama" and not cfg.qkv_bias and not cfg.qk_norm
    assert cfg.head_dim == 24 != cfg.hidden_size // cfg.num_attention_heads
    assert cfg.tie_word_embeddings == hf.config.tie_word_embeddings
    assert (cfg.rope_llama3 is not None) == (hf.config.rope_parameters["rope_type"] == "llama3")


def test_embedded_engine_greedy_equals_transformers(llama):
    """The engine's fast path, cached and batched, against transformers' full forward, token for token."""
    path, hf = llama
    engine = build_engine(path, None, EngineConfig(max_batch_size=8))
    got = engine.generate(samples_for_prompts(prompts()), GREEDY)
    for s in got:
        assert_greedy_equal_up_to_a_near_tie(hf, engine.cfg, s.prompt_ids, s.response_ids,
                                             hf_greedy(hf, s.prompt_ids, GREEDY.max_new_tokens))


def test_llama3_scaling_changes_the_logits_and_the_engine_follows_it(tmp_path):
    """Negative control for the llama3 variant: the same weights read without the scaling give other logits,
    so the equality above holds because the engine scales the frequencies as transformers does."""
    from rollout.embedded.model import CausalLMWithMTP
    from vime.models.hf_format import load_hf_checkpoint

    hf = make_llama(tmp_path, seed=2, tie=False, rope=LLAMA3_ROPE)
    cfg, state, _ = load_hf_checkpoint(str(tmp_path))
    tokens = torch.tensor([prompts(1, seed=3)[0] * 6])
    positions = torch.arange(tokens.shape[1])[None]
    with torch.no_grad():
        want = hf(tokens).logits
        scaled, plain = CausalLMWithMTP(cfg).eval(), CausalLMWithMTP(dataclasses.replace(cfg, rope_llama3=None))
        for model in (scaled, plain):
            model.load_state_dict(state)
        bound = model_logprob_bound(cfg, tokens.shape[1], want.abs().max().item())
        assert (scaled.logits(scaled(tokens, positions)) - want).abs().max() <= bound
        assert (plain.eval().logits(plain(tokens, positions)) - want).abs().max() > 100 * bound


def test_trainer_logprobs_equal_transformers(llama):
    """megatron-core's GPTModel built for the Llama config (tied output layer, llama3 rope scaling with the
    config's own factors) against transformers."""
    path, hf = llama
    trainer = Trainer(TrainerConfig(temperature=0.7), path)
    batch = make_batch(vocab=32)
    got = trainer.compute_logprobs(batch)
    with torch.no_grad():
        logits = hf(batch.tokens).logits
    want = token_logprobs(logits[:, :-1], batch.tokens[:, 1:], 0.7)
    bound = model_logprob_bound(read_config(path), batch.tokens.shape[1], logits.abs().max().item()) / 0.7
    assert (got[:, 1:] - want).abs().max().item() <= bound


def test_trainer_and_embedded_rollout_logprobs_agree_within_the_fp32_bound(llama):
    """Log-probs of sampled responses: the embedded engine's (cached, batched) and the trainer's (one forward)."""
    path, _ = llama
    samples = build_engine(path, None, EngineConfig(max_batch_size=8)).generate(
        samples_for_prompts(prompts(4, seed=1), n=2), SamplingParams(temperature=1.0, max_new_tokens=12, seed=3))
    assert_trainer_agrees_with_rollout(path, samples)


def test_hf_to_torch_dist_to_hf_is_bit_identical_with_tied_embeddings_still_tied(llama, tmp_path):
    """And transformers reads the result as the same model (its config keeps the rope scaling and the tie)."""
    from transformers import LlamaForCausalLM

    hf_dir, hf = llama
    td, back = str(tmp_path / "td"), str(tmp_path / "back")
    hf_to_torch_dist.main(["--hf-checkpoint", hf_dir, "--save", td])
    torch_dist_to_hf.main(["--input-dir", td, "--output-dir", back, "--origin-hf-dir", hf_dir])
    original, converted = load_file(f"{hf_dir}/model.safetensors"), load_file(f"{back}/model.safetensors")
    assert set(original) == set(converted)
    assert all(torch.equal(original[n], converted[n]) for n in original)
    with open(f"{back}/config.json") as f:
        config = json.load(f)
    tied = hf.config.tie_word_embeddings
    assert config["tie_word_embeddings"] == tied and ("lm_head.weight" in converted) == (not tied)
    assert config["rope_parameters"]["rope_type"] == hf.config.rope_parameters["rope_type"]
    reread = LlamaForCausalLM.from_pretrained(back, dtype=torch.float32).eval()
    assert (reread.lm_head.weight is reread.model.embed_tokens.weight) == tied
    tokens = torch.tensor([prompts(1)[0]])
    with torch.no_grad():
        assert torch.equal(reread(tokens).logits, hf(tokens).logits)


def test_a_weight_push_from_the_trainer_is_what_the_engine_serves(llama):
    """The trainer's named HF weights (a tied model sends one embedding) through the bucket push into the
    embedded backend: its fingerprint is the sent tensors' checksum."""
    from rollout.backend import EmbeddedBackend
    from test_weight_push import push
    from vime import weight_sync

    path, hf = llama
    trainer = Trainer(TrainerConfig(), path)
    with torch.no_grad():
        for p in trainer.model.parameters():
            p.mul_(1.01)  # an update the push must carry
    named = list(trainer.named_hf_weights())
    assert ("lm_head.weight" in dict(named)) == (not hf.config.tie_word_embeddings)
    backend = EmbeddedBackend(path, None, 4)
    push(backend.weight_receiver("reload"), named)
    assert backend.fingerprint()["target"] == weight_sync.checksum(named)


@pytest.mark.parametrize("config_change, needle", [
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope type 'dynamic' is not supported for "
                                                                "LlamaForCausalLM; vime implements default, llama3"),
    ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "rope_theta": 1e4}}, "needs low_freq_factor"),
    ({"attention_bias": True}, "attention_bias true is not supported for LlamaForCausalLM"),
    ({"mlp_bias": True}, "mlp_bias true is not supported"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
    ({"quantization_config": {"quant_method": "gguf"}}, "quantised checkpoints"),
])
def test_a_llama_config_vime_does_not_build_is_refused_in_one_line(tmp_path, config_change, needle):
    make_llama(tmp_path, seed=0)
    with open(tmp_path / "config.json") as f:
        config = json.load(f)
    config.pop("rope_parameters", None)
    config.update(config_change)
    with open(tmp_path / "config.json", "w") as f:
        json.dump(config, f)
    with pytest.raises(UserError) as err:
        read_config(str(tmp_path))
    assert "\n" not in str(err.value) and needle in str(err.value) and "config.json" in str(err.value)


def test_an_unsupported_rope_scaling_stops_train_rl_before_anything_starts(tmp_path):
    from bad_input_helpers import refused

    make_llama(tmp_path / "m", seed=0)
    with open(tmp_path / "m" / "config.json") as f:
        config = json.load(f)
    config["rope_parameters"] = {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}
    with open(tmp_path / "m" / "config.json", "w") as f:
        json.dump(config, f)
    (tmp_path / "p.jsonl").write_text('{"prompt": "1+2=", "label": "3"}\n')
    refused(["--hf-checkpoint", str(tmp_path / "m"), "--prompt-data", str(tmp_path / "p.jsonl"),
             "--output-dir", str(tmp_path / "out")], "rope type 'linear' is not supported")


def test_the_tokenizer_files_travel_with_a_converted_checkpoint_chat_template_included(tmp_path):
    """transformers 5 keeps a chat template in chat_template.jinja: the converters copy it with the rest."""
    from rollout.tokenizer import TextCodec

    hf_dir = tmp_path / "hf"
    make_llama(hf_dir, seed=0)
    (hf_dir / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}={% endfor %}")
    td, back = str(tmp_path / "td"), str(tmp_path / "back")
    hf_to_torch_dist.main(["--hf-checkpoint", str(hf_dir), "--save", td])
    torch_dist_to_hf.main(["--input-dir", td, "--output-dir", back, "--origin-hf-dir", str(hf_dir)])
    assert os.path.isfile(os.path.join(back, "chat_template.jinja"))
    assert TextCodec(back).render_chat([{"role": "user", "content": "1+2"}]) == "1+2="
