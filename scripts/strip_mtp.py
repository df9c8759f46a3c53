#!/usr/bin/env python
"""A checkpoint's trunk alone, as a family without MTP layers (a target for an external draft).

    python scripts/strip_mtp.py --source checkpoints/tiny-mimo-mtp --out checkpoints/tiny-qwen2 --family qwen2

MiMo's trunk is a Qwen2 trunk, so dropping the MTP layer and writing `Qwen2ForCausalLM` gives
the same policy (same weights, same outputs) in a family vLLM drafts for with EAGLE-3.
checkpoints/tiny-qwen2 is this command's output. Copies the tokenizer and the prompt files.
"""
import argparse
import dataclasses
import json
import os
import shutil
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from vime.errors import exit_on_user_error, require  # noqa: E402
from vime.paths import require_not_an_input  # noqa: E402
from vime.models.families import FAMILIES  # noqa: E402
from vime.models.hf_format import load_hf_checkpoint, save_hf_checkpoint  # noqa: E402
from vime.models.families import is_mtp_name  # noqa: E402

PROMPT_FILES = ("train.jsonl", "eval.jsonl")


@exit_on_user_error
def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--source", required=True, help="an HF checkpoint (with or without MTP layers)")
    p.add_argument("--out", required=True)
    p.add_argument("--family", default="qwen2", choices=sorted(FAMILIES))
    args = p.parse_args(argv)
    require_not_an_input(args.out, "--out", [(args.source, "--source")])
    cfg, state, _ = load_hf_checkpoint(args.source, "--source")
    new = FAMILIES[args.family]
    old = cfg.model_family
    require((new.qkv_bias, new.qk_norm) == (old.qkv_bias, old.qk_norm),
            f"--family {args.family}: its trunk flavour differs from {args.source}'s ({old.name}); "
            "pick a family with the same trunk (q/k/v bias, q/k norm)")
    trunk = {n: t for n, t in state.items() if not is_mtp_name(n, cfg.num_hidden_layers)}
    out_cfg = dataclasses.replace(cfg, family=new.name, num_nextn_predict_layers=0)
    save_hf_checkpoint(args.out, out_cfg, trunk, tokenizer_dir=args.source)
    for name in PROMPT_FILES:
        if os.path.isfile(os.path.join(args.source, name)):
            shutil.copy(os.path.join(args.source, name), os.path.join(args.out, name))
    with open(os.path.join(args.out, "PROVENANCE.json"), "w") as f:
        json.dump({"command": "python scripts/strip_mtp.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                   "note": f"the trunk of {os.path.basename(os.path.normpath(args.source))} unchanged, "
                           f"MTP layers dropped, written as {new.architectures[0]}"}, f, indent=1)
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
