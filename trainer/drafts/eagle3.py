"""The EAGLE-3 draft trained beside the policy: an external draft (`model` of the speculative config).

On every policy forward, hooks keep the hidden states the draft reads — the residual stream before
the target layers in its `aux_layer_ids` (id 0: the embedding output) — detached. The draft's loss
is EAGLE-3's training-time test over k drafting steps (mtp/eagle3.py) on those tensors alone, so
the policy's loss and gradients are exactly what they are without it. It has its own AdamW
(--draft-lr), data-parallel ranks average its gradients, and its tensors go to the rollout with
the policy's under `eagle3.<checkpoint name>`. A checkpoint keeps its weights and optimizer state.
"""
from mtp.eagle3 import training_time_test_loss
from trainer.drafts.external import ExternalDraftTrainer
from vime.errors import require
from vime.models.eagle3 import EAGLE3


class Eagle3DraftTrainer(ExternalDraftTrainer):
    """The external EAGLE-3 draft (trainer/drafts/external.py: its optimizer, the hooks, the push)."""

    kind = EAGLE3

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
        super().__init__(cfg, model, model_cfg)
        self.ttt_steps = cfg.draft_ttt_steps or cfg.speculative_config.num_speculative_tokens  # steps the loss unrolls

    # ---- the loss ----------------------------------------------------------------------
    def policy_inputs(self, kept, dtype, target):
        return {"embeds": kept[0]}  # aux id 0, the embedding output, is the token embeddings the draft reads

    def loss(self, inputs):
        c = self.cfg
        total, per_step = training_time_test_loss(self.module, inputs.embeds, inputs.aux, inputs.tokens,
                                                  inputs.loss_mask, self.ttt_steps, c.draft_loss_type,
                                                  inputs.policy_logits, c.temperature, c.draft_distill_topk)
        return self.scaled(inputs.share, total, per_step)
