"""GLM-4.5 (MoE) and DeepSeek-V3 (MoE + MLA) in the embedded engine, against transformers.

The checkpoints are unseen random ones written by transformers' own classes with MTP layers in
the public layout (tests/moe_fixtures.py). transformers is the reference for the trunk (greedy
tokens and log-probs) and for the MTP layer's math (its `MtpLayer`); the router is checked
against transformers' router modules, the latent cache against the expanded-cache formula.
"""
import json
import os
import random

import pytest
import torch
from safetensors.torch import load_file, save_file

from fp32_bounds import model_logprob_bound as logprob_bound
from moe_fixtures import transformers_mtp_layer, transformers_trunk, write_checkpoint
from rollout.embedded.engine import Engine, EngineConfig
from rollout.embedded.engine_builder import build_engine
from rollout.embedded.kv_cache import make_kv_cache
from rollout.embedded.mla import kv_bytes_per_token
from rollout.sampling_params import SamplingParams
from vime.errors import UserError
from vime.models.hf_format import load_hf_checkpoint
from vime.models.moe_routing import route, update_expert_bias
from vime.sample import samples_for_prompts

FAMILIES = ("glm4_moe", "deepseek_v3")


@pytest.fixture(scope="module", params=[
    ("glm4_moe", dict(seed=11)),
    ("glm4_moe", dict(seed=12, head_copies=False, use_qk_norm=False, n_group=1, topk_group=1)),  # GLM-4.6 style
    ("deepseek_v3", dict(seed=13)),
    ("deepseek_v3", dict(seed=14, q_lora_rank=None, num_mtp_layers=2)),  # no q LoRA, two chained MTP layers
], ids=["glm4_moe", "glm4_moe-4.6-layout", "deepseek_v3", "deepseek_v3-no-q-lora-2-mtp"])
def moe_ckpt(request, tmp_path_factory):
    family, options = request.param
    path = str(tmp_path_factory.mktemp(f"moe_{family}"))
    write_checkpoint(path, family, **options)
    return path


@pytest.fixture(scope="module")
def hf_trunk(moe_ckpt):
    return transformers_trunk(moe_ckpt)


def random_prompts(n=6, seed=0):
    rng = random.Random(seed)
    return [[1] + [rng.randrange(3, 32) for _ in range(rng.randrange(3, 14))] for _ in range(n)]


def greedy(engine, prompts, n_new=16):
    sampling = SamplingParams(temperature=0, max_new_tokens=n_new, ignore_eos=True)
    return engine.generate(samples_for_prompts(prompts), sampling)


def test_greedy_tokens_and_logprobs_equal_transformers(moe_ckpt, hf_trunk):
    engine = Engine.from_checkpoint(moe_ckpt, EngineConfig(max_batch_size=4))  # 6 prompts: slots get reused
    samples = greedy(engine, random_prompts())
    varied = set()
    for s in samples:
        out = hf_trunk.generate(torch.tensor([s.prompt_ids]), max_new_tokens=16, min_new_tokens=16, do_sample=False,
                                pad_token_id=0, eos_token_id=None)
        assert s.response_ids == out[0, len(s.prompt_ids):].tolist()
        varied.update(s.response_ids)
        with torch.no_grad():
            logits = hf_trunk(torch.tensor([s.tokens])).logits[0, len(s.prompt_ids) - 1:-1]
        reference = logits.log_softmax(-1).gather(1, torch.tensor(s.response_ids)[:, None])[:, 0]
        bound = logprob_bound(engine.cfg, len(s.tokens), logits.abs().max().item())
        assert (torch.tensor(s.rollout_logprobs) - reference).abs().max().item() <= bound
    assert len(varied) > 4  # not a comparison of two constant outputs


