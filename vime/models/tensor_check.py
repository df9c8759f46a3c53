"""Tensors held against the config that describes them (pure): one comparison for every format.

Each format vime reads (the policy's HF checkpoint with its MTP layers, an external draft, a torch_dist
checkpoint) states which tensors its config implies, each with its shape and the config keys that decide
it. `tensor_mismatch` compares that with what a file holds — names and shapes, read from the file's header
without loading data — and names the first disagreement of each sort (missing, extra, mis-shaped) with the
config key behind it, so the one-line error says what to change. Checking before anything loads is what
turns a late `Missing key(s)` / `Unexpected key(s)` traceback inside an actor into one line at start.
"""
from dataclasses import dataclass


@dataclass(frozen=True)
class Expected:
    """One tensor a config implies: its shape and the config keys that decide whether and how it exists."""

    shape: tuple
    keys: str  # e.g. "hidden_size, intermediate_size"


def tensor_mismatch(expected, held, explain_extra=None):
    """None when `held` ({name: shape}) is exactly `expected` ({name: Expected}); otherwise one clause per
    kind of disagreement, joined by '; '. `explain_extra(name)` may name the config key that would describe
    an extra tensor (e.g. "n_shared_experts") so the clause says which key disagrees with the file."""
    missing = [n for n in expected if n not in held]
    extra = [n for n in held if n not in expected]
    misshaped = [n for n in expected if n in held and tuple(held[n]) != tuple(expected[n].shape)]
    clauses = []
    if missing:
        first = missing[0]
        clauses.append(f"{len(missing)} tensor(s) the config implies are missing (first: {first}, "
                       f"implied by {expected[first].keys})")
    if extra:
        first = extra[0]
        key = explain_extra(first) if explain_extra else None
        why = f"; check {key}" if key else ""
        clauses.append(f"{len(extra)} tensor(s) the config does not describe (first: {first}{why})")
    if misshaped:
        first = misshaped[0]
        clauses.append(f"{first} has shape {list(held[first])} but the config ({expected[first].keys}) "
                       f"gives {list(expected[first].shape)}")
    return "; ".join(clauses) or None


def safetensors_shapes(path):
    """{name: shape} of a safetensors file, read from its header alone (no tensor data)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
