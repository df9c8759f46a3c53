"""The run's compute dtype (--bf16) and the check that this machine can compute in it.

fp32 is the default everywhere. With --bf16 the trainer's model, the rollout engine (embedded or
vLLM) and the synced weights are bf16; megatron-core's optimizer keeps fp32 master weights
(trainer/optimizer.py) and every probability the samplers and losses compute stays fp32.
"""
import torch

from vime.errors import require

DTYPES = {False: torch.float32, True: torch.bfloat16}


def compute_dtype(bf16):
    """torch.bfloat16 under --bf16, else torch.float32."""
    return DTYPES[bool(bf16)]


# weights every part keeps fp32 under --bf16: the MoE routers' correction bias (megatron keeps its
# expert bias fp32, vLLM its e_score_correction_bias); a bf16 one (8 bits) would move near-tie routes
FP32_WEIGHT_SUFFIXES = ("e_score_correction_bias",)


def held_dtype(name, dtype):
    """The dtype weight `name` is held and synced in when the run computes in `dtype`."""
    return torch.float32 if name.endswith(FP32_WEIGHT_SUFFIXES) else dtype


def dtype_name(dtype):
    """'bfloat16' / 'float32': the name vLLM's `dtype` and getattr(torch, name) take."""
    return str(dtype).removeprefix("torch.")


def bf16_matmul_problem(device):
    """Why a bf16 matmul fails on `device` (a one-line reason), or None when it runs and is exact.

    The operands are small integers, exact in bf16, whose products and sums (at most 8 * 3 * 2 = 48 in size)
    are exact in bf16 too, so any working bf16 matmul returns exactly the fp32 result; an error or a
    different value means the device cannot run the model in bf16."""
    a = (torch.arange(32, dtype=torch.float32).reshape(4, 8) % 7 - 3)
    b = (torch.arange(24, dtype=torch.float32).reshape(8, 3) % 5 - 2)
    try:
        got = (a.to(device, torch.bfloat16) @ b.to(device, torch.bfloat16)).float().cpu()
    except (RuntimeError, TypeError, NotImplementedError) as e:
        return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    want = a @ b
    if not torch.equal(got, want):
        return f"a bf16 matmul returned wrong values (largest error {float((got - want).abs().max()):g})"
    return None


def check_bf16(bf16, device=None):
    """--bf16: one line when this machine's device cannot run a bf16 matmul (before any actor starts)."""
    if not bf16:
        return
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    problem = bf16_matmul_problem(device)
    require(problem is None, f"--bf16: this machine's {device.upper() if device == 'cpu' else device} cannot run a "
            f"bf16 matmul ({problem}); drop --bf16 to run in fp32")
