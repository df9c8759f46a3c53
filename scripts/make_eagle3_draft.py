#!/usr/bin/env python
"""Make an EAGLE-3 draft for a target (any family the embedded engine runs), in the directory vLLM serves.

    python scripts/make_eagle3_draft.py --target checkpoints/tiny-qwen2 --out DIR [--warmup-steps 300]

The draft (mtp/eagle3.py, format vime/models/eagle3.py) is shaped for the target: its hidden size,
heads and vocabulary, fc over three aux layers of the target (`--aux-layer-ids`; by default vLLM's
choice, or on a target of fewer than 7 layers the embedding output, the middle and the last layer's
output). Any family the embedded engine runs is a target; vLLM drafts for the families whose models hand it
aux hidden states (Qwen2, Qwen3, Llama: vime/models/families.py). Its head and final
norm start as the target's; the rest is a small random init. `--warmup-steps N` then trains it
offline for up to N steps on the target's own samples (temperature 1) on the task's prompts (`--prompt-data`,
chat messages with `--apply-chat-template`; default: the target directory's train.jsonl) with EAGLE-3's training-time test over `--ttt-steps` drafting steps: a draft that
knows the target as it is before RL moves it. The result loads, unchanged, with
`vllm.LLM(model=TARGET, speculative_config={"method": "eagle3", "model": DIR, ...})`.
"""
import argparse
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
from vime.models.hf_format import load_hf_checkpoint, read_config  # noqa: E402
from vime.sample import samples_for_prompts  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True, help="the target's HF checkpoint (any family the embedded engine runs)")
    p.add_argument("--out", required=True)
    p.add_argument("--aux-layer-ids", type=int, nargs=3, default=None,
                   help="the three aux layers the draft reads (id i: before target layer i; default: see above)")
    p.add_argument("--intermediate-size", type=int, default=None, help="the draft's MLP width (default: the target's)")
    p.add_argument("--warmup-steps", type=int, default=0, help="offline training steps on the target's samples, at most (the warm-up stops where its loss on held-out "
                   "samples stops falling: mtp/draft_warmup.py)")
    p.add_argument("--warmup-samples", type=int, default=512)
    p.add_argument("--ttt-steps", type=int, default=3, help="drafting steps the training-time test unrolls")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    add_sample_args(p)
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


def add_sample_args(p):
    """The options of the prompts a draft maker's warm-up samples the target on (the RL task's prompts)."""
    p.add_argument("--prompt-data", default=None,
                   help="JSONL prompts the target answers for the warm-up (default: the target's train.jsonl)")
    p.add_argument("--input-key", default="prompt", help="the prompt column of --prompt-data")
    p.add_argument("--label-key", default="label", help="the label column of --prompt-data")
    p.add_argument("--apply-chat-template", action="store_true",
                   help="--input-key holds chat messages, rendered with the target tokenizer's chat template")


def check_out(args):
    """A draft maker's --out is none of its inputs: it writes config.json and the weights there, which
    would overwrite the target's own (or the prompt file). An empty --prompt-data names no file (it would
    fall back to the target's prompts without a word)."""
    from vime.paths import require_given, require_not_an_input

    require_given(args.prompt_data, "--prompt-data")
    require_not_an_input(args.out, "--out", [(args.target, "--target"), (args.prompt_data, "--prompt-data")])


def target_samples(target_path, n, max_new_tokens, seed, args=None):
    """([token ids], [prompt length] of n target samples (temperature 1) on the prompts `args` names (a draft
    maker's --prompt-data, --input-key, --label-key, --apply-chat-template; default: the target's train.jsonl),
    the target's model): the target's own responses, the self-distillation data of every draft kind."""
    from rollout.data import read_prompt_file
    from rollout.tokenizer import TextCodec

    path = getattr(args, "prompt_data", None) or os.path.join(target_path, "train.jsonl")
    chat = bool(getattr(args, "apply_chat_template", False))
    codec = TextCodec(target_path)
    require(not chat or codec.has_chat_template, f"--apply-chat-template: the tokenizer of {target_path} has no chat "
            "template; drop the flag and give plain-text prompts, or use a chat model")
    rows = read_prompt_file(path, getattr(args, "input_key", "prompt"), getattr(args, "label_key", "label"),
                            codec=codec, apply_chat_template=chat)
    rng = random.Random(seed)
    bos = read_config(target_path).bos_token_id
    chosen = [codec.prompt_ids(rng.choice(rows)[0], bos, chat) for _ in range(n)]
    # the KV cache for this warm-up's context, not the model's (a real model's runs to thousands of positions)
    engine = Engine.from_checkpoint(target_path, EngineConfig(max_batch_size=min(n, 128),
                                                              max_len=max(map(len, chosen)) + max_new_tokens))
    out = engine.generate(samples_for_prompts(chosen), SamplingParams(temperature=1.0, max_new_tokens=max_new_tokens,
                                                                       seed=seed))
    return [s.tokens for s in out], [len(s.prompt_ids) for s in out], engine.model


def warm_up(draft, target, sequences, steps, batch_size, lr, ttt_steps, seed, log=print):
    """Offline training-time-test steps on the target's own sequences (aux states recomputed, detached)."""
    embed = target.model.embed_tokens.weight.detach()

    def loss_of(tokens, mask, aux):
        return training_time_test_loss(draft, F.embedding(tokens, embed), aux, tokens, mask, ttt_steps)

    warm_up_draft(draft, target, sequences, steps, batch_size, lr, seed, loss_of, "drafting step", log)


@exit_on_user_error
def main(argv=None):
    args = parse_args(argv)
    check_out(args)
    require(args.warmup_steps >= 0, f"--warmup-steps must be >= 0 (got {args.warmup_steps})")
    require(args.ttt_steps >= 1, f"--ttt-steps must be >= 1 (got {args.ttt_steps})")
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    target_cfg, target_state, _ = load_hf_checkpoint(args.target, "--target")
    draft = init_draft(target_cfg, target_state, args.seed, args.intermediate_size, args.aux_layer_ids)
    EAGLE3.check_fits(args.out, draft.cfg, target_cfg, tensors={n: t.shape for n, t in draft.state_dict().items()})
    if args.warmup_steps:
        sequences, _, target = target_samples(args.target, args.warmup_samples, args.max_new_tokens, args.seed, args)
        warm_up(draft, target, sequences, args.warmup_steps, args.batch_size, args.lr, args.ttt_steps, args.seed)
    EAGLE3.save(args.out, draft.cfg, draft.state_dict())
    print(f"saved {args.out} (aux layers {list(draft.cfg.aux_layer_ids)} of {target_cfg.num_hidden_layers})")


if __name__ == "__main__":
    main()
