"""`python -m vime.models.memory_plan`: what one trainer rank holds for a real model, before the GPUs are rented.

Given an HF `config.json`, a GPU count and the memory of one GPU, it lists the TP x PP x EP x DP layouts
megatron-core can split the model into (vime/parallel_layout.py's rules, the trainer's) whose model states fit, each with the bytes one rank of its
fullest pipeline stage holds, and refuses in one line (exit 2) when none fits. Nothing starts: it reads
one JSON file. Parameters are counted from the checkpoint format (hf_format.py) as megatron-core places
them (rank_params.py), so the plan, the checkpoints and the trainer agree on every tensor.

What vime's trainer keeps per parameter (trainer/mixed_precision.py, trainer/trainer.py, vime/precision.py):
- fp32 (the default): the weight and its gradient fp32, AdamW's two moments fp32: 16 bytes;
- --bf16: a bf16 weight, its fp32 main weight and fp32 gradient, the two moments: 18 bytes (a parameter's
  bf16 gradient lives only until its hook adds it to the fp32 one);
- the optimizer is not distributed over data-parallel ranks: every DP rank keeps the whole state of its
  model shard (`--distributed-optimizer` shows what megatron's distributed optimizer would hold instead:
  main weights and moments split over the data-parallel ranks, the experts' over the expert-data-parallel
  ones; vime does not have it);
- MTP layers without --enable-mtp-training are loaded frozen: weights only;
- the routers' correction bias is an fp32 buffer: weights only;
- --use-kl-loss: a copy of the rank's weights as the KL reference, and a second one while the reference
  log-probs are computed.

Not counted, and said so in the output: activations, the rollout engines' weights and KV cache,
communication buffers, the CUDA context and the allocator's slack.
"""
import os
import sys
from dataclasses import dataclass, replace
from functools import cached_property

import torch

from vime.cli_config import OneLineErrorParser
from vime.config import AT_LEAST_1, POSITIVE, RANGES, Config, check_flag_ranges
from vime.errors import UserError, exit_on_user_error, require
from vime.models.hf_format import config_from_raw, read_json
from vime.models.rank_params import BUFFER_SUFFIXES, Held, RankParams
from vime.models.trainable import check_trainable
from vime.parallel_layout import FLAGS, ParallelLayout
from vime.paths import require_given
from vime.precision import compute_dtype, dtype_name, held_dtype

GB = 10**9
DEFAULTS = Config()  # the run's defaults (vime/config.py): the plan assumes what train_rl.py would run
FP32 = torch.empty((), dtype=torch.float32).element_size()
ADAM_MOMENTS = 2  # exp_avg and exp_avg_sq, each fp32 like the weights AdamW steps
NOT_COUNTED = ("activations (they grow with micro-batch x sequence length; the trainer's fp32 logits alone take "
               "4 x micro-batch x sequence x vocabulary bytes per forward), the rollout engines' weights and KV "
               "cache, communication buffers, the CUDA context and the allocator's slack")


@dataclass(frozen=True)
class PlanOptions:
    """How the run trains: what decides the bytes per parameter."""

    bf16: bool = DEFAULTS.model.bf16
    train_mtp: bool = DEFAULTS.mtp.enable_training
    use_kl_loss: bool = DEFAULTS.train.use_kl_loss
    distributed_optimizer: bool = False  # megatron's, as a what-if: vime keeps the whole state on every DP rank

    @cached_property
    def weight_bytes(self):
        return torch.empty((), dtype=compute_dtype(self.bf16)).element_size()

    @cached_property
    def buffer_bytes(self):
        return torch.empty((), dtype=held_dtype(BUFFER_SUFFIXES[0], compute_dtype(self.bf16))).element_size()

    @property
    def state_bytes(self):
        """Optimizer bytes per trained parameter: the moments, and an fp32 main weight when weights are not fp32."""
        main = FP32 if self.weight_bytes != FP32 else 0
        return main + ADAM_MOMENTS * FP32

    def describe(self):
        weight = f"{dtype_name(compute_dtype(self.bf16))} weight {self.weight_bytes} B"
        main = f" + fp32 main weight {FP32} B" if self.weight_bytes != FP32 else ""
        total = self.weight_bytes + FP32 + self.state_bytes
        sharded = ("main weights and moments split over the data-parallel ranks (--distributed-optimizer: megatron's "
                   "distributed optimizer, which vime does not have)" if self.distributed_optimizer else
                   "vime's optimizer keeps its whole state on every data-parallel rank")
        return (f"{'--bf16' if self.bf16 else 'fp32 (no --bf16)'}: {weight}{main} + fp32 gradient {FP32} B + AdamW "
                f"moments {ADAM_MOMENTS * FP32} B = {total} B per trained parameter; {sharded}")


