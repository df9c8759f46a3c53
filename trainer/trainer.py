"""`Trainer`: one megatron-core policy trainer process (+ the draft it trains), in-process or in a Ray actor.

Call `trainer.distributed.init_distributed(...)` first in multi-process setups; a lone
Trainer starts a one-process group itself. Per step: the policy loss (PPO-clip on the rollout
log-probs) plus the loss of the draft the run trains, whatever its kind (trainer/drafts: the MTP
layers or an external EAGLE-3 or DFlash draft), which reads detached policy states and has its own grad-norm
clip; then the draft's own steps on the updated policy (trainer/drafts/base.py).
"""
import collections
import contextlib
import dataclasses
import re

import torch

from vime.models.hf_format import load_hf_checkpoint, read_config
from vime.models.torch_dist_format import torch_dist_tensor_problem
from mtp.sampling import effective_temperature, token_logprobs
from trainer import checkpoint, grads
from trainer.mixed_precision import build_optimizer, fp32_params_for_checkpoint, grad_params, named_grad_params
from trainer.distributed import dp_sum, ensure_distributed
from trainer.drafts import build_draft, load_draft_state, save_draft_state
from trainer.losses import entropy_from_logits, policy_loss, token_mean
from trainer.routing_replay import RoutingReplay
from trainer.model import build_model, forward, is_mtp_param, update_expert_biases
from trainer.weights import load_hf_state, named_hf_weights
from vime.errors import require
from vime.precision import compute_dtype


def resolve_mtp_layers(requested, available):
    """MTP layers to build: the checkpoint's count by default; more than it has is refused."""
    n = available if requested is None else requested
    require(0 <= n <= available, f"--mtp-num-layers {n}: the HF checkpoint has only {available} MTP layers; "
            + (f"pass --mtp-num-layers {available}" if available else "drop --mtp-num-layers"))
    return n


