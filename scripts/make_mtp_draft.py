#!/usr/bin/env python
"""Add fresh MTP layers to a checkpoint that has none, and warm them up on the model's own responses.

    python scripts/make_mtp_draft.py --target checkpoints/smollm2-135m-instruct --out DIR \\
        [--mtp-num-layers 1] [--warmup-steps 200] [--prompt-data TASK.jsonl --apply-chat-template]

The new layers (mtp/fresh_layers.py) are initialised as megatron-core initialises an MTP layer; the trunk,
embedding and head are the target's, unchanged. `--warmup-steps N` then trains only the MTP layers for up to N
AdamW steps on the target's own responses (temperature 1) to the task's prompts, the loss read on the
response tokens: self-distillation, as the external draft kinds' makers do. DIR is an HF checkpoint with
`num_nextn_predict_layers` MTP layers (the target's tokenizer, chat template and prompt files copied), which
train_rl.py loads with `--enable-mtp-training --mtp-num-layers N`; train_rl.py runs this itself when given
a checkpoint without MTP layers (`--mtp-warmup-steps`).
"""
import argparse
import os
import shutil
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from make_eagle3_draft import add_sample_args, check_out, response_masks, target_samples  # noqa: E402
from mtp.fresh_layers import fresh_mtp_state, warm_up_mtp_layers, with_mtp_layers  # noqa: E402
from rollout.embedded.model import CausalLMWithMTP  # noqa: E402
from vime.config import MTPSection  # noqa: E402
from vime.errors import exit_on_user_error, require  # noqa: E402
from vime.models.hf_format import expected_hf_tensors, load_hf_checkpoint, save_hf_checkpoint  # noqa: E402

PROMPT_FILES = ("train.jsonl", "eval.jsonl")  # the task's prompts a checkpoint directory may carry


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True, help="an HF checkpoint without MTP layers (any family vime runs)")
    p.add_argument("--out", required=True)
    p.add_argument("--mtp-num-layers", type=int, default=1, help="MTP layers to add")
    p.add_argument("--warmup-steps", type=int, default=0, help="offline training steps on the target's responses, at most (the warm-up stops where its loss on "
                   "held-out responses stops falling: mtp/draft_warmup.py)")
    p.add_argument("--warmup-samples", type=int, default=MTPSection.warmup_samples,
                   help="the target's responses (temperature 1) the warm-up trains on")
    p.add_argument("--batch-size", type=int, default=MTPSection.warmup_batch_size, help="responses per warm-up step")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    add_sample_args(p)
    return p.parse_args(argv)


def make(args, log=print):
    """The checkpoint with fresh (and warmed-up) MTP layers, written to args.out."""
    require(args.mtp_num_layers >= 1, f"--mtp-num-layers must be >= 1 (got {args.mtp_num_layers})")
    require(args.warmup_steps >= 0, f"--warmup-steps must be >= 0 (got {args.warmup_steps})")
    require(args.warmup_samples >= 1, f"--warmup-samples must be >= 1 (got {args.warmup_samples})")
    require(args.batch_size >= 1, f"--batch-size must be >= 1 (got {args.batch_size})")
    check_out(args)
    cfg, state, _ = load_hf_checkpoint(args.target, "--target")
    require(cfg.num_nextn_predict_layers == 0, f"--target {args.target} already has {cfg.num_nextn_predict_layers} "
            "MTP layers; train them with --enable-mtp-training instead of adding new ones")
    new_cfg = with_mtp_layers(cfg, args.mtp_num_layers)
    shapes = {name: e.shape for name, e in expected_hf_tensors(new_cfg).items()}
    state.update(fresh_mtp_state(cfg, args.mtp_num_layers, shapes, seed=args.seed))
    model = CausalLMWithMTP(new_cfg)
    model.load_state_dict(state, strict=True)
    kept = 0
    if args.warmup_steps:
        sequences, prompt_lengths, _ = target_samples(args.target, args.warmup_samples, args.max_new_tokens,
                                                      args.seed, args)
        kept = warm_up_mtp_layers(model, sequences, response_masks(sequences, prompt_lengths), args.warmup_steps,
                                  args.batch_size, args.lr, args.seed, log=log)
    save_hf_checkpoint(args.out, new_cfg, model.state_dict(), tokenizer_dir=args.target)
    for name in PROMPT_FILES:
        if os.path.isfile(os.path.join(args.target, name)):
            shutil.copy(os.path.join(args.target, name), os.path.join(args.out, name))
    log(f"saved {args.out}: {args.target} with {args.mtp_num_layers} fresh MTP layer(s) (megatron-core's "
        f"initialisation), warmed up for {kept} of at most {args.warmup_steps} steps on its own responses")


@exit_on_user_error
def main(argv=None):
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    make(parse_args(argv))


if __name__ == "__main__":
    main()
