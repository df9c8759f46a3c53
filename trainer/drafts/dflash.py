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
import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch

from mtp.dflash import DFlashDraft, block_loss
from trainer.drafts.base import DraftKnobs
from trainer.drafts.external import AuxHiddenStates, ExternalDraftTrainer
from trainer.model import is_last_stage
from trainer.weights import gather, word_embedding_on_last_stage
from vime.errors import require
from vime.models.dflash import WIRE_PREFIX, check_draft_fits_target, load_draft


@dataclass
class DFlashInputs:
    """What the block loss reads from one policy forward over a micro-batch (all detached)."""

    tokens: torch.Tensor  # [b, s]
    loss_mask: torch.Tensor  # [b, s] 1 on response tokens (the block slots that count)
    share: float  # this micro-batch's share of the step (1 / micro-batches)
    policy_logits: Optional[torch.Tensor] = None  # [b, s, V] for a distillation loss, else None
    # set by `fill`, from every pipeline stage:
    aux: Optional[torch.Tensor] = None  # [b, s, n * H] the policy's states after target_layer_ids, concatenated
    embed_weight: Optional[torch.Tensor] = None  # [V, H] the policy's embedding (block inputs: anchor, mask tokens)
    head_weight: Optional[torch.Tensor] = None  # [V, H] the policy's output layer (block logits)


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
        spec = cfg.speculative_config
        draft_cfg, state = load_draft(spec.model)
        check_draft_fits_target(spec.model, draft_cfg, model_cfg, spec.num_speculative_tokens)
        module = DFlashDraft(draft_cfg)
        module.load_state_dict(state, strict=True)
        super().__init__(cfg, model, model_cfg, module, draft_cfg.aux_layer_ids)
        self.vocab_size = model_cfg.vocab_size
        # the anchors' own stream: the draft's randomness leaves the policy's RNG (and so its step) untouched
        self.generator = torch.Generator(device="cpu").manual_seed(cfg.seed)

    @classmethod
    def check_config(cls, cfg):
        require(cfg.draft_ttt_steps is None,
                f"--draft-ttt-steps {cfg.draft_ttt_steps} unrolls EAGLE-3's drafting steps; a DFlash draft trains "
                "its whole block in one forward (the block size is the draft's): leave it unset")

    def policy_weights(self):
        """The policy's [V, H] embedding and head as the rollout reads them: whole (gathered over TP and, the
        embedding, from the first pipeline stage), detached; on the last stage (None elsewhere)."""
        embed = word_embedding_on_last_stage(self.model)
        if not is_last_stage(self.model):
            return None
        head = gather("output_layer.weight", self.model.output_weight())
        return embed[:self.vocab_size], head[:self.vocab_size]

    # ---- checkpoints: the anchors' stream too, so that a resumed run draws the same blocks ----
    def state(self):
        return {**super().state(), "anchor_rng": self.generator.get_state()}

    def load_state(self, state):
        super().load_state(state)
        self.generator.set_state(state["anchor_rng"])

    # ---- the loss ----------------------------------------------------------------------
    def inputs(self, out, mb, normaliser):
        return DFlashInputs(mb.tokens, mb.loss_mask, 1 / normaliser, self.policy_logits(out))

    def fill(self, inputs, kept, weights):
        aux = AuxHiddenStates.concat(kept, self.module.cfg.aux_layer_ids)
        embed, head = weights
        return dataclasses.replace(inputs, aux=aux, embed_weight=embed.to(aux.dtype), head_weight=head.to(aux.dtype))

    def loss(self, inputs):
        c = self.cfg
        total, per_slot = block_loss(self.module, inputs.aux, inputs.tokens, inputs.loss_mask, inputs.embed_weight,
                                     inputs.head_weight, self.anchors_per_sequence, generator=self.generator,
                                     loss_type=c.draft_loss_type, policy_logits=inputs.policy_logits,
                                     temperature=c.temperature, topk=c.draft_distill_topk)
        return self.scaled(inputs.share, total, list(per_slot))
