"""`Trainer`: one megatron-core policy trainer process (+ the draft it trains), in-process or in a Ray actor.

Call `trainer.distributed.init_distributed(...)` first in multi-process setups; a lone
Trainer starts a one-process group itself. Per step: the policy loss (PPO-clip on the rollout
log-probs) plus the loss of the draft the run trains, whatever its kind (trainer/drafts: the MTP
layers or an external EAGLE-3, DFlash or DSpark draft), which reads detached policy states and has its own
optimizer part and grad-norm clip (trainer/optimizer.py: megatron's DDP and optimizer); then the draft's own
steps on the updated policy (trainer/drafts/base.py).

A rank holds its TP shard of its pipeline stage's layers; the micro-batches go through megatron-core's
schedule (trainer/pipeline.py), the losses on the last stage, and what a step reports is the same on
every rank: the last stage's losses, grad norms over every stage (docs/at_scale.md#pipeline-parallelism).
"""
import collections
import contextlib
import dataclasses
import re

import torch

from vime.models.hf_format import load_hf_checkpoint, read_config
from vime.models.torch_dist_format import torch_dist_tensor_problem
from mtp.sampling import effective_temperature, token_logprobs
from trainer import checkpoint, offload
from trainer.distributed import dp_sum, ensure_distributed, from_last_stage, pp_sum, tensor_from_last_stage
from trainer.expert_parallel import padded_to_common_width
from trainer.drafts import build_draft, load_draft_state, save_draft_state
from trainer.losses import entropy_from_logits, policy_loss, token_mean
from trainer.routing_replay import RoutingReplay
from trainer.model import build_model, forward, is_mtp_param, update_expert_biases
from trainer.optimizer import OptimizerOptions, PolicyPart, no_sync
from trainer.pipeline import run_micro_batches
from trainer.weights import gather_stages, load_hf_state, stage_hf_weights
from vime.errors import require
from vime.models.activations import RecomputePlan
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
        self.model = build_model(self.model_cfg, self.mtp_num_layers, cfg.layout, cfg.seed, compute_dtype(cfg.bf16),
                                 RecomputePlan.of(cfg))
        if load is None:
            _, hf_state, _ = load_hf_checkpoint(hf_checkpoint)
            load_hf_state(self.model, hf_state, self.model_cfg)
        for name, p in self.model.named_parameters():  # loaded frozen, still synced, unless they are the draft
            if is_mtp_param(name):
                p.requires_grad_(False)
        # MoE: the decoder routers take the rollout's routes (--use-rollout-routing-replay) or their own,
        # and count where they differ (trainer/routing_replay.py)
        self.routing = (RoutingReplay(self.model, cfg.use_rollout_routing_replay, self.model_cfg)
                        if self.model_cfg.moe is not None else None)
        # the policy's DDP and optimizer, built while the MTP layers are frozen (trainer/optimizer.py)
        self.policy = PolicyPart(self.model, self.model.config, OptimizerOptions.of(cfg), cfg.lr, cfg.weight_decay,
                                 cfg.adam_eps, cfg.clip_grad)
        # the draft trained beside the policy (trainer/drafts: MTP layers, EAGLE-3, DFlash, DSpark), or None
        self.draft = build_draft(cfg, self.model, self.model_cfg)
        # the pipeline schedule holds back every part's gradient reduce until a step's last micro-batch
        self.policy.config.no_sync_func = lambda: no_sync(self.parts)
        self.offloaded = None  # what waits on the host while the engines generate (trainer/offload.py)
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

    @property
    def parts(self):
        """The trained parts (trainer/optimizer.py): the policy's, and the draft's."""
        return [self.policy] + ([self.draft.part] if self.draft is not None else [])

    @property
    def optimizer(self):
        """The policy's megatron optimizer."""
        return self.policy.optimizer

    def named_gradients(self):
        """{parameter name: its gradient of the last backward, reduced over the ranks} of every trained parameter
        of the model (megatron's DDP keeps them in `main_grad`); a frozen parameter is not listed."""
        return {n: p.main_grad for n, p in self.model.named_parameters() if getattr(p, "main_grad", None) is not None}

    # ---- forward pieces ---------------------------------------------------------------
    def _token_logprobs(self, out, tokens):
        """[b, s-1] log-probs of tokens 1.. under softmax(logits / T)."""
        return token_logprobs(out.logits[:, :-1], tokens[:, 1:], self.cfg.temperature)

    @property
    def device(self):
        """The model's device: batches are built on the CPU and moved here."""
        return next(self.model.parameters()).device

    def _on_device(self, batch):
        """`batch` on the model's device, as wide as its expert-parallel peers' (trainer/expert_parallel.py) and,
        under sequence parallelism, a multiple of TP wide (megatron splits the positions evenly over TP)."""
        batch = batch.to(self.device)
        batch = padded_to_common_width(batch) if self.model_cfg.moe is not None else batch
        tp = self.cfg.tensor_model_parallel_size
        return batch.padded_to(-(-batch.width // tp) * tp) if self.cfg.sequence_parallel else batch

    @torch.no_grad()
    def compute_logprobs(self, batch):
        """[B, S] log-prob of each token given its prefix (0 at position 0), at the rollout temperature
        (computed on the last pipeline stage, returned on every stage)."""
        width = batch.width
        batch = self._on_device(batch)
        self.model.eval()

        def logprobs(out, mb):
            return torch.zeros((), device=self.device), self._token_logprobs(out, mb.tokens)

        rows = self._run(batch.micro_batches(self.cfg.micro_batch_size), logprobs, forward_only=True)
        lp = torch.nn.functional.pad(torch.cat(rows), (1, 0))[:batch.size] if rows else torch.empty(batch.tokens.shape)
        return tensor_from_last_stage(lp.to(self.device, torch.float32))[:, :width]

    def _run(self, micro_batches, loss, forward_only=False, training=False):
        """`loss(out, mb)` of every micro-batch's forward, through the pipeline stages
        (trainer/pipeline.py); each forward with its rollout routes. `training`: the forwards the policy
        or the draft trains on: the MoE load is counted on real tokens only, and the draft keeps the
        states it reads. Between stages every micro-batch has one shape: a short last one is padded
        with empty rows (they add nothing; its results keep them, after the real rows). Returns the
        results on the last stage, [] on the others."""
        def forward_one(mb):
            with self._rollout_routes(mb):
                out = forward(self.model, mb.tokens, mb.token_mask if training else None)
            if training and self.draft is not None:
                self.draft.after_forward()
            return out

        micro_batches = list(micro_batches)
        if self.cfg.pipeline_model_parallel_size > 1:
            micro_batches = [mb.with_rows(micro_batches[0].size) for mb in micro_batches]
        return run_micro_batches(self.policy.ddp, self.model, micro_batches, forward_one, loss, forward_only)

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
        batch = self._on_device(batch)
        self.model.train()
        for part in self.parts:
            part.zero_grad()
        num_tokens = dp_sum(batch.num_response_tokens()).float()
        micro_batches = list(batch.micro_batches(self.cfg.micro_batch_size))
        normaliser = self.draft.normaliser(batch, len(micro_batches)) if self.draft else None
        if self.routing:
            self.routing.disagreement()  # counts start with this step's forwards

        later = []  # (draft inputs, metrics) of a draft whose loss runs after the pipeline

        def loss_of(out, mb):
            loss, m = self._policy_loss(out, mb, num_tokens)
            m = {k: float(v) for k, v in m.items()}
            if self.draft is not None:  # on detached policy states: the policy's gradients are untouched
                inputs = self.draft.inputs(out, mb, normaliser)
                if self.draft.loss_in_pipeline:
                    loss = loss + self._draft_loss(inputs, m)[0]
                else:
                    later.append((inputs, m))
            return loss, m

        results = self._run(micro_batches, loss_of, training=True)
        if self.draft is not None and not self.draft.loss_in_pipeline:
            # its own graph: the same gradients as inside the policy's backward
            inputs = self.draft.complete([i for i, _ in later])
            self._draft_backward(inputs, [m for _, m in later])
        totals = {}
        for m in results:
            for k, v in m.items():
                totals[k] = totals.get(k, 0.0) + v
        if self.draft is not None:  # an external draft's weights have no TP parts; the policy's walk sums the MTP's
            self.draft.part.finish_gradients(tensor_parallel_sums=False)
        self.policy.finish_gradients()
        return dict(self._metrics(totals), **self._route_metrics())

    def _draft_backward(self, inputs, metrics=None):
        """The draft's loss of each micro-batch's `inputs` backward, outside the pipeline (its gradient reduce
        held back to the last, as the schedule holds the policy's; a jointly trained MTP layer's gradients to the
        policy wait for the policy's next backward, which zeroes them); returns the losses' reported shares."""
        total = 0.0
        for i, micro in enumerate(inputs):
            last = i == len(inputs) - 1
            with no_sync([self.policy] + ([] if last else [self.draft.part])):
                loss, reported = self._draft_loss(micro, metrics[i] if metrics else None)
                loss.backward()
            total += reported
        return total

    def _route_metrics(self):
        """train/route_disagreement: the share of (position, MoE layer) routes of this step where the
        trainer's own routers chose other experts than the rollout (with or without replay)."""
        if self.routing is None:
            return {}
        diff, total = self.routing.disagreement()  # this stage's MoE layers: summed over stages and replicas
        total = pp_sum(dp_sum(total)).item()
        return {"train/route_disagreement": pp_sum(dp_sum(diff)).item() / total} if total else {}

    def _draft_inputs(self, batch):
        """The draft's inputs of every micro-batch of `batch` under the current policy: one no-grad
        forward each (the policy does not change between the draft-only steps)."""
        batch = self._on_device(batch)
        micro_batches = list(batch.micro_batches(self.cfg.micro_batch_size))
        normaliser = self.draft.normaliser(batch, len(micro_batches))

        def inputs(out, mb):
            return torch.zeros((), device=self.device), self.draft.inputs(out, mb, normaliser)

        with torch.no_grad():
            return self.draft.complete(self._run(micro_batches, inputs, forward_only=True, training=True))

    def _draft_only_step(self, inputs):
        """One optimiser step of the draft alone on one batch's `inputs` (the last pipeline stage's; the
        others have none): the draft's part steps, the policy's does not. Returns this rank's share of the
        step's loss."""
        self.draft.part.zero_grad()
        total = self._draft_backward(inputs)
        self.draft.part.finish_gradients(tensor_parallel_sums=self.draft.in_model)
        self.draft.part.step()
        self._balance_experts()
        return total

    def _draft_only_steps(self, batches, steps):
        """`steps` draft-only steps cycling over `batches` (this RL step's first), ordered so that the
        last step is on this step's batch; returns that step's loss (mean over parts and ranks)."""
        prepared = [self._draft_inputs(b) for b in batches]
        total = None
        for i in range(steps):
            total = self._draft_only_step(prepared[(steps - 1 - i) % len(prepared)])
        return dp_sum(total).item()  # the last stage's; train_step hands its metrics to every stage

    def _metrics(self, totals):
        """The step's train/* losses from the micro-batches' `totals` (the last pipeline stage's; a stage
        before it has none and reports none)."""
        if not totals:
            return {}
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
        # each part clips by its own grad norm (the draft's never clips the policy's update)
        metrics["train/grad_norm"] = self.policy.step()
        if self.draft is not None:
            # the rate of the draft's joint step (--draft-lr-warmup-iters raises it over the first steps)
            metrics[f"train/{self.draft.metric_prefix}_lr"] = self.draft.part.learning_rate
            metrics[f"train/{self.draft.metric_prefix}_grad_norm"] = self.draft.part.step()
        self._balance_experts()
        steps = self.draft.knobs.steps_per_rollout - 1 if self.draft else 0
        if steps > 0:
            metrics["train/draft_final_loss"] = self._draft_only_steps([batch, *self._draft_replay], steps)
            self._draft_replay.appendleft(batch)
        return from_last_stage(metrics)  # the losses live on the last pipeline stage

    def _balance_experts(self):
        """After every optimiser step (joint or draft-only), MoE routers' expert biases step towards
        balance over the tokens they routed in it; a router that routed none keeps its bias."""
        update_expert_biases(self.model, self.cfg.moe_router_bias_update_rate)

    # ---- memory by turns --------------------------------------------------------------
    def offload(self, weights=False):
        """While the engines generate: gradients freed and the optimizers' state on the host; with `weights`
        (--offload-train) the weights too (trainer/offload.py)."""
        if self.offloaded is None:
            self.offloaded = offload.offload(self.parts, weights)

    def onload(self):
        """Before a step: what `offload` moved back on the model's device."""
        if self.offloaded is not None:
            self.offloaded.onload()
            self.offloaded = None

    @contextlib.contextmanager
    def _state_on_device(self):
        """Around a save or load: everything where the model computes, then as it was."""
        was = self.offloaded
        self.onload()
        try:
            yield
        finally:
            if was is not None:
                self.offload(was.weights)

    # ---- weights and checkpoints ------------------------------------------------------
    def named_hf_weights(self):
        """[(canonical HF name, full tensor)] of every weight, trunk, MTP and an external draft's: the whole
        model on trainer rank 0 (the push's source), gathered over TP and the pipeline stages
        (trainer/weights.py); collective, every rank calls it."""
        with self.offloaded.weights_back() if self.offloaded is not None else contextlib.nullcontext():
            own = stage_hf_weights(self.model, self.model_cfg)  # copies: they outlive the weights' return
            if self.draft is not None:
                own += [(name, t.clone()) for name, t in self.draft.named_weights()]
            return gather_stages(own)

    def _meta(self):
        return {"model_config": dataclasses.asdict(self.model_cfg), "mtp_num_layers": self.mtp_num_layers,
                "mtp_trained": bool(self.cfg.enable_mtp_training)}

    def _checkpointed_optimizers(self):
        """{name: megatron optimizer} whose state the torch_dist checkpoint holds: the policy's, and the MTP
        layers' (an external draft keeps its own, trainer/drafts/base.py)."""
        own = {"policy": self.optimizer}
        if self.draft is not None and self.draft.in_model:
            own[self.draft.kind.name] = self.draft.part.optimizer
        return own

    def save(self, path):
        """torch_dist checkpoint of weights + optimizer state (collective: every rank calls it)."""
        with self._state_on_device():
            checkpoint.save(path, self.model, self._checkpointed_optimizers(), self._meta())
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
        with self._state_on_device():
            checkpoint.load(path, self.model, self._checkpointed_optimizers())
        if self.draft is not None:
            load_draft_state(path, self.draft)
            # its learning rate's warm-up goes on from the steps its loaded optimizer took (none: from the start)
            self.draft.part.resume_schedule(checkpoint.optimizer_step(self.draft.part.optimizer))
