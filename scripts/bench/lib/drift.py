"""The drift benchmark for any draft kind: an online-trained draft against a frozen one and no
speculation, one RL run per arm, same target, seed and prompts.

    python scripts/bench/rl_arms.py drift --draft mtp                  # tiny MiMo, its MTP layer, k = 2
    python scripts/bench/rl_arms.py drift --draft eagle3 --backends embedded,vllm   # tiny Qwen2 + EAGLE-3, k = 3
    python scripts/bench/rl_arms.py drift --draft dflash               # tiny Qwen2 + DFlash, blocks of 4
    python scripts/bench/rl_arms.py drift --draft dspark --arms dspark --draft-warmup-steps 20   # DSpark, k = 3
    python scripts/bench/rl_arms.py drift --hf-checkpoint checkpoints/tiny-glm4-moe-mtp   # another MTP target

RL moves the policy away from what a frozen draft was trained on; the online arm trains the draft
every step (--enable-mtp-training or --enable-draft-training) and syncs it with the target.
Arms are `online`, `frozen` or `none`, each optionally followed by `:key=value` options that
append train_rl.py flags: loss (--draft-loss-type), topk (--draft-distill-topk), lr (--draft-lr),
lr_warmup (--draft-lr-warmup-iters), steps (--draft-steps-per-rollout), replay (--draft-replay-batches),
layers (--mtp-num-layers), depths (--mtp-train-depths), reuse (--mtp-reuse-attention), ckpt (--hf-checkpoint),
sync_draft (--sync-draft-weights: false syncs only the target, the draft goes stale), ce_weight / l1_weight /
confidence_weight (--draft-<term>-weight); e.g.
`online:depths=3:steps=16:replay=8`. Other options change the arm's draft instead: draft=KIND (another
draft kind, for arms of several kinds in one run), k=N (its speculative tokens; a DFlash draft is built
for blocks of k + 1, so the arm gets its own draft made with --draft-warmup-steps), and two that shape the
draft its kind's maker makes with --draft-warmup-steps: draft_layers=N (a DFlash or DSpark draft's decoder
layers, --num-layers) and draft_vocab=N (an EAGLE-3 draft predicting the N tokens most frequent in its
warm-up's responses, --draft-vocab-size; e.g. `--arms online:draft_vocab=4096,frozen:draft_vocab=4096,none`).
Every arm runs on each of --backends, and arms of one draft kind and k are compared among themselves.
An arm set names a list of arms (ARM_SETS): `--arms blocks` is DFlash at blocks of 4 and 8, online
and frozen, against online EAGLE-3 at k = 3, every draft warmed up alike
(`rl_arms.py drift --draft dflash --arms blocks --draft-warmup-steps 20`); each kind-and-k group's
end acceptance length is printed as a ratio to the first arm's.

Writes drift.csv and drift.png (reward, acceptance length, rollout tokens/s, response length per
step) in --out, and with --curves the per-position acceptance. Prints per arm the end window
(tokens per verify, acceptance by position, tokens/s, trainer seconds, reward ± SE), start and end
figures, and per backend whether the step-0 rewards agree (same weights everywhere: exact
speculation must agree within noise), each online arm's end ratios over frozen and none, and at how
many steps online rolled out the same responses as none (strict verification reproduces plain
sampling, so there the arms timed the same work). --time-plain adds the paired speedup against
plain decoding of the same batch (on the none arm: plain against plain, the noise control).
vLLM counts drafts accepted past a request's end too, so compare arms within one backend.
A draft kind (DRIFT_DRAFTS) names its target, its speculative config and the flags that train it
online: adding a kind is one entry there.
"""
import csv
import dataclasses
import json
import math
import os
import subprocess
import sys

from scripts.bench.lib.arm_runs import REPO, run_arm, window
from vime.models.draft_kinds import LOSS_TERMS
from vime.errors import UserError


def _mtp_spec(k, draft_model):
    return {"method": "mtp", "num_speculative_tokens": k}


def _external_spec(method):
    """(k, draft model dir) -> the speculative config of an external draft of `method`."""
    return lambda k, draft_model: {"method": method, "model": draft_model, "num_speculative_tokens": k}


