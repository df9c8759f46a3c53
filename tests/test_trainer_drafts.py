"""Every draft kind (MTP layers, external EAGLE-3, DFlash and DSpark drafts) trains through the Trainer's one
step loop: each kind's loss equals its own formula recomputed by an independent implementation (the
embedded engine's model or transformers, cache-free), the policy's loss, gradients and update are
bit-identical with and without the draft, and a shared knob left unset takes the kind's own default."""
import math
import os

import pytest
import torch
import torch.nn.functional as F

from dflash_fixtures import reference_block_logits, reference_block_states
from draft_kind_fixtures import REPO, random_draft
from eagle3_fixtures import reference_ttt_losses
from fp32_bounds import reduction_rtol
from mtp_oracles import reference_mtp_hidden
from rollout.embedded.model import CausalLMWithMTP
from vime.spec_config import parse_spec_config
from trainer.config import TrainerConfig
from trainer.drafts import DRAFT_TRAINERS
from trainer.trainer import Trainer
from trainer_fixtures import make_batch, make_tiny
from mtp.dflash import DFlashDraft
from vime.models import dflash as dflash_format
from vime.models.dspark import DSPARK
from vime.models.draft_kinds import DRAFT_KINDS
from vime.models.eagle3 import EAGLE3
from vime.models.hf_format import load_hf_checkpoint, read_config

TTT_STEPS = 3


@pytest.fixture(scope="module")
def mtp_target(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("drafts_mtp_target"))
    make_tiny(path, seed=1)
    return path


@pytest.fixture(scope="module")
def eagle3_pair(tmp_path_factory):
    """A 2-layer Qwen2 target without MTP layers and a random EAGLE-3 draft reading its layers 0, 1, 2."""
    target = str(tmp_path_factory.mktemp("drafts_qwen2_target"))
    make_tiny(target, seed=1, family="qwen2", num_nextn_predict_layers=0)
    draft = random_draft(EAGLE3, read_config(target), seed=2, std=0.05, layers=(0, 1, 2))
    path = str(tmp_path_factory.mktemp("drafts_eagle3"))
    EAGLE3.save(path, draft.cfg, draft.state_dict())
    return target, path, draft


@pytest.fixture(scope="module")
def dflash_pair(tmp_path_factory):
    """A 3-layer Qwen2 target and a random two-layer DFlash draft (blocks of TTT_STEPS + 1) reading the
    outputs of its layers 0 and 1 (below the last, whose transformers state is after the final norm)."""
    target = str(tmp_path_factory.mktemp("drafts_dflash_target"))
    make_tiny(target, seed=1, family="qwen2", num_nextn_predict_layers=0, num_hidden_layers=3)
    torch.manual_seed(3)
    cfg = dflash_format.draft_config_for_target(read_config(target), num_layers=2, block_size=TTT_STEPS + 1,
                                                target_layer_ids=(0, 1))
    draft = DFlashDraft(cfg)
    with torch.no_grad():
        for p in draft.parameters():  # norms perturbed too, so that each matters
            p.normal_(0, 0.05) if p.dim() == 2 else p.add_(torch.randn(p.shape) * 0.3)
    path = str(tmp_path_factory.mktemp("drafts_dflash"))
    dflash_format.DFLASH.save(path, cfg, draft.state_dict())
    return target, path


@pytest.fixture(scope="module")
def dspark_pair(dflash_pair, tmp_path_factory):
    """dflash_pair's target and a random two-layer DSpark draft on the same layers (blocks of TTT_STEPS slots,
    its confidence head reading the Markov embedding too)."""
    target = dflash_pair[0]
    draft = random_draft(DSPARK, read_config(target), seed=4, std=0.05, k=TTT_STEPS, layers=(0, 1))
    path = str(tmp_path_factory.mktemp("drafts_dspark"))
    DSPARK.save(path, draft.cfg, draft.state_dict())
    return target, path


@pytest.fixture(params=sorted(DRAFT_TRAINERS))
def kind(request, mtp_target, eagle3_pair, dflash_pair, dspark_pair):
    """(kind, target checkpoint, the TrainerConfig settings that train that kind)."""
    if request.param == "mtp":
        return "mtp", mtp_target, dict(enable_mtp_training=True)
    target, draft_dir = {"eagle3": eagle3_pair[:2], "dflash": dflash_pair, "dspark": dspark_pair}[request.param]
    spec = parse_spec_config({"method": request.param, "model": draft_dir, "num_speculative_tokens": TTT_STEPS})
    return request.param, target, dict(enable_draft_training=True, speculative_config=spec)


