"""The trainer's gradients and optimizer steps: megatron-core's `DistributedDataParallel` and
`get_megatron_optimizer`, on every layout and with every option.

A `TrainedPart` is one module the trainer steps: it is wrapped in megatron's DDP (its gradients accumulate
in contiguous buffers, in fp32 under --bf16, and are reduced over the data-parallel ranks bucket by bucket:
all-reduced, or reduce-scattered under --use-distributed-optimizer; --overlap-grad-reduce starts each
bucket's reduce during the backward pass) and stepped by the megatron optimizer built for it: Adam on fp32
main weights (a --bf16 model's are copies), distributed over the DP ranks (--use-distributed-optimizer),
stepped on the host (--optimizer-cpu-offload, --optimizer-offload-fraction), with its moments and main
gradients in bf16 (--use-precision-aware-optimizer). The optimizer clips by megatron's grad norm, which
counts every weight once over TP, PP, EP and DP (`--clip-grad 0`: no clip, the norm still reported).
Megatron's OptimizerParamScheduler sets each step's learning rate and weight decay: constant, after an
optional linear warm-up (--draft-lr-warmup-iters), with megatron's weight-decay groups (biases and other
1-D weights undecayed).

The trainer's parts (trainer/trainer.py, trainer/drafts):
- the policy: the whole megatron model but its MTP layers;
- the MTP layers when they train: a part of their own (--draft-lr, --draft-clip-grad), so that MTP
  gradients never trigger clipping of the policy update; every pipeline stage builds it (megatron's
  optimizer without parameters on the stages without MTP layers), since the grad norm is a collective
  over the stages;
- an external draft: a part of its own, its gradients averaged over the DP ranks (each rank's loss is
  the mean of its own micro-batches); small and replicated, its optimizer is never distributed, so that
  its state is one file of the checkpoint (trainer/drafts/base.py).

Megatron's optimizer expects its parameters to be the module's trainable ones when it is built: the
policy's part is built while the MTP layers are still frozen (trainer/trainer.py).
"""
import contextlib
import dataclasses
import math

import torch

from vime.errors import require

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclasses.dataclass(frozen=True)
class OptimizerOptions:
    """How the trainer's optimizers run (TrainerConfig's megatron flags)."""

    bf16: bool = False
    use_distributed_optimizer: bool = False
    overlap_grad_reduce: bool = False
    optimizer_cpu_offload: bool = False
    optimizer_offload_fraction: float = 1.0
    overlap_cpu_optimizer_d2h_h2d: bool = False
    use_precision_aware_optimizer: bool = False
    main_grads_dtype: str = "fp32"
    exp_avg_dtype: str = "fp32"
    exp_avg_sq_dtype: str = "fp32"

    @classmethod
    def of(cls, cfg):
        """The options of a TrainerConfig (or any object with these fields)."""
        return cls(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(cls)})

    def replicated(self):
        """These options for a small replicated module (an external draft): not distributed, not offloaded, its
        reduce not overlapped (the stages before the last, which run no backward of it, would wait for buckets)."""
        return dataclasses.replace(self, use_distributed_optimizer=False, optimizer_cpu_offload=False,
                                   overlap_grad_reduce=False,
                                   use_precision_aware_optimizer=False, main_grads_dtype="fp32",
                                   exp_avg_dtype="fp32", exp_avg_sq_dtype="fp32")


def ddp_config(options):
    """megatron's DistributedDataParallelConfig of `options`."""
    from megatron.core.distributed import DistributedDataParallelConfig

    # the bucket size is megatron's own (its default when overlapping, one bucket per buffer otherwise)
    return DistributedDataParallelConfig(
        grad_reduce_in_fp32=DTYPES[options.main_grads_dtype] == torch.float32,
        overlap_grad_reduce=options.overlap_grad_reduce, use_distributed_optimizer=options.use_distributed_optimizer)


