"""The megatron-core trainer on GLM-4.5 (MoE) and DeepSeek-V3 (MoE + MLA) checkpoints.

The checkpoints are unseen random ones written by transformers' own classes with MTP layers in the
public layout (tests/moe_fixtures.py). References: transformers' trunk for the trainer's log-probs
(and the embedded engine, itself checked against transformers in test_moe_families.py), the engine's
MTP layer for the trainer's MTP block, the aux-loss-free rule written out here for the expert-bias
step, and the checkpoint's own tensors for the converters and the weights the trainer pushes.
"""
import json

import pytest
import torch
from safetensors.torch import load_file

from bad_input_helpers import refused

from checkpoint_convert import hf_to_torch_dist, torch_dist_to_hf
from fp32_bounds import FP32_UNIT_ROUNDOFF, model_logprob_bound
from moe_fixtures import transformers_trunk, write_checkpoint
from mtp.sampling import token_logprobs
from rollout.backend import EmbeddedBackend
from rollout.task import make_prompts, write_jsonl
from test_weight_push import push
from trainer.batch import build_batch
from trainer.config import TrainerConfig
from trainer.model import forward, routers
from trainer.trainer import Trainer
from trainer_fixtures import engine_model, engine_mtp_logits, make_batch, random_scored_samples
from vime import weight_sync
from vime.models.hf_format import load_hf_checkpoint

VARIANTS = {
    "glm4_moe": ("glm4_moe", dict(seed=21)),  # q/k/v bias, q/k norm, partial rotary, 2 expert groups
    "glm4_moe-4.6-layout": ("glm4_moe", dict(seed=22, head_copies=False, use_qk_norm=False, n_group=1,
                                              topk_group=1)),
    "deepseek_v3": ("deepseek_v3", dict(seed=23)),  # MLA with q LoRA, YaRN, 4 groups of which 2 are kept
    "deepseek_v3-no-q-lora": ("deepseek_v3", dict(seed=24, q_lora_rank=None)),
}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def moe_ckpt(request, tmp_path_factory):
    family, options = VARIANTS[request.param]
    path = str(tmp_path_factory.mktemp(f"trainer_moe_{request.param}"))
    write_checkpoint(path, family, **options)
    return path


def test_trainer_logprobs_equal_transformers_and_the_engine(moe_ckpt):
    trainer = Trainer(TrainerConfig(temperature=1.0), moe_ckpt)
    batch = make_batch(seed=3)
    got = trainer.compute_logprobs(batch)[:, 1:]
    tokens = batch.tokens  # right-padded rows: causal attention keeps the padding out of earlier positions
    with torch.no_grad():
        logits = transformers_trunk(moe_ckpt)(tokens).logits[:, :-1]
        engine = engine_model(moe_ckpt)
        positions = torch.arange(tokens.shape[1]).expand_as(tokens)
        engine_logits = engine.logits(engine(tokens, positions))[:, :-1]
    bound = model_logprob_bound(trainer.model_cfg, tokens.shape[1], logits.abs().max().item())
    assert (got - token_logprobs(logits, tokens[:, 1:], 1.0)).abs().max().item() <= bound
    assert (got - token_logprobs(engine_logits, tokens[:, 1:], 1.0)).abs().max().item() <= bound
    assert got.std().item() > 0.5  # peaked, varied distributions: not a comparison of two uniform ones


def test_trainer_mtp_logits_equal_the_engine_mtp_drafter(moe_ckpt):
    """megatron's MTP block over MoE (and MLA) layers, as the trainer runs it, gives the logits of the
    engine's MTP layer reading the final-normed trunk state (checked against transformers' MtpLayer)."""
    trainer = Trainer(TrainerConfig(enable_mtp_training=True), moe_ckpt)
    tokens = make_batch(seed=4).tokens
    trainer.model.eval()
    with torch.no_grad():
        got = trainer.model.mtp_logits(forward(trainer.model, tokens))[0][:, :-1]
        engine = engine_model(moe_ckpt)
        _, mtp_hidden = engine.forward_states(tokens, torch.arange(tokens.shape[1]).expand_as(tokens))
        want = engine_mtp_logits(engine, tokens, mtp_hidden)
    bound = model_logprob_bound(trainer.model_cfg, tokens.shape[1], want.abs().max().item()) / 2
    assert (got - want).abs().max().item() <= bound
    assert want.std().item() > 0.5


def test_a_train_step_with_the_mtp_loss_over_moe_layers_moves_policy_and_mtp_experts(moe_ckpt):
    trainer = Trainer(TrainerConfig(lr=1e-3, enable_mtp_training=True), moe_ckpt)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    metrics = trainer.train_step(make_batch(seed=5))
    assert torch.isfinite(torch.tensor(metrics["train/mtp_loss"])) and metrics["train/mtp_loss"] > 0
    moved = {n for n, p in trainer.model.named_parameters() if not torch.equal(p, before[n])}
    experts = [n for n in before if ".local_experts." in n]
    assert any(n.startswith("mtp.") and n in moved for n in experts)  # the MTP layer's experts learn
    assert any(n.startswith("decoder.") and n in moved for n in experts)  # and the trunk's
    assert any(n.endswith("router.weight") and n.startswith("decoder.") for n in moved)


