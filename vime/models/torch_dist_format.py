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

from vime.errors import UserError
from vime.models.hf_format import ModelConfig, expected_hf_tensors, extra_tensor_key
from vime.models.moe_mla_config import MLAConfig, MoEConfig
from vime.models.rope import Llama3Scaling, YarnScaling
from vime.models.tensor_check import tensor_mismatch

META_FILE = "vime_meta.json"
NESTED = {"moe": MoEConfig, "mla": MLAConfig, "rope_yarn": YarnScaling, "rope_llama3": Llama3Scaling}  # ModelConfig fields holding dataclasses


def read_saved_meta(model_dir, flag="--load"):
    """The vime_meta.json of a torch_dist model directory, or one UserError line naming `flag`."""
    meta_file = os.path.join(model_dir, META_FILE)
    if not os.path.isfile(meta_file):
        raise UserError(f"{flag} {model_dir}: {META_FILE} is missing; not a vime torch_dist checkpoint (make one "
                        "with `python -m checkpoint_convert.hf_to_torch_dist`)")
    with open(meta_file) as f:
        return json.load(f)


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
