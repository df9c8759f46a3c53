#!/usr/bin/env python
"""Make a DSpark draft for a target without MTP layers, in the directory vLLM serves.

    python scripts/make_dspark_draft.py --target checkpoints/tiny-qwen2 --out DIR [--block-size 4] [--warmup-steps 800]

A DFlash draft as scripts/make_dflash_draft.py makes it (the same options: its layers, target
layers, width, the target's pad token in the block's slots after the anchor) plus DSpark's heads
(mtp/dspark.py, format vime/models/dspark.py): a Markov head of rank `--markov-rank` and a
confidence head (`--no-confidence-head` to leave it out, `--confidence-head-with-markov` to feed it
the Markov embedding too). Blocks of `--block-size` slots, each drafting a token: serve it with
num_speculative_tokens = block_size. `--warmup-steps N` trains it offline for up to N steps on the target's own
samples (temperature 1) with DSpark's objective (`dspark_loss`: cross-entropy, L1 to the target's
distribution, the confidence head's binary cross-entropy, weighted `--ce-weight`, `--l1-weight`,
`--confidence-weight`, the recipes' defaults). The result loads, unchanged, with
`vllm.LLM(model=TARGET, speculative_config={"method": "dspark", "model": DIR})` on a GPU build.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from make_dflash_draft import block_draft_parser, initialised, make  # noqa: E402
from mtp.draft_warmup import warm_up_draft  # noqa: E402
from mtp.dspark import RECIPE_WEIGHTS, dspark_loss  # noqa: E402
from vime.errors import exit_on_user_error, require  # noqa: E402
from vime.models.dspark import DSPARK, check_loss_weights, draft_config_for_target  # noqa: E402


def parse_args(argv=None):
    p = block_draft_parser(__doc__, "the block's slots, each drafting a token (num_speculative_tokens)")
    p.add_argument("--markov-rank", type=int, default=32, help="rank of the Markov head's transition bias")
    p.add_argument("--no-confidence-head", dest="confidence_head", action="store_false",
                   help="leave out the confidence head (verification can then not be sized by it)")
    p.add_argument("--confidence-head-with-markov", action="store_true",
                   help="the confidence head reads the Markov embedding beside the slot's state")
    for term, weight in RECIPE_WEIGHTS.items():
        p.add_argument(f"--{term}-weight", type=float, default=None,
                       help=f"weight of the {term} term (default {weight:g})")
    return p.parse_args(argv)


def given_weights(args):
    """{term: weight} of the loss weights given on the command line (the others: the recipe's)."""
    return {term: getattr(args, f"{term}_weight") for term in RECIPE_WEIGHTS
            if getattr(args, f"{term}_weight") is not None}


def init_draft(target_cfg, target_state, args, std=0.02):
    """A draft for the target: final norm copied from the target, the rest normal(std), the
    confidence head's bias 0 (sigmoid 1/2)."""
    cfg = draft_config_for_target(target_cfg, args.num_layers, args.block_size, args.markov_rank,
                                  args.confidence_head, args.confidence_head_with_markov, args.target_layer_ids,
                                  args.mask_token_id, args.intermediate_size)
    draft = initialised(DSPARK, cfg, target_cfg, target_state, args, args.block_size, std)
    if draft.confidence_head is not None:
        torch.nn.init.zeros_(draft.confidence_head.proj.bias)
    return draft


def warm_up(draft, target, sequences, args, log=print):
    """Offline steps of DSpark's objective on the target's own sequences (target states and logits
    recomputed, detached)."""
    generator = torch.Generator().manual_seed(args.seed)
    embed, head = target.model.embed_tokens.weight.detach(), target.head_weight().detach()
    weights = dict(RECIPE_WEIGHTS, **given_weights(args))

    def loss_of(tokens, mask, aux):
        with torch.no_grad():
            logits = target.logits(target(tokens, torch.arange(tokens.shape[1]).expand_as(tokens)))
        loss, per_slot, _ = dspark_loss(draft, aux, tokens, mask, embed, head, args.anchors, logits, weights,
                                        args.gamma, generator)
        return loss, per_slot

    warm_up_draft(draft, target, sequences, args.warmup_steps, args.batch_size, args.lr, args.seed, loss_of,
                  "block slot", log)


@exit_on_user_error
def main(argv=None):
    args = parse_args(argv)
    require(args.block_size >= 1, f"--block-size must be >= 1: the block's drafts (got {args.block_size})")
    require(args.markov_rank >= 1, f"--markov-rank must be >= 1 (got {args.markov_rank})")
    for term, weight in given_weights(args).items():
        require(weight >= 0, f"--{term}-weight must be >= 0 (got {weight:g})")
    check_loss_weights(given_weights(args), args.confidence_head, lambda term: f"--{term}-weight",
                       "the draft (--no-confidence-head)" if not args.confidence_head else "the draft")
    make(args, DSPARK, init_draft, warm_up)


if __name__ == "__main__":
    main()