@dataclasses.dataclass(frozen=True)
class DriftDraft:
    """What the drift benchmark needs to know of one draft kind."""

    target: str  # the checkpoint the draft drafts for
    default_k: int
    spec: callable  # (k, draft model dir) -> vLLM speculative config
    online_flags: tuple  # train_rl.py flags that train this draft online
    draft_model: str = None  # an external draft's shipped directory (None: the draft is in the target)
    make_draft: tuple = ()  # an external draft's maker: (script under scripts/, its flags given k)
    built_for_k: bool = False  # the draft serves only the k it was made for (the shipped one: default_k)
    maker_options: tuple = ()  # (arm option, flag of its make_draft script): arm options that shape the draft
    # a draft inside the target (draft_model None) that make_draft adds fresh to a target without one: with
    # --draft-warmup-steps the made checkpoint is the arms' target (online and frozen from the same warm-up)


DRIFT_DRAFTS = {
    "mtp": DriftDraft("checkpoints/tiny-mimo-mtp", 2, _mtp_spec, ("--enable-mtp-training", "--mtp-num-layers", "1"),
                      make_draft=("make_mtp_draft.py", lambda k: ["--mtp-num-layers", "1"])),
    "eagle3": DriftDraft("checkpoints/tiny-qwen2", 3, _external_spec("eagle3"), ("--enable-draft-training",),
                        draft_model="checkpoints/tiny-qwen2-eagle3", make_draft=("make_eagle3_draft.py", lambda k: []),
                        maker_options=(("draft_vocab", "--draft-vocab-size"),)),
    # a block draft: k is its block size less the anchor (the shipped one drafts blocks of 4)
    "dflash": DriftDraft("checkpoints/tiny-qwen2", 3, _external_spec("dflash"), ("--enable-draft-training",),
                        draft_model="checkpoints/tiny-qwen2-dflash",
                        make_draft=("make_dflash_draft.py", lambda k: ["--block-size", str(k + 1)]), built_for_k=True,
                        maker_options=(("draft_layers", "--num-layers"),)),
    # a block whose every slot drafts (k = its block size), Markov head and confidence head as shipped
    "dspark": DriftDraft("checkpoints/tiny-qwen2", 3, _external_spec("dspark"), ("--enable-draft-training",),
                        draft_model="checkpoints/tiny-qwen2-dspark",
                        make_draft=("make_dspark_draft.py", lambda k: ["--block-size", str(k), "--markov-rank", "8",
                                                                       "--confidence-head-with-markov"]),
                        built_for_k=True, maker_options=(("draft_layers", "--num-layers"),)),
}
ARMS = ("online", "frozen", "none")
BACKENDS = ("embedded", "vllm")
# arm options: "online:loss=tv:steps=16" appends these flags last (later flags win in train_rl.py)
ARM_OPTIONS = {"loss": "--draft-loss-type", "topk": "--draft-distill-topk", "lr": "--draft-lr",
               "lr_warmup": "--draft-lr-warmup-iters",
               "steps": "--draft-steps-per-rollout", "replay": "--draft-replay-batches",
               "layers": "--mtp-num-layers", "depths": "--mtp-train-depths", "reuse": "--mtp-reuse-attention",
               "ckpt": "--hf-checkpoint", "sync_draft": "--sync-draft-weights",
               **{f"{term}_weight": f"--draft-{term}-weight" for term in LOSS_TERMS}}
# arm options that choose the arm's draft, not train_rl.py flags: its kind, its k, what shapes its maker's draft
DRAFT_OPTIONS = ("draft", "k", *dict.fromkeys(option for d in DRIFT_DRAFTS.values() for option, _ in d.maker_options))
ARM_SETS = {  # --arms NAME: a question answered by arms whose drafts all start from the same warm-up
    "blocks": "online:draft=eagle3,online,frozen,online:k=7,frozen:k=7",  # the block size
    # DSpark against the other kinds at k = 3, and DSpark trained on cross-entropy alone (DFlash's loss) against
    # the recipes' mix: which of the two costs its later slots
    "dspark": "online,frozen,online:draft=dflash,online:draft=eagle3,online:ce_weight=1:l1_weight=0",
}
MAX_POSITIONS = 8


