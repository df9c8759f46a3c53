"""Plain vLLM serving an external draft, for the tests that hold it against references: the task
prompts they share, the served `vllm.LLM`, one greedy request with vLLM's own speculative counters,
and transformers' greedy tokens."""
import os


from llama_fixtures import hf_greedy  # noqa: F401 (the tests of both read it here)
from rollout.task import EOS, make_prompts
from rollout.tokenizer import TextCodec


def task_prompts(checkpoint):
    """Sixteen task prompts, four of them with two-digit operands (shorter contexts)."""
    codec = TextCodec(checkpoint)
    return [codec.encode_prompt(r["prompt"], 1) for r in make_prompts(12, seed=5) + make_prompts(4, seed=6, digits=2)]


def serve(target, speculative_config):
    """`vllm.LLM` on the target with the draft, fp32, eager, its spec metrics on (shut it down after)."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    # collective_rpc ships a test's functions into the worker by pickle, as the vLLM backend does
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    from vllm import LLM

    return LLM(model=target, speculative_config=speculative_config, skip_tokenizer_init=True, dtype="float32",
               enforce_eager=True, max_model_len=256, seed=0, disable_log_stats=False)


def spec_counters(llm, k):
    """(drafting steps, accepted drafts per position) vLLM has counted so far."""
    drafts, accepted = 0, [0] * k
    for m in llm.get_metrics():
        if m.name == "vllm:spec_decode_num_drafts":
            drafts = int(m.value)
        if m.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            accepted = [int(v) for v in m.values] + [0] * (k - len(m.values))
    return drafts, accepted


def vllm_greedy(llm, prompt, max_new, k):
    """(tokens, drafting steps, accepted drafts per position) of one greedy request (stop at EOS)."""
    from vllm import SamplingParams as VSampling

    drafts_before, before = spec_counters(llm, k)
    out = llm.generate([{"prompt_token_ids": list(prompt)}],
                       VSampling(temperature=0, max_tokens=max_new, stop_token_ids=[EOS], detokenize=False),
                       use_tqdm=False)
    drafts_after, after = spec_counters(llm, k)
    return list(out[0].outputs[0].token_ids), drafts_after - drafts_before, [a - b for a, b in zip(after, before)]


def sample_first_tokens(backend, checkpoint, n, prompt="37+58="):
    """(prompt ids, n samples of 4 tokens after `prompt` at temperature 1, drafts made) from a rollout backend."""
    from rollout.sampling_params import SamplingParams
    from vime.sample import samples_for_prompts

    ids = TextCodec(checkpoint).encode_prompt(prompt, 1)
    samples = samples_for_prompts([ids], n=n)
    backend.generate(samples, SamplingParams(temperature=1.0, max_new_tokens=4))
    return ids, samples, backend.stats()["spec"]["draft_tokens"]


def first_two_p_value(checkpoint, sampled, temperature):
    """Chi-square p-value of the sampled joint of the first two tokens (`sample_first_tokens`) against the
    exact joint of the policy at `temperature` (transformers)."""
    from spec_fixtures import chi_square_p_value, first_two_counts, hf_first_two_joint

    prompt, samples, _ = sampled
    return chi_square_p_value(first_two_counts(samples), hf_first_two_joint(checkpoint, prompt, temperature),
                              len(samples))
