"""`python -m rollout.generate`: batch generation from a JSONL prompt file with the embedded engine.

Input lines hold "prompt" (text; BOS is prepended when the model has one), "prompt_ids", or with
--apply-chat-template "messages" (chat messages rendered by the tokenizer's own template). The engine's
KV cache holds the longest prompt plus --max-new-tokens, not the model's whole context.
Output: one line per sample with prompt_index, sample_index, response_ids, response,
logprobs, finish_reason. Prints a summary with tokens/s.
"""
import argparse
import json
import os
import sys

import torch

from rollout.data import read_jsonl_rows
from rollout.embedded.engine import EngineConfig
from rollout.sampling_params import SamplingParams
from rollout.embedded.engine_builder import build_engine
from rollout.tokenizer import codec_or_none
from vime.models.hf_format import read_config
from vime.spec_config import parse_spec_config
from rollout.spec_stats import aggregate_spec_stats, format_spec_stats
from vime.config import AT_LEAST_0, AT_LEAST_1, SEED, Range, check_flag_ranges
from vime.errors import UserError, exit_on_user_error, require
from vime.sample import Sample


GENERATE_RANGES = {"--max-new-tokens": AT_LEAST_1, "--temperature": AT_LEAST_0, "--top-p": Range(0, 1, low_open=True),
                   "--top-k": AT_LEAST_0, "--n": AT_LEAST_1, "--seed": SEED, "--max-batch-size": AT_LEAST_1}


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m rollout.generate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hf-checkpoint", required=True)
    p.add_argument("--prompts", required=True, help="JSONL with 'prompt' or 'prompt_ids' per line")
    p.add_argument("--output", required=True)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--n", type=int, default=1, help="samples per prompt")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-batch-size", type=int, default=64)
    p.add_argument("--device", default="cpu")
    p.add_argument("--vllm-speculative-config", default=None,
                   help='speculative decoding, vLLM JSON schema, e.g. \'{"method":"mtp","num_speculative_tokens":3}\'')
    p.add_argument("--apply-chat-template", action="store_true",
                   help="prompt lines hold 'messages' (chat messages), rendered with the tokenizer's chat template")
    p.add_argument("--spec-adaptive", action="store_true",
                   help="k in 0..num_speculative_tokens per batch size from a start-up cost profile and measured acceptance")
    args = p.parse_args(argv)
    check_flag_ranges({f"--{k.replace('_', '-')}": v for k, v in vars(args).items()}, GENERATE_RANGES)
    return args


def prompt_ids_of(row, lineno, path, codec, bos_token_id, chat=False):
    if chat:
        from rollout.tokenizer import check_messages

        require("messages" in row, f"--prompts {path}: line {lineno} has no 'messages' (--apply-chat-template)")
        check_messages(row["messages"], f"--prompts {path}: line {lineno}")
        return codec.chat_prompt_ids(row["messages"])
    if "prompt_ids" in row:
        ids = row["prompt_ids"]
        require(isinstance(ids, list) and all(isinstance(t, int) for t in ids),
                f"--prompts {path}: line {lineno}: 'prompt_ids' must be a list of ints")
    else:
        require("prompt" in row, f"--prompts {path}: line {lineno} has neither 'prompt' nor 'prompt_ids'")
        require(isinstance(row["prompt"], str), f"--prompts {path}: line {lineno}: 'prompt' must be a string")
        require(codec is not None, f"--prompts {path}: line {lineno} is text but the checkpoint has no tokenizer.json; "
                "give 'prompt_ids' instead")
        codec.require_known(row["prompt"], f"--prompts {path}: line {lineno}")
        ids = codec.encode_prompt(row["prompt"], bos_token_id) if row["prompt"] else []
    require(len(ids) > 0, f"--prompts {path}: line {lineno}: the prompt is empty")
    return ids