def add_arguments(p):
    """The drift experiment's flags on its argparse sub-parser."""
    p.add_argument("--draft", default="mtp", choices=list(DRIFT_DRAFTS), help="the draft kind")
    p.add_argument("--hf-checkpoint", default=None,
                   help="the target every arm trains (default: the draft kind's, e.g. mtp: checkpoints/tiny-mimo-mtp)")
    p.add_argument("--arms", default=",".join(ARMS),
                   help=f"comma-separated arms, each NAME[:key=value...], or an arm set ({', '.join(ARM_SETS)})")
    p.add_argument("--backends", default="embedded", help=f"comma-separated, of {', '.join(BACKENDS)}")
    p.add_argument("--num-speculative-tokens", type=int, default=None,
                   help="k (default: the kind's, mtp 2, eagle3 3, dflash 3: its block less the anchor)")
    p.add_argument("--draft-model", default=None, help="an external draft's directory (default: the shipped one)")
    p.add_argument("--draft-warmup-steps", type=int, default=None,
                   help="external draft: start the frozen and online arms from a draft made here with this many "
                        "offline warm-up steps (the kind's scripts/make_<kind>_draft.py)")
    p.add_argument("--window", type=int, default=5, help="steps averaged for the start and end figures")
    p.add_argument("--png", default=None, help="the reward / acceptance / tokens/s curves (default OUT/drift.png)")
    p.add_argument("--curves", default=None, help="also write the per-position acceptance PNG here")
    p.add_argument("--spec-adaptive", action="store_true", help="k per batch size (--spec-adaptive)")
    p.add_argument("--save-arms", action="store_true",
                   help="each speculative arm saves its last step (--save ARM_DIR/save): its policy and draft, "
                        "to export (checkpoint_convert.torch_dist_to_hf, scripts/export_draft.py)")
    p.add_argument("--time-plain", action="store_true",
                   help="speculative arms also decode each batch without drafts, back to back "
                        "(--rollout-time-plain-baseline): a paired speedup per step")


def arm_options(arm):
    """(base arm, option flags, draft options) of an arm spec such as 'online:loss=soft_ce:layers=2'
    or 'online:draft=eagle3:k=3'."""
    base, *options = arm.split(":")
    if base not in ARMS:
        raise UserError(f"--arms {arm!r}: the arm must start with one of {', '.join(ARMS)}")
    flags, draft = [], {}
    for option in options:
        key, _, value = option.partition("=")
        if key in DRAFT_OPTIONS and value:
            draft[key] = value
        elif key in ARM_OPTIONS and value:
            flags += [ARM_OPTIONS[key], value]
        else:
            raise UserError(f"--arms {arm!r}: options are key=value with key in {', '.join((*ARM_OPTIONS, *DRAFT_OPTIONS))}")
    return base, flags, draft


def arm_draft(arm, args):
    """(draft kind name, k) of an arm: its draft=/k= options, else --draft and its k."""
    draft = arm_options(arm)[2]
    name = draft.get("draft", args.draft)
    if name not in DRIFT_DRAFTS:
        raise UserError(f"--arms {arm!r}: draft= is one of {', '.join(DRIFT_DRAFTS)}")
    k = draft.get("k") or args.num_speculative_tokens or DRIFT_DRAFTS[name].default_k
    try:
        k = int(k)
    except ValueError:
        raise UserError(f"--arms {arm!r}: k= takes an integer")
    if k < 1:
        raise UserError(f"--arms {arm!r}: k must be >= 1")
    return name, k


def maker_flags(arm, args):
    """The arm's draft options its kind's make_draft script takes (e.g. draft_layers=2 -> --num-layers 2)."""
    name, _ = arm_draft(arm, args)
    takes = dict(DRIFT_DRAFTS[name].maker_options)
    flags = []
    for key, value in arm_options(arm)[2].items():
        if key in ("draft", "k"):
            continue
        if key not in takes:
            raise UserError(f"--arms {arm!r}: the {name} draft takes no {key}= option")
        if args.draft_warmup_steps is None:
            raise UserError(f"--arms {arm!r}: {key}= makes the arm's draft; give --draft-warmup-steps N")
        flags += [takes[key], value]
    return flags


def arm_list(args):
    """The arm specs of --arms (an arm set's name expands to its arms)."""
    return ARM_SETS.get(args.arms, args.arms).split(",")


