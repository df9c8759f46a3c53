"""What one trainer rank holds for a real model under a layout and the trainer's options (pure: no torch
device, Ray or megatron; the command line is `python -m vime.memory_plan`, vime/memory_plan.py).

Parameters are counted from the checkpoint format (hf_format.py) as megatron-core places them
(rank_params.py), so the plan, the checkpoints and the trainer agree on every tensor. Per parameter the
trainer (megatron-core's DDP and optimizer, trainer/optimizer.py) keeps:

- the weight in the compute dtype (bf16 under --bf16, else fp32); the routers' correction bias fp32;
- its gradient in megatron's DDP buffer: fp32 (`--main-grads-dtype bf16` with the precision-aware
  optimizer: bf16);
- optimizer state: an fp32 main weight unless the weight is fp32 itself, and Adam's two moments (fp32, or
  `--exp-avg-dtype` / `--exp-avg-sq-dtype` with the precision-aware optimizer);
  `--use-distributed-optimizer` splits it over the data-parallel (x context-parallel) ranks, a routed
  expert's over the expert-data-parallel ones; `--optimizer-cpu-offload` moves `--optimizer-offload-fraction`
  of it to the host, where megatron's HybridDeviceOptimizer keeps an fp32 main weight, fp32 moments (torch's
  CPU Adam) and an fp32 copy of the gradient (16 bytes), and its device share keeps fp32 moments too;
- MTP layers without --enable-mtp-training are loaded frozen: weights only;
- --use-kl-loss: a copy of the rank's weights as the KL reference, and a second one while the reference
  log-probs are computed.

Activations are vime/models/activations.py's per-token counts, times the tokens of a micro-batch and the
micro-batches megatron's 1F1B schedule keeps in flight on a stage (PP - stage index), plus, on the last
stage, the trainer's fp32 logits over the whole vocabulary and their log-softmax (for the policy and for each
trained MTP depth).
"""
from dataclasses import dataclass, field, replace
from functools import cached_property

from vime.errors import require
from vime.models.activations import FP32, RecomputePlan, Split, recompute_problem, stage_activations
from vime.models.rank_params import Held, RankParams
from vime.models.trainable import check_trainable
from vime.parallel_layout import ParallelLayout

GB = 10**9
BYTES = {"fp32": 4, "bf16": 2}
HOST_STATE = 4 + 2 * 4 + 4  # per parameter on the host: fp32 main weight, fp32 moments, fp32 gradient copy
LOGITS_KEPT = 2  # fp32 values per vocabulary entry and token the loss keeps: the logits and their log-softmax


@dataclass(frozen=True)
class PlanOptions:
    """How the run trains (the trainer's flags): what decides the bytes per parameter and per token."""

    bf16: bool = False
    train_mtp: bool = False
    use_kl_loss: bool = False
    distributed_optimizer: bool = False
    cpu_offload: bool = False
    offload_fraction: float = 1.0
    precision_aware: bool = False
    main_grads_dtype: str = "fp32"
    exp_avg_dtype: str = "fp32"
    exp_avg_sq_dtype: str = "fp32"
    recompute: RecomputePlan = field(default_factory=RecomputePlan)

    @cached_property
    def weight_bytes(self):
        return BYTES["bf16" if self.bf16 else "fp32"]

    @property
    def buffer_bytes(self):
        return FP32  # the routers' correction bias stays fp32 (vime/precision.py FP32_WEIGHT_SUFFIXES)

    @property
    def grad_bytes(self):
        return BYTES[self.main_grads_dtype] if self.precision_aware else FP32

    @property
    def main_bytes(self):
        """The fp32 main weight, where the weight is not fp32 itself."""
        return FP32 if self.weight_bytes != FP32 else 0

    @property
    def moment_bytes(self):
        """Adam's two moments on the device: the precision-aware optimizer's dtypes (its device optimizer,
        Transformer Engine's FusedAdam; the host one beside it keeps fp32), else fp32."""
        if self.precision_aware and not self.cpu_offload:
            return BYTES[self.exp_avg_dtype] + BYTES[self.exp_avg_sq_dtype]
        return 2 * FP32

    @property
    def host_fraction(self):
        return self.offload_fraction if self.cpu_offload else 0.0

    def describe(self):
        weight = f"{'bf16' if self.bf16 else 'fp32'} weight {self.weight_bytes} B"
        main = f" + fp32 main weight {self.main_bytes} B" if self.main_bytes else ""
        state = (f"{weight}{main} + gradient {self.grad_bytes} B + Adam moments {self.moment_bytes} B = "
                 f"{self.weight_bytes + self.main_bytes + self.grad_bytes + self.moment_bytes} B per trained "
                 "parameter")
        where = []
        if self.distributed_optimizer:
            where.append("main weights and moments split over the data-parallel ranks (--use-distributed-optimizer)")
        if self.cpu_offload:
            where.append(f"{self.offload_fraction:g} of them on the host, {HOST_STATE} B per parameter there "
                         "(--optimizer-cpu-offload)")
        if self.precision_aware:
            where.append("the precision-aware optimizer's dtypes")
        return state + ("; " + ", ".join(where) if where else "")