def engine_model(target):
    """The embedded engine's model: an implementation of the target that shares no code with megatron's."""
    cfg, state, _ = load_hf_checkpoint(target)
    model = CausalLMWithMTP(cfg)
    model.load_state_dict(state, strict=False)
    return model.eval()


def reference_mtp_loss(model, batch, mask_of=lambda m, t: m[t + 1] * m[t + 2]):
    """Token-mean cross-entropy of MTP depth 1 at position t on token t+2, over the positions where
    `mask_of(loss mask row, t)` holds (the MTP loss: the fed token t+1 and the label t+2 both trained)."""
    total, count = 0.0, 0
    for b in range(batch.tokens.shape[0]):
        ids = batch.tokens[b].tolist()
        with torch.inference_mode():
            logits = model.logits(reference_mtp_hidden(model, ids, num_layers=1)[0])[0]  # row t predicts t+2
        for t in range(len(ids) - 2):
            if mask_of(batch.loss_mask[b], t):
                total += float(F.cross_entropy(logits[t], batch.tokens[b, t + 2]))
                count += 1
    return total / count


def loss_tolerance(target, expected):
    """Two fp32 implementations (reduction order differs): the trunk's reductions (4 per layer), the
    draft's layer and heads (9 more), the longest over the vocabulary or the 3H-wide fc (Higham)."""
    cfg = read_config(target)
    longest = max(cfg.intermediate_size, 3 * cfg.hidden_size, cfg.vocab_size)
    return reduction_rtol(longest, 4 * cfg.num_hidden_layers + 13) * max(1.0, abs(expected))


def slot_loss(loss_type, draft_logits, token, policy_logits):
    """One block slot's loss from its definition: cross-entropy against the token, or against the
    policy's distribution p of it (soft_ce: -sum p log q; tv: half the L1 distance of q and p)."""
    q = torch.softmax(draft_logits.double(), -1)
    p = torch.softmax(policy_logits.double(), -1)
    return {"ce": lambda: -float(q[token].log()), "soft_ce": lambda: -float((p * q.log()).sum()),
            "tv": lambda: 0.5 * float((q - p).abs().sum())}[loss_type]()


def block_decay(slots):
    """The DFlash paper's loss decay for its blocks of 16, 10 and 8 slots, half the block otherwise: the
    decay of a block drafting slots - 1 tokens (a DSpark block drafting as many has one slot fewer)."""
    return {16: 7.0, 10: 5.0, 8: 4.0}.get(slots, max(1.0, slots / 2))


def reference_dflash_losses(target, draft_dir, tokens, loss_mask, weigh=True, loss_type="ce"):
    """DFlash's block objective from its definition, every block recomputed from scratch on transformers'
    states (dflash_fixtures): a block at every anchor a >= 1 whose next token is a response token, slot
    i >= 1 predicting token a+i where it is a response token (the policy's distribution of it: its
    logits at a+i-1, temperature 1), its loss weighted by exp(-(i-1)/gamma).
    Returns (weighted mean over all slots of the batch, per-slot mean [k]); weigh=False: every slot weighs 1."""
    import json
    import os

    from safetensors.torch import load_file
    from transformers import Qwen2ForCausalLM

    model = Qwen2ForCausalLM.from_pretrained(target, torch_dtype=torch.float32).eval()
    with open(os.path.join(draft_dir, "config.json")) as f:
        cfg = json.load(f)
    state = load_file(os.path.join(draft_dir, "model.safetensors"))
    size = cfg["block_size"]
    gamma = block_decay(size) if weigh else float("inf")
    weighted, weights = 0.0, 0.0
    slot_sum, slot_count = [0.0] * (size - 1), [0] * (size - 1)
    for b in range(tokens.shape[0]):
        ids, mask = tokens[b].tolist(), loss_mask[b].tolist()
        with torch.no_grad():
            policy = model(tokens[b:b + 1]).logits[0]
        for a in range(1, len(ids) - 1):
            if not mask[a + 1]:
                continue
            logits = reference_block_logits(model, state, cfg, ids[:a + 1])
            for i in range(1, size):
                if a + i < len(ids) and mask[a + i]:
                    ce = slot_loss(loss_type, logits[i], ids[a + i], policy[a + i - 1])
                    w = math.exp(-(i - 1) / gamma)
                    weighted, weights = weighted + w * ce, weights + w
                    slot_sum[i - 1] += ce
                    slot_count[i - 1] += 1
    return weighted / weights, [x / max(n, 1) for x, n in zip(slot_sum, slot_count)]


