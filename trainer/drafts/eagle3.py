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

from mtp.eagle3 import Eagle3Draft, training_time_test_loss
from trainer.drafts.base import DraftKnobs
from trainer.drafts.external import AuxHiddenStates, ExternalDraftTrainer
from vime.errors import require
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


class Eagle3DraftTrainer(ExternalDraftTrainer):
    """The external EAGLE-3 draft (trainer/drafts/external.py: its optimizer, the hooks, the push)."""

    kind = "eagle3"
    metric_prefix = "draft"
    wire_prefix = DRAFT_PREFIX
    # a small module of its own: many cheap steps on the updated policy's states keep it caught up
    DEFAULTS = DraftKnobs(lr=1e-3, steps_per_rollout=8, replay_batches=4)

    @classmethod
    def check_bounds(cls, cfg, knobs):
        """--draft-ttt-steps at most the drafts the rollout asks for: each step unrolls the draft once more
        and keeps its activations for the backward, and a step past them trains a position never drafted."""
        super().check_bounds(cfg, knobs)
        k, ttt = cfg.speculative_config.num_speculative_tokens, cfg.draft_ttt_steps
        require(ttt is None or k is None or ttt <= k,
                f"--draft-ttt-steps {ttt}: the rollout drafts num_speculative_tokens {k} tokens a step, so the "
                f"training-time test unrolls at most {k} (a step past them costs memory and time and trains a "
                f"position never drafted): pass --draft-ttt-steps {k} or less, or raise num_speculative_tokens")

    def __init__(self, cfg, model, model_cfg):
        spec = cfg.speculative_config
        self.ttt_steps = cfg.draft_ttt_steps or spec.num_speculative_tokens  # drafting steps the loss unrolls
        draft_cfg, state = load_draft(spec.model)
        check_draft_fits_target(spec.model, draft_cfg, model_cfg)
        module = Eagle3Draft(resolve_aux_layers(draft_cfg, model_cfg))
        module.load_state_dict(state, strict=True)
        super().__init__(cfg, model, module, module.cfg.aux_layer_ids)

    # ---- the loss ----------------------------------------------------------------------
    def inputs(self, out, mb, normaliser):
        kept = self.aux.take()  # aux id 0, the embedding output, is also the token embeddings the draft reads
        aux = AuxHiddenStates.concat(kept, self.module.cfg.aux_layer_ids)
        return Eagle3Inputs(kept[0], aux, mb.tokens, mb.loss_mask, 1 / normaliser, self.policy_logits(out))

    def loss(self, inputs):
        c = self.cfg
        total, per_step = training_time_test_loss(self.module, inputs.embeds, inputs.aux, inputs.tokens,
                                                  inputs.loss_mask, self.ttt_steps, c.draft_loss_type,
                                                  inputs.policy_logits, c.temperature, c.draft_distill_topk)
        return self.scaled(inputs.share, total, per_step)