def test_mtp_layer_logits_equal_transformers_mtp_layer(moe_ckpt, hf_trunk):
    from transformers.masking_utils import create_causal_mask

    engine = Engine.from_checkpoint(moe_ckpt, EngineConfig(max_batch_size=2))
    cfg = engine.cfg
    tokens = torch.randint(3, 32, (2, 20), generator=torch.Generator().manual_seed(3))
    n = tokens.shape[1]
    positions = torch.arange(n - 1).expand(2, -1)
    with torch.no_grad():
        hidden = hf_trunk.model(tokens).last_hidden_state[:, :-1]  # DeepSeek/GLM MTP reads the final-normed state
        for k in range(cfg.num_nextn_predict_layers):
            mtp = transformers_mtp_layer(moe_ckpt, hf_trunk, k)
            embeds = hf_trunk.model.embed_tokens(tokens[:, 1:])
            mask = create_causal_mask(config=hf_trunk.config, inputs_embeds=embeds, attention_mask=None,
                                      past_key_values=None, position_ids=positions)
            reference = mtp.layers[k](embeds, hidden, position_embeddings=hf_trunk.model.rotary_emb(embeds, positions),
                                      attention_mask=mask, position_ids=positions, past_key_values=None)
            reference_logits = hf_trunk.lm_head(reference)
            width = hidden.shape[1]
            cache = make_kv_cache(cfg, 1, 2, 64)
            view = cache.step(torch.tensor([0, 1]), torch.zeros(2, dtype=torch.long), torch.tensor([width, width]))
            ours = engine.fast.logits(engine.fast.mtp(k, tokens[:, 1:], hidden, positions, view.layers(1)[0]))
            bound = logprob_bound(cfg, n, reference_logits.abs().max().item()) / 2
            assert (ours - reference_logits).abs().max().item() <= bound
            # depth k + 1 at position t reads depth k's output there and token t + k + 2
            hidden, tokens, positions = reference[:, :-1], tokens[:, 1:], positions[:, :-1]


@pytest.mark.parametrize("k", [3])  # past the MTP layers: chained depths, then the last one reused
def test_greedy_mtp_speculation_equals_plain_greedy(moe_ckpt, k):
    prompts = random_prompts(8, seed=5)
    plain = greedy(Engine.from_checkpoint(moe_ckpt, EngineConfig(max_batch_size=3)), prompts, n_new=20)
    engine = build_engine(moe_ckpt, json.dumps({"method": "mtp", "num_speculative_tokens": k}),
                          EngineConfig(max_batch_size=3))
    spec = greedy(engine, prompts, n_new=20)
    assert [s.response_ids for s in spec] == [s.response_ids for s in plain]
    assert sum(s.spec.draft_tokens for s in spec) > 0


# ------------------------------------------------------------------ the router
@pytest.mark.parametrize("family,n_group,topk_group,norm", [
    ("glm4_moe", 1, 1, True), ("deepseek_v3", 4, 2, True), ("deepseek_v3", 8, 3, False)])
def test_routing_equals_transformers_router(family, n_group, topk_group, norm):
    from transformers import DeepseekV3Config, Glm4MoeConfig
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter

    config_cls, router_cls = ((Glm4MoeConfig, Glm4MoeTopkRouter) if family == "glm4_moe"
                              else (DeepseekV3Config, DeepseekV3TopkRouter))
    config = config_cls(hidden_size=32, n_routed_experts=16, num_experts_per_tok=4, n_group=n_group,
                        topk_group=topk_group, norm_topk_prob=norm, routed_scaling_factor=2.5)
    g = torch.Generator().manual_seed(n_group)
    reference = router_cls(config)
    with torch.no_grad():
        reference.weight.copy_(torch.randn(16, 32, generator=g))
        reference.e_score_correction_bias.copy_(torch.randn(16, generator=g) * 0.3)
    x = torch.randn(200, 32, generator=g)
    _, ref_weights, ref_indices = reference(x)
    from vime.models.moe_mla_config import MoEConfig
    moe = MoEConfig(n_routed_experts=16, num_experts_per_tok=4, moe_intermediate_size=8, n_group=n_group,
                    topk_group=topk_group, norm_topk_prob=norm, routed_scaling_factor=2.5)
    weights, indices = route(x @ reference.weight.t(), reference.e_score_correction_bias, moe)
    order, ref_order = indices.argsort(-1), ref_indices.argsort(-1)
    assert torch.equal(indices.gather(1, order), ref_indices.gather(1, ref_order))
    assert torch.allclose(weights.gather(1, order), ref_weights.gather(1, ref_order), rtol=1e-6, atol=0)


