"""A torch_dist checkpoint's tensors against the config that is to read it (pure: json).

Every torch_dist checkpoint vime writes (a training run's --save, hf_to_torch_dist's --save) records
beside the tensors the `ModelConfig` it was built from (`vime_meta.json`, "model_config"); megatron
built each tensor from it and the checkpoint's manifest vouches that the files are the ones written.
So the tensors a checkpoint holds are those that config implies, and the check compares them with
the tensors the reading side's config implies (`expected_hf_tensors`, in canonical names) through the
one comparison of vime/models/tensor_check.py: a missing, extra or mis-shaped tensor is named with
the config key behind it, before megatron is asked to load anything. Shard layouts (TP, PP, EP)
never enter: the comparison is of whole tensors, as the checkpoint stores them.
"""
import dataclasses
import json
import os
import typing

from vime.errors import UserError
from vime.models.hf_format import ModelConfig, expected_hf_tensors, extra_tensor_key, json_kind
from vime.models.moe_mla_config import MLAConfig, MoEConfig
from vime.models.rope import Llama3Scaling, YarnScaling
from vime.models.tensor_check import tensor_mismatch

META_FILE = "vime_meta.json"
NESTED = {"moe": MoEConfig, "mla": MLAConfig, "rope_yarn": YarnScaling, "rope_llama3": Llama3Scaling}  # ModelConfig fields holding dataclasses


# the keys of vime_meta.json and their JSON types (each optional: older checkpoints lack some); model_config's
# own keys are typed by ModelConfig's fields
META_TYPES = {"model_config": dict, "mtp_num_layers": int, "mtp_trained": bool, "family": str,
              "tensor_model_parallel_size": int, "optimizer_step": int, "has_optimizer": bool}
JSON_NAMES = {dict: "an object", int: "an integer", float: "a number", bool: "true or false", str: "a string"}


def read_saved_meta(model_dir, flag="--load"):
    """The vime_meta.json of a torch_dist model directory, read as typed data (`META_TYPES`, and
    ModelConfig's fields for "model_config"), or one UserError line naming `flag` and what is wrong."""
    meta_file = os.path.join(model_dir, META_FILE)
    if not os.path.isfile(meta_file):
        raise UserError(f"{flag} {model_dir}: {META_FILE} is missing; not a vime torch_dist checkpoint (make one "
                        "with `python -m checkpoint_convert.hf_to_torch_dist`)")
    try:
        with open(meta_file, encoding="utf-8") as f:
            meta = json.load(f)
    except (ValueError, UnicodeDecodeError) as e:
        raise UserError(f"{flag} {model_dir}: {META_FILE} is not JSON ({e}); restore it from the save") from None
    problem = _meta_problem(meta)
    if problem:
        raise UserError(f"{flag} {model_dir}: {META_FILE}: {problem}; restore it from the save (vime writes it "
                        "with every checkpoint)")
    return meta


def _meta_problem(meta):
    """What in a parsed vime_meta.json is not of its type, in a few words, or None."""
    if not isinstance(meta, dict):
        return f"holds {json_kind(meta)}, not an object"
    for key, kind in META_TYPES.items():
        if key in meta and not _is(meta[key], kind):
            return f"{key!r} is {json_kind(meta[key])}, not {JSON_NAMES[kind]}"
    config = meta.get("model_config")
    return None if config is None else _fields_problem(ModelConfig, config, "model_config")


def _fields_problem(cls, values, where):
    """The first field of dataclass `cls` that `values` (a JSON object) lacks (one without a default) or
    holds with another type, or None. A field whose default is None may be null; a field holding a
    dataclass (NESTED) is an object of its own."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name not in values:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                return f"'{where}' has no '{f.name}'"
            continue
        value, kind = values[f.name], hints[f.name]
        if value is None and f.default is None:
            continue
        if dataclasses.is_dataclass(kind):
            problem = (f"'{where}.{f.name}' is {json_kind(value)}, not an object" if not isinstance(value, dict)
                       else _fields_problem(kind, value, f"{where}.{f.name}"))
            if problem:
                return problem
        elif kind in JSON_NAMES and not _is(value, kind):
            return f"'{where}.{f.name}' is {json_kind(value)}, not {JSON_NAMES[kind]}"
    return None


def _is(value, kind):
    """JSON's types as Python reads them: true is not an integer, an integer is a number."""
    if kind is bool or isinstance(value, bool):
        return isinstance(value, bool) and kind is bool
    return isinstance(value, (int, float)) if kind is float else isinstance(value, kind)



def model_config_from_dict(d):
    """The ModelConfig `dataclasses.asdict` wrote (keys it does not know, from another version, left out)."""
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    return ModelConfig(**{k: NESTED[k](**v) if k in NESTED and v is not None else v
                          for k, v in d.items() if k in known})


def torch_dist_tensor_problem(meta, cfg, num_mtp_layers):
    """What differs between the tensors of a checkpoint with vime_meta `meta` and those ModelConfig `cfg`
    implies, both with `num_mtp_layers` MTP layers; None when they agree (or the checkpoint records no
    config, as ones of older vime versions: then only the family is known, compared by the callers)."""
    saved = meta.get("model_config")
    if saved is None:
        return None
    held = {n: e.shape for n, e in expected_hf_tensors(model_config_from_dict(saved), num_mtp_layers).items()}
    return tensor_mismatch(expected_hf_tensors(cfg, num_mtp_layers), held,
                           explain_extra=lambda name: extra_tensor_key(name, cfg))
