"""megatron torch_dist checkpoint -> HF checkpoint in the origin directory's MTP layout.

The architecture comes from `--origin-hf-dir` (config.json), the MTP layer count from the
torch_dist checkpoint; the weights are exported through the same name maps as
`Trainer.named_hf_weights()`, written in the origin's layout (glm or mimo), and the
tokenizer files are copied.
"""
import argparse
import dataclasses
import os

from checkpoint_convert.families import detect_layout
from checkpoint_convert.hf_format import read_config, save_hf_checkpoint
from vime.errors import exit_on_user_error, require


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--input-dir", required=True)
    ap.add_argument("--output-dir", required=True)
    ap.add_argument("--origin-hf-dir", required=True)
    return ap.parse_args(argv)


def origin_layout(origin_dir, cfg):
    """The MTP layout of the origin checkpoint (glm when it has no MTP layers)."""
    from safetensors import safe_open

    path = os.path.join(origin_dir, "model.safetensors")
    if not os.path.isfile(path):
        return "glm"
    with safe_open(path, "pt") as f:
        return detect_layout(list(f.keys()), cfg.num_hidden_layers) or "glm"


def convert(args):
    from trainer import checkpoint
    from trainer.distributed import owned_single_process
    from trainer.model import build_model
    from trainer.weights import named_hf_weights

    require(os.path.isdir(args.input_dir), f"--input-dir {args.input_dir}: no such directory")
    meta = checkpoint.read_meta(args.input_dir)
    origin = read_config(args.origin_hf_dir)
    n_mtp = meta.get("mtp_num_layers", 0)
    cfg = dataclasses.replace(origin, num_nextn_predict_layers=n_mtp)
    layout = meta.get("hf_layout") or origin_layout(args.origin_hf_dir, origin)
    with owned_single_process():
        model = build_model(cfg, n_mtp)
        checkpoint.load(args.input_dir, model)
        state = dict(named_hf_weights(model, cfg))
    save_hf_checkpoint(args.output_dir, cfg, state, layout=layout, tokenizer_dir=args.origin_hf_dir)
    return layout


@exit_on_user_error
def main(argv=None):
    args = parse_args(argv)
    layout = convert(args)
    print(f"saved HF checkpoint ({layout} layout) to {os.path.abspath(args.output_dir)}")


if __name__ == "__main__":
    main()