def routed_tokens(trainer, lengths):
    """Hooks counting, per router, the tokens each expert receives in grad-enabled forwards: all
    positions, and only the real ones (the direct rule: a decoder router's position j of a row of
    `lengths[r]` tokens is real when j < length; the MTP layer's, which reads token j + 1 beside the
    state at j, when j + 1 < length). Routing maps are [s * b, experts], position-major."""
    all_counts, real_counts = {}, {}
    mtp_routers = set(routers(trainer.model.mtp))

    def hook(module, inputs, output):
        if not torch.is_grad_enabled():
            return
        routing = output[1].double()
        seq = routing.shape[0] // len(lengths)
        read = torch.arange(seq)[:, None] + (1 if module in mtp_routers else 0)
        real = (read < torch.tensor(lengths)[None, :]).reshape(-1, 1)
        all_counts[module] = all_counts.get(module, 0) + routing.sum(dim=0)
        real_counts[module] = real_counts.get(module, 0) + (routing * real).sum(dim=0)

    handles = [r.register_forward_hook(hook) for r in routers(trainer.model)]
    return all_counts, real_counts, handles


def aux_loss_free_step(bias, load, rate):
    """DeepSeek-V3's bias update written out: bias + rate * sign(mean load - load), in float64."""
    return bias.double() + rate * torch.sign(load.mean() - load)


@pytest.mark.parametrize("rate", [1e-3, 0.0])
def test_expert_bias_steps_by_the_aux_loss_free_rule_over_real_tokens_and_is_pushed(tmp_path, rate):
    """After a step on a right-padded batch every router's bias moved by rate * sign(mean load - load),
    load being the real (non-padding) tokens it routed in that step (counted here by hooks on the
    routers); counting the padding too would give a different bias (negative control); rate 0 keeps it."""
    write_checkpoint(str(tmp_path), "deepseek_v3", seed=25)
    trainer = Trainer(TrainerConfig(lr=1e-3, enable_mtp_training=True, moe_router_bias_update_rate=rate),
                      str(tmp_path))
    before = {r: r.expert_bias.clone() for r in routers(trainer.model)}
    assert len(before) == 2  # the MoE decoder layer's router and the MTP layer's
    samples = random_scored_samples(n=8, seed=6)
    lengths = [len(s.tokens) for s in samples]
    assert min(lengths) < max(lengths)  # rows of 9..16 tokens: a quarter of the batch is padding
    all_counts, real_counts, handles = routed_tokens(trainer, lengths)
    trainer.train_step(build_batch(samples))
    for h in handles:
        h.remove()
    differs_with_padding = []
    for router, bias in before.items():
        load = real_counts[router]
        expected = aux_loss_free_step(bias, load, rate)
        # the fp32 update rounds `rate` once and the sum once: <= u * (|result| + rate), doubled for margin
        tol = dict(rtol=2 * FP32_UNIT_ROUNDOFF, atol=2 * FP32_UNIT_ROUNDOFF * rate)
        assert torch.allclose(router.expert_bias.double(), expected, **tol)
        assert load.min() < load.max()  # an unbalanced load: some biases rise, some fall
        with_padding = aux_loss_free_step(bias, all_counts[router], rate)
        differs_with_padding.append(not torch.allclose(with_padding, expected, **tol))
    assert any(differs_with_padding) == (rate > 0)  # the padding would have moved some bias otherwise
    pushed = dict(trainer.named_hf_weights())
    assert torch.equal(pushed["model.layers.1.mlp.gate.e_score_correction_bias"],
                       routers(trainer.model)[0].expert_bias)
    _, original, _ = load_hf_checkpoint(str(tmp_path))
    moved = not torch.equal(pushed["model.layers.1.mlp.gate.e_score_correction_bias"],
                            original["model.layers.1.mlp.gate.e_score_correction_bias"])
    assert moved == (rate > 0)


def test_hf_to_torch_dist_to_hf_is_bit_identical_with_mtp(moe_ckpt, tmp_path):
    td, back = str(tmp_path / "td"), str(tmp_path / "back")
    hf_to_torch_dist.main(["--hf-checkpoint", moe_ckpt, "--save", td, "--mtp-num-layers", "1"])
    torch_dist_to_hf.main(["--input-dir", td, "--output-dir", back, "--origin-hf-dir", moe_ckpt])
    original, converted = load_file(f"{moe_ckpt}/model.safetensors"), load_file(f"{back}/model.safetensors")
    assert set(original) == set(converted)
    assert any(".mlp.experts.7." in n for n in converted) and any("e_score_correction_bias" in n for n in converted)
    assert all(torch.equal(original[n], converted[n]) for n in original)


