"""argv -> Config: Hydra YAML defaults, then Hydra `key=value` overrides, then `--kebab-flags`.

The flags are an argparse parser generated from the config fields' metadata (vime/config.py
`flag_table`): name, help, type; --help lists them in one group per config section, and the benchmark
and debugging switches of every section in a group of their own (`flag_groups`). Every argparse error is one `UserError` line. Flags are applied
to the dataclass tree after Hydra composes, so values Hydra's override grammar cannot hold (a JSON
speculative config) pass through unchanged. The speculative config is then parsed, once, into the
`SpecConfig` the tree holds from there on (vime/spec_config.py).
"""
import argparse
import dataclasses
import difflib
import json
import os
import re
import typing

from omegaconf import OmegaConf

from vime.config import BENCH_DEBUG, REPO_ROOT, Config, flag_table
from vime.errors import UserError, require
from vime.spec_config import SpecConfig, parse_spec_config

CONFIG_DIR = os.path.join(REPO_ROOT, "configs")

# flags that were replaced: old flag -> the one that now sets the same thing. The draft's knobs exist
# once, in the draft section, for whichever draft the run trains (MTP layers or an external one).
REMOVED_FLAGS = {
    "--mtp-steps-per-rollout": "--draft-steps-per-rollout", "--mtp-replay-batches": "--draft-replay-batches",
    "--mtp-loss-type": "--draft-loss-type", "--mtp-distill-topk": "--draft-distill-topk",
    "--mtp-lr": "--draft-lr", "--mtp-clip-grad": "--draft-clip-grad",
}


def _key_of(name):
    """The Hydra key a flag spells (`--mtp-lr` -> `mtp.lr`): section, then the field in snake case."""
    section, _, field = name[2:].partition("-")
    return f"{section}.{field.replace('-', '_')}"


# the same replacements as Hydra keys (`mtp.lr=...` -> draft.lr)
REMOVED_KEYS = {_key_of(old): _key_of(new) for old, new in REMOVED_FLAGS.items()}


def _refuse_removed_flag(name):
    new = REMOVED_FLAGS.get(name)
    if new is not None:
        raise UserError(f"{name} was replaced by {new} (one set of draft knobs for MTP layers and external "
                        f"drafts alike): pass {new}")


def _refuse_removed_keys(overrides):
    for override in overrides:
        key = override.split("=", 1)[0].lstrip("+~")
        new = REMOVED_KEYS.get(key)
        if new is not None:
            raise UserError(f"config override {key} was replaced by {new} (one set of draft knobs for MTP "
                            f"layers and external drafts alike): set {new}")


class OneLineErrorParser(argparse.ArgumentParser):
    """argparse whose errors are vime's one-line `UserError`s (not usage + exit inside argparse)."""

    def error(self, message):
        flag = re.match(r"argument ([^:/ ]+)[^:]*: expected one argument$", message)
        if flag:
            raise UserError(f"{flag.group(1)} needs a value")
        raise UserError(re.sub(r"^argument [^:]+: ", "", message))


BENCH_DEBUG_TITLE = "benchmark and debugging switches"


def flag_groups():
    """{--help group title: (description, [flags])}: one group per config section, titled with its name and
    described by its docstring, in the tree's order, then the benchmark and debugging switches of every
    section (the fields whose metadata says BENCH_DEBUG). Every flag is in exactly one group."""
    groups = {}
    for section in dataclasses.fields(Config):
        summary = (section.default_factory.__doc__ or "").split("(`cfg.")[0].split(". ")[0]
        groups[section.name] = (" ".join(summary.split()).rstrip(". "), [])
    groups[BENCH_DEBUG_TITLE] = ("switches for benchmarks and debugging runs, from every section", [])
    for name, (path, f) in flag_table().items():
        title = BENCH_DEBUG_TITLE if f.metadata.get("group") == BENCH_DEBUG else path.split(".")[0]
        groups[title][1].append(name)
    return groups


def build_parser(defaults=None):
    """An argparse parser with one option per config field (from `flag_table`), in one argument group per
    config section (`flag_groups`); each field's help, its config key and, given the composed `defaults`
    tree, its default appear in --help."""
    parser = OneLineErrorParser(
        prog="python train_rl.py", allow_abbrev=False, add_help=False,
        usage="python train_rl.py [--kebab-flags ...] [hydra.key=value ...]",
        description="Every flag sets one field of the config tree (configs/config.yaml, vime/config.py); "
                    "Hydra key=value overrides set the same fields. Flags win over overrides.",
        formatter_class=lambda prog: argparse.HelpFormatter(prog, max_help_position=44, width=132))
    table = flag_table()
    for title, (description, names) in flag_groups().items():
        group = parser.add_argument_group(title, description)
        for name in names:
            _add_flag(group, name, *table[name], defaults)
    return parser


