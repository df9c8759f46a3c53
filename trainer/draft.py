"""Online training of an external EAGLE-3 draft inside the trainer (--enable-draft-training).

The draft (mtp/eagle3.py, loaded from the rollout's speculative config `model`) lives next to
the policy on every trainer rank, with its own AdamW and grad clip. During the policy's forward
over a rollout micro-batch, forward hooks keep the hidden states the draft reads — the residual
stream before the target layers in its `aux_layer_ids` (id 0: the embedding output) — detached.
After the policy's backward the draft's loss (EAGLE-3's training-time test over k drafting steps,
mtp/eagle3.py) runs on those detached tensors alone, so the policy's loss and gradients are
exactly what they are without it. Data-parallel ranks average the draft's gradients.

After the policy's optimiser step, `--draft-steps-per-rollout N` gives the draft N-1 more steps of
its own on the hidden states (and, for a distillation `--draft-loss-type`, the distribution) of
the *updated* policy — the one the next rollout drafts for — cycling over this RL step's batch
and the `--draft-replay-batches` previous ones, all recomputed with the current policy in one
no-grad forward each. The policy sees none of it.
Its tensors go to the rollout with the policy's under `eagle3.<checkpoint name>`.
"""
import collections
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from mtp.eagle3 import Eagle3Draft, training_time_test_loss
from mtp.loss import DISTILLATION_LOSSES
from trainer.mixed_precision import build_optimizer, fp32_params_for_checkpoint, grad_params
from vime.errors import require
from vime.models.eagle3 import check_draft_fits_target, load_draft, resolve_aux_layers
from vime.models.families import DRAFT_PREFIX

DRAFT_STATE_FILE = "eagle3_draft.pt"  # in a --save checkpoint: the draft's weights and optimizer state


def draft_path_of(speculative_config):
    """The external draft directory of the rollout's speculative config (a JSON string or mapping)."""
    import json

    raw = json.loads(speculative_config) if isinstance(speculative_config, str) else dict(speculative_config or {})
    require(raw.get("method") == "eagle3" and raw.get("model"),
            "--enable-draft-training trains an external EAGLE-3 draft: give --vllm-speculative-config "
            '\'{"method":"eagle3","model":DRAFT_DIR,...}\'')
    return raw["model"], int(raw.get("num_speculative_tokens", 1))


@dataclass
class DraftInputs:
    """What the draft's loss reads from one policy forward over a micro-batch (all detached)."""

    embeds: torch.Tensor  # [b, s, H] the policy's token embeddings
    aux: torch.Tensor  # [b, s, 3H] its aux hidden states, concatenated in aux_layer_ids order
    tokens: torch.Tensor  # [b, s]
    loss_mask: torch.Tensor  # [b, s] 1 on response tokens (the predicted tokens that count)
    policy_logits: Optional[torch.Tensor] = None  # [b, s, V] for a distillation loss, else None


