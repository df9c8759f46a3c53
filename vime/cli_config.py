"""argv -> Config: Hydra YAML defaults, then Hydra `key=value` overrides, then `--kebab-flags`.

Flags are applied to the dataclass tree after Hydra composes, so values Hydra's override
grammar cannot hold (a JSON speculative config) pass through unchanged.
"""
import difflib
import json
import os
import typing

from omegaconf import OmegaConf

from vime.config import REPO_ROOT, Config, flag_table
from vime.errors import UserError, require

CONFIG_DIR = os.path.join(REPO_ROOT, "configs")


def split_argv(argv):
    """(hydra overrides, [(flag, value-or-None)]) from argv."""
    overrides, flags, i = [], [], 0
    table = flag_table()
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--"):
            require("=" in arg, f"unexpected argument {arg!r}: use --kebab-flags or Hydra key=value overrides")
            overrides.append(arg)
            i += 1
            continue
        name, _, inline = arg.partition("=")
        base = "--" + name[5:] if name.startswith("--no-") and name not in table else name
        _require_known(base, table)
        if name != base:
            flags.append((base, "false"))
        elif inline:
            flags.append((name, inline))
        elif _is_bool(table[name][1]) and (i + 1 == len(argv) or argv[i + 1].lower() not in ("true", "false")):
            flags.append((name, "true"))
        else:
            require(i + 1 < len(argv), f"{name} needs a value")
            flags.append((name, argv[i + 1]))
            i += 1
        i += 1
    return overrides, flags


def _require_known(name, table):
    if name in table:
        return
    close = difflib.get_close_matches(name, list(table), n=1)
    raise UserError(f"unknown flag {name}" + (f"; did you mean {close[0]}?" if close else "; see --help"))


def _is_bool(f):
    return f.type is bool


def _convert(name, f, text):
    """The flag's string value as the field's type."""
    args = [a for a in typing.get_args(f.type) if a is not type(None)]
    kind = args[0] if args else f.type
    if text.lower() in ("none", "null") and type(None) in typing.get_args(f.type):
        return None
    try:
        if kind is bool:
            require(text.lower() in ("true", "false", "1", "0"), f"{name} takes true or false (got {text!r})")
            return text.lower() in ("true", "1")
        if kind in (int, float, str):
            return kind(text)
    except ValueError:
        raise UserError(f"{name} expects {kind.__name__} (got {text!r})") from None
    return text  # Any: kept as given (e.g. a JSON string, parsed by its own validator)


def compose(overrides):
    """Hydra-composed YAML + overrides, merged onto the dataclass schema."""
    from hydra import compose as hydra_compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
            raw = hydra_compose("config", overrides=overrides)
        merged = OmegaConf.merge(OmegaConf.structured(Config), raw)
        return OmegaConf.to_object(merged)
    except Exception as e:  # Hydra/OmegaConf report bad overrides with their own exception types
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"config override {overrides}: {first}{_closest_key_hint(overrides)}") from None


def config_keys():
    """Every `section.field` of the tree (the keys Hydra overrides may set)."""
    return [path for path, _ in flag_table().values()]


def _closest_key_hint(overrides):
    """'; did you mean rollout.rollout_temperature?' for the first override whose key is unknown."""
    keys = config_keys()
    for override in overrides:
        key = override.split("=", 1)[0].lstrip("+~")
        if "." in key and key.split(".")[0] in {k.split(".")[0] for k in keys} and key not in keys:
            close = difflib.get_close_matches(key, keys, n=1, cutoff=0.5)
            return f"; did you mean {close[0]}?" if close else "; see --help for the keys"
    return ""


def load_config(argv):
    """The validated-later Config for argv (see module docstring)."""
    overrides, flags = split_argv(list(argv))
    cfg = compose(overrides)
    table = flag_table()
    for name, text in flags:
        path, f = table[name]
        section, key = path.split(".")
        setattr(getattr(cfg, section), key, _convert(name, f, text))
    spec = cfg.rollout.vllm_speculative_config
    if isinstance(spec, str) and spec.strip().lower() in ("", "none", "null"):
        cfg.rollout.vllm_speculative_config = None
    return cfg


def describe(cfg):
    """The config as YAML text (for the run directory)."""
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def help_text():
    """Every flag with its config key, its default (after configs/config.yaml) and its help."""
    defaults = compose([])
    lines = ["usage: python train_rl.py [--kebab-flags ...] [hydra.key=value ...]", ""]
    for name, (path, f) in flag_table().items():
        section, key = path.split(".")
        text = f.metadata.get("help", "")
        if "default" not in text:  # some helps already say what their default means
            text = f"{text} [default: {_shown(getattr(getattr(defaults, section), key))}]".strip()
        lines.append(f"  {name:<34} {path:<40} {text}")
    return "\n".join(lines)


def _shown(value):
    if isinstance(value, str) and os.path.isabs(value):
        return os.path.relpath(value) if value.startswith(os.getcwd()) else value
    return json.dumps(value) if isinstance(value, (dict, list)) else str(value)

