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
import torch

from mtp.dflash import block_loss
from trainer.drafts.external import ExternalDraftTrainer
from vime.models.dflash import DFLASH


class DFlashDraftTrainer(ExternalDraftTrainer):
    """The external DFlash draft: its block loss on the policy's detached target-layer states."""

    kind = DFLASH
    metric_prefix = "draft"  # train/draft_<i>_loss: block slot i's loss
    anchors_per_sequence = 32  # blocks each sequence trains per step (capped by its response length)

    def __init__(self, cfg, model, model_cfg):
        super().__init__(cfg, model, model_cfg)
        # the anchors' own stream: the draft's randomness leaves the policy's RNG (and so its step) untouched
        self.generator = torch.Generator(device="cpu").manual_seed(cfg.seed)

    # ---- checkpoints: the anchors' stream too, so that a resumed run draws the same blocks ----
    def state(self):
        return {**super().state(), "anchor_rng": self.generator.get_state()}

    def load_state(self, state):
        super().load_state(state)
        self.generator.set_state(state["anchor_rng"])

    # ---- the loss ----------------------------------------------------------------------
    reads_target_weights = True  # it stores neither: it reads the target's, as the rollout engines do

    def policy_inputs(self, kept, dtype, target):
        embed, head = target
        return {"embed_weight": embed.to(dtype), "head_weight": head.to(dtype)}

    def loss(self, inputs):
        c = self.cfg
        total, per_slot = block_loss(self.module, inputs.aux, inputs.tokens, inputs.loss_mask, inputs.embed_weight,
                                     inputs.head_weight, self.anchors_per_sequence, generator=self.generator,
                                     loss_type=c.draft_loss_type, policy_logits=inputs.policy_logits,
                                     temperature=c.temperature, topk=c.draft_distill_topk)
        return self.scaled(inputs.share, total, list(per_slot))
