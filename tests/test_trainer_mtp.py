"""Trainer: log-probs vs the engine model, and the online MTP loss (detach, scale, mask, clip, freeze)."""
import pytest
import torch

from checkpoint_convert.families import FAMILIES, is_mtp_name
from checkpoint_convert.hf_format import expected_tensor_names, load_hf_checkpoint
from checkpoint_convert.megatron_names import hf_targets
from mtp.loss import mtp_loss_mask
from mtp.sampling import token_logprobs
from rollout.model import CausalLMWithMTP
from trainer.batch import build_batch
from trainer.config import TrainerConfig
from trainer.model import forward
from trainer.trainer import Trainer
from fp32_bounds import reduction_rtol
from trainer_fixtures import make_batch, make_tiny
from vime.sample import Sample


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def hf_dir(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"trainer_mtp_hf_{request.param}")
    make_tiny(path, seed=1, family=request.param)
    return str(path)


def expected_mtp_hf_names(model_cfg):
    """The canonical HF names of the family's MTP tensors (what the MTP parameters must cover)."""
    return {n for n in expected_tensor_names(model_cfg) if is_mtp_name(n, model_cfg.num_hidden_layers)}


def engine_model(path):
    cfg, state, _ = load_hf_checkpoint(path)
    model = CausalLMWithMTP(cfg)
    model.load_state_dict(state, strict=False)
    return model.eval()


def grads(trainer):
    return {n: (p.grad.clone() if p.grad is not None else None) for n, p in trainer.model.named_parameters()}


def nonzero(g):
    return g is not None and g.abs().max().item() > 0


@pytest.mark.parametrize("tied", [True, False])
def test_trainer_logprobs_equal_engine_model_logprobs(tmp_path, tied):
    make_tiny(tmp_path, seed=2, tie_word_embeddings=tied)
    trainer = Trainer(TrainerConfig(temperature=0.7), str(tmp_path))
    batch = make_batch()
    got = trainer.compute_logprobs(batch)
    ref = engine_model(str(tmp_path))
    positions = torch.arange(batch.tokens.shape[1]).expand_as(batch.tokens)
    with torch.no_grad():
        logits = ref.logits(ref(batch.tokens, positions))
    want = token_logprobs(logits[:, :-1], batch.tokens[:, 1:], 0.7)
    assert (got[:, 1:] - want).abs().max().item() <= 1e-5
    assert torch.all(got[:, 0] == 0)


def test_logprob_abs_diff_metric_is_zero_against_engine_logprobs(hf_dir):
    trainer = Trainer(TrainerConfig(temperature=0.7), hf_dir)
    batch = make_batch()
    batch.rollout_logprobs = trainer.compute_logprobs(batch) * batch.loss_mask
    metrics = trainer.backward(batch)
    assert metrics["train/logprob_abs_diff"] <= 1e-6
    batch.rollout_logprobs = batch.rollout_logprobs - 0.25 * batch.loss_mask
    assert trainer.backward(batch)["train/logprob_abs_diff"] == pytest.approx(0.25, abs=1e-5)


@pytest.mark.parametrize("enable", [True, False])
def test_zero_policy_loss_only_mtp_params_get_gradients(hf_dir, enable):
    trainer = Trainer(TrainerConfig(enable_mtp_training=enable), hf_dir)
    metrics = trainer.backward(make_batch(advantages=[0.0] * 4))
    assert metrics["train/policy_loss"] == 0.0
    g = grads(trainer)
    with_grad = {n for n, v in g.items() if nonzero(v)}
    mtp_names = {n for n in g if n.startswith("mtp.")}
    assert with_grad == (mtp_names if enable else set())
    cfg = trainer.model_cfg
    assert {hf for n in mtp_names for hf in hf_targets(n, cfg.num_hidden_layers)[1]} == expected_mtp_hf_names(cfg)