def group_name(arm, args):
    """'KIND k=K[ draft_layers=N]': arms of one group share a draft and are compared online / frozen / none."""
    name, k = arm_draft(arm, args)
    shape = "".join(f" {key}={value}" for key, value in arm_options(arm)[2].items() if key not in ("draft", "k"))
    return f"{name} k={k}{shape}"


def arm_label(backend, arm):
    """backend/arm, checkpoint paths shortened to their directory name (tables, legends)."""
    arm = ":".join(os.path.basename(o.rstrip("/")) if o.startswith("ckpt=") else o for o in arm.split(":"))
    return f"{backend}/{arm}"


def arm_dir(label):
    return label.replace("/", "_").replace(":", "_").replace("=", "-")


def check_args(args):
    """One line and exit 2 for a bad arm, backend or draft option, before any run starts."""
    for backend in args.backends.split(","):
        if backend not in BACKENDS:
            raise UserError(f"--backends {backend!r}: choose from {', '.join(BACKENDS)}")
    if args.hf_checkpoint and not os.path.isfile(os.path.join(REPO, args.hf_checkpoint, "config.json")):
        raise UserError(f"--hf-checkpoint {args.hf_checkpoint}: no config.json there; give an HF checkpoint directory")
    if args.num_speculative_tokens is not None and args.num_speculative_tokens < 1:  # 0 is not "unset"
        raise UserError("--num-speculative-tokens must be >= 1")
    # a draft is checked where an arm drafts: a run of `none` arms only needs none
    drafts = [arm_draft(arm, args) for arm in arm_list(args) if arm_options(arm)[0] != "none"]
    for arm in arm_list(args):
        maker_flags(arm, args)
    if args.draft_model and not any(DRIFT_DRAFTS[n].draft_model for n, _ in drafts):
        raise UserError(f"--draft-model: the {args.draft} draft lives in the target checkpoint; the option is for an "
                        "external draft (--draft eagle3, --draft dflash)")
    for name in dict(drafts):
        check_draft_source(name, args)
    for name, k in drafts:
        kind = DRIFT_DRAFTS[name]
        if kind.built_for_k and k != kind.default_k and args.draft_warmup_steps is None and not args.draft_model:
            raise UserError(f"--arms: the shipped {name} draft is built for k = {kind.default_k}; give "
                            f"--draft-warmup-steps N to make one for k = {k}")


def check_draft_source(name, args):
    """Where the kind's draft comes from, checked: a draft inside the target is the target's own MTP layers, or
    fresh ones made by --draft-warmup-steps where it has none; an external kind's shipped draft serves only the
    target it was made for."""
    from vime.models.hf_format import read_config

    kind, target = DRIFT_DRAFTS[name], target_of(DRIFT_DRAFTS[name], args)
    if kind.draft_model is None:
        layers = read_config(target).num_nextn_predict_layers
        if layers and args.draft_warmup_steps is not None:
            raise UserError(f"--draft-warmup-steps adds fresh {name} layers to a target without any, and {target} has "
                            f"{layers}: drop --draft-warmup-steps (its own layers draft)")
        if not layers and args.draft_warmup_steps is None:
            raise UserError(f"{target} has no {name} layers: give --draft-warmup-steps N to add fresh ones, warmed up "
                            "on its own responses, as every arm's draft")
    elif args.draft_warmup_steps is None and not args.draft_model and target != os.path.normpath(
            os.path.join(REPO, kind.target)):
        raise UserError(f"the shipped {name} draft ({kind.draft_model}) is made for {kind.target}; give "
                        f"--draft-warmup-steps N to make one for {args.hf_checkpoint}")


def target_of(kind, args):
    """The target checkpoint directory: --hf-checkpoint, else the draft kind's shipped one."""
    return os.path.normpath(os.path.join(REPO, args.hf_checkpoint or kind.target))


def maker_sample_flags(args):
    """The flags that make a draft maker's warm-up sample the prompts the arms train on (their flags after --):
    a --task-variant's prompt set written into --out as the run writes it, or their --prompt-data; chat
    messages through the template as the runs render them; responses as long as theirs where they set
    --rollout-max-response-len (else the maker's own length)."""
    from rollout.task import prompt_tasks, write_jsonl
    from vime.cli_config import load_config
    from vime.config import RolloutSection

    r = load_config([str(f) for f in args.extra]).rollout
    path = r.prompt_data
    if r.task_variant is not None:
        path = os.path.join(args.out, f"prompts_{r.task_variant}.jsonl")
        write_jsonl(prompt_tasks()[r.task_variant].prompts(r.task_variant_prompts, r.rollout_seed), path)
    flags = ["--input-key", r.input_key, "--label-key", r.label_key]
    if r.rollout_max_response_len != RolloutSection.rollout_max_response_len:
        flags += ["--max-new-tokens", str(r.rollout_max_response_len)]
    return flags + (["--prompt-data", path] if path else []) + (["--apply-chat-template"] if r.apply_chat_template else [])