class DraftTraining:
    """The external draft, its optimizer and the hooks that keep the policy's aux hidden states."""

    def __init__(self, cfg, model, target_cfg):
        path, num_speculative_tokens = draft_path_of(cfg.speculative_config)
        self.steps = cfg.draft_ttt_steps or num_speculative_tokens  # drafting steps the loss unrolls
        draft_cfg, state = load_draft(path)
        check_draft_fits_target(path, draft_cfg, target_cfg)
        self.draft = Eagle3Draft(resolve_aux_layers(draft_cfg, target_cfg))
        self.draft.load_state_dict(state, strict=True)
        policy = next(model.parameters())
        self.draft.to(policy.device, policy.dtype)  # --bf16: bf16 like the policy, fp32 masters in the optimizer
        self.cfg = cfg
        self.optimizer = build_optimizer([{"params": list(self.draft.parameters())}], cfg.bf16,
                                         lr=cfg.lr if cfg.draft_lr is None else cfg.draft_lr,
                                         weight_decay=cfg.weight_decay, eps=cfg.adam_eps)
        self.kept = {}
        self._hook(model)
        # earlier rollout batches the draft-only steps also train on (--draft-replay-batches; CPU
        # tensors, newest first; not checkpointed: after --load it refills over R steps)
        self.replay = collections.deque(maxlen=cfg.draft_replay_batches)

    @property
    def reads_policy_logits(self):
        """Whether the loss distils the policy's distribution (the trainer then hands its logits over)."""
        return self.cfg.draft_loss_type in DISTILLATION_LOSSES

    # ---- aux hidden states from the policy's forward -----------------------------------
    def _hook(self, model):
        ids = self.draft.cfg.aux_layer_ids
        # the embedding output is both aux id 0 and the token embeddings the draft reads
        model.embedding.register_forward_hook(lambda m, i, out: self._keep("embeds", out))
        for i, layer in enumerate(model.decoder.layers):
            if i + 1 in ids:  # id i + 1: the residual stream after layer i
                layer.register_forward_hook(lambda m, i_, out, key=i + 1: self._keep(key, out))

    def _keep(self, key, out):
        hidden = out[0] if isinstance(out, tuple) else out
        self.kept[key] = hidden.detach().transpose(0, 1)  # megatron's [s, b, H] -> [b, s, H]

    def keep_policy_logits(self, logits):
        """The policy's logits [b, s, V] of the forward the hooks just saw (kept detached, and only
        for a distillation loss)."""
        if self.reads_policy_logits:
            self.kept["logits"] = logits.detach()

    def take_inputs(self, tokens, loss_mask):
        """The draft's inputs from what the last policy forward (over `tokens`) kept; clears it."""
        kept, self.kept = self.kept, {}
        aux = torch.cat([kept["embeds" if i == 0 else i] for i in self.draft.cfg.aux_layer_ids], -1)
        return DraftInputs(kept["embeds"], aux, tokens, loss_mask, kept.get("logits"))

    def loss(self, inputs):
        """(loss, per-drafting-step losses) of the training-time test on one micro-batch's inputs."""
        c = self.cfg
        return training_time_test_loss(self.draft, inputs.embeds, inputs.aux, inputs.tokens, inputs.loss_mask,
                                       self.steps, c.draft_loss_type, inputs.policy_logits, c.temperature,
                                       c.draft_distill_topk)

    # ---- one micro-batch's loss, one optimiser step ----------------------------------------
    def backward_micro_batch(self, tokens, loss_mask, weight):
        """Backward of the draft's training-time-test loss on what the last policy forward kept;
        `weight`: this micro-batch's share of the step. Returns the loss (detached) per drafting step."""
        loss, per_step = self.loss(self.take_inputs(tokens, loss_mask))
        (self.cfg.draft_loss_scaling_factor * weight * loss).backward()
        return [float(x.detach()) * weight for x in per_step]

    def train_on(self, prepared, steps):
        """`steps` draft-only optimiser steps cycling over `prepared` (per batch, its micro-batches'
        DraftInputs; this RL step's batch first), ordered so that the last step is on this step's
        batch. Returns that step's loss (mean over drafting steps and micro-batches, this rank's)."""
        loss = None
        for i in range(steps):
            micro = prepared[(steps - 1 - i) % len(prepared)]
            loss = 0.0
            for inputs in micro:
                total, _ = self.loss(inputs)
                (self.cfg.draft_loss_scaling_factor / len(micro) * total).backward()
                loss += float(total.detach()) / len(micro)
            self.step()
        return loss

    def step(self):
        """Average the gradients over data-parallel ranks, clip (--clip-grad), step; returns the grad norm."""
        from trainer import grads
        from trainer.distributed import dp_group

        size = dist.get_world_size(dp_group())
        params = [p for p in grad_params(self.optimizer, self.draft.parameters()) if p.grad is not None]
        if size > 1:
            for p in params:
                dist.all_reduce(p.grad, group=dp_group())
                p.grad.div_(size)
        norm = grads.clip_by_norm(params, self.cfg.clip_grad)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm

    # ---- sync and checkpoints ----------------------------------------------------------------
    def named_weights(self):
        """(wire name, tensor) of the draft: `eagle3.<checkpoint name>` (vime/models/families.py)."""
        for name, p in self.draft.state_dict().items():
            yield DRAFT_PREFIX + name, p.detach()

    def state(self):
        """The draft's weights (under --bf16 its fp32 masters), optimizer state and config."""
        with fp32_params_for_checkpoint(self.draft, self.optimizer):
            weights = {k: v.clone() for k, v in self.draft.state_dict().items()}
        return {"draft": weights, "optimizer": self.optimizer.state_dict(), "config": self.draft.cfg}

    def load_state(self, state):
        with fp32_params_for_checkpoint(self.draft, self.optimizer):
            self.draft.load_state_dict(state["draft"])
        self.optimizer.load_state_dict(state["optimizer"])


def save_draft_state(path, state):
    """The draft's weights, optimizer state and config into a --save checkpoint (rank 0 writes)."""
    import os

    if dist.get_rank() == 0:
        torch.save(state, os.path.join(path, DRAFT_STATE_FILE))
    dist.barrier()


def load_draft_state(path):
    """What save_draft_state wrote into `path`; one line when the checkpoint holds no draft."""
    import os

    file = os.path.join(path, DRAFT_STATE_FILE)
    require(os.path.isfile(file), f"--load {path}: the checkpoint holds no external draft ({DRAFT_STATE_FILE}); "
            "it was saved without --enable-draft-training: resume without it")
    return torch.load(file, map_location="cpu", weights_only=False)
