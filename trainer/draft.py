"""Online training of an external EAGLE-3 draft inside the trainer (--enable-draft-training).

The draft (mtp/eagle3.py, loaded from the rollout's speculative config `model`) lives next to
the policy on every trainer rank, with its own AdamW and grad clip. During the policy's forward
over a rollout micro-batch, forward hooks keep the hidden states the draft reads — the residual
stream before the target layers in its `aux_layer_ids` (id 0: the embedding output) — detached.
After the policy's backward the draft's loss (EAGLE-3's training-time test over k drafting steps,
mtp/eagle3.py) runs on those detached tensors alone, so the policy's loss and gradients are
exactly what they are without it. Data-parallel ranks average the draft's gradients.
Its tensors go to the rollout with the policy's under `eagle3.<checkpoint name>`.
"""
import torch
import torch.distributed as dist

from mtp.eagle3 import Eagle3Draft, training_time_test_loss
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


class DraftTraining:
    """The external draft, its optimizer and the hooks that keep the policy's aux hidden states."""

    def __init__(self, cfg, model, target_cfg):
        path, self.steps = draft_path_of(cfg.speculative_config)
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

    # ---- one micro-batch's loss, one optimiser step ----------------------------------------
    def backward_micro_batch(self, tokens, loss_mask, weight):
        """Backward of the draft's training-time-test loss on what the last policy forward kept;
        `weight`: this micro-batch's share of the step. Returns the loss (detached) per drafting step."""
        aux = torch.cat([self.kept["embeds" if i == 0 else i] for i in self.draft.cfg.aux_layer_ids], -1)
        loss, per_step = training_time_test_loss(self.draft, self.kept["embeds"], aux, tokens, loss_mask, self.steps)
        (self.cfg.draft_loss_scaling_factor * weight * loss).backward()
        self.kept = {}
        return [float(x.detach()) * weight for x in per_step]

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