@dataclass(frozen=True)
class RankBytes:
    """Bytes one rank holds, by kind; `optimizer` on the device, `host` the optimizer state on the host;
    `mtp` is the MTP layers' share of the device total."""

    weights: int
    gradients: int
    optimizer: int
    reference: int
    host: int
    mtp: int

    @property
    def total(self):
        """Model states on the device."""
        return self.weights + self.gradients + self.optimizer + self.reference


def sharded(trained, options, layout):
    """Elements of `trained` whose optimizer state this rank keeps: all of them, or under the distributed
    optimizer its share (dense parameters over DP x CP, routed experts over expert DP; rounded up)."""
    if not options.distributed_optimizer:
        return trained.params
    dense = trained.params - trained.expert_params
    return -(-dense // (layout.dp * layout.cp)) - (-trained.expert_params // layout.expert_dp)


def held_bytes(held, trained, options, layout):
    """RankBytes of `held` elements, of which `trained` train (mtp left 0)."""
    weights = held.params * options.weight_bytes + held.buffers * options.buffer_bytes
    state = sharded(trained, options, layout)
    device_state = state * (options.main_bytes + options.moment_bytes)
    host = round(state * options.host_fraction) * HOST_STATE
    optimizer = device_state - round(state * options.host_fraction) * (options.main_bytes + options.moment_bytes)
    reference = 2 * weights if options.use_kl_loss else 0
    return RankBytes(weights, trained.params * options.grad_bytes, optimizer, reference, host, 0)


def stage_bytes(stage, options, layout):
    """RankBytes of one rank of pipeline stage `stage` (rank_params.Stage)."""
    mtp_trained = stage.mtp if options.train_mtp else Held()
    whole = held_bytes(stage.total, stage.trunk + mtp_trained, options, layout)
    return replace(whole, mtp=held_bytes(stage.mtp, mtp_trained, options, layout).total)


def split_of(layout):
    return Split(tp=layout.tp, sp=layout.sp, etp=layout.expert_tp)


@dataclass(frozen=True)
class StageTokens:
    """Per token of a micro-batch on one rank of a stage: bytes kept while micro-batches wait for their backward
    pass (times the micro-batches in flight), and bytes on top at the backward's peak (one micro-batch)."""

    in_flight: int  # micro-batches megatron's 1F1B schedule keeps on the stage
    kept: float
    peak_extra: float  # one recomputed chunk, and on the last stage the logits

    def bytes(self, tokens):
        """Activation bytes of the stage at `tokens` tokens per micro-batch."""
        return tokens * (self.in_flight * self.kept + self.peak_extra)

    def most_tokens(self, free):
        """The most tokens a micro-batch may hold in `free` bytes (0 when none)."""
        per_token = self.in_flight * self.kept + self.peak_extra
        return max(int(free // per_token), 0) if per_token else 0


def stage_tokens(cfg, stage, index, layout, options, spec, context, num_mtp_layers):
    """StageTokens of pipeline stage `index` (rank_params.Stage `stage`) of `layout`."""
    last = index == layout.pp - 1
    dtype = options.weight_bytes
    acts = stage_activations(cfg, stage.layers, split_of(layout), spec, context, dtype, options.recompute,
                             mtp_layers=num_mtp_layers if last and options.train_mtp else 0)
    heads = 1 + (num_mtp_layers if options.train_mtp else 0)
    logits = LOGITS_KEPT * FP32 * cfg.vocab_size * heads if last else 0
    return StageTokens(in_flight=layout.pp - index, kept=acts.kept, peak_extra=acts.rebuilt + logits)


@dataclass(frozen=True)
class Plan:
    """One layout, its stages (rank_params.Stage), the bytes of one rank of each and their tokens' bytes."""

    layout: ParallelLayout
    stages: tuple
    bytes: tuple  # RankBytes per stage
    tokens: tuple  # StageTokens per stage

    @property
    def peak(self):
        """(stage index, RankBytes) of the fullest stage's model states."""
        return max(enumerate(self.bytes), key=lambda ib: ib[1].total)

    def most_tokens(self, memory):
        """The most tokens a micro-batch may hold on every stage within `memory` bytes per GPU, and the stage
        that bounds it."""
        return min((t.most_tokens(memory - b.total), i) for i, (b, t) in enumerate(zip(self.bytes, self.tokens)))

    def used(self, tokens):
        """(stage index, device bytes) of the fullest stage at `tokens` tokens per micro-batch."""
        return max(((i, b.total + t.bytes(tokens)) for i, (b, t) in enumerate(zip(self.bytes, self.tokens))),
                   key=lambda ib: ib[1])

    def host_per_rank(self):
        return max(b.host for b in self.bytes)


class MemoryPlanner:
    """The layouts of `gpus` GPUs for one model (a ModelConfig) and the bytes one rank of each holds."""

    def __init__(self, cfg, options, num_mtp_layers=None, spec="te", context=4096):
        check_trainable(cfg)
        self.cfg, self.options, self.spec, self.context = cfg, options, spec, context
        self.num_mtp_layers = cfg.num_nextn_predict_layers if num_mtp_layers is None else num_mtp_layers
        self.params = RankParams(cfg, self.num_mtp_layers, spec)

    def variant(self, **changes):
        """This planner with some options changed (e.g. cpu_offload)."""
        return MemoryPlanner(self.cfg, replace(self.options, **changes), self.num_mtp_layers, self.spec, self.context)

    def plan(self, layout):
        """The Plan of `layout`; parallel_layout's one-line error for a split megatron-core cannot make."""
        layout.check_split(self.cfg)
        problem = recompute_problem(layout.stage_layer_counts(self.cfg.num_hidden_layers), self.options.recompute)
        require(problem is None, problem)
        stages = tuple(self.params.stages(layout))
        return Plan(layout, stages, tuple(stage_bytes(s, self.options, layout) for s in stages),
                    tuple(stage_tokens(self.cfg, s, i, layout, self.options, self.spec, self.context,
                                       self.num_mtp_layers) for i, s in enumerate(stages)))

    def best_split(self, layout):
        """The Plan of `layout` whose first/last stage layer counts (when not given) make the fullest rank
        smallest; an even split wins a tie."""
        if layout.pp == 1 or layout.first_stage_layers is not None or layout.last_stage_layers is not None:
            return self.plan(layout)
        num_layers, totals = self.cfg.num_hidden_layers, {}

        def stage_total(start, count, first, last):  # many splits share a stage: each is counted once
            key = (start, count, first, last)
            if key not in totals:
                stage = self.params.stage(layout, start, count, first, last)
                totals[key] = stage_bytes(stage, self.options, layout).total
            return totals[key]

        def peak(split):
            counts = with_split(layout, split).stage_layer_counts(num_layers)
            return max(stage_total(sum(counts[:i]), n, i == 0, i == len(counts) - 1) for i, n in enumerate(counts))

        return self.plan(with_split(layout, min(pipeline_splits(num_layers, layout.pp), key=peak)))

    def layouts(self, gpus, given):
        """Every ParallelLayout of `gpus` GPUs megatron-core can split the model into, with the sizes `given`
        ({ParallelLayout field: size}) fixed: TP and PP dividing the GPUs (CP 1 unless given), EP the routed
        experts, ETP 1 or TP, sequence parallelism wherever TP > 1 (a MoE model needs it there)."""
        moe, out, cp = self.cfg.moe, [], given.get("cp", 1)
        for tp in _choices(given.get("tp"), divisors(gpus // cp)):
            for pp in _choices(given.get("pp"), divisors(gpus // (tp * cp))):
                if (gpus // (tp * cp)) % pp:
                    continue
                for ep in _choices(given.get("ep"), divisors(moe.n_routed_experts) if moe else [1]):
                    for etp in _choices(given.get("etp"), sorted({1, tp}) if moe else [None]):
                        sp = given.get("sp", tp > 1)
                        layout = ParallelLayout(tp=tp, pp=pp, dp=gpus // (tp * pp * cp), ep=ep, etp=etp, sp=sp, cp=cp,
                                                first_stage_layers=given.get("first_stage_layers"),
                                                last_stage_layers=given.get("last_stage_layers"))
                        if _accepted(self.check_any_split, layout):
                            out.append(layout)
        return out

    def check_any_split(self, layout):
        """`layout` against the rules, the pipeline split (unless given) being one megatron-core accepts."""
        given = layout.first_stage_layers is not None or layout.last_stage_layers is not None
        splits = [] if given else pipeline_splits(self.cfg.num_hidden_layers, layout.pp)
        (with_split(layout, splits[0]) if splits else layout).check_split(self.cfg)


def with_split(layout, split):
    """`layout` with (first, last) stage layer counts."""
    return replace(layout, first_stage_layers=split[0], last_stage_layers=split[1])


def pipeline_splits(num_layers, pp):
    """(first, last) stage layer counts megatron-core accepts for `num_layers` over `pp` stages, (None, None)
    (the even split) first when there is one; the middle stages split the rest evenly, each stage >= 1 layer."""
    even = [(None, None)] if pp == 1 or num_layers % pp == 0 else []
    return even + (uneven_splits(num_layers, pp) if 1 < pp <= num_layers else [])


def _choices(given, candidates):
    return [given] if given is not None else candidates


def _accepted(check, *args):
    from vime.errors import UserError

    try:
        check(*args)
    except UserError:
        return False
    return True


def divisors(n):
    return [d for d in range(1, n + 1) if n % d == 0]


def uneven_splits(num_layers, pp):
    """(first, last) stage layer counts that leave the middle stages an even split, each stage >= 1 layer."""
    if pp == 2:
        return [(f, num_layers - f) for f in range(1, num_layers)]
    middle = pp - 2
    return [(f, num_layers - middle * m - f) for m in range(1, (num_layers - 2) // middle + 1)
            for f in range(1, num_layers - middle * m)]
