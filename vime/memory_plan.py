"""`python -m vime.memory_plan`: what one trainer rank holds for a real model, before the GPUs are rented.

Given an HF `config.json`, a GPU count and the memory of one GPU, it lists the layouts megatron-core can split
the model into (vime/parallel_layout.py's rules, the trainer's) whose model states fit, each with the bytes
one rank of its fullest pipeline stage holds and the tokens a micro-batch may then hold; or, for one layout
(`--layout "tp=8,sp,pp=4,cp=2,ep=16,etp=1"`, or a `--preset` of a published run), its stages and the
verdict: whether it fits, at how many tokens, and what CPU Adam keeps on the host. The trainer's options
(--bf16, --use-distributed-optimizer, --optimizer-cpu-offload, --use-precision-aware-optimizer,
--recompute-*, ...) take the trainer's names and rules. Nothing starts: it reads one JSON file. The counting
is vime/models/memory_plan.py's and vime/models/activations.py's; a layout or GPU count where nothing fits
is refused in one line (exit 2).
"""
import dataclasses
import os
import sys
import typing
from dataclasses import dataclass

from vime.cli_config import OneLineErrorParser
from vime.config import AT_LEAST_1, POSITIVE, RANGES, Config, check_flag_ranges, validate_train_options
from vime.errors import UserError, exit_on_user_error, require
from vime.models.activations import RecomputePlan
from vime.models.hf_format import config_from_raw, read_json
from vime.models.memory_plan import GB, MemoryPlanner, PlanOptions, pipeline_splits, with_split
from vime.parallel_layout import FLAGS, ParallelLayout
from vime.paths import require_given

DEFAULTS = Config()  # the run's defaults (vime/config.py): the plan assumes what train_rl.py would run
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOT_COUNTED = ("the rollout engines' weights and KV cache (colocated, they take turns with the trainer: "
               "--offload-train), communication buffers, the CUDA context and the allocator's slack")

# the trainer's flags the plan takes, by (config section, field): their names, help, types and defaults
TRAINER_OPTIONS = (("model", "bf16"), ("mtp", "enable_training"), ("mtp", "num_layers"), ("train", "use_kl_loss"),
                   ("train", "use_distributed_optimizer"), ("train", "optimizer_cpu_offload"),
                   ("train", "optimizer_offload_fraction"), ("train", "use_precision_aware_optimizer"),
                   ("train", "main_grads_dtype"), ("train", "exp_avg_dtype"), ("train", "exp_avg_sq_dtype"),
                   ("train", "recompute_granularity"), ("train", "recompute_method"),
                   ("train", "recompute_num_layers"), ("train", "sequence_parallel"),
                   ("train", "context_parallel_size"))
LAYOUT_FLAGS = {flag: name for name, flag in FLAGS.items() if name not in ("dp", "sp", "cp")}  # DP: what GPUs leave
# --layout's keys: the ParallelLayout field each sets (`sp` alone switches sequence parallelism on)
LAYOUT_KEYS = {"tp": "tp", "pp": "pp", "cp": "cp", "ep": "ep", "etp": "etp", "first": "first_stage_layers",
               "last": "last_stage_layers", "sp": "sp"}
PLAN_RANGES = {**RANGES, "--gpus": AT_LEAST_1, "--gpu-memory-gb": POSITIVE, "--top": AT_LEAST_1,
               "--gpus-per-node": AT_LEAST_1, "--tokens-per-micro-batch": AT_LEAST_1,
               **{f: AT_LEAST_1 for f in LAYOUT_FLAGS}}


@dataclass(frozen=True)
class Preset:
    """A published run's layout and options, as the plan's command line: where it comes from, and why."""

    source: str
    argv: tuple
    note: str = ""


GLM = os.path.join(REPO_ROOT, "configs", "models", "glm-4.7", "config.json")
DEEPSEEK = os.path.join(REPO_ROOT, "configs", "models", "deepseek-v3", "config.json")
SLIME_OPTIONS = ("--bf16", "--use-distributed-optimizer", "--optimizer-cpu-offload", "--use-precision-aware-optimizer",
                 "--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1",
                 "--tokens-per-micro-batch", "16384")
