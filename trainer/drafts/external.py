"""What every external draft (the `model` of the speculative config) shares on the trainer side.

An external draft is a module of its own beside the policy: it reads the policy's residual
stream at a few layers (`AuxHiddenStates`, kept detached by forward hooks on every policy
forward, so the policy's loss and gradients are exactly those without it), steps with its own
AdamW (--draft-lr), averages its gradients over data-parallel ranks, goes to the rollout under
its wire prefix (`<kind>.<checkpoint name>`) and keeps its weights and optimizer state in a
checkpoint. The draft's module is its kind's (vime/models/draft_kinds.py), loaded from the speculative
config's `model` once the directory is checked against the policy; each kind's trainer (<kind>.py)
adds its loss and what of the policy it reads beside the aux states.
"""
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from trainer import grads
from trainer.distributed import dp_group
from trainer.drafts.base import DraftTrainer
from trainer.mixed_precision import build_optimizer, fp32_params_for_checkpoint, grad_params
from trainer.weights import gather
from vime.errors import require


class AuxHiddenStates:
    """The policy's residual stream at aux ids (vLLM's numbering: 0 the embedding output, i the
    stream after layer i-1), kept detached as [b, s, H] by hooks on its megatron model."""

    def __init__(self, model, aux_layer_ids):
        self.kept = {}
        model.embedding.register_forward_hook(lambda m, i, out: self._keep(0, out))
        for i, layer in enumerate(model.decoder.layers):
            if i + 1 in aux_layer_ids:
                layer.register_forward_hook(lambda m, i_, out, key=i + 1: self._keep(key, out))

    def _keep(self, key, out):
        hidden = out[0] if isinstance(out, tuple) else out
        self.kept[key] = hidden.detach().transpose(0, 1)  # megatron's [s, b, H] -> [b, s, H]

    def take(self):
        """{aux id: [b, s, H]} of the last forward (emptied: each forward's states are read once)."""
        kept, self.kept = self.kept, {}
        return kept

    @staticmethod
    def concat(kept, aux_layer_ids):
        """[b, s, len(ids) * H]: the kept states concatenated in `aux_layer_ids` order."""
        return torch.cat([kept[i] for i in aux_layer_ids], -1)


@dataclass
class DraftInputs:
    """What an external draft's loss reads from one policy forward over a micro-batch (all detached)."""

    aux: torch.Tensor  # [b, s, n * H] the policy's states at the draft's aux layers, concatenated in order
    tokens: torch.Tensor  # [b, s]
    loss_mask: torch.Tensor  # [b, s] 1 on response tokens (the predicted tokens that count)
    share: float  # this micro-batch's share of the step (1 / micro-batches)
    policy_logits: Optional[torch.Tensor] = None  # [b, s, V] for a distillation loss, else None
    embeds: Optional[torch.Tensor] = None  # [b, s, H] the policy's token embeddings (a draft reading them)
    embed_weight: Optional[torch.Tensor] = None  # [V, H] the policy's embedding (a draft storing none)
    head_weight: Optional[torch.Tensor] = None  # [V, H] the policy's output layer (a draft storing none)


class ExternalDraftTrainer(DraftTrainer):
    """The external draft of the speculative config's `model`, reading the policy's aux states, with its
    own optimizer."""

    def __init__(self, cfg, model, model_cfg):
        super().__init__(cfg)
        spec = cfg.speculative_config
        module = self.kind.load_for_target(spec.model, model_cfg, spec.num_speculative_tokens)
        policy = next(model.parameters())
        self.module = module.to(policy.device, policy.dtype)  # --bf16: bf16 like the policy, fp32 masters in the optimizer
        self.optimizer = build_optimizer([{"params": list(self.module.parameters())}], cfg.bf16, lr=self.knobs.lr,
                                         weight_decay=cfg.weight_decay, eps=cfg.adam_eps)
        self.aux = AuxHiddenStates(model, module.cfg.aux_layer_ids)
        self.model, self.vocab_size = model, model_cfg.vocab_size

    @classmethod
    def check_config(cls, cfg):
        require(cfg.draft_ttt_steps is None or not cls.kind.block,
                f"--draft-ttt-steps {cfg.draft_ttt_steps} unrolls a chain draft's drafting steps; a {cls.kind.title} "
                "draft trains its whole block in one forward (the block size is the draft's): leave it unset")

    def policy_logits(self, out):
        """The forward's logits, detached, where the loss reads them (else None: not kept)."""
        return out.logits.detach() if self.reads_policy_logits else None

    def target_weights(self):
        """The policy's [V, H] embedding and head as the rollout reads them (whole: gathered over TP), detached."""
        embed = gather("embedding.word_embeddings.weight", self.model.embedding.word_embeddings.weight)
        head = gather("output_layer.weight", self.model.output_weight())
        return embed[:self.vocab_size], head[:self.vocab_size]

    # ---- the loss ----------------------------------------------------------------------
    def normaliser(self, batch, num_micro_batches):
        return num_micro_batches

    def inputs(self, out, mb, normaliser):
        kept = self.aux.take()
        aux = AuxHiddenStates.concat(kept, self.module.cfg.aux_layer_ids)
        return DraftInputs(aux, mb.tokens, mb.loss_mask, 1 / normaliser, self.policy_logits(out),
                           **self.policy_inputs(kept, aux.dtype))

    def policy_inputs(self, kept, dtype):
        """What of the policy the kind's loss reads beside its aux states (DraftInputs fields), given the
        forward's kept states {aux id: [b, s, H]} (id 0: the token embeddings) and the draft's dtype."""
        return {}

    def scaled(self, share, total, parts):
        """(loss to backward, reported parts) of a micro-batch whose loss is a mean over it: the
        step's loss is the mean over micro-batches, the reported parts the ranks' mean once summed."""
        reported = share / dist.get_world_size(dp_group())
        return self.cfg.draft_loss_scaling_factor * share * total, [float(x.detach()) * reported for x in parts]

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
        """(wire name, tensor) of the draft: `<wire_prefix><checkpoint name>`."""
        for name, p in self.module.state_dict().items():
            yield self.kind.wire_prefix + name, p.detach()

    def state(self):
        """The draft's weights (under --bf16 its fp32 masters), optimizer state and config."""
        with fp32_params_for_checkpoint(self.module, self.optimizer):
            weights = {k: v.clone() for k, v in self.module.state_dict().items()}
        return {"draft": weights, "optimizer": self.optimizer.state_dict(), "config": self.module.cfg}

    def load_state(self, state):
        with fp32_params_for_checkpoint(self.module, self.optimizer):
            self.module.load_state_dict(state["draft"])
        self.optimizer.load_state_dict(state["optimizer"])
