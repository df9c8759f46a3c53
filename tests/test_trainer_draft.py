"""Online EAGLE-3 draft training in the trainer: the policy's loss and gradients are bit-identical
with and without it, the draft trains on the policy's own aux hidden states (the embedded engine's
model, an independent implementation, recomputes them), its tensors go out under `eagle3.*`, and a
checkpoint keeps it with its optimizer state."""
import pytest
import torch
import torch.nn.functional as F

from draft_kind_fixtures import random_draft
from eagle3_fixtures import REDUCED_IDS, reduced_draft
from mtp.eagle3 import training_time_test_loss
from rollout.embedded.model import CausalLMWithMTP
from vime.spec_config import parse_spec_config
from trainer.config import TrainerConfig
from trainer.trainer import Trainer
from trainer_fixtures import make_batch, make_tiny
from fp32_bounds import reduction_rtol
from vime.models.eagle3 import EAGLE3
from vime.models.hf_format import load_hf_checkpoint, read_config

AUX = (0, 1, 2)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A 2-layer Qwen2 target without MTP and a random EAGLE-3 draft reading its layers 0, 1, 2."""
    target = str(tmp_path_factory.mktemp("qwen2_target"))
    make_tiny(target, seed=1, family="qwen2", num_nextn_predict_layers=0)
    draft = random_draft(EAGLE3, read_config(target), seed=2, std=0.05, layers=AUX)
    path = str(tmp_path_factory.mktemp("draft"))
    EAGLE3.save(path, draft.cfg, draft.state_dict())
    return target, path


@pytest.fixture(scope="module")
def reduced_pair(pair, tmp_path_factory):
    """pair's target and its draft cut down to a reduced vocabulary (eagle3_fixtures.REDUCED_IDS)."""
    target, path = pair
    draft = reduced_draft(load_draft_module(path), REDUCED_IDS)
    reduced = str(tmp_path_factory.mktemp("reduced_draft"))
    EAGLE3.save(reduced, draft.cfg, draft.state_dict())
    return target, reduced


def config(draft_dir, enable, **kw):
    spec = parse_spec_config({"method": "eagle3", "model": draft_dir, "num_speculative_tokens": 3})
    return TrainerConfig(**{"enable_draft_training": enable, "speculative_config": spec, "micro_batch_size": 2, **kw})


def test_draft_training_leaves_the_policy_loss_and_gradients_bit_identical(pair):
    target, draft = pair
    batch = make_batch()
    runs = {}
    for enable in (False, True):
        trainer = Trainer(config(draft, enable), target)
        metrics = trainer.backward(batch)
        runs[enable] = (metrics, {n: g.clone() for n, g in trainer.named_gradients().items()}, trainer)
    (m_off, g_off, _), (m_on, g_on, on) = runs[False], runs[True]
    assert m_on["train/policy_loss"] == m_off["train/policy_loss"]
    assert g_on.keys() == g_off.keys() and all(torch.equal(g_on[n], g_off[n]) for n in g_on)
    assert all(p.main_grad.abs().max() > 0 for p in on.draft.module.parameters())
    assert m_on["train/draft_1_loss"] > 0 and "train/draft_3_loss" in m_on


def embedded_model(target, named_weights=None):
    """The embedded engine's model (an independent implementation of the target) with the
    checkpoint's weights, or with the trainer's (`named_weights`: its HF-named tensors)."""
    cfg, state, _ = load_hf_checkpoint(target)
    if named_weights is not None:
        state = {n: t.clone() for n, t in named_weights if not n.startswith(EAGLE3.wire_prefix)}
    model = CausalLMWithMTP(cfg)
    model.load_state_dict(state)
    return model