PRESETS = {
    "slime-glm-4.7": Preset(
        "slime scripts/run-glm4.7-355B-A32B.sh (64 x H100, colocated, --max-tokens-per-gpu 16384)",
        ("--hf-config", GLM, "--gpus", "64", "--gpu-memory-gb", "80", "--layout", "tp=8,sp,pp=4,cp=2,ep=16,etp=1",
         *SLIME_OPTIONS)),
    "slime-deepseek-r1": Preset(
        "slime scripts/run-deepseek-r1.sh (128 x H100, colocated, --max-tokens-per-gpu 16384)",
        ("--hf-config", DEEPSEEK, "--gpus", "128", "--gpu-memory-gb", "80",
         "--layout", "tp=8,sp,pp=4,cp=4,ep=32,etp=1,last=13", *SLIME_OPTIONS),
        "DeepSeek-R1 has DeepSeek-V3's architecture; slime's --use-kl-loss has coefficient 0 and its reference "
        "waits off the GPU, so none is counted"),
    "verl-deepseek-v3": Preset(
        "verl examples/grpo_trainer/run_deepseek671b_math_megatron_80gb.sh; NeMo-RL runs the same layout "
        "(256 x H100, 2048 + 4096 tokens per sample, one a micro-batch)",
        ("--hf-config", DEEPSEEK, "--gpus", "256", "--gpu-memory-gb", "80",
         "--layout", "tp=1,pp=16,ep=16,etp=1,first=4,last=1", "--bf16", "--use-distributed-optimizer",
         "--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1",
         "--mtp-num-layers", "0", "--tokens-per-micro-batch", "6144"),
        "verl drops the MTP layer and offloads its reference between phases, so neither is counted"),
    "megatron-bridge-deepseek-v3": Preset(
        "Megatron-Bridge deepseek_v3_pretrain_256gpu_h100_bf16_32nodes_config (256 x H100, 4096 tokens)",
        ("--hf-config", DEEPSEEK, "--gpus", "256", "--gpu-memory-gb", "80",
         "--layout", "tp=2,sp,pp=8,ep=32,etp=1,first=8,last=5", "--bf16", "--enable-mtp-training",
         "--use-distributed-optimizer", "--use-precision-aware-optimizer", "--main-grads-dtype", "bf16",
         "--exp-avg-dtype", "bf16", "--exp-avg-sq-dtype", "bf16", "--recompute-granularity", "full",
         "--recompute-method", "uniform", "--recompute-num-layers", "1", "--tokens-per-micro-batch", "4096")),
}


def _config_field(section, name):
    cls = type(getattr(DEFAULTS, section))
    return next(f for f in dataclasses.fields(cls) if f.name == name)


def _add_trainer_option(ap, section, name):
    """The trainer's flag of config field `section.name`, with its help and its default (vime/config.py)."""
    f = _config_field(section, name)
    default = getattr(getattr(DEFAULTS, section), name)
    kind = typing.get_args(f.type)[0] if typing.get_origin(f.type) is typing.Union else f.type
    if kind is bool:
        ap.add_argument(f.metadata["flag"], action="store_true", default=default, help=f.metadata["help"])
    else:
        ap.add_argument(f.metadata["flag"], type=kind, default=default, metavar=name.split("_")[-1].upper(),
                        help=f.metadata["help"])