def _add_flag(parser, name, path, f, defaults):
    """The option (and, for a bool, its --no- form) of field `f` at `path` in `parser` (a group)."""
    help_line = f"{f.metadata['help']} ({path})"
    if defaults is not None and "default" not in f.metadata["help"]:  # some helps say what theirs means
        section, key = path.split(".")
        help_line += f" [default: {_shown(getattr(getattr(defaults, section), key))}]"
    common = dict(dest=path, default=argparse.SUPPRESS, help=help_line.replace("%", "%%"))
    if _is_bool(f):  # `--flag`, `--flag true|false`, `--flag=false` and `--no-flag` (see _normalise_bools)
        parser.add_argument(name, nargs="?", const=True, type=_converter(name, f), metavar="true|false", **common)
        parser.add_argument("--no-" + name[2:], dest=path, action="store_false", default=argparse.SUPPRESS,
                            help=argparse.SUPPRESS)
    else:
        parser.add_argument(name, type=_converter(name, f), metavar=_metavar(f), **common)


def split_argv(argv):
    """(hydra overrides, {config key: value}) from argv; the values already have their field's type."""
    table = flag_table()
    for arg in argv:  # before argparse, which would read `--mtp-lr` as an abbreviation or a stray value
        if arg.startswith("--"):
            _refuse_removed_flag(arg.partition("=")[0])
    flags, rest = build_parser().parse_known_args(_normalise_bools(list(argv), table))
    for arg in rest:
        if arg.startswith("--"):
            _require_known(arg.partition("=")[0], table)
    for arg in rest:
        require(not arg.startswith("-") and "=" in arg,
                f"unexpected argument {arg!r}: use --kebab-flags or Hydra key=value overrides")
    return rest, vars(flags)


def _normalise_bools(argv, table):
    """`--flag` and `--flag true|false` of a bool field as `--flag=true|false`: a bare bool flag must not
    swallow the next argument (`--enable-mtp-training experiment=x`), so only true/false join it."""
    out = []
    for i, arg in enumerate(argv):
        if arg in table and _is_bool(table[arg][1]):
            nxt = argv[i + 1] if i + 1 < len(argv) else None
            joined = nxt is not None and nxt.lower() in ("true", "false")
            out.append(f"{arg}={nxt if joined else 'true'}")
            if joined:
                argv[i + 1] = None
        elif arg is not None:
            out.append(arg)
    return out


def _require_known(name, table):
    if name in table:
        return
    close = difflib.get_close_matches(name, list(table), n=1)
    raise UserError(f"unknown flag {name}" + (f"; did you mean {close[0]}?" if close else "; see --help"))


def _is_bool(f):
    return f.type is bool


def _value_kind(f):
    args = [a for a in typing.get_args(f.type) if a is not type(None)]
    return args[0] if args else f.type


def _metavar(f):
    kind = _value_kind(f)
    return "JSON" if kind is typing.Any else kind.__name__.upper()


def _converter(name, f):
    """The argparse `type` of a field: its type from the flag's text, `none`/`null` for optional fields."""

    def convert(text):
        kind = _value_kind(f)
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

    return convert


def compose(overrides):
    """Hydra-composed YAML + overrides, merged onto the dataclass schema."""
    from hydra import compose as hydra_compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    _register_defaults()
    try:
        with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
            raw = hydra_compose("config", overrides=overrides)
        merged = OmegaConf.merge(OmegaConf.structured(Config), raw)
        return OmegaConf.to_object(merged)
    except Exception as e:  # Hydra/OmegaConf report bad overrides with their own exception types
        e = e.__cause__ or e  # Hydra wraps the schema's own message ("could not be converted ...")
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"config override {overrides}: {first}{_closest_key_hint(overrides)}") from None


def _register_defaults():
    """The dataclass tree as Hydra's base config `vime_defaults` (configs/config.yaml composes it):
    the one source of every default, and the schema key=value overrides are checked against."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="vime_defaults", node=Config)


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
    """The Config for argv (see module docstring), its speculative config parsed into a `SpecConfig`;
    the other rules are checked later (vime.config.validate)."""
    overrides, values = split_argv(list(argv))
    _refuse_removed_keys(overrides)
    cfg = compose(overrides)
    for path, value in values.items():
        section, key = path.split(".")
        setattr(getattr(cfg, section), key, value)
    # read once, here: from now on the tree holds a SpecConfig (or None) that every part reads
    cfg.rollout.vllm_speculative_config = parse_spec_config(cfg.rollout.vllm_speculative_config, cfg.rollout.backend)
    return cfg


def describe(cfg):
    """The config as YAML text (for the run directory); the speculative config as it was written."""
    spec = cfg.rollout.vllm_speculative_config
    if isinstance(spec, SpecConfig):
        cfg = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, vllm_speculative_config=spec.to_vllm()))
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def help_text():
    """--help: every flag with its help, its config key and its default (after configs/config.yaml)."""
    return build_parser(compose([])).format_help()


def _shown(value):
    if isinstance(value, str) and os.path.isabs(value):
        return os.path.relpath(value) if value.startswith(os.getcwd()) else value
    return json.dumps(value) if isinstance(value, (dict, list)) else str(value)