def warmed_up_draft(name, args, k, extra=(), make=True):
    """--draft-warmup-steps N: a draft of the target warmed up for N offline steps (made once into --out,
    unless `make` is False: its directory only); `extra`: the arm's maker flags (the directory is named
    after them)."""
    kind = DRIFT_DRAFTS[name]
    suffix = (f"_k{k}" if kind.built_for_k else "") + "".join(f"_{f.strip('-')}{v}" for f, v in zip(extra[::2], extra[1::2]))
    out = os.path.join(args.out, f"{name}{suffix}_draft_warmup{args.draft_warmup_steps}")
    if make and not os.path.isfile(os.path.join(out, "config.json")):
        script, flags = kind.make_draft
        cmd = [sys.executable, os.path.join(REPO, "scripts", script), "--target", target_of(kind, args),
               "--out", out, "--warmup-steps", str(args.draft_warmup_steps), *flags(k), *extra,
               *maker_sample_flags(args)]
        print(f"[drift] draft: {' '.join(cmd[1:])}", flush=True)
        subprocess.run(cmd, cwd=REPO, check=True)
    return out


def arm_flags(kind, base, args, k, checkpoints):
    """train_rl.py flags of one base arm (before its options and the shared extra flags); `checkpoints`: the
    arm's (target, external draft directory or None)."""
    target, draft_model = checkpoints
    flags = ["--hf-checkpoint", target, "--num-rollout", args.steps]
    if base == "none":
        flags += ["--vllm-speculative-config", "none"]
    else:
        flags += ["--vllm-speculative-config", json.dumps(kind.spec(k, draft_model))]
        flags += ["--spec-adaptive"] if args.spec_adaptive else []
    flags += list(kind.online_flags) if base == "online" else []
    if args.save_arms and base != "none":
        flags += ["--save", os.path.join(args.out, "{arm_dir}", "save"), "--save-interval", args.steps]
    # on the none arm the paired pass decodes plain twice: the A/A control of the paired figure
    return flags + (["--rollout-time-plain-baseline"] if args.time_plain else [])


def rollout_wall(m):
    """(rollout wall seconds, tokens/s) of the speculative call alone: with --time-plain the worker
    also decoded the batch without drafts inside the same rollout, which is taken out here."""
    seconds, tokens = m["perf/rollout_time"], m["perf/rollout_tokens_per_s"] * m["perf/rollout_time"]
    seconds -= m.get("perf/rollout_plain_engine_time", 0.0)
    return seconds, tokens / max(seconds, 1e-9)


def row(label, m):
    """One drift-table row of a step's metrics."""
    accept_len = m.get("rollout/spec_accept_length") or 1.0  # no speculation: one token per forward
    rollout_time, tokens_per_s = rollout_wall(m)
    draft_loss = m.get("train/draft_loss", m.get("train/mtp_loss", ""))
    return {"arm": label, "step": m["rollout/step"], "num_samples": m["rollout/num_samples"],
            "reward": m["rollout/reward"], "response_len": m["rollout/response_len"],
            "spec_accept_length": accept_len, "spec_accept_rate": m.get("rollout/spec_accept_rate", 0.0),
            **{f"spec_accept_rate_pos_{i}": m.get(f"rollout/spec_accept_rate_pos_{i}", "") for i in range(MAX_POSITIONS)},
            "rollout_tokens_per_s": tokens_per_s, "rollout_time": rollout_time, "draft_loss": draft_loss,
            "trainer_time": m.get("perf/train_time", ""),
            **{k: m.get(f"rollout/{k}", "") for k in ("spec_k_mean", "spec_predicted_speedup", "spec_measured_speedup",
                                                      "plain_same_responses")},
            "rollout_engine_time": m.get("perf/rollout_engine_time", ""),
            "plain_engine_time": m.get("perf/rollout_plain_engine_time", ""),
            "spec_speedup_vs_plain": m.get("perf/spec_speedup_vs_plain", "")}


