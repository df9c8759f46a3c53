"""Micro-batches through the pipeline stages: megatron-core's forward-backward schedule, for every layout.

`run_micro_batches` hands megatron-core's `get_forward_backward_func()` (one-stage: forward and backward
per micro-batch; several stages: the 1F1B schedule, stage outputs and their gradients sent point to point
between neighbouring stages, gloo on CPU and NCCL on GPU) the trainer's own forward and loss:

    forward(mb) -> out        every stage, on its part of the model (trainer/model.py `forward`); a stage
                              after the first starts from what the one before handed on
    loss(out, mb) -> (loss, result)    the last stage only (where the logits and the MTP block are):
                              the micro-batch's share of the step's loss, and what the caller keeps of it

So the policy loss, the MTP loss, log-probs and entropy are computed where the logits live, the last
stage, and the earlier stages only carry the hidden states forward and their gradients back.
"""
import torch

from trainer.model import is_last_stage


def run_micro_batches(ddp, model, micro_batches, forward, loss, forward_only=False):
    """Forward (and unless `forward_only`, backward) every micro-batch of the list through the stages of
    `model`; `ddp` is megatron's DDP around it (trainer/optimizer.py), whose config holds the gradient reduce's
    hooks the schedule calls. Returns [result of `loss` per micro-batch] on the last stage, [] on the others."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    results = []

    def loss_of(mb, out):
        value, result = loss(out, mb)
        results.append(result)
        # the count is megatron's per-token normaliser; the trainer's losses are already normalised
        # (calculate_per_token_loss, trainer/model.py pipeline_options), so it only reads it for logging
        return value, torch.zeros((), dtype=torch.int), None

    def step(data, model):
        mb = next(data)
        return forward(mb), (lambda out: loss_of(mb, out))

    get_forward_backward_func()(
        forward_step_func=step, data_iterator=iter(micro_batches), model=ddp,
        num_microbatches=len(micro_batches), seq_length=micro_batches[0].tokens.shape[1],
        micro_batch_size=micro_batches[0].size, forward_only=forward_only)
    return results if is_last_stage(model) else []