def parse_args(argv):
    argv = sys.argv[1:] if argv is None else list(argv)
    ap = OneLineErrorParser(prog="python -m vime.memory_plan", description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--preset", choices=sorted(PRESETS), default=None,
                    help="a published run's model, GPUs, layout and options (flags given after it override them)")
    ap.add_argument("--hf-config", metavar="PATH", help="the model's HF config.json (or the directory holding it)")
    ap.add_argument("--gpus", type=int, metavar="N", help="trainer GPUs (= trainer ranks)")
    ap.add_argument("--gpu-memory-gb", type=float, metavar="GB", help="memory of one GPU, GB = 10^9 bytes")
    ap.add_argument("--gpus-per-node", type=int, default=8, metavar="N", help="GPUs of a node (for the host memory)")
    ap.add_argument("--layout", metavar="SPEC", help='one layout, e.g. "tp=8,sp,pp=4,cp=2,ep=16,etp=1,first=16,last=13" '
                    "(DP is what the GPUs leave)")
    ap.add_argument("--tokens-per-micro-batch", type=int, default=None, metavar="N",
                    help="tokens of one micro-batch on a rank (e.g. slime's --max-tokens-per-gpu): the verdict counts "
                         "their activations")
    for section, name in TRAINER_OPTIONS:
        _add_trainer_option(ap, section, name)
    for flag in LAYOUT_FLAGS:
        ap.add_argument(flag, type=int, default=None, metavar="N", help="fix this size (default: try every one the rules accept)")
    ap.add_argument("--layer-spec", choices=("te", "local"), default="te",
                    help="te: the Transformer-Engine layers the trainer builds on GPUs; local: its CPU layers")
    ap.add_argument("--all", action="store_true", help="list every layout the rules accept, fitting or not")
    ap.add_argument("--top", type=int, default=None, metavar="N", help="list only the N layouts with the smallest fullest rank")
    preset = ap.parse_known_args(argv)[0].preset
    args = ap.parse_args([*PRESETS[preset].argv, *argv] if preset else argv)
    for flag in ("--hf-config", "--gpus", "--gpu-memory-gb"):
        require(getattr(args, flag[2:].replace("-", "_")) is not None, f"{flag} is needed (or a --preset: "
                f"{', '.join(sorted(PRESETS))})")
    check_flag_ranges({"--gpus": args.gpus, "--gpu-memory-gb": args.gpu_memory_gb, "--top": args.top,
                       "--gpus-per-node": args.gpus_per_node, "--tokens-per-micro-batch": args.tokens_per_micro_batch,
                       "--mtp-num-layers": args.mtp_num_layers, **{f: getattr(args, f[2:].replace("-", "_")) for f in
                                                                  ("--optimizer-offload-fraction",
                                                                   "--recompute-num-layers", "--context-parallel-size")},
                       **{f: getattr(args, f[2:].replace("-", "_")) for f in LAYOUT_FLAGS}}, PLAN_RANGES)
    return args


def trainer_options(args):
    """The train section the options describe, checked by the trainer's own rules (vime/config.py)."""
    names = [name for section, name in TRAINER_OPTIONS if section == "train"]
    train = dataclasses.replace(DEFAULTS.train, **{name: getattr(args, name) for name in names})
    validate_train_options(train, args.bf16)
    return train


def plan_options(args, train):
    return PlanOptions(
        bf16=args.bf16, train_mtp=args.enable_mtp_training, use_kl_loss=train.use_kl_loss,
        distributed_optimizer=train.use_distributed_optimizer, cpu_offload=train.optimizer_cpu_offload,
        offload_fraction=train.optimizer_offload_fraction, precision_aware=train.use_precision_aware_optimizer,
        main_grads_dtype=train.main_grads_dtype, exp_avg_dtype=train.exp_avg_dtype,
        exp_avg_sq_dtype=train.exp_avg_sq_dtype,
        recompute=RecomputePlan(train.recompute_granularity, train.recompute_method, train.recompute_num_layers))


def parse_layout(spec):
    """{ParallelLayout field: value} of a --layout string; one line for a key or value it does not take."""
    sizes = {}
    for item in (part.strip() for part in spec.split(",") if part.strip()):
        key, _, value = item.partition("=")
        require(key in LAYOUT_KEYS, f"--layout {spec!r}: {key!r} is not a layout size; use {', '.join(LAYOUT_KEYS)} "
                f"(e.g. \"tp=8,sp,pp=4,cp=2,ep=16\")")
        if key == "sp":
            require(not value, f"--layout {spec!r}: sp takes no value (it switches sequence parallelism on)")
            sizes["sp"] = True
            continue
        require(value.isdigit() and int(value) >= 1, f"--layout {spec!r}: {key} needs a whole number >= 1 (got {value!r})")
        sizes[LAYOUT_KEYS[key]] = int(value)
    return sizes