def reference_draft_loss(model, draft, batch, loss_type):
    """The training-time-test loss recomputed from the embedded model's aux states and logits."""
    tokens = batch.tokens
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    with torch.no_grad():
        aux = model.aux_hidden_states(tokens, positions, AUX)
        embeds = F.embedding(tokens, model.model.embed_tokens.weight)
        logits = model.logits(model(tokens, positions))
        loss, _ = training_time_test_loss(draft, embeds, aux, tokens, batch.loss_mask, 3, loss_type, logits)
    return float(loss)


def loss_bound(target, expected):
    """Two fp32 implementations of the same trunk (reduction order differs): the trunk's reductions
    (4 per layer), the policy head (1) and the draft's (fc over 3H, q/k/v over 2H, attention, o,
    MLP, norm, head: 8), the longest being fc's 3H terms, bound the loss's relative error (Higham)."""
    cfg = read_config(target)
    longest = max(cfg.intermediate_size, 3 * cfg.hidden_size)
    return reduction_rtol(longest, 4 * cfg.num_hidden_layers + 9) * max(1.0, abs(expected))


def load_draft_module(draft_dir):
    from mtp.eagle3 import Eagle3Draft

    draft_cfg, draft_state = EAGLE3.load(draft_dir)
    draft = Eagle3Draft(draft_cfg)
    draft.load_state_dict(draft_state)
    return draft


@pytest.mark.parametrize("vocab", ["whole", "reduced"])
@pytest.mark.parametrize("loss_type", ["ce", "soft_ce", "tv"])
def test_the_draft_trains_on_the_policys_aux_hidden_states(request, vocab, loss_type):
    """The loss the trainer computes from megatron's hooked states (and, for the distillation
    losses, its logits) equals the same loss computed from the embedded engine's model (its own
    aux_hidden_states and logits) on one micro-batch; for a draft of the whole vocabulary and one of a
    reduced vocabulary."""
    target, draft_dir = request.getfixturevalue("pair" if vocab == "whole" else "reduced_pair")
    batch = make_batch(n=2)
    trainer = Trainer(config(draft_dir, True, micro_batch_size=0, draft_loss_type=loss_type), target)
    metrics = trainer.backward(batch)
    got = sum(metrics[f"train/draft_{i}_loss"] for i in (1, 2, 3)) / 3
    expected = reference_draft_loss(embedded_model(target), load_draft_module(draft_dir), batch, loss_type)
    assert abs(got - expected) <= loss_bound(target, expected)


@pytest.mark.parametrize("loss_type", ["ce", "soft_ce"])
def test_draft_only_steps_and_replay_leave_the_policy_bit_identical(pair, loss_type):
    target, draft_dir = pair
    trainers = {enable: Trainer(config(draft_dir, enable, draft_steps_per_rollout=3, draft_replay_batches=1,
                                       draft_loss_type=loss_type), target) for enable in (False, True)}
    for seed in (0, 1):  # the second step replays the first step's batch
        batch = make_batch(seed=seed)
        m = {enable: t.train_step(batch) for enable, t in trainers.items()}
        assert m[True]["train/policy_loss"] == m[False]["train/policy_loss"]
        assert m[True]["train/grad_norm"] == m[False]["train/grad_norm"]
    off, on = (dict(trainers[e].model.named_parameters()) for e in (False, True))
    assert off.keys() == on.keys() and all(torch.equal(on[n], off[n]) for n in off)
    assert m[True]["train/draft_final_loss"] > 0 and len(trainers[True]._draft_replay) == 1


