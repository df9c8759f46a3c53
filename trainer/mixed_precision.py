"""bf16 training with fp32 master weights (--bf16): megatron's mixed-precision design, on any device.

The model's parameters are bf16 (megatron's `params_dtype=bf16`, the module cast as megatron's
`Float16Module` casts it), so the forward and backward compute in bf16 and the weights the rollout
receives are exactly the ones the trainer computes with. The optimizer steps on fp32 copies of them
(the "main" parameters), as megatron's `Float16OptimizerWithFloat16Params` does:

- every bf16 gradient is added into its main parameter's fp32 gradient as soon as autograd has
  accumulated it (a post-accumulate-grad hook), so micro-batches accumulate in fp32 and
  reductions and grad-norm clipping run on fp32 gradients (megatron's fp32 `main_grad`);
- AdamW updates the fp32 main parameters (its moments are fp32), and each step ends by rounding
  them to the bf16 model parameters (round to nearest even), so small updates accumulate in the
  masters instead of vanishing under bf16's 8-bit significand.

megatron's own class accepts CUDA tensors only (its type checks name `torch.cuda.*Tensor`), and
megatron's optimizer path is unreliable on gloo (trainer/grads.py), hence this small equivalent.
Checkpoints hold the fp32 main parameters (`fp32_params_for_checkpoint`), so a --bf16 checkpoint is
a plain fp32 one: it resumes with or without --bf16 and converts to HF like any other.
"""
import contextlib

import torch

from trainer.expert_parallel import EXPERT_MARK


def _copy_parallel_attributes(dst, src):
    """megatron's parallel attributes (TP-sharded? along which dim? a pipeline stage's copy of the word
    embedding?) and the routed-expert mark (trainer/expert_parallel.py) onto the main parameter, which
    the gradient reductions and the grad norm read (trainer/grads.py)."""
    for name in ("tensor_model_parallel", "partition_dim", "partition_stride", "shared", "shared_embedding",
                 EXPERT_MARK):
        if hasattr(src, name):
            setattr(dst, name, getattr(src, name))


class MainParamsAdamW:
    """AdamW over fp32 main copies of bf16 (or any low-precision) model parameters.

    Quacks like the torch optimizer the trainer and trainer/checkpoint.py use (`param_groups`,
    `state`, `step`, `zero_grad`, `state_dict`, `load_state_dict`); the groups and state are those
    of the fp32 main parameters. `model_params` lists the model parameters in the same order."""

    def __init__(self, param_groups, **adam_kwargs):
        self.model_params, self._main_of, groups = [], {}, []
        for group in param_groups:
            mains = []
            for p in group["params"]:
                main = torch.nn.Parameter(p.detach().clone().float(), requires_grad=p.requires_grad)
                _copy_parallel_attributes(main, p)
                self.model_params.append(p)
                self._main_of[p] = main
                mains.append(main)
                p.register_post_accumulate_grad_hook(self._move_grad_to_main)
            groups.append(dict(group, params=mains))
        self.inner = torch.optim.AdamW(groups, **adam_kwargs)

    def _move_grad_to_main(self, p):
        """Add p's freshly accumulated bf16 gradient to its main parameter's fp32 gradient."""
        main = self._main_of[p]
        grad = p.grad.detach().float()
        main.grad = grad if main.grad is None else main.grad.add_(grad)
        p.grad = None

    def main_param(self, p):
        """The fp32 parameter the optimizer steps for model parameter `p` (it holds p's gradient);
        a parameter the optimizer does not step (a frozen one) is its own."""
        return self._main_of.get(p, p)

    @property
    def param_groups(self):
        return self.inner.param_groups

    @property
    def state(self):
        return self.inner.state

    def zero_grad(self, set_to_none=True):
        for p in self.model_params:
            p.grad = None
        self.inner.zero_grad(set_to_none=set_to_none)

    @torch.no_grad()
    def step(self):
        """AdamW on the fp32 main parameters, then each rounded into its bf16 model parameter."""
        self.inner.step()
        self.copy_main_to_model()

    @torch.no_grad()
    def copy_main_to_model(self):
        for p in self.model_params:
            p.copy_(self._main_of[p])

    def state_dict(self):
        return self.inner.state_dict()

    def load_state_dict(self, state):
        self.inner.load_state_dict(state)


def build_optimizer(param_groups, bf16, **adam_kwargs):
    """torch AdamW on the model's own fp32 parameters, or with --bf16 `MainParamsAdamW`."""
    if bf16:
        return MainParamsAdamW(param_groups, **adam_kwargs)
    return torch.optim.AdamW(param_groups, **adam_kwargs)


def grad_params(optimizer, params):
    """The tensors holding the gradients `optimizer` steps on for model parameters `params`: the
    fp32 main parameters under --bf16, the parameters themselves otherwise."""
    main = getattr(optimizer, "main_param", None)
    return [main(p) for p in params] if main else list(params)


def named_grad_params(optimizer, named_params):
    """(name, gradient holder) pairs: `grad_params` keeping the model's names (for the TP-partial rule)."""
    main = getattr(optimizer, "main_param", None)
    return [(n, main(p) if main else p) for n, p in named_params]


@contextlib.contextmanager
def fp32_params_for_checkpoint(module, optimizer):
    """Inside the block every parameter of `module` holds fp32 values: under --bf16 an optimized
    parameter holds its fp32 main parameter's storage, a frozen one an fp32 copy. A checkpoint saved
    there holds the fp32 masters (a plain fp32 checkpoint); one loaded there lands in them. On exit
    the bf16 parameters get their (loaded) fp32 values rounded. Without --bf16 nothing changes."""
    low = [p for p in module.parameters() if p.dtype != torch.float32]
    main_of = getattr(optimizer, "main_param", lambda p: p)
    kept = [p.data for p in low]
    for p in low:
        main = main_of(p)
        p.data = main.data if main is not p else p.data.float()
    try:
        yield
    finally:
        with torch.no_grad():
            for p, data in zip(low, kept):
                values, p.data = p.data, data
                p.copy_(values)