def given_sizes(args):
    """{ParallelLayout field: size} of the layout flags given on the command line (and --layout's)."""
    sizes = {field: getattr(args, flag[2:].replace("-", "_")) for flag, field in LAYOUT_FLAGS.items()}
    sizes = {field: size for field, size in sizes.items() if size is not None}
    if args.sequence_parallel:
        sizes["sp"] = True
    if args.context_parallel_size != 1:
        sizes["cp"] = args.context_parallel_size
    if args.layout:
        layout = parse_layout(args.layout)
        twice = sorted(set(layout) & set(sizes) - {"sp"})
        require(not twice, f"--layout and {FLAGS[twice[0]] if twice else ''} both set {twice[0] if twice else ''}: "
                "give it once")
        sizes.update(layout)
    return sizes


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


def check_given_sizes(cfg, gpus, given):
    """One line for given sizes no layout of `gpus` GPUs can have (the others at their simplest), before the search."""
    tp, pp, cp = given.get("tp", 1), given.get("pp", 1), given.get("cp", 1)
    require(gpus % (tp * pp * cp) == 0, f"--gpus {gpus} is not a multiple of {FLAGS['tp']} {tp} x {FLAGS['pp']} {pp} "
            f"x {FLAGS['cp']} {cp} = {tp * pp * cp}: the trainer's ranks are TP x PP x CP x DP")
    probe = ParallelLayout(**{"dp": gpus // (tp * pp * cp), **given})
    split_given = "first_stage_layers" in given or "last_stage_layers" in given
    splits = [] if split_given else pipeline_splits(cfg.num_hidden_layers, probe.pp)
    (with_split(probe, splits[0]) if splits else probe).check_split(cfg)


def name_of(cfg, path):
    """The model's name for messages: the directory its config.json is in, and its architecture."""
    directory = os.path.abspath(path if os.path.isdir(path) else os.path.dirname(path) or ".")
    return f"{os.path.basename(directory)} ({cfg.model_family.architectures[0]})"


def layout_name(layout):
    cp = f" x CP {layout.cp}" if layout.cp > 1 else ""
    return (f"TP {layout.tp}{' (SP)' if layout.sp else ''} x PP {layout.pp}{cp} x DP {layout.dp}"
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


def kb(n):
    return f"{n / 1e3:.1f}"


def count(n):
    """A parameter count in billions, or in millions below 0.1 B."""
    return f"{n / 1e9:.2f} B" if n >= 1e8 else f"{n / 1e6:.2f} M"


def stage_name(plan, index):
    last = len(plan.stages) - 1
    return "only" if last == 0 else "first" if index == 0 else "last" if index == last else f"{index}"


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


def table(plans, memory, options):
    """The layouts' rows: sizes, layers per stage, the fullest stage's model states, the host's share, the
    MTP layers' on the last stage, what is left of the GPU and the tokens a micro-batch may hold in it."""
    host = options.cpu_offload
    head = (("TP", "SP", "PP", "CP", "EP", "ETP", "DP", "layers/stage", "fullest stage", "weights", "grads", "optimizer")
            + (("reference",) if options.use_kl_loss else ()) + (("host",) if host else ())
            + ("total GB", "MTP GB (last)", "free GB", "tokens"))
    rows = []
    for p in plans:
        i, b = p.peak
        lay = p.layout
        rows.append((lay.tp, "yes" if lay.sp else "no", lay.pp, lay.cp, lay.ep, lay.expert_tp, lay.dp, split_name(p),
                     stage_name(p, i), gb(b.weights), gb(b.gradients), gb(b.optimizer))
                    + ((gb(b.reference),) if options.use_kl_loss else ()) + ((gb(p.host_per_rank()),) if host else ())
                    + (gb(b.total), gb(p.bytes[-1].mtp), gb(memory - b.total), p.most_tokens(memory)[0]))
    return _columns(head, rows)


def stage_table(plan, memory, options, tokens, plain_plan):
    """One row per pipeline stage of `plan`: its layers, the other parts it holds, one rank's model states, the
    activations per token in flight (with the options' recompute and without), the tokens a micro-batch may
    hold, and at `tokens` tokens the device total."""
    head = (("stage", "layers", "also holds", "weights", "grads", "optimizer")
            + (("reference",) if options.use_kl_loss else ()) + ("host", "states GB", "KB/token", "KB/token (no recompute)",
                                                                 "tokens") + ((f"GB at {tokens}",) if tokens else ()))
    rows = []
    for i, (s, b, t, plain) in enumerate(zip(plan.stages, plan.bytes, plan.tokens, plain_plan.tokens)):
        in_flight = t.in_flight * t.kept + t.peak_extra
        row = ((i, f"{s.layers.start}-{s.layers.stop - 1}", ", ".join(s.parts) or "-", gb(b.weights), gb(b.gradients),
                gb(b.optimizer)) + ((gb(b.reference),) if options.use_kl_loss else ())
               + (gb(b.host), gb(b.total), kb(in_flight), kb(plain.in_flight * plain.kept + plain.peak_extra),
                  t.most_tokens(memory - b.total)))
        rows.append(row + ((gb(b.total + t.bytes(tokens)),) if tokens else ()))
    return _columns(head, rows)


def header(cfg, planner, args, note):
    trunk, mtp = planner.params.totals()
    experts = trunk.expert_params + mtp.expert_params
    lines = [f"model: {name_of(cfg, args.hf_config)}; {count(trunk.elements)} parameters in the trunk + "
             f"{count(mtp.elements)} in {planner.num_mtp_layers} MTP layer(s) = "
             f"{count(trunk.elements + mtp.elements)}" + (f", of which routed experts {count(experts)}" if experts else ""),
             f"per parameter: {planner.options.describe()}",
             f"MTP layers: {'trained (--enable-mtp-training)' if planner.options.train_mtp else 'frozen (weights only)'}"
             f"; recompute: {args.recompute_granularity or 'none'}; layer spec: {args.layer_spec}; {args.gpus} GPUs of "
             f"{args.gpu_memory_gb:g} GB (1 GB = 10^9 bytes)"]
    if args.preset:
        preset = PRESETS[args.preset]
        lines.append(f"preset {args.preset}: {preset.source}" + (f"; {preset.note}" if preset.note else ""))
    if note:
        lines.append(f"note: {note}")
    return "\n".join(lines)


def refuse_unfit(cfg, args, plans):
    """One line when no plan's model states fit: the smallest one's bytes and what to change."""
    smallest = min(plans, key=lambda p: p.peak[1].total)
    i, b = smallest.peak
    parts = f"weights {gb(b.weights)} + gradients {gb(b.gradients)} + optimizer {gb(b.optimizer)}" + (
        f" + reference {gb(b.reference)}" if b.reference else "")
    which = (f"{name_of(cfg, args.hf_config)} at {layout_name(smallest.layout)}" if len(plans) == 1 else
             f"none of the {len(plans)} layouts of {args.gpus} GPUs fits {name_of(cfg, args.hf_config)}: the "
             f"smallest, {layout_name(smallest.layout)},")
    raise UserError(f"{which} needs {gb(b.total)} GB per rank on pipeline stage {i} ({parts} GB), more than "
                    f"--gpu-memory-gb {args.gpu_memory_gb:g}; use more GPUs, a larger --pipeline-model-parallel-size "
                    "/ --expert-model-parallel-size, --use-distributed-optimizer or --optimizer-cpu-offload (--all lists "
                    "every layout with its bytes)")


def verdict(plan, memory, args, options, planner):
    """The lines that say whether one layout fits: its model states, its tokens, and the host's share (what CPU
    Adam keeps there, or would keep: the same layout and options with --optimizer-cpu-offload)."""
    i, b = plan.peak
    most, bound = plan.most_tokens(memory)
    lines = [f"fits: the fullest stage ({stage_name(plan, i)}) holds {gb(b.total)} GB of model states of "
             f"{args.gpu_memory_gb:g} GB; a micro-batch may hold up to {most} tokens per rank (stage "
             f"{stage_name(plan, bound)} bounds it)"]
    tokens = args.tokens_per_micro_batch
    if tokens:
        j, used = plan.used(tokens)
        fits = "fits" if used <= memory else "does not fit"
        lines.append(f"at {tokens} tokens per micro-batch the fullest stage ({stage_name(plan, j)}) takes {gb(used)} GB: "
                     f"{fits}")
    offloaded = plan if options.cpu_offload else planner.variant(cpu_offload=True).plan(plan.layout)
    on_device = planner.variant(cpu_offload=False).plan(plan.layout) if options.cpu_offload else plan
    per_node = offloaded.host_per_rank() * args.gpus_per_node
    weights = max(s.weights + s.gradients for s in plan.bytes) * args.gpus_per_node
    if options.cpu_offload:
        i, kept = on_device.peak
        lines.append(f"host: CPU Adam keeps {gb(offloaded.host_per_rank())} GB per rank, {gb(per_node)} GB per node of "
                     f"{args.gpus_per_node} GPUs; with the trainer's weights and gradients there too while the engines "
                     f"generate (--offload-train), {gb(per_node + weights)} GB; without CPU Adam the fullest stage "
                     f"({stage_name(on_device, i)}) would need {gb(kept.total)} GB of model states")
    else:
        lines.append(f"host: no CPU Adam (the optimizer's state stays on the GPUs); with --optimizer-cpu-offload it would "
                     f"keep {gb(per_node)} GB per node of {args.gpus_per_node} GPUs")
    return "\n".join(lines)


def run(argv=None, out=None):
    """The command: prints the plan to `out` (stdout); one-line UserError when no layout fits (or none is valid)."""
    out = out or sys.stdout
    args = parse_args(argv)
    cfg, note = read_model_config(args.hf_config)
    require(args.mtp_num_layers is None or args.mtp_num_layers <= cfg.num_nextn_predict_layers,
            f"--mtp-num-layers {args.mtp_num_layers}: {args.hf_config} has only {cfg.num_nextn_predict_layers} "
            "MTP layers")
    given = given_sizes(args)
    train = trainer_options(args)
    options = plan_options(args, train)
    context = args.tokens_per_micro_batch or 4096
    planner = MemoryPlanner(cfg, options, args.mtp_num_layers, args.layer_spec, context)
    check_given_sizes(cfg, args.gpus, given)
    # a --layout is one layout, megatron's even pipeline split unless it gives first / last: no split is searched
    search = planner.plan if args.layout else planner.best_split
    plans = [search(layout) for layout in planner.layouts(args.gpus, given)]
    require(plans, f"no layout of {args.gpus} GPUs satisfies the trainer's rules for {name_of(cfg, args.hf_config)} "
            "with the sizes given; drop one of them to see what is possible")
    memory = args.gpu_memory_gb * GB
    listed = sorted((p for p in plans if p.peak[1].total <= memory or args.all), key=lambda p: p.peak[1].total)
    if not listed:
        refuse_unfit(cfg, args, plans)
    shown = listed[:args.top]
    print(header(cfg, planner, args, note), file=out)
    print(table(shown, memory, options), file=out)
    if len(listed) > len(shown):
        print(f"... and {len(listed) - len(shown)} more (--top)", file=out)
    if len(listed) == 1:
        plan = listed[0]
        plain = MemoryPlanner(cfg, dataclasses.replace(options, recompute=RecomputePlan()), args.mtp_num_layers,
                              args.layer_spec, context).plan(plan.layout)
        print(f"\nstages of {layout_name(plan.layout)} (one rank each; KB/token: activations of a micro-batch's "
              "token in flight on the stage):", file=out)
        print(stage_table(plan, memory, options, args.tokens_per_micro_batch, plain), file=out)
        print(verdict(plan, memory, args, options, planner), file=out)
    print(f"not counted: {NOT_COUNTED}", file=out)


@exit_on_user_error
def main(argv=None):
    run(argv)


if __name__ == "__main__":
    main()