def reference_dspark_losses(target, draft_dir, tokens, loss_mask, weights):
    """DSpark's objective from its definition, every block recomputed from scratch on transformers' states
    (dflash_fixtures): a block at every anchor a >= 1 whose next token is a response token, slot i >= 0
    predicting token a+i+1 where it is a response token, from its state through the target's head plus
    the Markov bias of the true token a+i; the terms: cross-entropy of that token, L1 distance to the
    policy's distribution of it (its logits at a+i, temperature 1), and the binary cross-entropy of the
    confidence against 1 - L1/2; slot i weighted exp(-i/gamma), gamma that of a DFlash block drafting as many
    tokens. Returns (weighted mean, per-slot mean)."""
    import json

    from safetensors.torch import load_file
    from transformers import Qwen2ForCausalLM

    model = Qwen2ForCausalLM.from_pretrained(target, torch_dtype=torch.float32).eval()
    with open(os.path.join(draft_dir, "config.json")) as f:
        cfg = json.load(f)
    state = {k: v.double() for k, v in load_file(os.path.join(draft_dir, "model.safetensors")).items()}
    size, head = cfg["block_size"], model.lm_head.weight.detach().double()
    w1, w2 = state["markov_head.markov_w1.weight"], state["markov_head.markov_w2.weight"]
    proj_w, proj_b = state["confidence_head.proj.weight"][0], state["confidence_head.proj.bias"][0]
    gamma = block_decay(size + 1)  # as many drafts as a DFlash block of size + 1
    weighted, total_weight = 0.0, 0.0
    slot_sum, slot_count = [0.0] * size, [0] * size
    for b in range(tokens.shape[0]):
        ids, mask = tokens[b].tolist(), loss_mask[b].tolist()
        with torch.no_grad():
            policy = torch.softmax(model(tokens[b:b + 1]).logits[0].double(), -1)
        for a in range(1, len(ids) - 1):
            if not mask[a + 1]:
                continue
            states = reference_block_states(model, load_file(os.path.join(draft_dir, "model.safetensors")), cfg,
                                            ids[:a + 1], cfg["target_layer_ids"],
                                            [cfg["dspark_noise_token_id"]] * (size - 1)).double()
            for i in range(size):
                p = a + i + 1
                if p >= len(ids) or not mask[p]:
                    continue
                logits = states[i] @ head.T + w2 @ w1[ids[a + i]]
                ce = -float(torch.log_softmax(logits, -1)[ids[p]])
                l1 = float((torch.softmax(logits, -1) - policy[a + i]).abs().sum())
                c = float(torch.cat([states[i], w1[ids[a + i]]]) @ proj_w + proj_b)
                label = 1 - l1 / 2
                bce = -(label * math.log(1 / (1 + math.exp(-c))) + (1 - label) * math.log(1 / (1 + math.exp(c))))
                loss = weights["ce"] * ce + weights["l1"] * l1 + weights["confidence"] * bce
                w = math.exp(-i / gamma)
                weighted, total_weight = weighted + w * loss, total_weight + w
                slot_sum[i] += loss
                slot_count[i] += 1
    return weighted / total_weight, [x / max(n, 1) for x, n in zip(slot_sum, slot_count)]


