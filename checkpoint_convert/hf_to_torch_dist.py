"""HF checkpoint -> megatron torch_dist checkpoint (trunk and MTP layers).

Builds the megatron model in one gloo process (one rank), fills it through the declarative
name maps (megatron_names.py) and saves `model.sharded_state_dict()` with
dist_checkpointing. torch_dist is layout-independent (megatron reshards on load), so a
checkpoint written by one rank loads at any `--tensor-model-parallel-size` and
`--pipeline-model-parallel-size`; the layout flags are validated here against the model
(vime/parallel_layout.py) and the TP size recorded in vime_meta.json.
"""
import argparse
import dataclasses
import os

from vime.models.hf_format import load_hf_checkpoint
from vime.config import RANGES, check_flag_ranges
from vime.manifest import write_manifest
from vime.errors import exit_on_user_error, require


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hf-checkpoint", required=True)
    ap.add_argument("--save", required=True)
    ap.add_argument("--mtp-num-layers", type=int, default=None)
    ap.add_argument("--drop-mtp", action="store_true", help="convert the trunk only, on purpose")
    ap.add_argument("--tensor-model-parallel-size", type=int, default=1)
    ap.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    ap.add_argument("--decoder-first-pipeline-num-layers", type=int, default=None)
    ap.add_argument("--decoder-last-pipeline-num-layers", type=int, default=None)
    args = ap.parse_args(argv)
    check_flag_ranges({"--mtp-num-layers": args.mtp_num_layers, "--tensor-model-parallel-size":
                       args.tensor_model_parallel_size, "--pipeline-model-parallel-size":
                       args.pipeline_model_parallel_size, "--decoder-first-pipeline-num-layers":
                       args.decoder_first_pipeline_num_layers, "--decoder-last-pipeline-num-layers":
                       args.decoder_last_pipeline_num_layers}, RANGES)  # train_rl.py's ranges for the same flags
    return args


def mtp_layers_to_convert(args, available):
    """How many MTP layers to keep, with one-line refusals for dropping them by accident."""
    if args.drop_mtp:
        require(args.mtp_num_layers in (None, 0), "--drop-mtp and --mtp-num-layers "
                f"{args.mtp_num_layers} contradict each other; pass one of them")
        return 0
    if args.mtp_num_layers is None:
        require(available == 0, f"--hf-checkpoint {args.hf_checkpoint} has {available} MTP layers but "
                "--mtp-num-layers is not set: the MTP weights would be dropped; pass "
                f"--mtp-num-layers {available} to keep them or --drop-mtp to drop them on purpose")
        return 0
    require(args.mtp_num_layers != 0 or available == 0,
            f"--mtp-num-layers 0 would drop the {available} MTP layers of --hf-checkpoint {args.hf_checkpoint}; "
            "pass --drop-mtp to drop them on purpose")
    require(args.mtp_num_layers <= available, f"--mtp-num-layers {args.mtp_num_layers} is larger than the "
            f"{available} MTP layers in --hf-checkpoint {args.hf_checkpoint}")
    require(args.mtp_num_layers >= 0, f"--mtp-num-layers {args.mtp_num_layers} must be >= 0")
    return args.mtp_num_layers


def convert(args):
    from trainer import checkpoint
    from trainer.distributed import owned_single_process
    from trainer.model import build_model
    from trainer.weights import load_hf_state
    from vime.parallel_layout import ParallelLayout

    cfg, state, family = load_hf_checkpoint(args.hf_checkpoint)
    n_mtp = mtp_layers_to_convert(args, cfg.num_nextn_predict_layers)
    tp = args.tensor_model_parallel_size
    cfg = dataclasses.replace(cfg, num_nextn_predict_layers=n_mtp)
    ParallelLayout.of(args).check_model(cfg)  # the layout the checkpoint is meant for (it loads at any)
    with owned_single_process():
        model = build_model(cfg, n_mtp)
        load_hf_state(model, state, cfg)
        checkpoint.save(args.save, model, meta={"model_config": dataclasses.asdict(cfg), "mtp_num_layers": n_mtp,
                                                "family": family, "tensor_model_parallel_size": tp})
    write_manifest(args.save)  # what torch_dist_to_hf checks every file against
    return n_mtp


@exit_on_user_error
def main(argv=None):
    from vime.paths import require_new_or_empty_dir, require_not_an_input

    args = parse_args(argv)
    require_not_an_input(args.save, "--save", [(args.hf_checkpoint, "--hf-checkpoint")])
    require_new_or_empty_dir(args.save, "--save")
    n_mtp = convert(args)
    print(f"saved torch_dist checkpoint to {os.path.abspath(args.save)} ({n_mtp} MTP layers)")


if __name__ == "__main__":
    main()