def test_detached_mtp_training_leaves_policy_gradients_identical(hf_dir):
    batch = make_batch()
    g_on = grads_after(hf_dir, batch, enable_mtp_training=True)
    g_off = grads_after(hf_dir, batch, enable_mtp_training=False)
    policy = [n for n in g_on if not n.startswith("mtp.")]
    assert all(torch.equal(g_on[n], g_off[n]) for n in policy)
    assert all(nonzero(g_on[n]) for n in policy)


def grads_after(hf_dir, batch, **cfg):
    trainer = Trainer(TrainerConfig(**cfg), hf_dir)
    trainer.backward(batch)
    return grads(trainer)


def test_no_mtp_detach_trunk_lets_the_mtp_loss_reach_the_trunk(hf_dir):
    g = grads_after(hf_dir, make_batch(advantages=[0.0] * 4), enable_mtp_training=True, mtp_detach_trunk=False)
    assert nonzero(g["decoder.layers.0.mlp.linear_fc1.weight"])
    assert nonzero(g["embedding.word_embeddings.weight"])


def test_mtp_gradients_scale_linearly_with_the_factor(hf_dir):
    batch = make_batch(advantages=[0.0] * 4)
    g1 = grads_after(hf_dir, batch, enable_mtp_training=True, mtp_loss_scaling_factor=0.2)
    g2 = grads_after(hf_dir, batch, enable_mtp_training=True, mtp_loss_scaling_factor=0.6)
    for n in (n for n in g1 if n.startswith("mtp.")):
        assert (g2[n] - 3.0 * g1[n]).abs().max().item() <= 1e-5 * g2[n].abs().max().item(), n
        assert nonzero(g1[n]), n


def test_mtp_mask_at_prompt_response_boundary_and_response_end(hf_dir):
    short = Sample(prompt_ids=[5, 6, 7], response_ids=[8, 9, 10], rollout_logprobs=[-1.0] * 3, advantage=1.0)
    long = Sample(prompt_ids=[3, 4], response_ids=[11, 12, 13, 14, 15, 16], rollout_logprobs=[-1.0] * 6)
    batch = build_batch([short, long], pad_token_id=0)
    # t: input hidden h(t) and token t+1, label token t+2; counted iff m(t+1)*m(t+2)
    mask = mtp_loss_mask(batch.loss_mask, 1)
    assert mask.tolist() == [[0, 0, 1, 1, 0, 0],   # t=2: feeds r0 predicts r1; t=4 would predict PAD
                             [0, 1, 1, 1, 1, 1]]   # t=0 feeds a prompt token; t=1 feeds r0 predicts r1
    trainer = Trainer(TrainerConfig(enable_mtp_training=True), hf_dir)
    got = trainer.backward(batch)["train/mtp_1_loss"]
    ref = engine_model(hf_dir)
    tokens = batch.tokens
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    with torch.no_grad():
        _, hidden = ref.forward_states(tokens, positions)
        logits = ref.logits(ref.mtp_forward(0, tokens[:, 1:], hidden[:, :-1], positions[:, :-1]))
    counted = [(0, 2), (0, 3), (1, 1), (1, 2), (1, 3), (1, 4), (1, 5)]
    ce = [torch.nn.functional.cross_entropy(logits[b, t], tokens[b, t + 2]) for b, t in counted]
    assert got == pytest.approx(torch.stack(ce).mean().item(), abs=1e-5)


def test_mtp_grad_clip_never_shrinks_the_policy_update(hf_dir):
    batch = make_batch()
    params = {}
    for mtp_clip in (1e-6, 1e6):
        trainer = Trainer(TrainerConfig(lr=1e-2, clip_grad=1e6, enable_mtp_training=True, mtp_clip_grad=mtp_clip), hf_dir)
        metrics = trainer.train_step(batch)
        assert metrics["train/mtp_grad_norm"] > 1e-3
        params[mtp_clip] = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    policy = [n for n in params[1e6] if not n.startswith("mtp.")]
    assert all(torch.equal(params[1e-6][n], params[1e6][n]) for n in policy)
    assert not torch.equal(params[1e-6]["mtp.layers.0.eh_proj.weight"], params[1e6]["mtp.layers.0.eh_proj.weight"])