def test_each_kind_trains_through_the_one_step_loop_on_its_own_loss_formula(kind, eagle3_pair):
    name, target, settings = kind
    batch = make_batch(n=3)
    # the whole batch in one micro-batch: EAGLE-3's loss is a mean per micro-batch
    trainer = Trainer(TrainerConfig(micro_batch_size=0, draft_steps_per_rollout=2, **settings), target)
    if name in ("dflash", "dspark"):  # a block at every anchor the responses offer: no sampling left
        trainer.draft.anchors_per_sequence = batch.tokens.shape[1]
        losses = []
        trainer.draft.loss = lambda inputs, own=trainer.draft.loss: losses.append(own(inputs)) or losses[-1]
    metrics = trainer.train_step(batch)  # the reported losses are the joint step's, before it moved anything
    model = engine_model(target)
    if name == "mtp":
        want = reference_mtp_loss(model, batch)
        got = metrics["train/mtp_1_loss"]
        assert metrics["train/mtp_loss"] == got and metrics["train/mtp_grad_norm"] > 0
        # negative control: counting positions whose fed token is a prompt token changes the loss
        other = reference_mtp_loss(model, batch, mask_of=lambda m, t: m[t + 2])
        assert abs(other - want) > loss_tolerance(target, other)
        assert abs(got - want) <= loss_tolerance(target, want)
    elif name == "dflash":
        draft_dir = settings["speculative_config"].model
        want, per_slot = reference_dflash_losses(target, draft_dir, batch.tokens, batch.loss_mask)
        assert abs(float(losses[0][0].detach()) - want) <= loss_tolerance(target, want)
        for slot, want_slot in enumerate(per_slot, start=1):
            assert abs(metrics[f"train/draft_{slot}_loss"] - want_slot) <= loss_tolerance(target, want_slot), slot
        # negative control: the same slots unweighted give another loss
        unweighted, _ = reference_dflash_losses(target, draft_dir, batch.tokens, batch.loss_mask, weigh=False)
        assert abs(unweighted - want) > loss_tolerance(target, want)
        assert metrics["train/draft_grad_norm"] > 0
    elif name == "dspark":
        draft_dir = settings["speculative_config"].model
        recipe = dict(DSPARK.loss_weights)
        want, per_slot = reference_dspark_losses(target, draft_dir, batch.tokens, batch.loss_mask, recipe)
        assert abs(float(losses[0][0].detach()) - want) <= loss_tolerance(target, want)
        for slot, want_slot in enumerate(per_slot, start=1):
            assert abs(metrics[f"train/draft_{slot}_loss"] - want_slot) <= loss_tolerance(target, want_slot), slot
        # negative control: other weights of the same terms give another loss
        other, _ = reference_dspark_losses(target, draft_dir, batch.tokens, batch.loss_mask,
                                           dict(recipe, ce=1.0, l1=0.0))
        assert abs(other - want) > loss_tolerance(target, want)
        assert metrics["train/draft_grad_norm"] > 0
    else:
        wants = reference_ttt_losses(model, eagle3_pair[2], batch.tokens, batch.loss_mask, TTT_STEPS)
        for step, want in enumerate(wants, start=1):
            assert abs(metrics[f"train/draft_{step}_loss"] - want) <= loss_tolerance(target, want), step
        assert metrics["train/draft_grad_norm"] > 0
    assert metrics["train/draft_final_loss"] > 0  # the same loop's draft-only step ran


def test_the_policy_loss_gradients_and_update_are_bit_identical_with_and_without_the_draft(kind):
    name, target, settings = kind
    extra = dict(draft_steps_per_rollout=3, draft_replay_batches=1, micro_batch_size=2)
    trainers = {on: Trainer(TrainerConfig(**extra, **(settings if on else {})), target) for on in (False, True)}
    first = {on: t.backward(make_batch(seed=0)) for on, t in trainers.items()}
    assert first[True]["train/policy_loss"] == first[False]["train/policy_loss"]
    off, on = ({n: g for n, g in trainers[e].named_gradients().items() if not n.startswith("mtp.")}
               for e in (False, True))
    assert off.keys() == on.keys() and all(torch.equal(on[n], off[n]) for n in off)
    draft_params = trainers[True].draft.part.parameters()  # the draft's own part (trainer/optimizer.py)
    assert any(p.main_grad.abs().max() > 0 for p in draft_params)  # and it did train
    for seed in (0, 1):  # the second step's draft-only steps replay the first step's batch
        m = {e: t.train_step(make_batch(seed=seed)) for e, t in trainers.items()}
        assert m[True]["train/policy_loss"] == m[False]["train/policy_loss"]
        assert m[True]["train/grad_norm"] == m[False]["train/grad_norm"]
    off, on = (dict(trainers[e].named_policy_params()) for e in (False, True))
    assert all(torch.equal(on[n], off[n]) for n in off)
    assert len(trainers[True]._draft_replay) == 1


def test_a_shared_knob_left_unset_takes_the_kinds_own_default(kind):
    name, target, settings = kind
    defaults = DRAFT_KINDS[name].knobs
    assert Trainer(TrainerConfig(**settings), target).draft.knobs == defaults
    given = Trainer(TrainerConfig(draft_lr=3e-4, draft_steps_per_rollout=2, draft_replay_batches=1, **settings), target)
    assert (given.draft.knobs.lr, given.draft.knobs.steps_per_rollout, given.draft.knobs.replay_batches) == (3e-4, 2, 1)
    assert {g["lr"] for g in given.draft.part.optimizer.param_groups} == {3e-4}


