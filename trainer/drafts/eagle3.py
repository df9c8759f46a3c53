"""The EAGLE-3 draft trained beside the policy: an external draft (`model` of the speculative config).

On every policy forward, hooks keep the hidden states the draft reads — the residual stream before
the target layers in its `aux_layer_ids` (id 0: the embedding output) — detached. The draft's loss
is EAGLE-3's training-time test over k drafting steps (mtp/eagle3.py) on those tensors alone, so
the policy's loss and gradients are exactly what they are without it. It has its own AdamW
(--draft-lr), data-parallel ranks average its gradients, and its tensors go to the rollout with
the policy's under `eagle3.<checkpoint name>`. A checkpoint keeps its weights and optimizer state.
"""
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from mtp.eagle3 import Eagle3Draft, training_time_test_loss
from mtp.loss import DISTILLATION_LOSSES
from trainer import grads
from trainer.distributed import dp_group
from trainer.drafts.base import DraftKnobs, DraftTrainer
from trainer.mixed_precision import build_optimizer, fp32_params_for_checkpoint, grad_params
from vime.models.eagle3 import check_draft_fits_target, load_draft, resolve_aux_layers
from vime.models.families import DRAFT_PREFIX


@dataclass
class Eagle3Inputs:
    """What the draft's loss reads from one policy forward over a micro-batch (all detached)."""

    embeds: torch.Tensor  # [b, s, H] the policy's token embeddings
    aux: torch.Tensor  # [b, s, 3H] its aux hidden states, concatenated in aux_layer_ids order
    tokens: torch.Tensor  # [b, s]
    loss_mask: torch.Tensor  # [b, s] 1 on response tokens (the predicted tokens that count)
    share: float  # this micro-batch's share of the step (1 / micro-batches)
    policy_logits: Optional[torch.Tensor] = None  # [b, s, V] for a distillation loss, else None


class Eagle3DraftTrainer(DraftTrainer):
    """The external EAGLE-3 draft, its optimizer and the hooks that keep the policy's aux hidden states."""

    kind = "eagle3"
    metric_prefix = "draft"
    # a small module of its own: many cheap steps on the updated policy's states keep it caught up
    DEFAULTS = DraftKnobs(lr=1e-3, steps_per_rollout=8, replay_batches=4)

    def __init__(self, cfg, model, model_cfg):
        super().__init__(cfg)
        spec = cfg.speculative_config
        self.ttt_steps = cfg.draft_ttt_steps or spec.num_speculative_tokens  # drafting steps the loss unrolls
        draft_cfg, state = load_draft(spec.model)
        check_draft_fits_target(spec.model, draft_cfg, model_cfg)
        self.module = Eagle3Draft(resolve_aux_layers(draft_cfg, model_cfg))
        self.module.load_state_dict(state, strict=True)
        policy = next(model.parameters())
        self.module.to(policy.device, policy.dtype)  # --bf16: bf16 like the policy, fp32 masters in the optimizer
        self.optimizer = build_optimizer([{"params": list(self.module.parameters())}], cfg.bf16, lr=self.knobs.lr,
                                         weight_decay=cfg.weight_decay, eps=cfg.adam_eps)
        self.kept = {}
        self._hook(model)

    @property
    def reads_policy_logits(self):
        """Whether the loss distils the policy's distribution (then its logits are kept)."""
        return self.cfg.draft_loss_type in DISTILLATION_LOSSES

    # ---- aux hidden states from the policy's forward -----------------------------------
    def _hook(self, model):
        ids = self.module.cfg.aux_layer_ids
        # the embedding output is both aux id 0 and the token embeddings the draft reads
        model.embedding.register_forward_hook(lambda m, i, out: self._keep("embeds", out))
        for i, layer in enumerate(model.decoder.layers):
            if i + 1 in ids:  # id i + 1: the residual stream after layer i
                layer.register_forward_hook(lambda m, i_, out, key=i + 1: self._keep(key, out))

    def _keep(self, key, out):
        hidden = out[0] if isinstance(out, tuple) else out
        self.kept[key] = hidden.detach().transpose(0, 1)  # megatron's [s, b, H] -> [b, s, H]

    # ---- the loss ----------------------------------------------------------------------
    def normaliser(self, batch, num_micro_batches):
        return num_micro_batches

    def inputs(self, out, mb, normaliser):
        kept, self.kept = self.kept, {}
        aux = torch.cat([kept["embeds" if i == 0 else i] for i in self.module.cfg.aux_layer_ids], -1)
        logits = out.logits.detach() if self.reads_policy_logits else None
        return Eagle3Inputs(kept["embeds"], aux, mb.tokens, mb.loss_mask, 1 / normaliser, logits)

    def loss(self, inputs):
        c = self.cfg
        total, per_step = training_time_test_loss(self.module, inputs.embeds, inputs.aux, inputs.tokens,
                                                  inputs.loss_mask, self.ttt_steps, c.draft_loss_type,
                                                  inputs.policy_logits, c.temperature, c.draft_distill_topk)
        reported = inputs.share / dist.get_world_size(dp_group())  # the ranks' mean once summed over them
        return c.draft_loss_scaling_factor * inputs.share * total, [float(x.detach()) * reported for x in per_step]

    # ---- gradients -----------------------------------------------------------------------
    def _grads(self):
        return [p for p in grad_params(self.optimizer, self.module.parameters()) if p.grad is not None]

    def reduce_gradients(self):
        """The mean over data-parallel ranks (each rank's loss is its own micro-batches' mean)."""
        size = dist.get_world_size(dp_group())
        if size > 1:
            for p in self._grads():
                dist.all_reduce(p.grad, group=dp_group())
                p.grad.div_(size)

    def clip_gradients(self):
        return grads.clip_by_norm(self._grads(), self.cfg.effective_draft_clip_grad)

    # ---- sync and checkpoints ----------------------------------------------------------------
    def named_weights(self):
        """(wire name, tensor) of the draft: `eagle3.<checkpoint name>` (vime/models/families.py)."""
        for name, p in self.module.state_dict().items():
            yield DRAFT_PREFIX + name, p.detach()

    def state(self):
        """The draft's weights (under --bf16 its fp32 masters), optimizer state and config."""
        with fp32_params_for_checkpoint(self.module, self.optimizer):
            weights = {k: v.clone() for k, v in self.module.state_dict().items()}
        return {"draft": weights, "optimizer": self.optimizer.state_dict(), "config": self.module.cfg}

    def load_state(self, state):
        with fp32_params_for_checkpoint(self.module, self.optimizer):
            self.module.load_state_dict(state["draft"])
        self.optimizer.load_state_dict(state["optimizer"])
