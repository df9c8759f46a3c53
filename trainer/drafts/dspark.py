"""The DSpark draft trained beside the policy: a DFlash block draft with a Markov head and a confidence head.

Everything but the loss is the DFlash draft trainer's (trainer/drafts/dflash.py: the policy's detached
states after the draft's target layers, its embedding and head detached, its own AdamW, the anchors'
own random stream, tensors pushed as `<kind>.<checkpoint name>`). The loss is DSpark's (mtp/dspark.py
`dspark_loss`): on blocks anchored at random response positions, the recipes' cross-entropy on the
sampled token, L1 distance to the detached policy's distribution at the rollout temperature, and the
confidence head's binary cross-entropy against the acceptance 1 - TV that distance implies, weighted
by --draft-ce-weight / --draft-l1-weight / --draft-confidence-weight (their defaults: the kind's
`loss_weights`). It always reads the policy's logits (the L1 term and the label need them).
"""
from mtp.dspark import dspark_loss
from trainer.drafts.dflash import DFlashDraftTrainer
from vime.errors import require
from vime.models.draft_format import read_config
from vime.models.dspark import DSPARK, check_loss_weights


class DSparkDraftTrainer(DFlashDraftTrainer):
    """The external DSpark draft: its three-term loss on the policy's detached states."""

    kind = DSPARK

    @classmethod
    def check_config(cls, cfg):
        super().check_config(cfg)
        require(cfg.draft_loss_type == "ce",
                f"--draft-loss-type {cfg.draft_loss_type} picks one loss; the {cls.kind.title} draft trains with its "
                "recipe's terms: weigh them with " + ", ".join(f"--draft-{term}-weight" for term, _ in cls.kind.loss_weights))

    @classmethod
    def check_draft_files(cls, cfg):
        model = cfg.speculative_config.model
        check_loss_weights(cfg.draft_loss_weights, read_config(cls.kind, model).enable_confidence_head,
                           lambda term: f"--draft-{term}-weight", f"the draft {model}")

    @property
    def reads_policy_logits(self):
        return True

    def loss(self, inputs):
        c = self.cfg
        weights = dict(self.kind.loss_weights, **c.draft_loss_weights)
        total, per_slot, _ = dspark_loss(self.module, inputs.aux, inputs.tokens, inputs.loss_mask, inputs.embed_weight,
                                         inputs.head_weight, self.anchors_per_sequence, inputs.policy_logits, weights,
                                         generator=self.generator, temperature=c.temperature, topk=c.draft_distill_topk)
        return self.scaled(inputs.share, total, list(per_slot))
