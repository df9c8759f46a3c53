"""The policy's MTP layers trained as the draft (--enable-mtp-training).

The layers live in the megatron model (`mtp.*`) and are stepped by a part of their own (trainer/optimizer.py:
megatron's DDP over the MTP block and megatron's optimizer, --draft-lr). Their loss (mtp/loss.py: token-mean loss of depth d on
token t+d+1, masked by m(t+d)·m(t+d+1), times --mtp-loss-scaling-factor / depths) reads the trunk's
outputs detached by default (--mtp-detach-trunk), so the policy's loss and gradients are those
without it; its gradients are clipped by their own part's grad norm (--draft-clip-grad), so they never
trigger clipping of the policy update. Their weights reach the rollout and the checkpoints with the
policy's (their optimizer state beside the policy's in the torch_dist checkpoint), so this kind pushes and
saves nothing of its own.
"""
import dataclasses

from mtp.loss import mtp_loss, mtp_loss_mask, scaled_mtp_loss
from trainer.distributed import dp_sum
from trainer.drafts.base import DraftTrainer
from trainer.model import is_mtp_param, spec_name
from trainer.optimizer import OptimizerOptions, TrainedPart, empty_module
from vime.errors import require
from vime.models.draft_kinds import MTP


def resolve_train_depths(requested, num_layers):
    """Draft depths the MTP loss trains: one per layer by default; fewer than the layers is refused."""
    depths = num_layers if requested is None else requested
    require(depths >= num_layers, f"--mtp-train-depths {depths} is fewer than the {num_layers} MTP layers: "
            f"every layer trains at its own depth; pass at least {num_layers}")
    return depths


def first_counted_position(loss_mask, depths):
    """The first position any depth's loss counts in a micro-batch whose rows start at position 0: depth d counts
    position t only where the token t+d it reads is trained (mtp/loss.py), so nothing before the earliest trained
    token less `depths` counts (0 when no token is trained)."""
    trained = loss_mask.sum(0).nonzero()
    return max(0, int(trained[0]) - depths) if len(trained) else 0


class MTPDraftTrainer(DraftTrainer):
    """The MTP layers of the policy's model as the trained draft (see module docstring)."""

    kind = MTP
    in_model = True
    metric_prefix = "mtp"  # train/mtp_loss, train/mtp_<d>_loss, train/mtp_grad_norm (the names users know)

    @classmethod
    def check_bounds(cls, cfg, knobs):
        """--mtp-train-depths at most the depths the rollout drafts (num_speculative_tokens; at least one per
        layer): a depth past them costs memory and time every step and trains a depth never drafted."""
        super().check_bounds(cfg, knobs)
        spec, depths = cfg.speculative_config, cfg.mtp_train_depths
        k = spec.num_speculative_tokens if spec is not None else None
        most = max(k or 0, cfg.mtp_num_layers or 0)
        require(depths is None or k is None or depths <= most,
                f"--mtp-train-depths {depths}: the rollout drafts num_speculative_tokens {k} tokens a step with "
                f"{cfg.mtp_num_layers} MTP layers, so at most {most} depths are drafted (a depth past them costs "
                f"memory and time and trains one never drafted): pass --mtp-train-depths {most} or less, or raise "
                "num_speculative_tokens")

    def __init__(self, cfg, model, model_cfg):
        super().__init__(cfg)
        num_layers = model_cfg.num_nextn_predict_layers  # the layers the trainer built
        require(num_layers > 0,
                "--enable-mtp-training needs MTP layers; the HF checkpoint has none or --mtp-num-layers is 0")
        self.model = model
        self.depths = resolve_train_depths(cfg.mtp_train_depths, num_layers)
        # the drafter-exact reuse needs an arbitrary attention mask, which the local attention
        # applies; Transformer Engine's layers are built causal and would ignore it silently
        require(self.depths <= num_layers or cfg.mtp_reuse_attention != "drafter" or spec_name() != "te",
                "--mtp-reuse-attention drafter runs the reused depths with an arbitrary attention mask, which "
                "the Transformer Engine layers used on this GPU do not take; use --mtp-reuse-attention megatron")
        require(self.depths <= num_layers or cfg.mtp_reuse_attention != "drafter" or not cfg.sequence_parallel,
                "--mtp-reuse-attention drafter runs the reused depths over blocks of whole sequences, and under "
                "--sequence-parallel a rank holds part of each; use --mtp-reuse-attention megatron")
        # a rank holding a slice of the sequence (sequence or context parallel) cannot drop positions alone
        self.projects_from_any_position = not cfg.layout.sp and cfg.layout.cp == 1
        self.named_params = [(n, p) for n, p in model.named_parameters() if is_mtp_param(n)]
        for _, p in self.named_params:
            p.requires_grad_(True)
        # every pipeline stage builds the part (its grad norm is a collective over them); a stage without the
        # MTP block steps nothing
        block = model.mtp if model.mtp_process else empty_module(model.config)
        self.part = TrainedPart(block, model.config, OptimizerOptions.of(cfg), self.knobs.lr, cfg.weight_decay,
                                cfg.adam_eps, cfg.effective_draft_clip_grad,
                                lr_warmup_steps=cfg.draft_lr_warmup_iters)

    # ---- the loss ----------------------------------------------------------------------
    def normaliser(self, batch, num_micro_batches):
        """Tokens each depth's loss averages over, summed over data-parallel ranks."""
        return [dp_sum(mtp_loss_mask(batch.loss_mask, d).sum()).float() for d in range(1, self.depths + 1)]

    def inputs(self, out, mb, normaliser):
        # the [b, s, V] policy logits are kept only where the loss reads them (distillation)
        return out if self.reads_policy_logits else dataclasses.replace(out, logits=None), mb, normaliser

    def loss(self, inputs):
        """The per-depth losses (--draft-loss-type), each a share of the step's token mean (sums to it
        over micro-batches and ranks); the distillation target is the detached policy (mtp/loss.py)."""
        out, mb, counts = inputs
        c = self.cfg
        first = first_counted_position(mb.loss_mask, self.depths) if self.projects_from_any_position else 0
        logits = self.model.mtp_logits(out, detach_trunk=c.mtp_detach_trunk, depths=self.depths,
                                       reuse_attention=c.mtp_reuse_attention, first=first)
        policy_logits = out.logits.detach()[:, first:] if out.logits is not None else None
        tokens, loss_mask = mb.tokens[:, first:], mb.loss_mask[:, first:]
        per_depth = []
        for d, lg in enumerate(logits, start=1):
            local = mtp_loss_mask(mb.loss_mask, d).sum()
            loss = mtp_loss(lg, tokens, loss_mask, d, c.draft_loss_type, policy_logits, c.temperature,
                            c.draft_distill_topk)
            per_depth.append(loss * local / counts[d - 1].clamp(min=1))
        return scaled_mtp_loss(per_depth, c.mtp_loss_scaling_factor), [float(x.detach()) for x in per_depth]