def test_correction_bias_steers_the_choice_but_not_the_weights():
    from vime.models.moe_mla_config import MoEConfig

    moe = MoEConfig(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=8, norm_topk_prob=False,
                    routed_scaling_factor=1.0)
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    bias = torch.tensor([0.0, 0.0, 0.0, 5.0])  # expert 3 has the lowest score but a large bias
    weights, indices = route(logits, bias, moe)
    assert sorted(indices[0].tolist()) == [0, 3]
    assert torch.allclose(weights[0].sort().values, torch.sigmoid(torch.tensor([-1.0, 2.0])))  # unbiased scores


def test_bias_update_raises_underused_experts_and_lowers_overused_ones():
    bias = torch.zeros(4)
    update_expert_bias(bias, torch.tensor([10, 2, 4, 0]), rate=0.01)  # mean 4
    assert bias.tolist() == pytest.approx([-0.01, 0.01, 0.0, 0.01])


# ------------------------------------------------------------------ the latent cache
def test_mla_caches_the_latent_not_expanded_keys_and_values(tmp_path):
    write_checkpoint(str(tmp_path), "deepseek_v3", seed=21)
    engine = Engine.from_checkpoint(str(tmp_path), EngineConfig(max_batch_size=2))
    cfg, m = engine.cfg, engine.cfg.mla
    cache = engine.cache.latent
    per_token_per_layer = cache[0, 0, 0].numel() * cache.element_size()
    assert cache.shape[0] == cfg.num_hidden_layers
    assert per_token_per_layer == (m.kv_lora_rank + m.qk_rope_head_dim) * 4
    latent, expanded = kv_bytes_per_token(cfg)
    assert expanded == cfg.num_hidden_layers * cfg.num_attention_heads * (m.qk_head_dim + m.v_head_dim) * 4
    assert latent == cfg.num_hidden_layers * per_token_per_layer


def test_shipped_deepseek_sizes_cache_at_most_a_quarter_of_expanded_keys_and_values():
    from rollout.tiny_model import tiny_config

    latent, expanded = kv_bytes_per_token(tiny_config("deepseek_v3"))
    assert latent * 4 <= expanded


# ------------------------------------------------------------------ bad input
def _edit_config(path, **changes):
    with open(os.path.join(path, "config.json")) as f:
        raw = json.load(f)
    raw.update(changes)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(raw, f)


@pytest.fixture(scope="module")
def ckpt_dirs(tmp_path_factory):
    out = {}
    for family in FAMILIES:
        path = str(tmp_path_factory.mktemp(f"bad_{family}"))
        write_checkpoint(path, family, seed=31)
        out[family] = path
    return out


def _copy(src, dst):
    import shutil

    shutil.copytree(src, dst)
    return str(dst)


