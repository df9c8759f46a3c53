"""Rollout routing replay in the megatron-core trainer, and the route-disagreement count.

megatron-core's top-k routing asks the router's `router_replay` object (when it has one) for the
chosen experts: `get_replay_topk(scores, topk, num_groups, group_topk, default_compute_topk)`.
`DecoderRoutes` is such an object, installed on the *decoder's* MoE routers only, found by
module path (`decoder.layers.{i}.mlp.router`). Its answer is always computed from the trainer's
own scores; with replay on, each position that has a rollout route takes the rollout's experts
instead, and the gate weights are then the trainer's own scores gathered at those experts, so
gradients flow through the router as usual. Positions without a rollout route (a sample's last
token, padding) keep the trainer's own choice.

The MTP layers' routers get no such object: megatron numbers an MTP layer's router like decoder
layer k (their `layer_number`s collide), and the rollout's routes are the trunk's, recorded for
the decoder layers only; an MTP router routes by its own scores, with or without replay.

Whether or not it replays, each decoder router keeps its own choice of the last forward, so
`RoutingReplay.disagreement()` counts the (position, MoE layer) routes whose expert set differs
from the rollout's: the `train/route_disagreement` share logged every step.
"""
import contextlib

import torch

from vime.models.routing_replay import NO_ROUTE, routes_differ


class DecoderRoutes:
    """megatron's `router_replay` hook of one decoder MoE router: own choice, or the rollout's."""

    def __init__(self):
        self.target = None  # [tokens, k] long, NO_ROUTE where the trainer keeps its own choice
        self.replay = False
        self.own = None  # [tokens, k]: the trainer's own choice in the last forward

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        probs, own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        self.own = own.detach()
        if not self.replay or self.target is None:
            return probs, own
        target = self.target.to(own.device)
        chosen = torch.where(target == NO_ROUTE, own, target)
        return scores.gather(1, chosen), chosen


def decoder_moe_routers(model):
    """[(MoE decoder layer ordinal, router)] in layer order; the MTP block's routers are left out."""
    layers = model.decoder.layers
    routers = [getattr(layer.mlp, "router", None) for layer in layers]
    return [r for r in routers if r is not None]


class RoutingReplay:
    """The decoder routers' hooks of one model: set a micro-batch's rollout routes around its forward."""

    def __init__(self, model, replay):
        self.hooks = []
        for router in decoder_moe_routers(model):
            router.router_replay = DecoderRoutes()
            router.router_replay.replay = replay
            self.hooks.append(router.router_replay)
        self.diff, self.total = 0, 0

    @contextlib.contextmanager
    def routes(self, routes):
        """Within: the routers see `routes` [b, s, layers, k] (or None: own choice everywhere); after
        the forward, the disagreement of their own choice with it is counted."""
        for i, hook in enumerate(self.hooks):
            # megatron flattens router input [s, b, h] s-major: token s * b + j
            hook.target = None if routes is None else routes[:, :, i].transpose(0, 1).reshape(-1, routes.shape[-1]).long()
        try:
            yield
        finally:
            if routes is not None:
                self._count()
            for hook in self.hooks:
                hook.target, hook.own = None, None

    def _count(self):
        for hook in self.hooks:
            if hook.own is None:
                continue
            target = hook.target.to(hook.own.device)
            has = (target != NO_ROUTE).all(dim=-1)
            self.diff += int(routes_differ(hook.own[has], target[has]).sum())
            self.total += int(has.sum())

    def disagreement(self):
        """(routes where the trainer's own choice differs from the rollout's, routes compared) since the
        last call; the counts restart."""
        out = (self.diff, self.total)
        self.diff, self.total = 0, 0
        return out


def check_routing_replay(cfg, hf):
    """--use-rollout-routing-replay needs a model with MoE routers (checked before any actor starts)."""
    from vime.errors import require

    require(not cfg.train.use_rollout_routing_replay or hf.moe is not None,
            f"--use-rollout-routing-replay: {cfg.model.hf_checkpoint} is a dense model "
            f"({hf.model_family.architectures[0]}) with no MoE router to replay; drop the flag")
