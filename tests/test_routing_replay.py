"""Rollout routing replay (--use-rollout-routing-replay) on GLM-4.5 and DeepSeek-V3 checkpoints.

References: the rollout's routes against a direct recomputation on the final sequence (the module
model's hidden states through vime/models/moe_routing.py `route`), and plain decoding's routes;
the routes the trainer applies, read from megatron's routers' own output (their routing map and
gate weights), against the rollout's and against the trainer's own scores; the MTP layer's
router against its own top-k of its own scores; a run without replay for the MTP layer's loss
and gradients and for the policy's log-probs when every route agrees.

Two fp32 forwards of one model may choose differently only where the choice is a near tie: a
decision margin (k-th vs next expert, or the last kept group vs the next) within the bound two
reduction orders can move the router's scores (`near_tie_bound`). Those positions are exempt and
counted, so a test that exempts most of them fails.
"""
import pytest
import torch

from bad_input_helpers import refused
from fp32_bounds import FP32_UNIT_ROUNDOFF, forward_depth, reduction_rtol
from moe_fixtures import write_checkpoint
from rollout.embedded.engine import EngineConfig
from rollout.embedded.engine_builder import build_engine
from rollout.sampling_params import SamplingParams
from trainer.batch import build_batch
from trainer.config import TrainerConfig
from trainer.model import forward
from trainer.routing_replay import decoder_moe_routers
from trainer.trainer import Trainer
from trainer_fixtures import engine_model
from vime.models.draft_kinds import is_draft_name
from vime.models.hf_format import read_config
from vime.models.moe_routing import route
from vime.models.routing_replay import NO_ROUTE, route_dtype
from vime.sample import samples_for_prompts

FAMILIES = {"glm4_moe": dict(seed=31), "deepseek_v3": dict(seed=32)}
PROMPTS = [[1, 5, 6, 7], [1, 9, 3], [1, 4, 4, 8, 2 + 9], [1, 12]]
MTP_K2 = {"method": "mtp", "num_speculative_tokens": 2}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def ckpt(request, tmp_path_factory):
    path = str(tmp_path_factory.mktemp(f"r3_{request.param}"))
    write_checkpoint(path, request.param, **FAMILIES[request.param])
    return path


def rollout(ckpt, spec=None, temperature=1.0, n=2, max_new_tokens=12):
    engine = build_engine(ckpt, spec, EngineConfig(max_batch_size=8))
    samples = samples_for_prompts(PROMPTS, n=n)
    engine.generate(samples, SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens, seed=5))
    for i, s in enumerate(samples):
        s.advantage = float(i % 3) - 1.0
    return samples