def tokenized_prompts(rows, path, codec, cfg, max_new_tokens, chat=False):
    """[(row, prompt ids)] of the prompt file's rows, each within the model's context (`cfg`, a ModelConfig)
    with --max-new-tokens after it."""
    out, context = [], cfg.max_position_embeddings
    for lineno, row in rows:
        ids = prompt_ids_of(row, lineno, path, codec, cfg.bos_token_id, chat)
        require(len(ids) < context, f"--prompts {path}: line {lineno}: the prompt has {len(ids)} tokens; "
                f"the context is {context}")
        require(len(ids) + max_new_tokens <= context,
                f"--max-new-tokens {max_new_tokens}: with line {lineno}'s {len(ids)}-token prompt that is "
                f"{len(ids) + max_new_tokens} positions, beyond the model's context of {context}; use "
                f"--max-new-tokens {context - len(ids)} or less")
        out.append((row, ids))
    return out


def build_samples(prompts, n):
    return [Sample(prompt_ids=ids, index=index, sample_index=j, prompt=row.get("prompt", ""))
            for index, (row, ids) in enumerate(prompts) for j in range(n)]


def write_outputs(samples, path):
    with open(path, "w") as f:
        for s in samples:
            f.write(json.dumps({"prompt_index": s.index, "sample_index": s.sample_index,
                                "response_ids": s.response_ids, "response": s.response,
                                "logprobs": s.rollout_logprobs, "finish_reason": s.finish_reason,
                                "spec": s.spec.to_dict()}) + "\n")


def check_device(device):
    """--device names a device this torch build has."""
    try:
        kind = torch.device(device).type
    except RuntimeError:
        raise UserError(f"--device {device!r}: not a torch device; use cpu or cuda") from None
    require(kind != "cuda" or torch.cuda.is_available(),
            f"--device {device}: this torch build has no CUDA device "
            f"(torch {torch.__version__}); use --device cpu")


def check_output(path, inputs=()):
    """--output is none of the `inputs` ([(path, flag)]), and its directory exists and is writable,
    checked before any generation work."""
    from vime.paths import require_not_an_input, require_writable_dir

    require_not_an_input(path, "--output", inputs)
    parent = os.path.dirname(os.path.abspath(path))
    require(os.path.isdir(parent), f"--output {path}: the directory {parent} does not exist; create it first")
    require(not os.path.isdir(path), f"--output {path} is a directory; give a file path")
    require_writable_dir(parent, "--output")


def make_sampling(args):
    return SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                          max_new_tokens=args.max_new_tokens, seed=args.seed)


@exit_on_user_error
def main(argv=None):
    args = parse_args(argv)
    check_output(args.output, [(args.prompts, "--prompts"), (args.hf_checkpoint, "--hf-checkpoint")])
    check_device(args.device)
    sampling = make_sampling(args)
    rows = read_jsonl_rows(args.prompts, "--prompts")
    spec = parse_spec_config(args.vllm_speculative_config)
    cfg = read_config(args.hf_checkpoint)
    codec = codec_or_none(args.hf_checkpoint)
    require(not args.apply_chat_template or (codec is not None and codec.has_chat_template),
            f"--apply-chat-template: the tokenizer of {args.hf_checkpoint} has no chat template; drop the flag and "
            "give 'prompt' text, or use a chat model")
    prompts = tokenized_prompts(rows, args.prompts, codec, cfg, args.max_new_tokens, args.apply_chat_template)
    context = max(len(ids) for _, ids in prompts) + args.max_new_tokens
    engine = build_engine(args.hf_checkpoint, spec, EngineConfig(max_batch_size=args.max_batch_size, device=args.device,
                                                                 max_len=context), adaptive=args.spec_adaptive)
    samples = build_samples(prompts, args.n)
    engine.generate(samples, sampling)
    write_outputs(samples, args.output)
    st = engine.stats()
    print(f"generated {len(samples)} samples, {st['generated_tokens']} tokens in {st['seconds']:.2f}s "
          f"({st['tokens_per_s']:.1f} tokens/s) -> {args.output}")
    if spec is not None:
        print(format_spec_stats(aggregate_spec_stats(samples)))
    if "spec_k_mean" in st:
        print(f"adaptive k: mean {st['spec_k_mean']:.2f}, speedup predicted {st['spec_predicted_speedup']:.2f}x "
              f"measured {st['spec_measured_speedup']:.2f}x (vs the profiled plain step)")
    return 0


if __name__ == "__main__":
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    sys.exit(main())