def optimizer_config(options, lr, weight_decay, adam_eps, clip_grad):
    """megatron's OptimizerConfig: Adam (decoupled weight decay, torch's betas), `clip_grad` 0 meaning no clip."""
    from megatron.core.optimizer import OptimizerConfig

    return OptimizerConfig(
        optimizer="adam", lr=lr, min_lr=lr, weight_decay=weight_decay, adam_beta1=0.9, adam_beta2=0.999,
        adam_eps=adam_eps, clip_grad=clip_grad if clip_grad and clip_grad > 0 else math.inf,
        bf16=options.bf16, params_dtype=torch.bfloat16 if options.bf16 else torch.float32,
        use_distributed_optimizer=options.use_distributed_optimizer,
        optimizer_cpu_offload=options.optimizer_cpu_offload,
        optimizer_offload_fraction=options.optimizer_offload_fraction,
        overlap_cpu_optimizer_d2h_h2d=options.overlap_cpu_optimizer_d2h_h2d,
        # the host optimizer's copies in pinned memory, which exists only beside a CUDA device
        pin_cpu_grads=torch.cuda.is_available(), pin_cpu_params=torch.cuda.is_available(),
        use_precision_aware_optimizer=options.use_precision_aware_optimizer,
        main_grads_dtype=DTYPES[options.main_grads_dtype], exp_avg_dtype=DTYPES[options.exp_avg_dtype],
        exp_avg_sq_dtype=DTYPES[options.exp_avg_sq_dtype])


def check_device_options(cfg):
    """One line for an optimizer option megatron-core cannot run on this machine (TrainerConfig or TrainSection
    `cfg`): the precision-aware optimizer steps with Transformer Engine's FusedAdam unless it is CPU-offloaded
    (then the host optimizer keeps the main weights)."""
    import importlib.util

    require(not cfg.use_precision_aware_optimizer or cfg.optimizer_cpu_offload
            or importlib.util.find_spec("transformer_engine") is not None,
            "--use-precision-aware-optimizer steps with Transformer Engine's FusedAdam, which this machine lacks (it "
            "needs CUDA): add --optimizer-cpu-offload (its host optimizer keeps the main weights) or drop the flag "
            "(python -m vime.memory_plan models it)")


class TrainedPart:
    """One module the trainer steps: megatron's DDP around it and megatron's optimizer for it (module docstring).

    `config`: the module's TransformerConfig; `sum_over_ranks`: the DP ranks' gradients are summed (the loss is
    normalised by the step's global token count) rather than averaged; `stage_local`: the module lives on
    this rank's pipeline stage alone (the MTP layers), so its grad norm sums over its own stage's ranks."""

    def __init__(self, module, config, options, lr, weight_decay, adam_eps, clip_grad, sum_over_ranks=True,
                 lr_warmup_steps=0):
        from megatron.core.distributed import DistributedDataParallel
        from megatron.core.optimizer import get_megatron_optimizer

        check_device_options(options)

        # the DDP's own copy of the config: the schedule reads its gradient hooks there (`no_sync_func`), and
        # the router's expert bias steps in the trainer after every step, the draft-only ones too
        # (trainer/model.py update_expert_biases), not in megatron's finalize_model_grads
        self.config = dataclasses.replace(config, calculate_per_token_loss=sum_over_ranks,
                                          moe_router_enable_expert_bias=False)
        self.options = options
        self.ddp = DistributedDataParallel(self.config, ddp_config(options), module)
        self.optimizer = get_megatron_optimizer(optimizer_config(options, lr, weight_decay, adam_eps, clip_grad),
                                                [self.ddp])
        self.schedule = learning_rate_schedule(self.optimizer, lr, weight_decay, lr_warmup_steps)
        self.resume_schedule(0)

    @property
    def module(self):
        return self.ddp.module

    def parameters(self):
        """The module's parameters this part trains (the DDP's)."""
        return list(self.ddp.params_with_grad)

    def zero_grad(self):
        """Before a step's backward: empty gradient buffers (megatron accumulates every micro-batch into them)."""
        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()

    def no_sync(self):
        """Around the backward of every micro-batch but a step's last: no bucket's reduce starts yet."""
        return self.ddp.no_sync()

    def finish_gradients(self, tensor_parallel_sums=True):
        """After a step's backward: the DP reduce (megatron's finish_grad_sync: it waits for the overlapped buckets
        or reduces them now), then, with `tensor_parallel_sums`, the sums megatron's finalize_model_grads adds for
        weights whose gradient each TP rank holds a part of (q/k norms, the norms under sequence parallelism)."""
        from megatron.core.distributed.finalize_model_grads import _allreduce_non_tensor_model_parallel_grads

        self.ddp.finish_grad_sync()
        if tensor_parallel_sums:
            _allreduce_non_tensor_model_parallel_grads([self.ddp], self.config)

    def step(self):
        """megatron's optimizer step (its clip, then Adam, then the main weights copied into the model's); returns
        the grad norm before the clip."""
        ok, grad_norm, _ = self.optimizer.step()
        require(ok, "the optimizer step found an inf or nan gradient")  # bf16 without a loss scale never reports one
        self.schedule.step(increment=1)
        return float(grad_norm)

    def resume_schedule(self, steps_taken):
        """The schedule after `steps_taken` steps: the next step takes the learning rate of step steps_taken + 1
        (1-based), so that a warm-up's first step already moves the weights."""
        self.schedule.num_steps = 0
        self.schedule.step(increment=steps_taken + 1)

    @property
    def learning_rate(self):
        """The learning rate of the next step."""
        return self.schedule.get_lr({})


