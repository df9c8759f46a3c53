"""`Trainer`: one megatron-core policy (+ MTP) trainer process, usable in-process or in a Ray actor.

Call `trainer.distributed.init_distributed(...)` first in multi-process setups; a lone
Trainer starts a one-process group itself. Per step:
policy loss (PPO-clip on the rollout log-probs) + factor/num_layers * MTP loss, where the
MTP block reads detached trunk outputs (DESIGN §4) and has its own grad-norm clip.
"""
import collections
import dataclasses

import torch
import torch.distributed as dist

from vime.models.hf_format import load_hf_checkpoint, read_config
from mtp.loss import DISTILLATION_LOSSES, mtp_loss, mtp_loss_mask, scaled_mtp_loss
from mtp.sampling import effective_temperature, token_logprobs
from trainer import checkpoint, grads
from trainer.mixed_precision import build_optimizer, fp32_params_for_checkpoint, grad_params, named_grad_params
from trainer.distributed import ensure_distributed
from trainer.draft import DraftTraining, load_draft_state, save_draft_state
from trainer.losses import entropy_from_logits, policy_loss, token_mean
from trainer.model import build_model, forward, is_mtp_param, spec_name
from trainer.weights import load_hf_state, named_hf_weights
from vime.errors import require
from vime.precision import compute_dtype


def resolve_mtp_layers(requested, available):
    """MTP layers to build: the checkpoint's count by default; more than it has is refused."""
    n = available if requested is None else requested
    require(0 <= n <= available, f"--mtp-num-layers {n}: the HF checkpoint has only {available} MTP layers")
    return n


def resolve_train_depths(requested, num_layers):
    """Draft depths the MTP loss trains: one per layer by default; fewer than the layers is refused."""
    depths = num_layers if requested is None else requested
    require(depths >= num_layers, f"--mtp-train-depths {depths} is fewer than the {num_layers} MTP layers: "
            f"every layer trains at its own depth; pass at least {num_layers}")
    return depths


def _dp_sum(value):
    from trainer.distributed import collective_device, dp_group

    # on the collective's device (NCCL reduces CUDA tensors only); callers read it with .item()
    t = torch.as_tensor(value, dtype=torch.float64).detach().clone().to(collective_device())

    if dist.get_world_size(dp_group()) > 1:
        dist.all_reduce(t, group=dp_group())
    return t


