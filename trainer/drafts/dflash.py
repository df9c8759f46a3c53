"""The DFlash draft trained beside the policy: an external block-diffusion draft (`model` of the speculative config).

Its loss is DFlash's block objective (mtp/dflash.py `block_loss`): blocks anchored at random
positions of the rollout's responses, the anchor token clean and the rest of the block mask
tokens, every slot predicting its own token of the response, weighted by exp(-(i-1)/gamma) for
slot i so that the early slots, which decide acceptance, weigh most. It reads the policy's
detached states after the draft's `target_layer_ids` (hooks of trainer/drafts/external.py) and
the policy's embedding and head, detached too: the draft stores neither and reads the target's,
as the rollout engines do. So the policy's loss and gradients are those without it. Its own
AdamW, gradients averaged over data-parallel ranks, tensors pushed as `dflash.<checkpoint name>`,
weights and optimizer state in a checkpoint (external.py).
"""
from dataclasses import dataclass
from typing import Optional

import torch

from mtp.dflash import DFlashDraft, block_loss
from trainer.drafts.base import DraftKnobs
from trainer.drafts.external import AuxHiddenStates, ExternalDraftTrainer
from trainer.weights import gather
from vime.errors import require
from vime.models.dflash import WIRE_PREFIX, check_draft_fits_target, load_draft


@dataclass
class DFlashInputs:
    """What the block loss reads from one policy forward over a micro-batch (all detached)."""

    aux: torch.Tensor  # [b, s, n * H] the policy's states after target_layer_ids, concatenated
    tokens: torch.Tensor  # [b, s]
    loss_mask: torch.Tensor  # [b, s] 1 on response tokens (the block slots that count)
    embed_weight: torch.Tensor  # [V, H] the policy's embedding (block inputs: anchor, mask tokens)
    head_weight: torch.Tensor  # [V, H] the policy's output layer (block logits)
    share: float  # this micro-batch's share of the step (1 / micro-batches)
    policy_logits: Optional[torch.Tensor] = None  # [b, s, V] for a distillation loss, else None


class DFlashDraftTrainer(ExternalDraftTrainer):
    """The external DFlash draft: its block loss on the policy's detached target-layer states."""

    kind = "dflash"
    metric_prefix = "draft"  # train/draft_<i>_loss: block slot i's loss
    wire_prefix = WIRE_PREFIX
    # one forward trains every anchor's whole block, so few anchors per sequence suffice on short
    # responses; like EAGLE-3 a small module that many cheap steps on the updated policy keep caught up
    DEFAULTS = DraftKnobs(lr=1e-3, steps_per_rollout=8, replay_batches=4)
    anchors_per_sequence = 32  # blocks each sequence trains per step (capped by its response length)

    def __init__(self, cfg, model, model_cfg):
        module = self.draft_module(cfg.speculative_config, model_cfg)
        super().__init__(cfg, model, module, module.cfg.aux_layer_ids)
        self.model, self.vocab_size = model, model_cfg.vocab_size
        # the anchors' own stream: the draft's randomness leaves the policy's RNG (and so its step) untouched
        self.generator = torch.Generator(device="cpu").manual_seed(cfg.seed)

    @staticmethod
    def draft_module(spec, model_cfg):
        """The draft of the speculative config, checked against the policy's ModelConfig."""
        draft_cfg, state = load_draft(spec.model)
        check_draft_fits_target(spec.model, draft_cfg, model_cfg, spec.num_speculative_tokens)
        module = DFlashDraft(draft_cfg)
        module.load_state_dict(state, strict=True)
        return module

    @classmethod
    def check_config(cls, cfg):
        require(cfg.draft_ttt_steps is None,
                f"--draft-ttt-steps {cfg.draft_ttt_steps} unrolls EAGLE-3's drafting steps; a DFlash draft trains "
                "its whole block in one forward (the block size is the draft's): leave it unset")

    def _target_weight(self, name, param):
        """The policy's [V, H] embedding or head as the rollout reads it: whole (gathered over TP), detached."""
        return gather(name, param)[:self.vocab_size]

    # ---- checkpoints: the anchors' stream too, so that a resumed run draws the same blocks ----
    def state(self):
        return {**super().state(), "anchor_rng": self.generator.get_state()}

    def load_state(self, state):
        super().load_state(state)
        self.generator.set_state(state["anchor_rng"])

    # ---- the loss ----------------------------------------------------------------------
    def inputs(self, out, mb, normaliser):
        aux = AuxHiddenStates.concat(self.aux.take(), self.module.cfg.aux_layer_ids)
        embed = self._target_weight("embedding.word_embeddings.weight", self.model.embedding.word_embeddings.weight)
        head = self._target_weight("output_layer.weight", self.model.output_weight())
        return DFlashInputs(aux, mb.tokens, mb.loss_mask, embed.to(aux.dtype), head.to(aux.dtype), 1 / normaliser,
                            self.policy_logits(out))

    def loss(self, inputs):
        c = self.cfg
        total, per_slot = block_loss(self.module, inputs.aux, inputs.tokens, inputs.loss_mask, inputs.embed_weight,
                                     inputs.head_weight, self.anchors_per_sequence, generator=self.generator,
                                     loss_type=c.draft_loss_type, policy_logits=inputs.policy_logits,
                                     temperature=c.temperature, topk=c.draft_distill_topk)
        return self.scaled(inputs.share, total, list(per_slot))