def arm_checkpoints(name, args, k, extra=(), make=True):
    """(target, external draft directory or None) of an arm's draft kind; `extra`: its maker flags; `make`
    False: a warmed-up draft's directory without making it. A draft inside the target warmed up fresh
    (--draft-warmup-steps) is made into a copy of the target, which becomes the arm's target."""
    kind = DRIFT_DRAFTS[name]
    target = target_of(kind, args)
    if args.draft_warmup_steps is not None:
        made = warmed_up_draft(name, args, k, extra, make)
        return (target, made) if kind.draft_model else (made, None)
    if kind.draft_model is None:
        return target, None
    return target, os.path.join(REPO, args.draft_model if args.draft_model and name == args.draft else kind.draft_model)


def run(args):
    """Every arm on every backend; writes drift.csv and the PNGs, prints the tables."""
    check_args(args)
    os.makedirs(args.out, exist_ok=True)
    # a flag an arm refuses stops the benchmark before any draft is warmed up or arm run
    for _, _, flags in plan_arms(args, make_drafts=False):
        check_arm_flags(flags)
    planned = plan_arms(args)
    rows_by_arm, groups = {}, {}
    for arm, label, flags in planned:
        metrics = run_arm(arm_dir(label), args.out, flags, args.steps, args.reuse)
        rows_by_arm[label] = [row(label, m) for m in metrics]
        groups[label] = group_name(arm, args)
    report(rows_by_arm, groups, args, max(arm_draft(arm, args)[1] for arm in arm_list(args)))


def plan_arms(args, make_drafts=True):
    """[(arm, label, train_rl.py flags)] of every arm on every backend, in the order they run; with
    make_drafts False no warmed-up draft is made (its directory is named all the same)."""
    planned = []
    for backend in args.backends.split(","):
        for arm in arm_list(args):
            base, options, _ = arm_options(arm)
            name, k = arm_draft(arm, args)
            kind = DRIFT_DRAFTS[name]
            label = arm_label(backend, arm)
            flags = arm_flags(kind, base, args, k, arm_checkpoints(name, args, k, maker_flags(arm, args), make_drafts))
            flags = [str(f).replace("{arm_dir}", arm_dir(label)) for f in flags] + ["--rollout-backend", backend]
            # an arm's own options win over the shared extra arguments
            planned.append((arm, label, flags + args.extra + options))
    return planned


def check_arm_flags(flags):
    """train_rl.py's checks that read no file, on one arm's flags (a UserError line if it refuses one)."""
    from orchestration.preflight import check_config
    from vime.cli_config import load_config

    check_config(load_config([str(f) for f in flags]))


def report(rows_by_arm, groups, args, k):
    w = args.window
    write_csv(rows_by_arm, os.path.join(args.out, "drift.csv"))
    png = args.png or os.path.join(args.out, "drift.png")
    plot(rows_by_arm, ("reward", "spec_accept_length", "rollout_tokens_per_s", "response_len"),
         ("reward", "tokens per verify (acceptance length)", "rollout tokens/s", "response length"), png)
    if args.curves:
        keys = [f"spec_accept_rate_pos_{i}" for i in range(k)] + ["spec_accept_length", "reward"]
        titles = [f"acceptance at draft position {i + 1}" for i in range(k)] + ["tokens per verify", "reward"]
        plot(rows_by_arm, keys, titles, args.curves)
    print_end_table(rows_by_arm, k, w)
    print_start_end(rows_by_arm, w)
    for (backend, group), arms in backend_groups(rows_by_arm, groups).items():
        print_comparisons(f"{backend}, {group}", arms, rows_by_arm, w)
    print_group_ratios(rows_by_arm, groups, w)
    for label, rows in rows_by_arm.items():
        print_adaptive(label, rows, w)
        print_paired(label, rows, w)
    print(f"wrote {os.path.join(args.out, 'drift.csv')}, {png}" + (f" and {args.curves}" if args.curves else ""))


