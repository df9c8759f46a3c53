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
from vime.errors import UserError, exit_on_user_error, require


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--input-dir", required=True)
    ap.add_argument("--output-dir", required=True)
    ap.add_argument("--origin-hf-dir", required=True)
    return ap.parse_args(argv)


def check_args(args):
    """Errors naming this tool's own flags, before any model is built."""
    from checkpoint_convert.hf_format import read_config as read_origin
    from vime.checkpointing import check_torch_dist_dir
    from vime.paths import require_new_or_empty_dir, same_dir

    require(os.path.isdir(args.input_dir), f"--input-dir {args.input_dir}: no such directory")
    require(os.path.isfile(os.path.join(args.input_dir, "vime_meta.json")),
            f"--input-dir {args.input_dir}: vime_meta.json is missing; not a vime torch_dist checkpoint (make one "
            "with `python -m checkpoint_convert.hf_to_torch_dist`)")
    check_torch_dist_dir(args.input_dir, f"--input-dir {args.input_dir}")
    require(os.path.isdir(args.origin_hf_dir), f"--origin-hf-dir {args.origin_hf_dir}: no such directory")
    try:
        read_origin(args.origin_hf_dir)
    except UserError as e:  # read_config words its errors for --hf-checkpoint
        raise UserError(f"--origin-hf-dir {args.origin_hf_dir}: " + str(e).replace(
            f"--hf-checkpoint {args.origin_hf_dir}: ", "")) from None
    for other, flag in ((args.origin_hf_dir, "--origin-hf-dir"), (args.input_dir, "--input-dir")):
        require(not same_dir(args.output_dir, other), f"--output-dir {args.output_dir} is {flag}: writing there "
                "would overwrite it; choose a new directory")
    require_new_or_empty_dir(args.output_dir, "--output-dir")


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
    check_args(args)
    layout = convert(args)
    print(f"saved HF checkpoint ({layout} layout) to {os.path.abspath(args.output_dir)}")


if __name__ == "__main__":
    main()