def test_the_draft_only_steps_train_on_the_updated_policy(pair):
    """The draft-only step's loss is the loss of the draft after the joint step on the hidden states
    of the policy after its optimiser step (recomputed by the embedded model), not the old policy's."""
    target, draft_dir = pair
    # positive advantages: the random rollout log-probs sit above the policy's, so only these leave
    # the PPO ratio unclipped (a non-zero policy gradient)
    batch = make_batch(n=2, advantages=[1.0, 2.0])
    kw = dict(micro_batch_size=0, lr=1e-2, draft_replay_batches=0)  # a policy step large enough to tell apart
    joint_only = Trainer(config(draft_dir, True, draft_steps_per_rollout=1, **kw), target)
    joint_only.train_step(batch)  # the policy and the draft the second trainer holds before its draft-only step
    got = Trainer(config(draft_dir, True, draft_steps_per_rollout=2, **kw), target).train_step(batch)[
        "train/draft_final_loss"]
    draft = joint_only.draft.module
    updated = reference_draft_loss(embedded_model(target, joint_only.named_hf_weights()), draft, batch, "ce")
    old = reference_draft_loss(embedded_model(target), draft, batch, "ce")
    assert abs(got - updated) <= loss_bound(target, updated)
    assert abs(got - old) > loss_bound(target, old)  # the negative control: the old policy's states differ


def test_a_step_moves_the_draft_and_sends_it_under_its_wire_names(pair):
    target, draft_dir = pair
    trainer = Trainer(config(draft_dir, True), target)
    before = {n: p.clone() for n, p in trainer.draft.module.state_dict().items()}
    metrics = trainer.train_step(make_batch())
    assert metrics["train/draft_grad_norm"] > 0
    sent = {n[len(EAGLE3.wire_prefix):]: t for n, t in trainer.named_hf_weights() if n.startswith(EAGLE3.wire_prefix)}
    assert sent.keys() == before.keys()
    assert any(not torch.equal(sent[n], before[n]) for n in sent)
    assert all(torch.equal(sent[n], p) for n, p in trainer.draft.module.state_dict().items())


def test_save_and_load_keep_the_draft_and_its_optimizer_state(pair, tmp_path):
    target, draft_dir = pair
    # the replayed batches are not checkpointed (they refill after a resume): none here, so the
    # next step must be the same on both
    trainer = Trainer(config(draft_dir, True, draft_replay_batches=0), target)
    trainer.train_step(make_batch())
    trainer.save(str(tmp_path / "ckpt"))
    resumed = Trainer(config(draft_dir, True, draft_replay_batches=0), target, load=str(tmp_path / "ckpt"))
    for (n, a), (_, b) in zip(trainer.draft.module.state_dict().items(), resumed.draft.module.state_dict().items()):
        assert torch.equal(a, b), n
    a, b = trainer.draft.part.optimizer.state_dict(), resumed.draft.part.optimizer.state_dict()
    assert a["state"].keys() == b["state"].keys()
    assert all(torch.equal(a["state"][k]["exp_avg"], b["state"][k]["exp_avg"]) for k in a["state"])
    # the next step is the same on both
    batch = make_batch(seed=3)
    trainer.train_step(batch)
    resumed.train_step(batch)
    for (n, x), (_, y) in zip(trainer.draft.module.state_dict().items(), resumed.draft.module.state_dict().items()):
        assert torch.equal(x, y), n


def test_a_checkpoint_of_the_earlier_layout_still_resumes_its_draft(pair, tmp_path):
    """Checkpoints written before the draft state had a kind held `eagle3_draft.pt` without one."""
    import os

    from trainer.drafts import DRAFT_STATE_FILE

    target, draft_dir = pair
    trainer = Trainer(config(draft_dir, True, draft_replay_batches=0, draft_steps_per_rollout=1), target)
    trainer.train_step(make_batch())
    path = str(tmp_path / "ckpt")
    trainer.save(path)
    state = torch.load(os.path.join(path, DRAFT_STATE_FILE), weights_only=False)
    assert state.pop("kind") == "eagle3"
    torch.save(state, os.path.join(path, "eagle3_draft.pt"))
    os.remove(os.path.join(path, DRAFT_STATE_FILE))
    resumed = Trainer(config(draft_dir, True, draft_replay_batches=0, draft_steps_per_rollout=1), target, load=path)
    for (n, a), (_, b) in zip(trainer.draft.module.state_dict().items(), resumed.draft.module.state_dict().items()):
        assert torch.equal(a, b), n
