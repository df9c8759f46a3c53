#!/usr/bin/env python
"""Make an EAGLE-3 draft for a target (any family the embedded engine runs), in the directory vLLM serves.

    python scripts/make_eagle3_draft.py --target checkpoints/tiny-qwen2 --out DIR [--warmup-steps 300]
        [--draft-vocab-size N]

The draft (mtp/eagle3.py, format vime/models/eagle3.py) is shaped for the target: its hidden size,
heads and vocabulary, fc over three aux layers of the target (`--aux-layer-ids`; by default vLLM's
choice, or on a target of fewer than 7 layers the embedding output, the middle and the last layer's
output). Any family the embedded engine runs is a target; vLLM drafts for the families whose models hand it
aux hidden states (Qwen2, Qwen3, Llama: vime/models/families.py). Its head and final
norm start as the target's; the rest is a small random init. `--warmup-steps N` then trains it
offline for up to N steps on the target's own samples (temperature 1) on the task's prompts (`--prompt-data`,
chat messages with `--apply-chat-template`; default: the target directory's train.jsonl) with EAGLE-3's
training-time test over `--ttt-steps` drafting steps, its loss read on the responses (as RL trains it): a
draft that knows the target as it is before RL moves it.

`--draft-vocab-size N` (default: the target's vocabulary) gives the draft EAGLE-3's reduced vocabulary: its
head predicts only the N target tokens most frequent in the responses of those samples (ties: the lower
id; fewer distinct tokens than N: the lowest ids unused), drawn even with `--warmup-steps 0`, its rows
copied from the target's head at those ids; `d2t` and `t2d` say which tokens they are. Each drafting step
then projects onto N tokens instead of the whole vocabulary (a real model's 49152: most of a step's cost),
and a target token outside them is never drafted.

The result loads, unchanged, with `vllm.LLM(model=TARGET, speculative_config={"method": "eagle3",
"model": DIR, ...})`.
"""
import argparse
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from mtp.draft_warmup import warm_up_draft  # noqa: E402
from mtp.eagle3 import Eagle3Draft, frequent_vocabulary, training_time_test_loss  # noqa: E402
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
    p.add_argument("--draft-vocab-size", type=int, default=None,
                   help="the target tokens the draft predicts, the most frequent in the warm-up's responses "
                        "(default: the target's whole vocabulary; see above)")
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


def init_draft(target_cfg, target_state, seed, intermediate_size=None, aux_layer_ids=None, std=0.02,
               draft_vocab_size=None):
    """A draft for the target: head and final norm copied from the target (a reduced vocabulary: its lowest
    ids until `use_vocabulary` picks them), the rest normal(std)."""
    cfg = draft_config_for_target(target_cfg, intermediate_size, aux_layer_ids, draft_vocab_size)
    torch.manual_seed(seed)
    draft = Eagle3Draft(cfg)
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if p.dim() == 2:
                torch.nn.init.normal_(p, std=std)
        draft.lm_head.weight.copy_(target_head(target_cfg, target_state)[draft.target_ids()])
        draft.norm.weight.copy_(target_state["model.norm.weight"])
    return draft


def target_head(target_cfg, target_state):
    """The target's [V, H] output layer (its embedding when tied)."""
    return target_state["model.embed_tokens.weight" if target_cfg.tie_word_embeddings else "lm_head.weight"]


def use_vocabulary(draft, head, target_ids):
    """The draft predicts the target tokens `target_ids` (ascending), its head rows the target head's there."""
    draft.set_vocabulary(target_ids)
    with torch.no_grad():
        draft.lm_head.weight.copy_(head[target_ids])


def predicted_tokens(sequences, masks):
    """[n] the tokens the warm-up's loss predicts: those `masks` marks, from position 2 on (the training-time
    test's first step reads tokens 0 and 1 and predicts token 2)."""
    return torch.tensor([t for seq, mask in zip(sequences, masks) for t, on in list(zip(seq, mask))[2:] if on],
                        dtype=torch.long)


def response_masks(sequences, prompt_lengths):
    """1 on each sequence's response tokens, 0 on its prompt: a warm-up's loss reads responses, as in RL."""
    return [[0] * n + [1] * (len(seq) - n) for seq, n in zip(sequences, prompt_lengths)]


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


def warm_up(draft, target, sequences, masks, steps, batch_size, lr, ttt_steps, seed, log=print):
    """Offline training-time-test steps on the target's own sequences (aux states recomputed, detached), the
    loss on the tokens `masks` marks."""
    embed = target.model.embed_tokens.weight.detach()

    def loss_of(tokens, mask, aux):
        return training_time_test_loss(draft, F.embedding(tokens, embed), aux, tokens, mask, ttt_steps)

    warm_up_draft(draft, target, sequences, steps, batch_size, lr, seed, loss_of, "drafting step", log,
                  masks=masks)


def check_draft_vocab_size(args, vocab_size):
    """--draft-vocab-size names from 1 to all of the target's `vocab_size` tokens."""
    n = args.draft_vocab_size
    require(n is None or 1 <= n <= vocab_size, f"--draft-vocab-size {n}: the draft predicts from 1 to the target's "
            f"{vocab_size} tokens ({args.target})")


@exit_on_user_error
def main(argv=None):
    args = parse_args(argv)
    check_out(args)
    require(args.warmup_steps >= 0, f"--warmup-steps must be >= 0 (got {args.warmup_steps})")
    require(args.ttt_steps >= 1, f"--ttt-steps must be >= 1 (got {args.ttt_steps})")
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    target_cfg, target_state, _ = load_hf_checkpoint(args.target, "--target")
    check_draft_vocab_size(args, target_cfg.vocab_size)
    draft = init_draft(target_cfg, target_state, args.seed, args.intermediate_size, args.aux_layer_ids,
                       draft_vocab_size=args.draft_vocab_size)
    EAGLE3.check_fits(args.out, draft.cfg, target_cfg, tensors={n: t.shape for n, t in draft.state_dict().items()})
    if args.warmup_steps or draft.cfg.reduced_vocab:  # a reduced vocabulary is the samples' most frequent tokens
        sequences, prompt_lengths, target = target_samples(args.target, args.warmup_samples, args.max_new_tokens,
                                                           args.seed, args)
        masks = response_masks(sequences, prompt_lengths)
        if draft.cfg.reduced_vocab:
            predicted = predicted_tokens(sequences, masks)
            use_vocabulary(draft, target_head(target_cfg, target_state),
                           frequent_vocabulary(predicted, draft.cfg.head_size, target_cfg.vocab_size))
            print(f"draft vocabulary: {draft.cfg.head_size} tokens, the most frequent of the "
                  f"{len(predicted.unique())} distinct ones in {len(sequences)} responses")
        if args.warmup_steps:
            warm_up(draft, target, sequences, masks, args.warmup_steps, args.batch_size, args.lr, args.ttt_steps,
                    args.seed)
    EAGLE3.save(args.out, draft.cfg, draft.state_dict())
    vocab = f", {draft.cfg.head_size} of its {target_cfg.vocab_size} tokens" if draft.cfg.reduced_vocab else ""
    print(f"saved {args.out} (aux layers {list(draft.cfg.aux_layer_ids)} of {target_cfg.num_hidden_layers}{vocab})")


if __name__ == "__main__":
    main()