@pytest.mark.parametrize("family,changes,needle", [
    ("deepseek_v3", dict(scoring_func="softmax"), "scoring_func"),
    ("deepseek_v3", dict(topk_method="group_limited_greedy"), "topk_method"),
    ("deepseek_v3", dict(quantization_config={"quant_method": "fp8"}), "quantised"),
    ("deepseek_v3", dict(moe_layer_freq=2), "moe_layer_freq"),
    ("deepseek_v3", dict(attention_bias=True), "attention_bias"),
    ("deepseek_v3", dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}), "rope type"),
    ("deepseek_v3", dict(n_group=3), "n_group"),
    ("deepseek_v3", dict(kv_lora_rank=None), "kv_lora_rank"),
    ("glm4_moe", dict(hidden_act="gelu"), "hidden_act"),
    ("glm4_moe", dict(partial_rotary_factor=1.5, rope_parameters=None), "partial_rotary_factor"),
    ("glm4_moe", dict(num_experts_per_tok=0), "num_experts_per_tok"),
    ("glm4_moe", dict(num_nextn_predict_layers=0), "num_nextn_predict_layers"),  # MTP tensors it does not declare
])
def test_bad_moe_or_mla_config_is_one_line_exit_2(ckpt_dirs, tmp_path, capsys, family, changes, needle):
    from rollout.generate import main

    path = _copy(ckpt_dirs[family], tmp_path / "ckpt")
    _edit_config(path, **changes)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt_ids": [1, 5, 6]}\n')
    with pytest.raises(SystemExit) as exit_info:
        main(["--hf-checkpoint", path, "--prompts", str(prompts), "--output", str(tmp_path / "out.jsonl")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and needle in err, err


@pytest.mark.parametrize("damage,needle", [
    ("scale_inv", "quantised"),
    ("head_copy", "differs from"),
])
def test_quantised_tensors_and_a_different_mtp_head_copy_are_refused(ckpt_dirs, tmp_path, damage, needle):
    path = _copy(ckpt_dirs["deepseek_v3"], tmp_path / "ckpt")
    weights = os.path.join(path, "model.safetensors")
    state = load_file(weights)
    if damage == "scale_inv":
        state["model.layers.0.self_attn.kv_b_proj.weight_scale_inv"] = torch.ones(1)
    else:
        state["model.layers.2.shared_head.head.weight"] = state["lm_head.weight"] + 1
    save_file(state, weights)
    with pytest.raises(UserError) as err:
        load_hf_checkpoint(path)
    assert needle in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("family", FAMILIES)
def test_checkpoints_vime_writes_load_in_transformers_with_equal_logits(tmp_path, family):
    from rollout.tiny_model import make_random_checkpoint

    make_random_checkpoint(str(tmp_path), family=family, seed=41, std=0.2, num_hidden_layers=2)
    cfg, state, _ = load_hf_checkpoint(str(tmp_path))
    engine = Engine.from_checkpoint(str(tmp_path), EngineConfig(max_batch_size=2))
    reference = transformers_trunk(str(tmp_path))
    tokens = torch.randint(3, 32, (2, 24), generator=torch.Generator().manual_seed(41))
    view = engine.cache.step(torch.tensor([0, 1]), torch.zeros(2, dtype=torch.long), torch.tensor([24, 24]))
    with torch.no_grad():
        ours = engine.fast.logits(engine.fast(tokens, torch.arange(24).expand(2, -1),
                                              view.layers(cfg.num_hidden_layers)))
        theirs = reference(tokens).logits
    assert (ours - theirs).abs().max().item() <= logprob_bound(cfg, 24, theirs.abs().max().item()) / 2
    assert type(reference).__name__ == cfg.model_family.hf_trunk_class


SHIPPED = {"glm4_moe": "tiny-glm4-moe-mtp", "deepseek_v3": "tiny-deepseek-v3-mtp"}
CHECKPOINTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "checkpoints")


@pytest.mark.parametrize("family", FAMILIES)
def test_shipped_moe_model_is_its_family_and_its_mtp_layer_drafts_what_the_trunk_says(family):
    from rollout.spec_stats import aggregate_spec_stats
    from rollout.tokenizer import TextCodec

    path = os.path.join(CHECKPOINTS, SHIPPED[family])
    engine = build_engine(path, json.dumps({"method": "mtp", "num_speculative_tokens": 2}),
                          EngineConfig(max_batch_size=32))
    assert engine.cfg.family == family
    codec = TextCodec(path)
    with open(os.path.join(path, "eval.jsonl")) as f:
        prompts = [codec.encode_prompt(json.loads(line)["prompt"], engine.cfg.bos_token_id) for line in f][:32]
    sampling = SamplingParams(temperature=0.0, max_new_tokens=32)
    trained = aggregate_spec_stats(engine.generate(samples_for_prompts(prompts), sampling))["spec_accept_length"]
    assert trained > 1.3
    # negative control: the same engine with the MTP layer's input projection scrambled drafts far worse
    name = f"model.layers.{engine.cfg.num_hidden_layers}.eh_proj.weight"
    weight = dict(engine.model.named_parameters())[name]
    engine.load_weights([(name, weight[torch.randperm(weight.shape[0], generator=torch.Generator().manual_seed(0))])], 1)
    scrambled = aggregate_spec_stats(engine.generate(samples_for_prompts(prompts), sampling))["spec_accept_length"]
    assert scrambled < trained - 0.1