# ---------------------------------------------------------------- the reference routes
def decision_margin(logits, bias, moe):
    """[T]: the smallest gap a route's choice rests on (the k-th vs the next allowed biased score,
    and with expert groups the last kept group's score vs the next)."""
    biased = logits.float().sigmoid() + bias.float()
    tokens, experts = biased.shape
    margin = torch.full((tokens,), float("inf"))
    allowed = torch.ones_like(biased, dtype=torch.bool)
    if moe.n_group > 1:
        groups = biased.view(tokens, moe.n_group, -1).topk(2, dim=-1).values.sum(-1).sort(-1, descending=True)
        margin = groups.values[:, moe.topk_group - 1] - groups.values[:, moe.topk_group]
        keep = torch.zeros(tokens, moe.n_group, dtype=torch.bool)
        keep.scatter_(1, groups.indices[:, :moe.topk_group], True)
        allowed = keep.repeat_interleave(experts // moe.n_group, dim=1)
    ranked = biased.masked_fill(~allowed, float("-inf")).sort(-1, descending=True).values
    k = moe.num_experts_per_tok
    return torch.minimum(margin, ranked[:, k - 1] - ranked[:, k])


def near_tie_bound(cfg, context, max_abs_router_logit):
    """How far two fp32 forwards differing in reduction order can move a decision margin: each router
    logit by the chained reduction bound of the model, a sigmoid score by a quarter of that, a margin
    (a difference of sums of two scores) by four scores' worth; doubled for the two forwards."""
    widths = [cfg.hidden_size, cfg.intermediate_size, 2 * cfg.hidden_size, context]
    if cfg.mla:
        widths += [cfg.mla.latent_width, cfg.num_attention_heads * cfg.mla.v_head_dim]
    logit_error = reduction_rtol(max(widths), forward_depth(cfg.num_hidden_layers + 1)) * max_abs_router_logit
    return 2 * 4 * logit_error / 4


def reference_routes(ckpt, sample):
    """(routes [S-1, layers, k], margins [S-1, layers], largest |router logit|) of the sample's final
    sequence: the module model's hidden states, the routers recomputed with moe_routing.route."""
    model = engine_model(ckpt)
    cfg = model.cfg
    captured = []
    moe_layers = [layer.mlp for layer in model.model.layers[:cfg.num_hidden_layers] if hasattr(layer.mlp, "gate")]
    hooks = [m.register_forward_pre_hook(lambda mod, args: captured.append((mod, args[0]))) for m in moe_layers]
    tokens = torch.tensor([sample.tokens])
    with torch.no_grad():
        model(tokens, torch.arange(tokens.shape[1])[None])
    for h in hooks:
        h.remove()
    routes, margins, largest = [], [], 0.0
    for mod, x in captured:
        mod.gate.requires_grad_(False)
        logits = x.reshape(-1, x.shape[-1]).float() @ mod.gate.weight.float().t()
        routes.append(route(logits, mod.gate.e_score_correction_bias, cfg.moe)[1][:-1])
        margins.append(decision_margin(logits, mod.gate.e_score_correction_bias, cfg.moe)[:-1])
        largest = max(largest, logits.abs().max().item())
    return torch.stack(routes, 1), torch.stack(margins, 1), largest


def same_sets(a, b):
    return (a.long().sort(-1).values == b.long().sort(-1).values).all(-1)


def assert_routes_match_except_near_ties(pairs):
    """pairs: (got routes, want routes, want's margins, near-tie bound) per sample."""
    exempt = total = 0
    for got, want, margins, bound in pairs:
        differ = ~same_sets(got, want)
        assert not (differ & (margins > bound)).any(), f"{int((differ & (margins > bound)).sum())} routes differ"
        exempt, total = exempt + int((margins <= bound).sum()), total + margins.numel()
    assert exempt < 0.05 * total  # the exemption stays rare


# ---------------------------------------------------------------- rollout
def test_embedded_routes_are_small_integers_for_every_position_but_the_last(ckpt):
    cfg = read_config(ckpt)
    for s in rollout(ckpt, MTP_K2):
        moe_layers = cfg.num_hidden_layers - cfg.moe.first_k_dense_replace
        assert s.routed_experts.shape == (len(s.tokens) - 1, moe_layers, cfg.moe.num_experts_per_tok)
        assert s.routed_experts.dtype == route_dtype(cfg.moe.n_routed_experts) == torch.uint8
        assert int(s.routed_experts.max()) < cfg.moe.n_routed_experts
    assert route_dtype(257) == torch.int16


def test_speculative_rollout_routes_equal_a_recomputation_on_the_final_sequence(ckpt):
    """Sampled MTP speculation (k = 2, rejections included): last write wins per position, so each
    recorded route is that of the token the sample finally holds there."""
    cfg = read_config(ckpt)
    samples = rollout(ckpt, MTP_K2)
    assert sum(s.spec.draft_tokens - s.spec.accepted_tokens for s in samples) > 0  # some drafts were rejected
    pairs = []
    for s in samples:
        want, margins, largest = reference_routes(ckpt, s)
        pairs.append((s.routed_experts, want, margins, near_tie_bound(cfg, len(s.tokens), largest)))
    assert_routes_match_except_near_ties(pairs)


def test_speculative_rollout_routes_equal_plain_decodings(ckpt):
    cfg = read_config(ckpt)
    plain = rollout(ckpt, None, temperature=0.0)
    spec = rollout(ckpt, MTP_K2, temperature=0.0)
    pairs = []
    for p, s in zip(plain, spec):
        assert p.tokens == s.tokens
        _, margins, largest = reference_routes(ckpt, p)
        pairs.append((s.routed_experts, p.routed_experts, margins, near_tie_bound(cfg, len(p.tokens), largest)))
    assert_routes_match_except_near_ties(pairs)


# ---------------------------------------------------------------- trainer
class RouterTap:
    """What megatron's routers output in a forward: per router, (its input's own route by
    moe_routing.route on the router's logits, routing map [T, E], gate weights [T, E])."""

    def __init__(self, routers, moe):
        self.seen, self.moe = [], moe
        self.handles = [r.register_forward_hook(self._hook) for r in routers]

    def _hook(self, router, inputs, output):
        with torch.no_grad():
            logits = router.gating(inputs[0]).reshape(-1, router.config.num_moe_experts).float()
            own = route(logits, router.expert_bias, self.moe)[1]
            self.seen.append((own, output[1].detach(), output[0].detach(), logits))

    def close(self):
        for h in self.handles:
            h.remove()


def distinct_random_routes(shape, num_experts, seed):
    """[..., k] random expert sets (k distinct experts each), as int16 routes."""
    g = torch.Generator().manual_seed(seed)
    flat = torch.stack([torch.randperm(num_experts, generator=g)[:shape[-1]]
                        for _ in range(int(torch.tensor(shape[:-1]).prod()))])
    return flat.view(*shape).to(torch.int16)


def test_with_replay_the_trainer_applies_the_rollout_routes_with_its_own_gate_weights(ckpt):
    """Routes unlike the trainer's own (random sets): megatron's routers dispatch to exactly those
    experts at every (position, MoE layer) that has one, with gate weights = the trainer's own sigmoid
    scores there, normalised and scaled; the router weights still get gradients."""
    batch = build_batch(rollout(ckpt, MTP_K2))
    moe = read_config(ckpt).moe
    batch.routed_experts = torch.where(batch.routed_experts == NO_ROUTE, batch.routed_experts,
                                       distinct_random_routes(batch.routed_experts.shape, moe.n_routed_experts, 1))
    metrics = assert_trainer_applies_the_batch_routes(ckpt, batch)
    assert metrics["train/route_disagreement"] > 0.5  # random sets: the trainer's own mostly differ


def assert_trainer_applies_the_batch_routes(ckpt, batch):
    """One replayed training step on `batch`: every routed (position, MoE layer) dispatches to the batch's
    experts with the trainer's own gate weights, the rest to the trainer's own choice; returns its metrics."""
    moe = read_config(ckpt).moe
    trainer = Trainer(TrainerConfig(use_rollout_routing_replay=True), ckpt)
    tap = RouterTap(decoder_moe_routers(trainer.model), moe)
    metrics = trainer.backward(batch)
    tap.close()
    for i, (own, routing_map, gates, logits) in enumerate(tap.seen):
        target = batch.routed_experts[:, :, i].transpose(0, 1).reshape(-1, moe.num_experts_per_tok).long()
        has = (target != NO_ROUTE).all(-1)
        want_map = torch.zeros_like(routing_map).scatter_(1, target.clamp(min=0), True)
        assert torch.equal(routing_map[has], want_map[has])
        assert torch.equal(routing_map[~has], torch.zeros_like(routing_map[~has]).scatter_(1, own[~has], True))
        scores = logits.sigmoid() * want_map
        want_gates = scores / scores.sum(-1, keepdim=True) * moe.routed_scaling_factor
        # the same scores on both sides, then a sigmoid (<= 2 ulp), a k-term sum, a division and the
        # scaling: each side is within (3 + k) roundings of exact, so the two within twice that
        rtol = 2 * (3 + moe.num_experts_per_tok) * FP32_UNIT_ROUNDOFF
        assert torch.allclose(gates[has], want_gates[has], rtol=rtol, atol=rtol * moe.routed_scaling_factor)
    for router in decoder_moe_routers(trainer.model):
        assert router.weight.main_grad.abs().sum() > 0
    return metrics


def test_route_disagreement_counts_the_routes_whose_expert_set_differs_from_the_rollouts(ckpt):
    """The logged share against the routers' own choices read from their output (no replay), for
    the rollout's routes (the same fp32 model: differences only at near ties) and random ones."""
    samples = rollout(ckpt, MTP_K2)
    moe = read_config(ckpt).moe
    trainer = Trainer(TrainerConfig(), ckpt)
    for seed in (None, 2):
        batch = build_batch(samples)
        if seed is not None:
            batch.routed_experts = torch.where(batch.routed_experts == NO_ROUTE, batch.routed_experts,
                                               distinct_random_routes(batch.routed_experts.shape,
                                                                      moe.n_routed_experts, seed))
        tap = RouterTap(decoder_moe_routers(trainer.model), moe)
        share = trainer.backward(batch)["train/route_disagreement"]
        tap.close()
        diff = total = 0
        for i, (_, routing_map, _, _) in enumerate(tap.seen):
            target = batch.routed_experts[:, :, i].transpose(0, 1).reshape(-1, moe.num_experts_per_tok).long()
            has = (target != NO_ROUTE).all(-1)
            want_map = torch.zeros_like(routing_map).scatter_(1, target.clamp(min=0), True)
            diff += int((routing_map[has] != want_map[has]).any(-1).sum())
            total += int(has.sum())
        assert share == pytest.approx(diff / total, abs=1e-12)
        assert (share < 0.05) if seed is None else (share > 0.5)


def own_routes(trainer, batch):
    """The trainer's own routes of `batch` (no replay), as rollout routes: NO_ROUTE where the batch has none."""
    moe = trainer.model_cfg.moe
    tap = RouterTap(decoder_moe_routers(trainer.model), moe)
    with torch.no_grad():
        forward(trainer.model, batch.tokens)
    tap.close()
    b, s = batch.tokens.shape
    own = torch.stack([o.view(s, b, -1).transpose(0, 1) for o, _, _, _ in tap.seen], 2).to(torch.int16)
    return torch.where(batch.routed_experts == NO_ROUTE, batch.routed_experts, own)


def test_policy_logprobs_under_replay_of_the_trainers_own_routes_equal_those_without(ckpt):
    batch = build_batch(rollout(ckpt, MTP_K2))
    without = Trainer(TrainerConfig(), ckpt)
    batch.routed_experts = own_routes(without, batch)
    with_r3 = Trainer(TrainerConfig(use_rollout_routing_replay=True), ckpt)
    assert torch.equal(with_r3.compute_logprobs(batch), without.compute_logprobs(batch))


def test_mtp_layer_trains_under_replay_exactly_as_without_where_every_route_agrees(ckpt):
    """Loss and gradients of the MTP layer (and the policy) equal a run without replay on a batch whose
    routes are the trainer's own; its router routes by its own scores even when the decoder's
    routes are replaced (its layer number collides with a decoder layer's: it must not take them)."""
    batch = build_batch(rollout(ckpt, MTP_K2))
    runs = {}
    for r3 in (False, True):
        trainer = Trainer(TrainerConfig(use_rollout_routing_replay=r3, enable_mtp_training=True), ckpt)
        batch.routed_experts = own_routes(trainer, batch)
        metrics = trainer.backward(batch)
        grads = {n: g.clone() for n, g in trainer.named_gradients().items()}
        runs[r3] = (metrics, grads)
    (m0, g0), (m1, g1) = runs[False], runs[True]
    assert m1["train/mtp_loss"] == m0["train/mtp_loss"] and m1["train/policy_loss"] == m0["train/policy_loss"]
    assert g0.keys() == g1.keys() and any(n.startswith("mtp.") for n in g0)
    for name in g0:
        assert torch.equal(g0[name], g1[name]), name

    # decoder routes replaced by random sets: the MTP router still takes its own top-k of its own scores
    moe = trainer.model_cfg.moe
    batch.routed_experts = torch.where(batch.routed_experts == NO_ROUTE, batch.routed_experts,
                                       distinct_random_routes(batch.routed_experts.shape, moe.n_routed_experts, 3))
    mtp_routers = [m for n, m in trainer.model.named_modules() if n.startswith("mtp.") and n.endswith("router")]
    assert mtp_routers
    tap = RouterTap(mtp_routers, moe)
    trainer.backward(batch)
    tap.close()
    for own, routing_map, _, _ in tap.seen:
        assert torch.equal(routing_map, torch.zeros_like(routing_map).scatter_(1, own, True))


# ---------------------------------------------------------------- bad input
def test_routing_replay_on_a_dense_model_is_refused():
    refused(["--use-rollout-routing-replay"], "--use-rollout-routing-replay", "dense model", "drop the flag")


# ---------------------------------------------------------------- bf16
def test_under_bf16_the_router_bias_is_held_and_synced_fp32_from_the_first_push(ckpt):
    """The bucket layout of a run's pushes is fixed at its first push, before any forward: the
    trainer's expert bias must be fp32 by then (megatron makes it fp32 only in its first forward),
    and the bf16 engine must hold it fp32, or the bias is rounded in transit and on arrival and the
    sync guard stops the run after the first step (its checksums of the bias differ)."""
    from rollout.backend import EmbeddedBackend
    from trainer_fixtures import make_batch
    from vime import weight_sync

    trainer = Trainer(TrainerConfig(bf16=True, moe_router_bias_update_rate=1e-2), ckpt)
    named = dict(trainer.named_hf_weights())
    biases = [n for n in named if n.endswith("e_score_correction_bias")]
    assert biases and all(named[n].dtype == torch.float32 for n in biases)
    layout = weight_sync.bucket_layout(list(named.items()), 1 << 12)
    backend = EmbeddedBackend(ckpt, None, 4, dtype=torch.bfloat16)
    trainer.train_step(make_batch(seed=1))  # the bias moves by 1e-2: not a bf16-representable step near 0.1
    named = dict(trainer.named_hf_weights())
    wire = [pair for bucket in layout for pair in
            weight_sync.unflatten_bucket(bucket, weight_sync.flatten_bucket(bucket, named))]
    backend.load_weights(wire, 1)
    held = dict(backend.engine.named_weights())
    for n in biases:
        assert held[n].dtype == torch.float32 and torch.equal(held[n], named[n]), n
    layers = trainer.model_cfg.num_hidden_layers
    assert backend.fingerprint()["target"] == weight_sync.checksum(
        [(n, t) for n, t in named.items() if not is_draft_name(n, layers)])
