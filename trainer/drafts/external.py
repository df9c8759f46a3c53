"""What every external draft (the `model` of the speculative config) shares on the trainer side.

An external draft is a module of its own beside the policy: it reads the policy's residual
stream at a few layers (`AuxHiddenStates`, kept detached by forward hooks on every policy
forward, so the policy's loss and gradients are exactly those without it), steps with its own
AdamW (--draft-lr), averages its gradients over data-parallel ranks, goes to the rollout under
its wire prefix (`<kind>.<checkpoint name>`) and keeps its weights and optimizer state in a
checkpoint. Each kind (eagle3.py, dflash.py) adds its module and its loss.
"""
import torch
import torch.distributed as dist

from trainer import grads
from trainer.distributed import dp_group
from trainer.drafts.base import DraftTrainer
from trainer.mixed_precision import build_optimizer, fp32_params_for_checkpoint, grad_params


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


class ExternalDraftTrainer(DraftTrainer):
    """An external draft `module` reading the policy's aux states `aux_layer_ids`, with its own optimizer."""

    wire_prefix = None  # its tensors on the weight-sync wire: wire_prefix + checkpoint name

    def __init__(self, cfg, model, module, aux_layer_ids):
        super().__init__(cfg)
        policy = next(model.parameters())
        self.module = module.to(policy.device, policy.dtype)  # --bf16: bf16 like the policy, fp32 masters in the optimizer
        self.optimizer = build_optimizer([{"params": list(self.module.parameters())}], cfg.bf16, lr=self.knobs.lr,
                                         weight_decay=cfg.weight_decay, eps=cfg.adam_eps)
        self.aux = AuxHiddenStates(model, aux_layer_ids)

    def policy_logits(self, out):
        """The forward's logits, detached, where the loss reads them (else None: not kept)."""
        return out.logits.detach() if self.reads_policy_logits else None

    # ---- the loss ----------------------------------------------------------------------
    def normaliser(self, batch, num_micro_batches):
        return num_micro_batches

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
            yield self.wire_prefix + name, p.detach()

    def state(self):
        """The draft's weights (under --bf16 its fp32 masters), optimizer state and config."""
        with fp32_params_for_checkpoint(self.module, self.optimizer):
            weights = {k: v.clone() for k, v in self.module.state_dict().items()}
        return {"draft": weights, "optimizer": self.optimizer.state_dict(), "config": self.module.cfg}

    def load_state(self, state):
        with fp32_params_for_checkpoint(self.module, self.optimizer):
            self.module.load_state_dict(state["draft"])
        self.optimizer.load_state_dict(state["optimizer"])