def test_without_mtp_training_mtp_weights_stay_frozen_and_are_exported(hf_dir):
    trainer = Trainer(TrainerConfig(lr=1e-2), hf_dir)
    metrics = trainer.train_step(make_batch())
    assert "train/mtp_loss" not in metrics and metrics["train/grad_norm"] > 0
    _, hf_state, _ = load_hf_checkpoint(hf_dir)
    exported = dict(trainer.named_hf_weights())
    assert set(exported) == set(hf_state)
    mtp_names = [n for n in exported if n.startswith("model.layers.2.")]
    assert set(mtp_names) == expected_mtp_hf_names(trainer.model_cfg)
    assert all(torch.equal(exported[n], hf_state[n]) for n in mtp_names)
    assert not torch.equal(exported["model.layers.0.mlp.up_proj.weight"], hf_state["model.layers.0.mlp.up_proj.weight"])


def test_mtp_training_metrics_are_reported(hf_dir):
    trainer = Trainer(TrainerConfig(lr=1e-3, enable_mtp_training=True), hf_dir)
    m = trainer.train_step(make_batch())
    for key in ("train/policy_loss", "train/mtp_loss", "train/mtp_1_loss", "train/grad_norm", "train/mtp_grad_norm",
                "train/entropy", "train/clipfrac", "train/logprob_abs_diff"):
        assert key in m and m[key] == m[key], key
    assert m["train/mtp_loss"] == m["train/mtp_1_loss"] > 0
    assert 0 < m["train/entropy"] <= torch.log(torch.tensor(32.0)).item() + 1e-5


def test_mtp_lr_sets_the_draft_step_size_independently_of_the_policy(hf_dir):
    def mtp_change(mtp_lr):
        trainer = Trainer(TrainerConfig(lr=1e-3, enable_mtp_training=True, mtp_lr=mtp_lr), hf_dir)
        before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        trainer.train_step(make_batch())
        delta = {n: (p.detach() - before[n]).abs().max().item() for n, p in trainer.model.named_parameters()}
        return (max(v for n, v in delta.items() if n.startswith("mtp.")),
                max(v for n, v in delta.items() if not n.startswith("mtp.")))

    frozen_draft, policy_a = mtp_change(0.0)
    fast_draft, policy_b = mtp_change(1e-2)
    assert frozen_draft == 0.0 and fast_draft > 5e-3
    assert policy_a == policy_b > 0  # the policy update does not depend on the draft's lr


def engine_mtp_logits(model, tokens, mtp_hidden):
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    return model.logits(model.mtp_forward(0, tokens[:, 1:], mtp_hidden[:, :-1], positions[:, :-1]))


def test_trainer_mtp_logits_equal_the_engine_mtp_layer_for_each_family(hf_dir):
    """megatron's MTP block (as the trainer runs it) and the engine's MTP layer read the same trunk
    state (MiMo: before the final norm, no token at position 0) and give the same logits."""
    trainer = Trainer(TrainerConfig(enable_mtp_training=True), hf_dir)
    batch = make_batch(seed=4)
    tokens = batch.tokens
    trainer.model.eval()
    with torch.no_grad():
        got = trainer.model.mtp_logits(forward(trainer.model, tokens))[0][:, :-1]
        ref = engine_model(hf_dir)
        positions = torch.arange(tokens.shape[1]).expand_as(tokens)
        normed, mtp_hidden = ref.forward_states(tokens, positions)
        pre_norm = ref.trunk(tokens, positions)
        want = engine_mtp_logits(ref, tokens, mtp_hidden)
        reads_pre_norm = trainer.model_cfg.model_family.mtp_reads_pre_norm_hidden
        other = engine_mtp_logits(ref, tokens, normed if reads_pre_norm else pre_norm)
    cfg = trainer.model_cfg
    tol = reduction_rtol(cfg.intermediate_size, 4 * (cfg.num_hidden_layers + 1) + 4) * want.abs().max().item()
    assert (got - want).abs().max().item() <= tol
    assert (other - want).abs().max().item() > 100 * tol  # negative control: the input the family does not use
