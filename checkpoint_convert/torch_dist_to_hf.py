"""megatron torch_dist checkpoint -> HF checkpoint of the origin directory's model family.

The architecture and family come from `--origin-hf-dir` (config.json), the MTP layer count
from the torch_dist checkpoint; the weights are exported through the same name maps as
`Trainer.named_hf_weights()`, written in the family's layout, and the tokenizer files are
copied.
"""
import argparse
import dataclasses
import os

from checkpoint_convert.hf_format import read_config, save_hf_checkpoint
from vime.errors import exit_on_user_error, require


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--input-dir", required=True)
    ap.add_argument("--output-dir", required=True)
    ap.add_argument("--origin-hf-dir", required=True)
    return ap.parse_args(argv)


def convert(args):
    from trainer import checkpoint
    from trainer.distributed import owned_single_process
    from trainer.model import build_model
    from trainer.weights import named_hf_weights

    require(os.path.isdir(args.input_dir), f"--input-dir {args.input_dir}: no such directory")
    meta = checkpoint.read_meta(args.input_dir)
    origin = read_config(args.origin_hf_dir)
    n_mtp = meta.get("mtp_num_layers", 0)
    saved_family = meta.get("family", origin.family)
    require(saved_family == origin.family, f"--input-dir {args.input_dir} holds a {saved_family} model but "
            f"--origin-hf-dir {args.origin_hf_dir} is {origin.family}; give the HF directory it was converted from")
    cfg = dataclasses.replace(origin, num_nextn_predict_layers=n_mtp)
    with owned_single_process():
        model = build_model(cfg, n_mtp)
        checkpoint.load(args.input_dir, model)
        state = dict(named_hf_weights(model, cfg))
    save_hf_checkpoint(args.output_dir, cfg, state, tokenizer_dir=args.origin_hf_dir)
    return cfg.family


@exit_on_user_error
def main(argv=None):
    args = parse_args(argv)
    family = convert(args)
    print(f"saved HF checkpoint ({family} family) to {os.path.abspath(args.output_dir)}")


if __name__ == "__main__":
    main()