def write_csv(rows_by_arm, path):
    rows = [r for rs in rows_by_arm.values() for r in rs]
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def plot(rows_by_arm, keys, titles, path):
    """One panel per key over the RL steps, one line per arm (arms without the key left out), each arm in one
    colour on every panel and named once in a legend under them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(keys), figsize=(4.2 * len(keys), 4.2))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    lines = {}
    for ax, key, title in zip(axes, keys, titles):
        for i, (label, rows) in enumerate(rows_by_arm.items()):
            if rows and rows[0][key] != "":
                lines[label], = ax.plot([r["step"] for r in rows], [r[key] for r in rows],
                                        color=colours[i % len(colours)], label=label)
        ax.set_title(title)
        ax.set_xlabel("RL step")
        ax.grid(alpha=0.3)
    fig.legend(list(lines.values()), list(lines), loc="lower center", ncol=min(len(lines), 4), fontsize=8)
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    fig.savefig(path, dpi=100)


def reward_stats(rows):
    """(mean reward, binomial standard error) over `rows`."""
    p = sum(r["reward"] for r in rows) / len(rows)
    samples = sum(r["num_samples"] for r in rows)
    return p, math.sqrt(max(p * (1 - p), 1e-12) / samples)


def agree_within_3_se(stats):
    arms = list(stats)
    return all(abs(stats[a][0] - stats[b][0]) <= 3 * math.hypot(stats[a][1], stats[b][1])
               for i, a in enumerate(arms) for b in arms[i + 1:])


def print_end_table(rows_by_arm, k, size):
    """Per arm: tokens per verify, acceptance at positions 1..k, tokens/s, trainer s/step, reward (end window)."""
    pos_head = " ".join(f"{'acc@' + str(i + 1):>6}" for i in range(k))
    print(f"\n{'arm (end = last ' + str(size) + ' steps)':<40} {'tok/verify':>10} {pos_head} {'tok/s':>7} "
          f"{'train s':>8} {'reward':>13}")
    for label, rows in rows_by_arm.items():
        pos = " ".join(f"{window(rows, f'spec_accept_rate_pos_{i}', False, size):>6.3f}" for i in range(k))
        p, se = reward_stats(rows[-size:])
        print(f"{label:<40} {window(rows, 'spec_accept_length', False, size):>10.3f} {pos} "
              f"{window(rows, 'rollout_tokens_per_s', False, size):>7.0f} "
              f"{window(rows, 'trainer_time', False, size):>8.2f} {p:>7.3f}±{se:.3f}")


def print_start_end(rows_by_arm, w):
    print(f"\n{'arm':<40} {'accept_len start':>16} {'end':>6} {'tok/s start':>12} {'end':>6} "
          f"{'rollout s start':>15} {'end':>6} {'resp len end':>12} {'reward start':>12} {'end':>6}")
    for label, rows in rows_by_arm.items():
        print(f"{label:<40} {window(rows, 'spec_accept_length', True, w):>16.3f} "
              f"{window(rows, 'spec_accept_length', False, w):>6.3f} "
              f"{window(rows, 'rollout_tokens_per_s', True, w):>12.0f} {window(rows, 'rollout_tokens_per_s', False, w):>6.0f} "
              f"{window(rows, 'rollout_time', True, w):>15.3f} {window(rows, 'rollout_time', False, w):>6.3f} "
              f"{window(rows, 'response_len', False, w):>12.1f} "
              f"{window(rows, 'reward', True, w):>12.3f} {window(rows, 'reward', False, w):>6.3f}")


def backend_groups(rows_by_arm, groups):
    """{(backend, draft group): {base arm: [labels]}}: the online/frozen/none comparisons are made
    within one backend and one draft kind and k (the first arm of a base is its reference; every
    online arm gets its end ratios); a none arm belongs to every group of its backend."""
    out = {}
    for label, group in groups.items():
        backend, arm = label.split("/", 1)
        base = arm.split(":")[0]
        if base != "none":
            out.setdefault((backend, group), {}).setdefault(base, []).append(label)
    for label in groups:
        backend, arm = label.split("/", 1)
        if arm.split(":")[0] == "none":
            for key, arms in out.items():
                if key[0] == backend:
                    arms.setdefault("none", []).append(label)
    return out


def print_group_ratios(rows_by_arm, groups, w):
    """Arms of several draft kinds or k: each arm's end acceptance length over the backend's first
    arm's, with the end rewards (all arms sample the same target, so these must agree)."""
    if len(set(groups.values())) < 2:
        return
    first = {}
    for label in rows_by_arm:
        first.setdefault(label.split("/", 1)[0], label)
    print("\nend acceptance length against each backend's first arm (tokens per verify, last "
          f"{w} steps); reward ± SE")
    for label, rows in rows_by_arm.items():
        ref = first[label.split("/", 1)[0]]
        mine, theirs = (window(rows_by_arm[x], "spec_accept_length", False, w) for x in (label, ref))
        p, se = reward_stats(rows[-w:])
        print(f"{label:<40} {groups[label]:<12} {mine:>6.3f} / {theirs:.3f} = {mine / theirs:.2f}x   "
              f"reward {p:.3f} ± {se:.3f}")


