"""megatron torch_dist checkpoint -> HF checkpoint of the origin directory's model family.

The architecture and family come from `--origin-hf-dir` (config.json), checked against the tensors
the checkpoint holds (vime/models/torch_dist_format.py), the MTP layer count from the torch_dist
checkpoint; the weights are exported through the same name maps as
`Trainer.named_hf_weights()`, written in the family's layout (with the MTP layers' copies of the
embedding and head where the origin stores them), and the tokenizer files are copied.
`--input-dir` is a converted checkpoint (hf_to_torch_dist's --save), one iteration of a training
run (`iter_0000040`), or a training run's --save directory (the checkpoint `--load` resumes from);
every file of it is verified against the manifest written with it first.
"""
import argparse
import dataclasses
import os

from vime.checkpointing import LATEST, checkpoint_steps
from vime.models.hf_format import has_mtp_head_copies, read_config, save_hf_checkpoint
from vime.models.torch_dist_format import torch_dist_tensor_problem
from vime.errors import UserError, exit_on_user_error, require
from vime.paths import require_dir


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--input-dir", required=True)
    ap.add_argument("--output-dir", required=True)
    ap.add_argument("--origin-hf-dir", required=True)
    return ap.parse_args(argv)


def model_dir(input_dir):
    """The torch_dist model directory that --input-dir names (see the module docstring), every file of
    its checkpoint verified against the manifest written with it."""
    from vime.checkpointing import iteration_problem, resolve_load
    from vime.manifest import manifest_problem

    require_dir(input_dir, "--input-dir")
    if os.path.isfile(os.path.join(input_dir, "vime_meta.json")):  # a converted checkpoint (hf_to_torch_dist)
        problem = manifest_problem(input_dir)
        require(problem is None, f"--input-dir {input_dir}: {problem}; convert it again with "
                "`python -m checkpoint_convert.hf_to_torch_dist`")
        return input_dir
    if os.path.isdir(os.path.join(input_dir, "model")):  # one iteration of a training run
        problem = iteration_problem(input_dir)
        require(problem is None, f"--input-dir {input_dir}: {problem}; give another iteration, or the run's --save "
                "directory (its newest valid checkpoint is converted)")
        return os.path.join(input_dir, "model")
    require(os.path.isfile(os.path.join(input_dir, LATEST)) or checkpoint_steps(input_dir),
            f"--input-dir {input_dir}: vime_meta.json is missing; not a vime torch_dist checkpoint (make one with "
            "`python -m checkpoint_convert.hf_to_torch_dist`, or give a training run's --save directory or one of "
            "its iter_* directories)")
    step, iteration, skipped = resolve_load(input_dir, flag="--input-dir")
    if skipped:
        print(f"[vime] --input-dir {input_dir}: converting step {step} ({os.path.basename(iteration)}), passed over: "
              f"{'; '.join(skipped)}", flush=True)
    return os.path.join(iteration, "model")


def check_args(args):
    """Errors naming this tool's own flags, before any model is built."""
    from vime.models.hf_format import read_config as read_origin
    from vime.paths import require_new_or_empty_dir, require_not_an_input

    args.input_dir = model_dir(args.input_dir)
    require_dir(args.origin_hf_dir, "--origin-hf-dir")
    try:
        read_origin(args.origin_hf_dir)
    except UserError as e:  # read_config words its errors for --hf-checkpoint
        raise UserError(f"--origin-hf-dir {args.origin_hf_dir}: " + str(e).replace(
            f"--hf-checkpoint {args.origin_hf_dir}: ", "")) from None
    require_not_an_input(args.output_dir, "--output-dir", [(args.origin_hf_dir, "--origin-hf-dir"),
                                                           (args.input_dir, "--input-dir")])
    require_new_or_empty_dir(args.output_dir, "--output-dir")


def convert(args):
    from trainer import checkpoint
    from trainer.distributed import owned_single_process
    from trainer.model import build_model
    from trainer.weights import stage_hf_weights

    require_dir(args.input_dir, "--input-dir")
    meta = checkpoint.read_meta(args.input_dir, "--input-dir")
    origin = read_config(args.origin_hf_dir, "--origin-hf-dir")
    n_mtp = meta.get("mtp_num_layers", 0)
    saved_family = meta.get("family", origin.family)
    require(saved_family == origin.family, f"--input-dir {args.input_dir} holds a {saved_family} model but "
            f"--origin-hf-dir {args.origin_hf_dir} is {origin.family}; give the HF directory it was converted from")
    cfg = dataclasses.replace(origin, num_nextn_predict_layers=n_mtp)
    problem = torch_dist_tensor_problem(meta, cfg, n_mtp)
    require(problem is None, f"--origin-hf-dir {args.origin_hf_dir}: its config.json disagrees with the tensors of "
            f"--input-dir {args.input_dir}: {problem}; give the HF directory it was converted from")
    with owned_single_process():
        model = build_model(cfg, n_mtp)
        checkpoint.load(args.input_dir, model)
        state = dict(stage_hf_weights(model, cfg))  # one rank: its one stage is the whole model
    # MTP layers' copies of the embedding and head are written back where the origin stores them
    save_hf_checkpoint(args.output_dir, cfg, state, tokenizer_dir=args.origin_hf_dir,
                       mtp_head_copies=bool(n_mtp) and has_mtp_head_copies(args.origin_hf_dir, origin))
    return cfg.family


@exit_on_user_error
def main(argv=None):
    args = parse_args(argv)
    check_args(args)
    family = convert(args)
    print(f"saved HF checkpoint ({family} family) to {os.path.abspath(args.output_dir)}")


if __name__ == "__main__":
    main()
