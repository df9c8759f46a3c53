#!/usr/bin/env python
"""Make an EAGLE-3 draft for a target (any family the embedded engine runs), in the directory vLLM serves.

    python scripts/make_eagle3_draft.py --target checkpoints/tiny-qwen2 --out DIR [--warmup-steps 300]

The draft (mtp/eagle3.py, format vime/models/eagle3.py) is shaped for the target: its hidden size,
heads and vocabulary, fc over three aux layers of the target (`--aux-layer-ids`; by default vLLM's
choice, or on a target of fewer than 7 layers the embedding output, the middle and the last layer's
output). Any family the embedded engine runs is a target; vLLM drafts for Qwen2 and Qwen3. Its head and final
norm start as the target's; the rest is a small random init. `--warmup-steps N` then trains it
offline for N steps on the target's own samples (prompts from the target directory's train.jsonl,
temperature 1) with EAGLE-3's training-time test over `--ttt-steps` drafting steps: a draft that
knows the target as it is before RL moves it. The result loads, unchanged, with
`vllm.LLM(model=TARGET, speculative_config={"method": "eagle3", "model": DIR, ...})`.
"""
import argparse
import json
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from mtp.draft_warmup import warm_up_draft  # noqa: E402
from mtp.eagle3 import Eagle3Draft, training_time_test_loss  # noqa: E402
from rollout.embedded.engine import Engine, EngineConfig  # noqa: E402
from rollout.sampling_params import SamplingParams  # noqa: E402
from vime.errors import exit_on_user_error, require  # noqa: E402
from vime.models.eagle3 import EAGLE3, draft_config_for_target  # noqa: E402
from vime.models.hf_format import load_hf_checkpoint  # noqa: E402
from vime.sample import samples_for_prompts  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True, help="the target's HF checkpoint (any family the embedded engine runs)")
    p.add_argument("--out", required=True)
    p.add_argument("--aux-layer-ids", type=int, nargs=3, default=None,
                   help="the three aux layers the draft reads (id i: before target layer i; default: see above)")
    p.add_argument("--intermediate-size", type=int, default=None, help="the draft's MLP width (default: the target's)")
    p.add_argument("--warmup-steps", type=int, default=0, help="offline training steps on the target's samples")
    p.add_argument("--warmup-samples", type=int, default=512)
    p.add_argument("--ttt-steps", type=int, default=3, help="drafting steps the training-time test unrolls")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def init_draft(target_cfg, target_state, seed, intermediate_size=None, aux_layer_ids=None, std=0.02):
    """A draft for the target: head and final norm copied from the target, the rest normal(std)."""
    cfg = draft_config_for_target(target_cfg, intermediate_size, aux_layer_ids)
    torch.manual_seed(seed)
    draft = Eagle3Draft(cfg)
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if p.dim() == 2:
                torch.nn.init.normal_(p, std=std)
        head = target_state["model.embed_tokens.weight" if target_cfg.tie_word_embeddings else "lm_head.weight"]
        draft.lm_head.weight.copy_(head)
        draft.norm.weight.copy_(target_state["model.norm.weight"])
    return draft


def target_samples(target_path, n, max_new_tokens, seed):
    """[token ids] of n target samples (temperature 1) on the target's train.jsonl prompts."""
    engine = Engine.from_checkpoint(target_path, EngineConfig(max_batch_size=128))
    with open(os.path.join(target_path, "train.jsonl")) as f:
        prompts = [json.loads(line)["prompt"] for line in f if line.strip()]
    rng = random.Random(seed)
    codec = engine.codec
    bos = engine.cfg.bos_token_id
    chosen = [([bos] if bos is not None else []) + codec.encode(rng.choice(prompts)) for _ in range(n)]
    out = engine.generate(samples_for_prompts(chosen), SamplingParams(temperature=1.0, max_new_tokens=max_new_tokens,
                                                                       seed=seed))
    return [s.tokens for s in out], engine.model


def warm_up(draft, target, sequences, steps, batch_size, lr, ttt_steps, seed, log=print):
    """Offline training-time-test steps on the target's own sequences (aux states recomputed, detached)."""
    embed = target.model.embed_tokens.weight.detach()

    def loss_of(tokens, mask, aux):
        return training_time_test_loss(draft, F.embedding(tokens, embed), aux, tokens, mask, ttt_steps)

    warm_up_draft(draft, target, sequences, steps, batch_size, lr, seed, loss_of, "drafting step", log)


@exit_on_user_error
def main(argv=None):
    args = parse_args(argv)
    require(args.warmup_steps >= 0, f"--warmup-steps must be >= 0 (got {args.warmup_steps})")
    require(args.ttt_steps >= 1, f"--ttt-steps must be >= 1 (got {args.ttt_steps})")
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    target_cfg, target_state, _ = load_hf_checkpoint(args.target, "--target")
    draft = init_draft(target_cfg, target_state, args.seed, args.intermediate_size, args.aux_layer_ids)
    EAGLE3.check_fits(args.out, draft.cfg, target_cfg, tensors={n: t.shape for n, t in draft.state_dict().items()})
    if args.warmup_steps:
        sequences, target = target_samples(args.target, args.warmup_samples, args.max_new_tokens, args.seed)
        warm_up(draft, target, sequences, args.warmup_steps, args.batch_size, args.lr, args.ttt_steps, args.seed)
    EAGLE3.save(args.out, draft.cfg, draft.state_dict())
    print(f"saved {args.out} (aux layers {list(draft.cfg.aux_layer_ids)} of {target_cfg.num_hidden_layers})")


if __name__ == "__main__":
    main()