def print_comparisons(backend, groups, rows_by_arm, w):
    """Step-0 reward agreement, online vs none step by step, and each online arm's end ratios over the
    first frozen and none arms."""
    arms = {base: labels[0] for base, labels in groups.items()}
    print(f"-- {backend}: " + ", ".join(f"{base} = {label}" for base, label in arms.items()))
    # only step 0 compares like with like: every arm samples from the same weights there, so exact
    # speculation must give the same reward distribution; later the RL trajectories part
    step0 = {label: reward_stats(rows_by_arm[label][:1]) for label in arms.values()}
    print("step-0 rewards (same weights in every arm) agree within 3 SE: "
          + ("yes" if agree_within_3_se(step0) else "NO — speculation should not change what is sampled"))
    if "online" in arms and "none" in arms:
        pairs = list(zip(rows_by_arm[arms["online"]], rows_by_arm[arms["none"]]))
        slower = [o["step"] for o, n in pairs if o["rollout_time"] > n["rollout_time"]]
        same = sum(o["reward"] == n["reward"] and o["response_len"] == n["response_len"] for o, n in pairs)
        print(f"rollout wall time per step, online <= none at {len(pairs) - len(slower)} of {len(pairs)} steps; "
              f"same rollouts as none (strict verification reproduces plain sampling) at {same} of {len(pairs)}")
    keys = ("rollout_tokens_per_s", "spec_accept_length")
    end = {label: {key: window(rows_by_arm[label], key, False, w) for key in keys}
           for label in [*groups.get("online", []), *arms.values()]}
    for online in groups.get("online", []):
        name = online.split("/", 1)[1]
        for other in ("frozen", "none"):
            if other in arms:
                mine, theirs = end[online], end[arms[other]]
                print(f"end ratio {name} / {other}: rollout tokens/s "
                      f"{mine['rollout_tokens_per_s'] / theirs['rollout_tokens_per_s']:.2f}x, "
                      f"acceptance length {mine['spec_accept_length'] / theirs['spec_accept_length']:.2f}x")


def print_adaptive(label, rows, w):
    """--spec-adaptive: the mean k chosen, and the predicted against the measured speedup."""
    if rows[-1]["spec_k_mean"] != "":
        print(f"{label}: adaptive k mean start {window(rows, 'spec_k_mean', True, w):.2f} end "
              f"{window(rows, 'spec_k_mean', False, w):.2f}; speedup vs plain at end predicted "
              f"{window(rows, 'spec_predicted_speedup', False, w):.2f}x measured "
              f"{window(rows, 'spec_measured_speedup', False, w):.2f}x")


def print_paired(label, rows, w):
    """--time-plain: the arm's engine time against plain decoding of the same batch, step by step."""
    paired = [r for r in rows if r["spec_speedup_vs_plain"] != ""]
    if not paired:
        return
    slower = [r["step"] for r in paired if r["spec_speedup_vs_plain"] < 1]
    whole = sum(r["plain_engine_time"] for r in paired) / sum(r["rollout_engine_time"] for r in paired)
    print(f"{label}: paired with plain decoding of the same batch: engine time <= plain at "
          f"{len(paired) - len(slower)} of {len(paired)} steps; speedup start "
          f"{window(paired, 'spec_speedup_vs_plain', True, w):.2f}x end {window(paired, 'spec_speedup_vs_plain', False, w):.2f}x, "
          f"whole run {whole:.2f}x; plain reproduced {window(paired, 'plain_same_responses', False, len(paired)):.3f} "
          "of the samples")
