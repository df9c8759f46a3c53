"""A draft directory as vLLM loads an external draft (pure): `config.json` + `model.safetensors`.

The reading and writing every external draft kind shares (EAGLE-3, DFlash); what the config holds
and which tensors must be there is each kind's own module. `not_a_draft(path, why)` is the kind's
one-line error, so a bad directory is named with what to do for that kind.
"""
import json
import os

from vime.errors import require
from vime.models.families import eagle3_target_families

FLAG = "--vllm-speculative-config"


def read_draft_json(path, not_a_draft, architecture):
    """The draft's config.json as a dict: the directory, the file, valid JSON, the architecture, the weights file."""
    cfg_file = os.path.join(str(path), "config.json")
    if not os.path.isdir(str(path)):
        raise not_a_draft(path, "no such directory")
    if not os.path.isfile(cfg_file):
        raise not_a_draft(path, "config.json is missing")
    try:
        with open(cfg_file) as f:
            raw = json.load(f)
    except json.JSONDecodeError as e:
        raise not_a_draft(path, f"config.json is malformed JSON: {e.msg} at line {e.lineno}") from None
    if architecture not in (raw.get("architectures") or []):
        raise not_a_draft(path, f"architectures {raw.get('architectures')} lack {architecture}")
    if not os.path.isfile(os.path.join(str(path), "model.safetensors")):
        raise not_a_draft(path, "model.safetensors is missing")
    return raw


def read_draft_tensors(path, not_a_draft, required):
    """The draft's tensors by checkpoint name; one line when the file is damaged or lacks a `required` one."""
    from safetensors.torch import load_file

    try:
        state = load_file(os.path.join(str(path), "model.safetensors"))
    except Exception as e:  # safetensors raises its own error types for damaged files
        raise not_a_draft(path, f"unreadable model.safetensors: {str(e).splitlines()[0]}") from None
    missing = [n for n in required if n not in state]
    if missing:
        raise not_a_draft(path, f"model.safetensors lacks {missing[0]}")
    return state


def write_draft_dir(path, hf_config, state):
    """Write config.json (the dict given) and model.safetensors (the tensors, contiguous, on the CPU)."""
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf_config, f, indent=2)
    save_file({k: v.detach().contiguous().cpu() for k, v in state.items()}, os.path.join(path, "model.safetensors"))


def check_target_gives_what_drafts_read(path, draft_cfg, target_cfg, method, kind, make):
    """What every external draft needs of its target (one line each): a family whose vLLM model returns
    aux hidden states, the draft's width (it reads the target's embedding) and vocabulary."""
    fam = target_cfg.model_family
    require(fam.eagle3_aux_hidden_states,
            f"{FLAG}: method '{method}' needs a target whose vLLM model returns aux hidden states; "
            f"{fam.architectures[0]} ({fam.name}) does not. {kind} targets: {eagle3_target_families()}; "
            "a model with MTP layers drafts with method 'mtp'")
    require(draft_cfg.target_hidden_size == target_cfg.hidden_size and draft_cfg.hidden_size == target_cfg.hidden_size,
            f"{FLAG}: draft {path} has hidden size {draft_cfg.hidden_size} (target_hidden_size "
            f"{draft_cfg.target_hidden_size}) but the target's is {target_cfg.hidden_size}; make the draft "
            f"for this target with {make}")
    require(draft_cfg.vocab_size == target_cfg.vocab_size,
            f"{FLAG}: draft {path} has vocab_size {draft_cfg.vocab_size} but the target has "
            f"{target_cfg.vocab_size}; the draft must share the target's tokenizer")