def learning_rate_schedule(optimizer, lr, weight_decay, warmup_steps):
    """megatron's OptimizerParamScheduler for a constant `lr` reached linearly from 0 over `warmup_steps` steps, and a
    constant weight decay (times each group's wd_mult: megatron leaves biases and 1-D weights undecayed)."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    return OptimizerParamScheduler(optimizer, init_lr=0.0, max_lr=lr, min_lr=lr, lr_warmup_steps=warmup_steps,
                                   lr_decay_steps=warmup_steps + 1, lr_decay_style="constant",
                                   start_wd=weight_decay, end_wd=weight_decay, wd_incr_steps=0,
                                   wd_incr_style="constant")


class PolicyPart(TrainedPart):
    """The policy's part, whose module is the whole megatron model: megatron's finalize_model_grads, which also
    sums the word embedding's gradients over the pipeline stages that hold a copy of it (the first, and the
    last for the MTP block or a tied output layer), so that every copy takes the same steps, and makes the TP
    sums of every trainable weight of the model, the MTP layers' too (their part then makes none)."""

    def finish_gradients(self, tensor_parallel_sums=True):
        from megatron.core.distributed import finalize_model_grads

        finalize_model_grads([self.ddp])


def empty_module(config):
    """A module without parameters: the MTP part of a pipeline stage without MTP layers (its optimizer has
    nothing to step but takes part in the grad norm's collectives)."""
    from megatron.core.transformer.module import MegatronModule

    return MegatronModule(config)


@contextlib.contextmanager
def no_sync(parts):
    """Every part's `no_sync` at once (the schedule's `no_sync_func`)."""
    with contextlib.ExitStack() as stack:
        for part in parts:
            stack.enter_context(part.no_sync())
        yield


def gradients(part):
    """{parameter: its accumulated (reduced) gradient} of a part's parameters: megatron's `main_grad`."""
    return {p: p.main_grad for p in part.parameters()}


def held_bytes(model, parts):
    """{"weights", "gradients", "optimizer", "optimizer_host"}: the bytes a trainer rank holds of `model` (its
    parameters and the buffers synced with them) and of its trained `parts`: megatron's gradient buffers without
    their padding, and per inner torch optimizer its parameters that are not the model's weights (the fp32 main
    weights) and its moments; a CPU-offloaded optimizer's host side adds the gradient copies megatron's
    HybridDeviceOptimizer keeps. What the memory plan counts (vime/models/memory_plan.py)."""
    from vime.models.megatron_names import is_synced_buffer

    tensors = [*model.parameters(), *(b for n, b in model.named_buffers() if is_synced_buffer(n))]
    weights = {t.untyped_storage().data_ptr() for t in tensors}  # a bf16 or distributed optimizer's buffer: one
    out = {"weights": sum(t.numel() * t.element_size() for t in tensors), "gradients": 0, "optimizer": 0,
           "optimizer_host": 0}
    for part in parts:
        for buffer in part.ddp.buffers + part.ddp.expert_parallel_buffers:
            out["gradients"] += sum(b.numel_unpadded for b in buffer.buckets) * buffer.grad_data.element_size()
        for megatron_optimizer in getattr(part.optimizer, "chained_optimizers", [part.optimizer]):
            inner = megatron_optimizer.optimizer
            if inner is None:  # a stage without such parameters
                continue
            if not hasattr(inner, "cpu_optimizers"):
                out["optimizer"] += _state_bytes(inner, weights)
                continue
            for host in inner.cpu_optimizers:
                copies = [inner.cpu_copy_map_grad.get(p) for g in host.param_groups for p in g["params"]]
                out["optimizer_host"] += _state_bytes(host, weights) + sum(
                    c.numel() * c.element_size() for c in copies if c is not None)
            if inner.gpu_optimizer is not None:
                out["optimizer"] += _state_bytes(inner.gpu_optimizer, weights)
    return out


def _state_bytes(optimizer, weights):
    """A torch optimizer's parameters that are not model weights (storages in `weights`), and its moments."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    mains = sum(p.numel() * p.element_size() for p in params if p.untyped_storage().data_ptr() not in weights)
    moments = sum(t.numel() * t.element_size() for p in params for k, t in optimizer.state.get(p, {}).items()
                  if k in ("exp_avg", "exp_avg_sq"))
    return mains + moments