def test_pushed_weights_are_the_checkpoints_and_load_bit_exactly_into_the_engine(moe_ckpt):
    trainer = Trainer(TrainerConfig(), moe_ckpt)
    named = list(trainer.named_hf_weights())
    _, state, _ = load_hf_checkpoint(moe_ckpt)
    assert sorted(n for n, _ in named) == sorted(state)
    assert all(torch.equal(v, state[n]) for n, v in named)
    g = torch.Generator().manual_seed(8)  # an RL step's change, so the engine must take what is pushed
    moved = [(n, v + 0.05 * torch.randn(v.shape, generator=g)) for n, v in named]
    backend = EmbeddedBackend(moe_ckpt, {"method": "mtp", "num_speculative_tokens": 2}, 4)
    push(backend.weight_receiver("reload"), moved)
    assert backend.digests() == weight_sync.digests(moved)


def run_args(ckpt, out, *extra):
    write_jsonl(make_prompts(8, seed=1), f"{ckpt}/train.jsonl")
    return ["--hf-checkpoint", ckpt, "--num-rollout", "2", "--rollout-batch-size", "4", "--n-samples-per-prompt",
            "4", "--global-batch-size", "16", "--micro-batch-size", "8", "--output-dir", str(out), *extra]


# three data-parallel ranks (EP 3 fits them; a global batch of 24 = 3 x 8)
DP3 = ("--data-parallel-size", "3", "--rollout-batch-size", "6", "--global-batch-size", "24")


@pytest.mark.parametrize("extra, config_changes, needles", [
    (("--tensor-model-parallel-size", "2"), {}, ("--tensor-model-parallel-size 2", "mixture-of-experts",
                                                 "only with sequence parallelism", "add --sequence-parallel")),
    ((), {"norm_topk_prob": False}, ("cannot train", "norm_topk_prob true")),
    (("--expert-model-parallel-size", "2"), {}, ("--expert-model-parallel-size 2 x --expert-tensor-parallel-size 1",
                                                 "does not divide the 1 trainer ranks of a pipeline stage")),
    (("--data-parallel-size", "2", "--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "2"), {},
     ("--expert-model-parallel-size 2 x --expert-tensor-parallel-size 2", "does not divide the 2 trainer ranks")),
    (("--expert-model-parallel-size", "3", *DP3), {}, ("--expert-model-parallel-size 3", "8 routed experts",
                                                       "choose a divisor of 8")),
    (("--expert-tensor-parallel-size", "3", *DP3), {}, ("--expert-tensor-parallel-size 3", "32 hidden units",
                                                        "moe_intermediate_size")),
    (("--sequence-parallel",), {}, ("--sequence-parallel splits the sequence over the tensor-parallel ranks",
                                    "--tensor-model-parallel-size 2 or more")),
    (("--context-parallel-size", "2"), {},
     ("--context-parallel-size 2", "only in Transformer Engine's attention", "python -m vime.memory_plan")),
    (("--optimizer-cpu-offload", "--bf16"), {}, ("--optimizer-cpu-offload", "add --use-distributed-optimizer")),
    (("--optimizer-cpu-offload", "--use-distributed-optimizer"), {}, ("--optimizer-cpu-offload", "add --bf16")),
    (("--use-precision-aware-optimizer", "--use-distributed-optimizer", "--bf16"), {},
     ("--use-precision-aware-optimizer", "Transformer Engine's FusedAdam", "add --optimizer-cpu-offload")),
    (("--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "3"), {},
     ("--recompute-num-layers 3", "a stage of 2 layers does not split into them")),
    (("--recompute-granularity", "full"), {}, ("--recompute-granularity full", "give both")),
], ids=["tensor-parallel-moe", "unnormalised-topk", "ep-over-too-few-ranks", "ep-x-etp-over-too-few-ranks",
        "ep-not-dividing-the-experts", "etp-not-dividing-an-expert", "sp-without-tp", "context-parallel",
        "cpu-offload-without-distributed", "cpu-offload-without-bf16", "precision-aware-without-te",
        "uneven-uniform-recompute", "full-recompute-without-layers"])
def test_what_megatron_cannot_train_is_refused_in_one_line_before_start(tmp_path, extra, config_changes, needles):
    ckpt = str(tmp_path / "hf")
    write_checkpoint(ckpt, "glm4_moe", seed=26)
    with open(f"{ckpt}/config.json") as f:
        raw = json.load(f)
    raw.update(config_changes)
    with open(f"{ckpt}/config.json", "w") as f:
        json.dump(raw, f)
    refused(run_args(ckpt, tmp_path / "out", *extra), *needles)