class Trainer:
    """The policy (and the draft the run trains) on this rank's TP shard. See module docstring."""

    def __init__(self, cfg, hf_checkpoint, load=None):
        """cfg: TrainerConfig; hf_checkpoint: HF dir (architecture, and weights unless `load`);
        load: a torch_dist checkpoint dir to resume from (weights + optimizer state)."""
        self.cfg = cfg
        ensure_distributed(cfg.layout)
        hf_cfg = read_config(hf_checkpoint)
        self.mtp_num_layers = resolve_mtp_layers(cfg.mtp_num_layers, hf_cfg.num_nextn_predict_layers)
        self.model_cfg = dataclasses.replace(hf_cfg, num_nextn_predict_layers=self.mtp_num_layers)
        self.model = build_model(self.model_cfg, self.mtp_num_layers, cfg.layout, cfg.seed, compute_dtype(cfg.bf16))
        if load is None:
            _, hf_state, _ = load_hf_checkpoint(hf_checkpoint)
            load_hf_state(self.model, hf_state, self.model_cfg)
        for name, p in self.model.named_parameters():  # loaded frozen, still synced, unless they are the draft
            if is_mtp_param(name):
                p.requires_grad_(False)
        # MoE: the decoder routers take the rollout's routes (--use-rollout-routing-replay) or their own,
        # and count where they differ (trainer/routing_replay.py)
        self.routing = (RoutingReplay(self.model, cfg.use_rollout_routing_replay)
                        if self.model_cfg.moe is not None else None)
        # the draft trained beside the policy (trainer/drafts: MTP layers, EAGLE-3, DFlash), or None
        self.draft = build_draft(cfg, self.model, self.model_cfg)
        self.optimizer = self._build_optimizer()
        if self.draft is not None:
            self.draft.attach(self.optimizer)
        # earlier rollout batches the draft-only steps also train on (--draft-replay-batches; CPU
        # tensors, newest first; not checkpointed: after --load it refills over R steps)
        self._draft_replay = collections.deque(maxlen=self.draft.knobs.replay_batches if self.draft else 0)
        if load is not None:
            self.load(load)

    # ---- parameters -------------------------------------------------------------------
    def named_policy_params(self):
        return [(n, p) for n, p in self.model.named_parameters() if not is_mtp_param(n)]

    def policy_params(self):
        return [p for _, p in self.named_policy_params()]

    def _build_optimizer(self):
        groups = [{"params": self.policy_params()}, *(self.draft.param_groups() if self.draft else [])]
        return build_optimizer(groups, self.cfg.bf16, lr=self.cfg.lr, weight_decay=self.cfg.weight_decay,
                               eps=self.cfg.adam_eps)

    def _optimizers(self):
        """The trainer's optimizer, and the draft's when it has one of its own."""
        own = self.draft is not None and self.draft.optimizer is not self.optimizer
        return [self.optimizer, self.draft.optimizer] if own else [self.optimizer]

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
            with self._rollout_routes(mb):
                lp = self._token_logprobs(forward(self.model, mb.tokens), mb.tokens)
            rows.append(torch.nn.functional.pad(lp, (1, 0)))
        return torch.cat(rows)

    def _rollout_routes(self, mb):
        """Around a forward of micro-batch `mb`: its rollout routes for the MoE routers (replayed under
        --use-rollout-routing-replay, else only compared)."""
        return self.routing.routes(mb.routed_experts) if self.routing else contextlib.nullcontext()

    def _policy_loss(self, out, mb, num_tokens):
        """(policy loss of one micro-batch, its metrics), a share of the step's token mean."""
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
        return loss, m

    def _draft_loss(self, inputs, metrics=None):
        """The draft's loss on one micro-batch's `inputs`; its parts (depths, drafting steps) go into
        `metrics` as <prefix>_<i>_loss. Returns (loss, the micro-batch's share of the reported mean)."""
        loss, parts = self.draft.loss(inputs)
        if metrics is not None:
            for i, x in enumerate(parts, start=1):
                metrics[f"{self.draft.metric_prefix}_{i}_loss"] = x
        return loss, sum(parts) / max(len(parts), 1)

    # ---- step -------------------------------------------------------------------------
    def backward(self, batch):
        """Forward + backward over micro-batches, the policy's loss and the draft's; grads left on the
        parameters, reduced over ranks. Returns metrics."""
        batch = batch.to(self.device)
        self.model.train()
        for optimizer in self._optimizers():
            optimizer.zero_grad(set_to_none=True)
        num_tokens = dp_sum(batch.num_response_tokens()).float()
        micro_batches = list(batch.micro_batches(self.cfg.micro_batch_size))
        normaliser = self.draft.normaliser(batch, len(micro_batches)) if self.draft else None
        totals = {}
        if self.routing:
            self.routing.disagreement()  # counts start with this step's forwards
        for mb in micro_batches:
            with self._rollout_routes(mb):
                out = forward(self.model, mb.tokens, mb.token_mask)
            loss, m = self._policy_loss(out, mb, num_tokens)
            if self.draft is not None:  # on detached policy states: the policy's gradients are untouched
                loss = loss + self._draft_loss(self.draft.inputs(out, mb, normaliser), m)[0]
            loss.backward()
            for k, v in m.items():
                totals[k] = totals.get(k, 0.0) + float(v)
        grads.reduce_gradients(named_grad_params(self.optimizer, self.named_policy_params()))
        if self.draft is not None:
            self.draft.reduce_gradients()
        return dict(self._metrics(totals), **self._route_metrics())

    def _route_metrics(self):
        """train/route_disagreement: the share of (position, MoE layer) routes of this step where the
        trainer's own routers chose other experts than the rollout (with or without replay)."""
        if self.routing is None:
            return {}
        diff, total = self.routing.disagreement()
        total = dp_sum(total).item()
        return {"train/route_disagreement": dp_sum(diff).item() / total} if total else {}

    def _draft_inputs(self, batch):
        """The draft's inputs of every micro-batch of `batch` under the current policy: one no-grad
        forward each (the policy does not change between the draft-only steps)."""
        batch = batch.to(self.device)
        micro_batches = list(batch.micro_batches(self.cfg.micro_batch_size))
        normaliser = self.draft.normaliser(batch, len(micro_batches))
        inputs = []
        with torch.no_grad():
            for mb in micro_batches:
                with self._rollout_routes(mb):
                    inputs.append(self.draft.inputs(forward(self.model, mb.tokens, mb.token_mask), mb, normaliser))
        return inputs

    def _draft_only_step(self, inputs):
        """One optimiser step of the draft alone on one batch's `inputs`: the policy's parameters keep
        no grad, so the optimizer skips them. Returns this rank's share of the step's loss."""
        self.draft.optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for micro in inputs:
            loss, reported = self._draft_loss(micro)
            loss.backward()
            total += reported
        self.draft.reduce_gradients()
        self.draft.clip_gradients()
        self.draft.optimizer.step()
        self._balance_experts()
        return total

    def _draft_only_steps(self, batches, steps):
        """`steps` draft-only steps cycling over `batches` (this RL step's first), ordered so that the
        last step is on this step's batch; returns that step's loss (mean over parts and ranks)."""
        prepared = [self._draft_inputs(b) for b in batches]
        total = None
        for i in range(steps):
            total = self._draft_only_step(prepared[(steps - 1 - i) % len(prepared)])
        return dp_sum(total).item()

    def _metrics(self, totals):
        out = {f"train/{k}": dp_sum(v).item() for k, v in totals.items()}
        policy = out.pop("train/pg_loss")
        if self.cfg.use_kl_loss:
            policy += self.cfg.kl_loss_coef * out["train/kl"]
        out["train/policy_loss"] = policy
        if self.draft is not None:
            prefix = self.draft.metric_prefix
            parts = [v for k, v in out.items() if re.fullmatch(f"train/{prefix}_[0-9]+_loss", k)]
            if parts:  # the mean over depths / drafting steps
                out[f"train/{prefix}_loss"] = sum(parts) / len(parts)
        return out

    def train_step(self, batch):
        """One optimiser step on `batch` (this DP rank's share), then --draft-steps-per-rollout - 1
        steps of the draft alone on the updated policy. Returns the train/* metrics."""
        metrics = self.backward(batch)
        metrics["train/grad_norm"] = grads.clip_by_norm(grad_params(self.optimizer, self.policy_params()),
                                                        self.cfg.clip_grad)
        if self.draft is not None:
            metrics[f"train/{self.draft.metric_prefix}_grad_norm"] = self.draft.clip_gradients()
        for optimizer in self._optimizers():
            optimizer.step()
        self._balance_experts()
        steps = self.draft.knobs.steps_per_rollout - 1 if self.draft else 0
        if steps > 0:
            metrics["train/draft_final_loss"] = self._draft_only_steps([batch, *self._draft_replay], steps)
            self._draft_replay.appendleft(batch)
        return metrics

    def _balance_experts(self):
        """After every optimiser step (joint or draft-only), MoE routers' expert biases step towards
        balance over the tokens they routed in it; a router that routed none keeps its bias."""
        update_expert_biases(self.model, self.cfg.moe_router_bias_update_rate)

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
            save_draft_state(path, self.draft)

    def load(self, path):
        """Load a torch_dist checkpoint saved at any TP size (collective)."""
        meta = checkpoint.read_meta(path)
        require(meta.get("mtp_num_layers", 0) >= self.mtp_num_layers,
                f"--load {path}: the checkpoint has {meta.get('mtp_num_layers', 0)} MTP layers, "
                f"fewer than --mtp-num-layers {self.mtp_num_layers}")
        problem = torch_dist_tensor_problem(meta, self.model_cfg, self.mtp_num_layers)
        require(problem is None, f"--load {path}: its tensors disagree with the model's config: {problem}")
        with fp32_params_for_checkpoint(self.model, self.optimizer):  # under --bf16 into the fp32 masters, then rounded
            checkpoint.load(path, self.model, self.optimizer)
        if self.draft is not None:
            load_draft_state(path, self.draft)
