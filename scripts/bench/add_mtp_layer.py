#!/usr/bin/env python
"""Copy a checkpoint with one more MTP layer, a copy of its last one (for the 1-vs-2-layer drift arms).

    python scripts/bench/add_mtp_layer.py --src checkpoints/tiny-mimo-mtp --out runs/tiny-mimo-2mtp

The new layer starts as the last layer's weights, so at step 0 the two-layer draft is close
to the one-layer draft reused on its own output, and online training can then specialise
it to depth 2 as megatron-core trains it (layer 2 on layer 1's output). Every other file of
the directory (tokenizer, task data) is copied unchanged.
"""
import argparse
import dataclasses
import os
import shutil
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from vime.models.hf_format import load_hf_checkpoint, save_hf_checkpoint  # noqa: E402
from vime.errors import UserError, require  # noqa: E402


def add_mtp_layer(src, out):
    require(os.path.isdir(src), f"--src {src}: no such directory (a checkpoint with MTP layers)")
    cfg, state, _ = load_hf_checkpoint(src)
    n, k = cfg.num_hidden_layers, cfg.num_nextn_predict_layers
    require(k >= 1, f"--src {src}: the checkpoint has no MTP layer to copy")
    last, new = f"model.layers.{n + k - 1}.", f"model.layers.{n + k}."
    state = dict(state)
    state.update({new + name[len(last):]: t.clone() for name, t in state.items() if name.startswith(last)})
    shutil.copytree(src, out, dirs_exist_ok=True)
    save_hf_checkpoint(out, dataclasses.replace(cfg, num_nextn_predict_layers=k + 1), state)
    return k + 1


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--src", required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    try:
        print(f"wrote {args.out} with {add_mtp_layer(args.src, args.out)} MTP layers")
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
