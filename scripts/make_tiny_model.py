#!/usr/bin/env python
"""Make vime's tiny model with MTP: tokenizer, pretraining on the synthetic task, HF directory.

    python scripts/make_tiny_model.py --out DIR [--steps 3000] [--family mimo|qwen3|glm4_moe|deepseek_v3]
        [--task-variant longtail --init-from checkpoints/tiny-mimo-mtp]
        [--chat --warm-start-from checkpoints/tiny-mimo-mtp]

The default, MiMo, is what vLLM serves with MTP speculation; the repository ships its
result in checkpoints/tiny-mimo-mtp (this command reproduces it). `--family glm4_moe` and
`--family deepseek_v3` make the mixture-of-experts models (checkpoints/tiny-glm4-moe-mtp,
checkpoints/tiny-deepseek-v3-mtp; their PROVENANCE.json has the command). `--task-variant longtail`
pretrains on the long-tail problems instead (answers of ~10-100 tokens); `--init-from` continues
from a checkpoint instead of a random init. checkpoints/tiny-mimo-longtail continues the shipped
model, which already knows the digits and both formats (its PROVENANCE.json has the command).

`--config-overrides '{"hidden_size": 768, ...}'` changes the family's tiny shape (a larger model on a GPU:
scripts/bench/gpu_recipe.py), `--device cuda --bf16` pretrains there in bf16 autocast, and `--seconds S`
pretrains for a time budget instead of --steps (the cosine runs over the budget).

`--chat` makes the chat model (checkpoints/tiny-mimo-chat): a byte-level BPE trained with
`tokenizers` on the task's conversations, a ChatML chat template in tokenizer_config.json, prompts
as chat messages and answers ending in \\boxed{<sum>}; `--warm-start-from` copies the character
model's weights (the shared symbols' embeddings included) before pretraining in the chat format.

Also writes the task's prompt files next to the model: train.jsonl and eval.jsonl.
"""
import argparse
import dataclasses
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from vime.models.families import DEFAULT_FAMILY, ENGINE_MTP_FAMILIES  # noqa: E402
from vime.models.hf_format import load_hf_checkpoint, save_hf_checkpoint  # noqa: E402
from rollout.task import DEFAULT_TASK_VARIANT, TASK_VARIANTS, write_jsonl  # noqa: E402
from rollout.tiny_model import TINY_CONFIG, init_model, pretrain, tiny_config  # noqa: E402
from rollout.tokenizer import build_tokenizer, save_tokenizer  # noqa: E402
from vime.errors import UserError, exit_on_user_error, require  # noqa: E402
from vime.paths import require_not_an_input  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--trace-fraction", type=float, default=0.2,
                   help="share of pretraining sequences in the step-by-step format")
    p.add_argument("--direct-error-rate", type=float, default=0.6,
                   help="share of direct-format corpus answers with a one-digit slip")
    p.add_argument("--family", default=DEFAULT_FAMILY, choices=sorted(ENGINE_MTP_FAMILIES),
                   help="model family (trunk flavour and MTP layout)")
    p.add_argument("--task-variant", default=DEFAULT_TASK_VARIANT, choices=sorted(TASK_VARIANTS),
                   help="problems of the pretraining corpus and the prompt files (rollout/task.py)")
    p.add_argument("--init-from", default=None,
                   help="an HF checkpoint of the same shape to continue from (default: random init)")
    p.add_argument("--chat", action="store_true",
                   help="byte-level BPE + chat template + chat-message prompts with \\boxed{} answers")
    p.add_argument("--bpe-vocab-size", type=int, default=384)
    p.add_argument("--warm-start-from", default=None,
                   help="--chat: a character-vocabulary checkpoint whose weights start the chat model")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) // 2))
    p.add_argument("--num-train-prompts", type=int, default=4096)
    p.add_argument("--num-eval-prompts", type=int, default=256)
    p.add_argument("--config-overrides", default=None,
                   help="JSON of ModelConfig fields that change the family's tiny shape (e.g. hidden_size)")
    p.add_argument("--device", default="cpu", help="where to pretrain (cpu, cuda)")
    p.add_argument("--bf16", action="store_true", help="pretrain in bf16 autocast (fp32 weights), e.g. on a GPU")
    p.add_argument("--seconds", type=float, default=None,
                   help="pretrain for this many seconds (the cosine over them), --steps being the bound")
    return p.parse_args(argv)