@pytest.mark.parametrize("kind", ["eagle3", "dflash", "dspark"], indirect=True)
def test_an_external_drafts_checkpoint_resumes_the_same_next_step(kind, tmp_path):
    """--save/--load keep an external draft's weights, optimizer state, the point its learning rate's warm-up
    reached and whatever it draws from (DFlash's anchors): the resumed trainer's next step moves the draft exactly
    as the original's (2 of 4 warm-up steps taken: a warm-up restarted would step at a third of the rate)."""
    _, target, settings = kind
    cfg = TrainerConfig(draft_replay_batches=0, draft_steps_per_rollout=2, draft_lr_warmup_iters=4,
                        **settings)  # replay is not checkpointed
    trainer = Trainer(cfg, target)
    trainer.train_step(make_batch(seed=0))
    trainer.save(str(tmp_path / "ckpt"))
    resumed = Trainer(cfg, target, load=str(tmp_path / "ckpt"))
    if kind[0] in ("dflash", "dspark"):  # fewer blocks than the responses offer: which anchors is drawn
        trainer.draft.anchors_per_sequence = resumed.draft.anchors_per_sequence = 2
    batch = make_batch(seed=3)
    m = {"original": trainer.train_step(batch), "resumed": resumed.train_step(batch)}
    assert m["original"]["train/draft_loss"] == m["resumed"]["train/draft_loss"]
    after = [t.draft.module.state_dict() for t in (trainer, resumed)]
    assert after[0].keys() == after[1].keys() and all(torch.equal(after[0][n], after[1][n]) for n in after[0])


@pytest.mark.parametrize("loss_type", ["soft_ce", "tv"])
def test_the_dflash_draft_distils_the_detached_policys_distribution(dflash_pair, loss_type):
    """--draft-loss-type soft_ce / tv: every block slot's loss against the policy's own distribution of
    its token, equal to the definition recomputed on transformers' logits."""
    target, draft_dir = dflash_pair
    spec = parse_spec_config({"method": "dflash", "model": draft_dir, "num_speculative_tokens": TTT_STEPS})
    batch = make_batch(n=3)
    trainer = Trainer(TrainerConfig(micro_batch_size=0, enable_draft_training=True, speculative_config=spec,
                                    draft_loss_type=loss_type), target)
    trainer.draft.anchors_per_sequence = batch.tokens.shape[1]
    metrics = trainer.backward(batch)
    _, per_slot = reference_dflash_losses(target, draft_dir, batch.tokens, batch.loss_mask, loss_type=loss_type)
    for slot, want in enumerate(per_slot, start=1):
        assert abs(metrics[f"train/draft_{slot}_loss"] - want) <= loss_tolerance(target, want), slot
    # negative control: the hard-label loss of the same slots is another figure
    _, hard = reference_dflash_losses(target, draft_dir, batch.tokens, batch.loss_mask)
    assert abs(hard[0] - per_slot[0]) > loss_tolerance(target, per_slot[0])


@pytest.mark.parametrize("family", [pytest.param("glm4_moe", marks=pytest.mark.slow), "deepseek_v3"])  # MoE; + MLA
def test_an_external_draft_trains_on_a_moe_or_mla_policys_aux_hidden_states_as_the_engine_computes_them(family,
                                                                                                       tmp_path):
    """The trainer keeps the aux hidden states of a mixture-of-experts policy (GLM-4.5; DeepSeek-V3 with
    MLA too) as the embedded engine computes them: an EAGLE-3 draft's training-time-test losses on the
    shipped tiny model equal the cache-free reference on the engine's model (megatron-core shares no code
    with it); the same draft reading other layers is the negative control."""
    import dataclasses

    from mtp.eagle3 import Eagle3Draft

    target = os.path.join(REPO, "checkpoints", f"tiny-{family.replace('_', '-')}-mtp")
    draft = random_draft(EAGLE3, read_config(target), seed=2, std=0.05)  # a 5-layer target's default (0, 2, 5)
    EAGLE3.save(str(tmp_path / "draft"), draft.cfg, draft.state_dict())
    spec = parse_spec_config({"method": "eagle3", "model": str(tmp_path / "draft"), "num_speculative_tokens": TTT_STEPS})
    trainer = Trainer(TrainerConfig(micro_batch_size=0, enable_draft_training=True, speculative_config=spec), target)
    batch = make_batch(n=3)
    metrics = trainer.train_step(batch)  # the reported losses are the joint step's, before it moved anything
    model = engine_model(target)
    wants = reference_ttt_losses(model, draft, batch.tokens, batch.loss_mask, TTT_STEPS)
    for step, want in enumerate(wants, start=1):
        assert abs(metrics[f"train/draft_{step}_loss"] - want) <= loss_tolerance(target, want), step
    elsewhere = Eagle3Draft(dataclasses.replace(draft.cfg, aux_layer_ids=(0, 2, 4)))
    elsewhere.load_state_dict(draft.state_dict())
    other = reference_ttt_losses(model, elsewhere.eval(), batch.tokens, batch.loss_mask, 1)[0]
    assert abs(other - wants[0]) > loss_tolerance(target, other)