@dataclass(frozen=True)
class RankBytes:
    """Bytes one rank holds, by kind; `mtp` is the MTP layers' share of the sum."""

    weights: int
    gradients: int
    optimizer: int
    reference: int
    mtp: int

    @property
    def total(self):
        return self.weights + self.gradients + self.optimizer + self.reference


def held_bytes(held, trained, options, layout):
    """(weights, gradients, optimizer, reference) bytes of `held` elements, of which `trained` train."""
    weights = held.params * options.weight_bytes + held.buffers * options.buffer_bytes
    state = options.state_bytes
    if options.distributed_optimizer:
        dense = trained.params - trained.expert_params
        optimizer = -(-dense * state // layout.dp) - (-trained.expert_params * state // layout.expert_dp)
    else:
        optimizer = trained.params * state
    reference = 2 * weights if options.use_kl_loss else 0
    return weights, trained.params * FP32, optimizer, reference


def stage_bytes(stage, options, layout):
    """RankBytes of one rank of pipeline stage `stage` (rank_params.Stage)."""
    mtp_trained = stage.mtp if options.train_mtp else Held()
    parts = held_bytes(stage.total, stage.trunk + mtp_trained, options, layout)
    return RankBytes(*parts, mtp=sum(held_bytes(stage.mtp, mtp_trained, options, layout)))


@dataclass(frozen=True)
class Plan:
    """One layout, its stages (rank_params.Stage) and the bytes of one rank of each."""

    layout: ParallelLayout
    stages: tuple
    bytes: tuple  # RankBytes per stage

    @property
    def peak(self):
        """(stage index, RankBytes) of the fullest stage."""
        return max(enumerate(self.bytes), key=lambda ib: ib[1].total)


class MemoryPlanner:
    """The layouts of `gpus` GPUs for one model (a ModelConfig) and the bytes one rank of each holds."""

    def __init__(self, cfg, options, num_mtp_layers=None, spec="te"):
        check_trainable(cfg)
        self.cfg, self.options = cfg, options
        self.num_mtp_layers = cfg.num_nextn_predict_layers if num_mtp_layers is None else num_mtp_layers
        self.params = RankParams(cfg, self.num_mtp_layers, spec)

    def plan(self, layout):
        """The Plan of `layout`; parallel_layout's one-line error for a split megatron-core cannot make."""
        layout.check_split(self.cfg)
        stages = tuple(self.params.stages(layout))
        return Plan(layout, stages, tuple(stage_bytes(s, self.options, layout) for s in stages))

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
        ({ParallelLayout field: size}) fixed: TP and PP dividing the GPUs, EP the routed experts, ETP 1 or TP."""
        moe, out = self.cfg.moe, []
        for tp in _choices(given.get("tp"), divisors(gpus)):
            for pp in _choices(given.get("pp"), divisors(gpus // tp)):
                if (gpus // tp) % pp:
                    continue
                for ep in _choices(given.get("ep"), divisors(moe.n_routed_experts) if moe else [1]):
                    for etp in _choices(given.get("etp"), sorted({1, tp}) if moe else [None]):
                        layout = ParallelLayout(tp=tp, pp=pp, dp=gpus // (tp * pp), ep=ep, etp=etp,
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


# ---- the command line ----------------------------------------------------------------------------

LAYOUT_FLAGS = {flag: field for field, flag in FLAGS.items() if field != "dp"}  # DP is what the GPUs leave
PLAN_RANGES = {**RANGES, "--gpus": AT_LEAST_1, "--gpu-memory-gb": POSITIVE, "--top": AT_LEAST_1,
               **{f: AT_LEAST_1 for f in LAYOUT_FLAGS}}


def parse_args(argv):
    ap = OneLineErrorParser(prog="python -m vime.models.memory_plan", description=__doc__.splitlines()[0],
                            allow_abbrev=False)
    ap.add_argument("--hf-config", required=True, metavar="PATH", help="the model's HF config.json (or the directory holding it)")
    ap.add_argument("--gpus", type=int, required=True, metavar="N", help="trainer GPUs (= trainer ranks)")
    ap.add_argument("--gpu-memory-gb", type=float, required=True, metavar="GB", help="memory of one GPU, GB = 10^9 bytes")
    ap.add_argument("--bf16", action="store_true", default=PlanOptions.bf16, help="train as train_rl.py --bf16")
    ap.add_argument("--enable-mtp-training", action="store_true", default=PlanOptions.train_mtp,
                    help="the MTP layers train (else frozen: weights only)")
    ap.add_argument("--mtp-num-layers", type=int, default=None, metavar="N", help="MTP layers to load (default: the config's)")
    ap.add_argument("--use-kl-loss", action="store_true", default=PlanOptions.use_kl_loss,
                    help="count the KL reference's copy of the weights")
    for flag in LAYOUT_FLAGS:
        ap.add_argument(flag, type=int, default=None, metavar="N", help="fix this size (default: try every one the rules accept)")
    ap.add_argument("--distributed-optimizer", action="store_true",
                    help="what-if: megatron's distributed optimizer (vime's optimizer is not distributed)")
    ap.add_argument("--layer-spec", choices=("te", "local"), default="te",
                    help="te: the Transformer-Engine layers the trainer builds on GPUs; local: its CPU layers")
    ap.add_argument("--all", action="store_true", help="list every layout the rules accept, fitting or not")
    ap.add_argument("--top", type=int, default=None, metavar="N", help="list only the N layouts with the smallest fullest rank")
    args = ap.parse_args(argv)
    check_flag_ranges({"--gpus": args.gpus, "--gpu-memory-gb": args.gpu_memory_gb, "--top": args.top,
                       "--mtp-num-layers": args.mtp_num_layers,
                       **{f: getattr(args, f[2:].replace("-", "_")) for f in LAYOUT_FLAGS}}, PLAN_RANGES)
    return args


def read_model_config(path):
    """(ModelConfig, a note or None) of config.json `path` (or a directory holding one). A quantised
    checkpoint's config (DeepSeek-V3 ships fp8) is read without its quantization_config: vime trains
    dequantised weights, so the plan counts them in vime's precision."""
    require_given(path, "--hf-config")
    cfg_file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    require(os.path.isfile(cfg_file), f"--hf-config {path}: no such file; give the model's HF config.json "
            "(or the directory holding it)")
    raw = read_json(cfg_file)
    require(isinstance(raw, dict), f"{cfg_file}: not a JSON object; give the model's HF config.json")
    quantised = raw.pop("quantization_config", None)
    note = (f"the published checkpoint is quantised ({quantised.get('quant_method', 'quantization_config')}); "
            "vime trains it dequantised (e.g. DeepSeek's fp8_cast_bf16.py), as counted here"
            if isinstance(quantised, dict) else None)
    return config_from_raw(raw, cfg_file), note


def given_sizes(args):
    """{ParallelLayout field: size} of the layout flags given on the command line."""
    sizes = {field: getattr(args, flag[2:].replace("-", "_")) for flag, field in LAYOUT_FLAGS.items()}
    return {field: size for field, size in sizes.items() if size is not None}


def check_given_sizes(cfg, gpus, given):
    """One line for given sizes no layout of `gpus` GPUs can have (the others at their simplest), before the search."""
    tp, pp = given.get("tp", 1), given.get("pp", 1)
    require(gpus % (tp * pp) == 0, f"--gpus {gpus} is not a multiple of {FLAGS['tp']} {tp} x {FLAGS['pp']} {pp} = "
            f"{tp * pp}: the trainer's ranks are TP x PP x DP")
    probe = ParallelLayout(**{"dp": gpus // (tp * pp), **given})
    split_given = "first_stage_layers" in given or "last_stage_layers" in given
    splits = [] if split_given else pipeline_splits(cfg.num_hidden_layers, probe.pp)
    (with_split(probe, splits[0]) if splits else probe).check_split(cfg)


def name_of(cfg, path):
    """The model's name for messages: the directory its config.json is in, and its architecture."""
    directory = os.path.abspath(path if os.path.isdir(path) else os.path.dirname(path) or ".")
    return f"{os.path.basename(directory)} ({cfg.model_family.architectures[0]})"


def layout_name(layout):
    return (f"TP {layout.tp} x PP {layout.pp} x DP {layout.dp}"
            + (f" (EP {layout.ep}, ETP {layout.expert_tp})" if layout.ep * layout.expert_tp > 1 else ""))


def split_name(plan):
    """Decoder layers per stage, as `first/middle x n/last` or `n x stages`."""
    counts = [len(s.layers) for s in plan.stages]
    if len(set(counts)) == 1:
        return f"{counts[0]} x {len(counts)}"
    middle = counts[1:-1]
    mid = f"/{middle[0]} x {len(middle)}" if middle else ""
    return f"{counts[0]}{mid}/{counts[-1]}"


def gb(n):
    """Bytes as GB: one decimal, or three significant digits below 1 GB (the tiny models)."""
    value = n / GB
    return f"{value:.1f}" if abs(value) >= 1 or value == 0 else f"{value:.3g}"


def count(n):
    """A parameter count in billions, or in millions below 0.1 B."""
    return f"{n / 1e9:.2f} B" if n >= 1e8 else f"{n / 1e6:.2f} M"


def stage_name(plan, index):
    last = len(plan.stages) - 1
    return "only" if last == 0 else "first" if index == 0 else "last" if index == last else f"{index}"


def byte_cells(b, with_reference):
    """The GB cells of one rank's RankBytes: weights, gradients, optimizer, [reference,] total."""
    cells = (gb(b.weights), gb(b.gradients), gb(b.optimizer)) + ((gb(b.reference),) if with_reference else ())
    return cells + (gb(b.total),)


BYTE_HEAD = ("weights", "grads", "optimizer")


def table(plans, memory, with_reference):
    """The layouts' rows: sizes, layers per stage, the fullest stage's bytes, the MTP layers' share on the
    last stage, what is left of the GPU."""
    head = (("TP", "PP", "EP", "ETP", "DP", "layers/stage", "fullest stage") + BYTE_HEAD
            + (("reference",) if with_reference else ()) + ("total GB", "MTP GB (last)", "free GB"))
    rows = []
    for p in plans:
        i, b = p.peak
        lay = p.layout
        rows.append((lay.tp, lay.pp, lay.ep, lay.expert_tp, lay.dp, split_name(p), stage_name(p, i))
                    + byte_cells(b, with_reference) + (gb(p.bytes[-1].mtp), gb(memory - b.total)))
    return _columns(head, rows)


def stage_table(plan, memory, with_reference):
    """One row per pipeline stage of `plan`: its layers, the other parts it holds, one rank's bytes."""
    head = (("stage", "layers", "also holds") + BYTE_HEAD + (("reference",) if with_reference else ())
            + ("total GB", "MTP GB", "free GB"))
    rows = [(i, f"{s.layers.start}-{s.layers.stop - 1}", ", ".join(s.parts) or "-")
            + byte_cells(b, with_reference) + (gb(b.mtp), gb(memory - b.total))
            for i, (s, b) in enumerate(zip(plan.stages, plan.bytes))]
    return _columns(head, rows)


def _columns(head, rows):
    """Rows as aligned text columns: numbers right-aligned, words left-aligned."""
    cells = [tuple(str(c) for c in r) for r in [head, *rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(head))]
    numeric = [all(_is_number(r[i]) for r in cells[1:]) for i in range(len(head))]
    return "\n".join("  ".join(c.rjust(w) if num else c.ljust(w) for c, w, num in zip(r, widths, numeric)).rstrip()
                     for r in cells)


def _is_number(text):
    try:
        float(text)
    except ValueError:
        return False
    return True


def header(cfg, planner, args, note):
    trunk, mtp = planner.params.totals()
    experts = trunk.expert_params + mtp.expert_params
    lines = [f"model: {name_of(cfg, args.hf_config)}; {count(trunk.elements)} parameters in the trunk + "
             f"{count(mtp.elements)} in {planner.num_mtp_layers} MTP layer(s) = "
             f"{count(trunk.elements + mtp.elements)}" + (f", of which routed experts {count(experts)}" if experts else ""),
             f"per parameter: {planner.options.describe()}",
             f"MTP layers: {'trained (--enable-mtp-training)' if planner.options.train_mtp else 'frozen (weights only)'}"
             f"; layer spec: {args.layer_spec}; {args.gpus} GPUs of {args.gpu_memory_gb:g} GB (1 GB = 10^9 bytes)"]
    if note:
        lines.append(f"note: {note}")
    return "\n".join(lines)


def refuse_unfit(cfg, args, plans):
    """One line when no plan fits: the smallest one's bytes and what to change."""
    smallest = min(plans, key=lambda p: p.peak[1].total)
    i, b = smallest.peak
    parts = f"weights {gb(b.weights)} + gradients {gb(b.gradients)} + optimizer {gb(b.optimizer)}" + (
        f" + reference {gb(b.reference)}" if b.reference else "")
    which = (f"{name_of(cfg, args.hf_config)} at {layout_name(smallest.layout)}" if len(plans) == 1 else
             f"none of the {len(plans)} layouts of {args.gpus} GPUs fits {name_of(cfg, args.hf_config)}: the "
             f"smallest, {layout_name(smallest.layout)},")
    raise UserError(f"{which} needs {gb(b.total)} GB per rank on pipeline stage {i} ({parts} GB), more than "
                    f"--gpu-memory-gb {args.gpu_memory_gb:g}; use more GPUs or a larger --pipeline-model-parallel-size "
                    "/ --expert-model-parallel-size (--all lists every layout with its bytes)")


def run(argv=None, out=None):
    """The command: prints the plan to `out` (stdout); one-line UserError when no layout fits (or none is valid)."""
    out = out or sys.stdout
    args = parse_args(argv)
    cfg, note = read_model_config(args.hf_config)
    options = PlanOptions(bf16=args.bf16, train_mtp=args.enable_mtp_training, use_kl_loss=args.use_kl_loss,
                          distributed_optimizer=args.distributed_optimizer)
    require(args.mtp_num_layers is None or args.mtp_num_layers <= cfg.num_nextn_predict_layers,
            f"--mtp-num-layers {args.mtp_num_layers}: {args.hf_config} has only {cfg.num_nextn_predict_layers} "
            "MTP layers")
    planner = MemoryPlanner(cfg, options, args.mtp_num_layers, args.layer_spec)
    given = given_sizes(args)
    check_given_sizes(cfg, args.gpus, given)
    plans = [planner.best_split(layout) for layout in planner.layouts(args.gpus, given)]
    require(plans, f"no layout of {args.gpus} GPUs satisfies the trainer's rules for {name_of(cfg, args.hf_config)} "
            "with the sizes given; drop one of them to see what is possible")
    memory = args.gpu_memory_gb * GB
    listed = sorted((p for p in plans if p.peak[1].total <= memory or args.all), key=lambda p: p.peak[1].total)
    if not listed:
        refuse_unfit(cfg, args, plans)
    shown = listed[:args.top]
    print(header(cfg, planner, args, note), file=out)
    print(table(shown, memory, options.use_kl_loss), file=out)
    if len(listed) > len(shown):
        print(f"... and {len(listed) - len(shown)} more (--top)", file=out)
    if len(listed) == 1:
        print(f"\nstages of {layout_name(listed[0].layout)} (one rank each):", file=out)
        print(stage_table(listed[0], memory, options.use_kl_loss), file=out)
    print(f"not counted: {NOT_COUNTED}", file=out)


@exit_on_user_error
def main(argv=None):
    run(argv)


if __name__ == "__main__":
    main()