class Trainer:
    """Policy + MTP trainer on this rank's TP shard. See module docstring."""

    def __init__(self, cfg, hf_checkpoint, load=None):
        """cfg: TrainerConfig; hf_checkpoint: HF dir (architecture, and weights unless `load`);
        load: a torch_dist checkpoint dir to resume from (weights + optimizer state)."""
        self.cfg = cfg
        ensure_distributed(cfg.tensor_model_parallel_size, cfg.pipeline_model_parallel_size)
        hf_cfg = read_config(hf_checkpoint)
        self.mtp_num_layers = resolve_mtp_layers(cfg.mtp_num_layers, hf_cfg.num_nextn_predict_layers)
        require(not cfg.enable_mtp_training or self.mtp_num_layers > 0,
                "--enable-mtp-training needs MTP layers; the HF checkpoint has none or --mtp-num-layers is 0")
        self.mtp_depths = resolve_train_depths(cfg.mtp_train_depths, self.mtp_num_layers)
        # the drafter-exact reuse needs an arbitrary attention mask, which the local attention
        # applies; Transformer Engine's layers are built causal and would ignore it silently
        require(self.mtp_depths <= self.mtp_num_layers or cfg.mtp_reuse_attention != "drafter" or spec_name() != "te",
                "--mtp-reuse-attention drafter runs the reused depths with an arbitrary attention mask, which "
                "the Transformer Engine layers used on this GPU do not take; use --mtp-reuse-attention megatron")
        self.model_cfg = dataclasses.replace(hf_cfg, num_nextn_predict_layers=self.mtp_num_layers)
        self.model = build_model(self.model_cfg, self.mtp_num_layers, cfg.tensor_model_parallel_size,
                                 cfg.pipeline_model_parallel_size, cfg.seed, compute_dtype(cfg.bf16))
        if load is None:
            _, hf_state, _ = load_hf_checkpoint(hf_checkpoint)
            load_hf_state(self.model, hf_state, self.model_cfg)
        self._freeze_mtp_unless_trained()
        self.optimizer = self._build_optimizer()
        # an external EAGLE-3 draft trained beside the policy (trainer/draft.py), or None
        self.draft = DraftTraining(cfg, self.model, self.model_cfg) if cfg.enable_draft_training else None
        # earlier rollout batches the MTP-only steps also train on (--mtp-replay-batches; CPU
        # tensors, newest first; not checkpointed: after --load it refills over R steps)
        self._mtp_replay = collections.deque(maxlen=cfg.mtp_replay_batches)
        if load is not None:
            self.load(load)

    # ---- parameters -------------------------------------------------------------------
    def _freeze_mtp_unless_trained(self):
        for name, p in self.model.named_parameters():
            if is_mtp_param(name):
                p.requires_grad_(self.cfg.enable_mtp_training)

    def policy_params(self):
        return [p for n, p in self.model.named_parameters() if not is_mtp_param(n)]

    def mtp_params(self):
        return [p for n, p in self.model.named_parameters() if is_mtp_param(n)]

    def _build_optimizer(self):
        groups = [{"params": self.policy_params()}]
        if self.cfg.enable_mtp_training:
            groups.append({"params": self.mtp_params(),
                           "lr": self.cfg.lr if self.cfg.mtp_lr is None else self.cfg.mtp_lr})
        return build_optimizer(groups, self.cfg.bf16, lr=self.cfg.lr, weight_decay=self.cfg.weight_decay,
                               eps=self.cfg.adam_eps)

    def _named_grads(self):
        """(name, the tensor holding its gradient) of every parameter: the parameter itself, or
        under --bf16 its fp32 main parameter (trainer/mixed_precision.py)."""
        return named_grad_params(self.optimizer, self.model.named_parameters())

    # ---- forward pieces ---------------------------------------------------------------
    def _token_logprobs(self, out, tokens):
        """[b, s-1] log-probs of tokens 1.. under softmax(logits / T)."""
        return token_logprobs(out.logits[:, :-1], tokens[:, 1:], self.cfg.temperature)

    @property
    def device(self):
        """The model's device: batches are built on the CPU and moved here."""
        return next(self.model.parameters()).device

    @torch.no_grad()
    def compute_logprobs(self, batch):
        """[B, S] log-prob of each token given its prefix (0 at position 0), at the rollout temperature."""
        batch = batch.to(self.device)
        self.model.eval()
        rows = []
        for mb in batch.micro_batches(self.cfg.micro_batch_size):
            lp = self._token_logprobs(forward(self.model, mb.tokens), mb.tokens)
            rows.append(torch.nn.functional.pad(lp, (1, 0)))
        return torch.cat(rows)

    def _mtp_losses(self, out, mb, mtp_counts):
        """Per-depth MTP loss (--mtp-loss-type), each a share of the step's token mean (sums to it
        over micro-batches). The distillation target is the detached policy (mtp/loss.py)."""
        logits = self.model.mtp_logits(out, detach_trunk=self.cfg.mtp_detach_trunk, depths=self.mtp_depths,
                                       reuse_attention=self.cfg.mtp_reuse_attention)
        policy_logits = out.logits.detach() if out.logits is not None else None
        losses = []
        for d, lg in enumerate(logits, start=1):
            local = mtp_loss_mask(mb.loss_mask, d).sum()
            loss = mtp_loss(lg, mb.tokens, mb.loss_mask, d, self.cfg.mtp_loss_type, policy_logits,
                            self.cfg.temperature, self.cfg.mtp_distill_topk)
            losses.append(loss * local / mtp_counts[d - 1].clamp(min=1))
        return losses

    def _micro_batch_loss(self, mb, num_tokens, mtp_counts):
        out = forward(self.model, mb.tokens)
        if self.draft is not None:  # a detached copy: the policy's graph is untouched
            self.draft.keep_policy_logits(out.logits)
        lp = self._token_logprobs(out, mb.tokens)
        mask = mb.label_mask
        ref = mb.ref_logprobs[:, 1:] if mb.ref_logprobs is not None else None
        require(not self.cfg.use_kl_loss or ref is not None, "--use-kl-loss needs reference log-probs in the batch")
        if self.cfg.use_tis:  # ratio against pi_old, TIS weight for pi_old / pi_rollout
            # pi_old is the policy before this RL step's first update: on that update it is this very
            # forward (detached), so only later updates of the same rollout need it precomputed
            old = mb.old_logprobs[:, 1:] if mb.old_logprobs is not None else lp.detach()
            loss, m = policy_loss(lp, old, mb.advantages[:, 1:], mask, self.cfg, ref, num_tokens,
                                  rollout_logprobs=mb.rollout_logprobs[:, 1:])
        else:
            loss, m = policy_loss(lp, mb.rollout_logprobs[:, 1:], mb.advantages[:, 1:], mask, self.cfg, ref,
                                  num_tokens)
        with torch.no_grad():
            temp = effective_temperature(self.cfg.temperature)
            m["entropy"] = token_mean(entropy_from_logits(out.logits[:, :-1], temp), mask, num_tokens)
            m["logprob_abs_diff"] = token_mean((lp - mb.rollout_logprobs[:, 1:]).abs(), mask, num_tokens)
        if self.cfg.enable_mtp_training:
            per_depth = self._mtp_losses(out, mb, mtp_counts)
            loss = loss + scaled_mtp_loss(per_depth, self.cfg.mtp_loss_scaling_factor)
            for i, l in enumerate(per_depth, start=1):
                m[f"mtp_{i}_loss"] = l.detach()
        return loss, m

    # ---- step -------------------------------------------------------------------------
    def backward(self, batch):
        """Forward + backward over micro-batches; grads left on the parameters. Returns metrics."""
        batch = batch.to(self.device)
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        num_tokens = _dp_sum(batch.num_response_tokens()).float()
        mtp_counts = self._mtp_counts(batch)
        totals = {}
        micro_batches = list(batch.micro_batches(self.cfg.micro_batch_size))
        for mb in micro_batches:
            loss, m = self._micro_batch_loss(mb, num_tokens, mtp_counts)
            loss.backward()
            if self.draft is not None:  # after the policy's backward, on the forward's detached states
                for i, x in enumerate(self.draft.backward_micro_batch(mb.tokens, mb.loss_mask, 1 / len(micro_batches))):
                    m[f"draft_{i + 1}_loss"] = x
            for k, v in m.items():
                totals[k] = totals.get(k, 0.0) + float(v)
        grads.reduce_gradients(self._named_grads())
        return self._metrics(totals)

    def _mtp_counts(self, batch):
        """Tokens each MTP depth's loss averages over, summed over data-parallel ranks."""
        return [_dp_sum(mtp_loss_mask(batch.loss_mask, d).sum()).float() for d in range(1, self.mtp_depths + 1)]

    def _frozen_trunk_outputs(self, batch):
        """(micro-batch, trunk ForwardOutput) pairs for the MTP-only steps, computed once: the
        trunk does not change between those steps, so one no-grad forward serves them all. The
        [b, s, V] policy logits are kept only where the loss type reads them (distillation)."""
        batch = batch.to(self.device)
        keep_logits = self.cfg.mtp_loss_type in DISTILLATION_LOSSES
        pairs = []
        with torch.no_grad():
            for mb in batch.micro_batches(self.cfg.micro_batch_size):
                out = forward(self.model, mb.tokens)
                pairs.append((mb, out if keep_logits else dataclasses.replace(out, logits=None)))
        return pairs

    def _mtp_only_step(self, trunk_outputs, mtp_counts):
        """One more optimiser step of the MTP layers alone (--mtp-steps-per-rollout) on the
        micro-batches of `trunk_outputs` (`_frozen_trunk_outputs`).

        The trunk's parameters keep no grad, so AdamW skips them: the policy is exactly what the
        joint step left. Returns the step's MTP loss (depth mean)."""
        self.optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for mb, out in trunk_outputs:
            per_depth = self._mtp_losses(out, mb, mtp_counts)
            scaled_mtp_loss(per_depth, self.cfg.mtp_loss_scaling_factor).backward()
            total += float(torch.stack(per_depth).detach().sum()) / len(per_depth)
        grads.reduce_gradients(self._named_grads())
        grads.clip_by_norm(grad_params(self.optimizer, self.mtp_params()), self.cfg.effective_mtp_clip_grad)
        self.optimizer.step()
        return _dp_sum(total).item()

    def _mtp_only_steps(self, batches, steps):
        """`steps` MTP-only optimiser steps cycling over `batches` (this step's first), ordered so
        that the last step is on this step's batch; returns that step's MTP loss."""
        prepared = [(self._frozen_trunk_outputs(b), self._mtp_counts(b.to(self.device))) for b in batches]
        loss = None
        for i in range(steps):
            loss = self._mtp_only_step(*prepared[(steps - 1 - i) % len(prepared)])
        return loss

    def _draft_inputs(self, batch):
        """The draft's inputs (trainer/draft.py DraftInputs) of every micro-batch of `batch` under
        the current policy: one no-grad forward each, read by the draft's hooks."""
        batch = batch.to(self.device)
        inputs = []
        with torch.no_grad():
            for mb in batch.micro_batches(self.cfg.micro_batch_size):
                self.draft.keep_policy_logits(forward(self.model, mb.tokens).logits)
                inputs.append(self.draft.take_inputs(mb.tokens, mb.loss_mask))
        return inputs

    def _draft_only_steps(self, batch):
        """--draft-steps-per-rollout N: N-1 steps of the external draft alone, on the updated
        policy's states of `batch` and the replayed earlier batches; the policy is not touched.
        Returns {"train/draft_final_loss": the last step's loss, averaged over DP ranks} or {}."""
        from trainer.distributed import dp_group

        steps = self.cfg.draft_steps_per_rollout - 1
        if steps < 1:
            return {}
        prepared = [self._draft_inputs(b) for b in [batch, *self.draft.replay]]
        loss = self.draft.train_on(prepared, steps)
        self.draft.replay.appendleft(batch)
        return {"train/draft_final_loss": _dp_sum(loss).item() / dist.get_world_size(dp_group())}

    def _metrics(self, totals):
        out = {f"train/{k}": _dp_sum(v).item() for k, v in totals.items()}
        policy = out.pop("train/pg_loss")
        if self.cfg.use_kl_loss:
            policy += self.cfg.kl_loss_coef * out["train/kl"]
        out["train/policy_loss"] = policy
        depths = [out[f"train/mtp_{i}_loss"] for i in range(1, self.mtp_depths + 1) if f"train/mtp_{i}_loss" in out]
        if depths:
            out["train/mtp_loss"] = sum(depths) / len(depths)
        return out

    def train_step(self, batch):
        """One optimiser step on `batch` (this DP rank's share). Returns the train/* metrics."""
        metrics = self.backward(batch)
        metrics["train/grad_norm"] = grads.clip_by_norm(grad_params(self.optimizer, self.policy_params()),
                                                        self.cfg.clip_grad)
        if self.cfg.enable_mtp_training:
            metrics["train/mtp_grad_norm"] = grads.clip_by_norm(grad_params(self.optimizer, self.mtp_params()),
                                                                self.cfg.effective_mtp_clip_grad)
        self.optimizer.step()
        if self.draft is not None:
            metrics["train/draft_grad_norm"] = self.draft.step()
            metrics.update(self._draft_only_steps(batch))
        if self.cfg.mtp_steps_per_rollout > 1:
            metrics["train/mtp_final_loss"] = self._mtp_only_steps([batch, *self._mtp_replay],
                                                                   self.cfg.mtp_steps_per_rollout - 1)
            self._mtp_replay.appendleft(batch)
        return metrics

    # ---- weights and checkpoints ------------------------------------------------------
    def named_hf_weights(self):
        """Yield (canonical HF name, full tensor) of every weight, trunk and MTP, on every TP rank."""
        yield from named_hf_weights(self.model, self.model_cfg)
        if self.draft is not None:
            yield from self.draft.named_weights()

    def _meta(self):
        return {"model_config": dataclasses.asdict(self.model_cfg), "mtp_num_layers": self.mtp_num_layers,
                "mtp_trained": bool(self.cfg.enable_mtp_training)}

    def save(self, path):
        """torch_dist checkpoint of weights + optimizer state (collective: every rank calls it)."""
        with fp32_params_for_checkpoint(self.model, self.optimizer):  # under --bf16 the fp32 masters: a plain fp32 checkpoint
            checkpoint.save(path, self.model, self.optimizer, self._meta())
        if self.draft is not None:
            save_draft_state(path, self.draft.state())

    def load(self, path):
        """Load a torch_dist checkpoint saved at any TP size (collective)."""
        meta = checkpoint.read_meta(path)
        require(meta.get("mtp_num_layers", 0) >= self.mtp_num_layers,
                f"--load {path}: the checkpoint has {meta.get('mtp_num_layers', 0)} MTP layers, "
                f"fewer than --mtp-num-layers {self.mtp_num_layers}")
        with fp32_params_for_checkpoint(self.model, self.optimizer):  # under --bf16 into the fp32 masters, then rounded
            checkpoint.load(path, self.model, self.optimizer)
        if self.draft is not None:
            self.draft.load_state(load_draft_state(path))