def model_config(args):
    """The family's tiny config with --config-overrides applied (one line for an unknown field)."""
    import json

    cfg = tiny_config(args.family)
    if not args.config_overrides:
        return cfg
    try:
        overrides = json.loads(args.config_overrides)
    except json.JSONDecodeError as e:
        raise UserError(f"--config-overrides {args.config_overrides!r}: not JSON ({e.msg})") from None
    known = {f.name for f in dataclasses.fields(cfg)}
    require(isinstance(overrides, dict) and set(overrides) <= known,
            f"--config-overrides: give a JSON object of ModelConfig fields ({', '.join(sorted(known))})")
    return dataclasses.replace(cfg, **overrides)


def load_same_shape(model, cfg, path):
    """Load `path`'s weights into `model`; its config must match `cfg` (family and shape)."""
    init_cfg, state, _ = load_hf_checkpoint(path)
    require(init_cfg == cfg, f"--init-from {path}: its config differs from the tiny {cfg.family} model's; "
            f"pass a checkpoint made by this script with the same --family")
    model.load_state_dict(state)


@exit_on_user_error
def main(argv=None):
    args = parse_args(argv)
    require_not_an_input(args.out, "--out", [(args.init_from, "--init-from"), (args.warm_start_from, "--warm-start-from")])
    require(args.steps >= 0, f"--steps must be >= 0 (got {args.steps})")
    torch.set_num_threads(args.threads)
    if args.chat:
        require(not (args.config_overrides or args.seconds or args.bf16 or args.device != "cpu"),
                "--chat makes the shipped chat model's shape on CPU: drop --config-overrides, --device, --bf16 "
                "and --seconds")
        return make_chat_model(args)
    cfg = model_config(args)
    model = init_model(cfg, args.seed)
    if args.init_from is not None:
        load_same_shape(model, cfg, args.init_from)
    print(f"tiny model: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters")
    model.to(args.device)
    losses = pretrain(model, args.steps, args.batch_size, args.lr, args.trace_fraction, args.seed,
                      direct_error_rate=args.direct_error_rate, variant=args.task_variant, device=args.device,
                      autocast_dtype=torch.bfloat16 if args.bf16 else None, seconds=args.seconds)
    save_tokenizer(build_tokenizer(), args.out)
    save_hf_checkpoint(args.out, cfg, {k: v.detach().cpu() for k, v in model.state_dict().items()})
    prompts = TASK_VARIANTS[args.task_variant].prompts
    write_jsonl(prompts(args.num_train_prompts, seed=args.seed + 1), os.path.join(args.out, "train.jsonl"))
    write_jsonl(prompts(args.num_eval_prompts, seed=args.seed + 2), os.path.join(args.out, "eval.jsonl"))
    print(f"saved {args.out}")
    return losses


def make_chat_model(args):
    """--chat: BPE tokenizer with a chat template, (warm-started) pretraining in the chat format."""
    from rollout.task import chat_prompt_rows
    from rollout.tiny_model import chat_corpus, transplant_embeddings
    from rollout.tokenizer import (CHAT_IM_END, CHAT_PAD, TextCodec, build_bpe_tokenizer,
                                   save_chat_tokenizer)

    save_chat_tokenizer(build_bpe_tokenizer(chat_corpus(20000, args.seed, args.task_variant),
                                            args.bpe_vocab_size), args.out)
    codec = TextCodec(args.out)
    cfg = dataclasses.replace(TINY_CONFIG, family=args.family, vocab_size=codec.vocab_size, bos_token_id=None,
                              eos_token_id=CHAT_IM_END, pad_token_id=CHAT_PAD)
    model = init_model(cfg, args.seed)
    if args.init_from is not None:  # continue a chat model's pretraining (the BPE above is rebuilt identically)
        load_same_shape(model, cfg, args.init_from)
    elif args.warm_start_from is not None:
        _, char_state, _ = load_hf_checkpoint(args.warm_start_from, "--warm-start-from")
        transplant_embeddings(model, char_state, codec)
    print(f"tiny chat model: vocabulary {cfg.vocab_size}, "
          f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters")
    pretrain(model, args.steps, args.batch_size, args.lr, args.trace_fraction, args.seed,
             direct_error_rate=args.direct_error_rate, variant=args.task_variant, codec=codec, fmt_name="chat")
    save_hf_checkpoint(args.out, cfg, model.state_dict())
    variant = TASK_VARIANTS[args.task_variant]
    write_jsonl(chat_prompt_rows(variant.draw_problem, args.num_train_prompts, args.seed + 1),
                os.path.join(args.out, "train.jsonl"))
    write_jsonl(chat_prompt_rows(variant.draw_problem, args.num_eval_prompts, args.seed + 2),
                os.path.join(args.out, "eval.jsonl"))
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
