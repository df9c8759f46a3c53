"""The engine's linear layer: `linear(x, pack(weight))` == `x @ weight.t()`, cost flat in the rows.

Why: torch's default fp32 GEMM on CPU costs about M times a GEMV for M = 2-4 rows, so a
verify forward of 1 + k tokens cost (1 + k) plain steps even where decoding streams its
weights from memory — exactly the regime where speculation should be nearly free. oneDNN
with the weight reordered once into its blocked layout reads each weight once for all rows
(`scripts/bench/throughput.py gemm-rows` prints the curve). A single row takes the plain GEMV
on one thread, where it is the faster kernel, and oneDNN's packed kernel when torch computes on
several: the GEMV streams its weight on one thread only, the packed kernel splits the weight's
rows across all of them. Both are exact to the fp32 bound of tests/fp32_bounds.py (they differ
only by reduction order, as plain and batched matmuls always did). A weight that stays in a
core's caches (below PACKED_MIN_BYTES) gains nothing from the reorder until the input has
many rows, and each oneDNN call costs more than the plain matmul (on a small model, whose forward
is many small linears, that call overhead would make a verify of a few tokens dearer than it need be):
such weights use the plain matmul below PACKED_SMALL_MIN_ROWS rows (`throughput.py gemm-rows`
shows both crossovers).

Backends are a registry keyed by name; `pick_backend` chooses "mkldnn" for fp32 on a CPU with
oneDNN and "dense" (the plain matmul) otherwise. Packed weights are snapshots: the caller
re-packs after every weight load (FastForward.refresh does).
"""
from dataclasses import dataclass

import torch


# Where oneDNN's packed kernel pays (`scripts/bench/throughput.py gemm-rows` measures it on a CPU): a weight
# larger than a core's L2 streams from memory, and reading it once for all rows wins at any row count >= 2;
# a smaller weight is compute-bound and the packed kernel only overtakes the plain one from a few hundred
# rows, below which its call overhead dominates. Both paths are exact to the fp32
# bound, so a CPU whose crossover lies elsewhere only loses speed, never correctness.
PACKED_MIN_BYTES = 1 << 20
PACKED_SMALL_MIN_ROWS = 256


@dataclass(frozen=True)
class PackedWeight:
    """A weight [out, in] prepared for one backend; `dense` is the original (for shape/fallback).
    Inputs with fewer than `min_packed_rows` rows use the plain matmul on `dense`."""

    backend: str
    dense: torch.Tensor
    packed: torch.Tensor = None
    min_packed_rows: int = 2
    one_row_packed: bool = False  # one row uses the packed kernel too when torch computes on several threads


def _mkldnn_available():
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def _pack_dense(weight):
    return PackedWeight("dense", weight)


def _apply_dense(x, w):
    return x @ w.dense.t()


def _pack_mkldnn(weight):
    cache_resident = weight.numel() * weight.element_size() < PACKED_MIN_BYTES
    return PackedWeight("mkldnn", weight, torch.ops.mkldnn._reorder_linear_weight(weight.contiguous()),
                        min_packed_rows=PACKED_SMALL_MIN_ROWS if cache_resident else 2,
                        one_row_packed=not cache_resident)


def _apply_mkldnn(x, w):
    rows = x.numel() // x.shape[-1]
    threaded_row = rows == 1 and w.one_row_packed and torch.get_num_threads() > 1
    if rows < w.min_packed_rows and not threaded_row:  # one row on one thread (GEMV), or few rows of a cached weight
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


class PackedLinear(torch.nn.Module):
    """A module's `nn.Linear`, run forward only through `linear` on a packed copy of its weight. It holds the
    linear's own weight and bias Parameters (the module's state-dict names and in-place weight loads are
    unchanged) and packs again whenever the weight was written since it last packed (a weight sync's
    `copy_`, a move to another tensor)."""

    def __init__(self, lin, backend):
        super().__init__()
        self.weight, self.bias, self.backend = lin.weight, lin.bias, backend
        self.packed, self.packed_from = None, None

    def forward(self, x):
        w = self.weight
        if self.packed_from != (w.data_ptr(), w._version):
            self.packed, self.packed_from = pack(w, self.backend), (w.data_ptr(), w._version)
        out = linear(x, self.packed)
        return out if self.bias is None else out + self.bias


def pack_linears(module, backend):
    """Swap every `nn.Linear` inside `module` (an engine's forward-only network) for a `PackedLinear` of
    `backend`, in place; returns the module."""
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is torch.nn.Linear:
                setattr(parent, name, PackedLinear(child, backend))
    return module
