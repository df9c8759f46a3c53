"""The engine's linear layer: `linear(x, pack(weight))` == `x @ weight.t()`, cost flat in the rows.

Why: torch's default fp32 GEMM on CPU costs about M times a GEMV for M = 2-4 rows, so a
verify forward of 1 + k tokens cost (1 + k) plain steps even where decoding streams its
weights from memory — exactly the regime where speculation should be nearly free. oneDNN
with the weight reordered once into its blocked layout reads each weight once for all rows
(scripts/bench/gemm_rows.py prints the curve). For a single row the plain GEMV is still
10-40 % faster than oneDNN's packed kernel on this CPU, so "mkldnn" sends one-row inputs
there; rows then differ from the packed ones only by reduction order (the fp32 bound of
tests/fp32_bounds.py), as plain and batched matmuls always did.

Backends are a registry keyed by name; `pick_backend` chooses "mkldnn" for fp32 on a CPU with
oneDNN and "dense" (the plain matmul) otherwise. Packed weights are snapshots: the caller
re-packs after every weight load (FastForward.refresh does).
"""
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PackedWeight:
    """A weight [out, in] prepared for one backend; `dense` is the original (for shape/fallback)."""

    backend: str
    dense: torch.Tensor
    packed: torch.Tensor = None


def _mkldnn_available():
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def _pack_dense(weight):
    return PackedWeight("dense", weight)


def _apply_dense(x, w):
    return x @ w.dense.t()


def _pack_mkldnn(weight):
    return PackedWeight("mkldnn", weight, torch.ops.mkldnn._reorder_linear_weight(weight.contiguous()))


def _apply_mkldnn(x, w):
    if x.numel() == x.shape[-1]:  # one row: the GEMV on the plain weight is faster
        return x @ w.dense.t()
    return torch.ops.mkldnn._linear_pointwise(x, w.packed, None, "none", [], "")


BACKENDS = {
    "dense": (_pack_dense, _apply_dense),
    "mkldnn": (_pack_mkldnn, _apply_mkldnn),
}


def pick_backend(device, dtype, requested="auto"):
    """'mkldnn' for fp32 on CPU when oneDNN is built in, else 'dense'; an explicit name is honoured."""
    if requested != "auto":
        return requested
    cpu_fp32 = torch.device(device).type == "cpu" and dtype == torch.float32
    return "mkldnn" if cpu_fp32 and _mkldnn_available() else "dense"


def pack(weight, backend="dense"):
    """Prepare `weight` [out, in] for `linear` with `backend` (a BACKENDS key)."""
    return BACKENDS[backend][0](weight.detach())


def linear(x, w):
    """x [..., in] @ w.dense.t() -> [..., out], computed by w's backend."""
    return BACKENDS[w.backend][1](x, w)
