"""Held-out evaluation: `--eval-prompt-data FILE` is sampled `--n-samples-per-eval-prompt` times per
prompt at `--eval-temperature` with the rollout's current weights, at step 0 and every
`--eval-interval` steps, and summarised as eval/* metrics (mean reward, pass@k, response length,
speculative acceptance on the eval prompts)."""
import math

from rollout.spec_stats import spec_rates


def pass_at_k(n, c, k):
    """The unbiased pass@k of one prompt with c correct among n samples (Chen et al., 2021):
    1 - C(n - c, k) / C(n, k)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def is_eval_step(step, interval):
    """Step 0 and every `interval` steps after it."""
    return step % interval == 0


def eval_metrics(samples, k, counters):
    """eval/reward, eval/pass@k (a reward of 1 is a pass), eval/response_len and eval/spec_* rates."""
    by_prompt = {}
    for s in samples:
        by_prompt.setdefault(s.index, []).append(s.reward)
    passes = [pass_at_k(len(r), sum(x >= 1.0 for x in r), k) for r in by_prompt.values()]
    out = {f"eval/{key}": v for key, v in spec_rates(counters).items()}
    out.update({
        "eval/reward": sum(s.reward for s in samples) / len(samples),
        f"eval/pass@{k}": sum(passes) / len(passes),
        "eval/response_len": sum(len(s.response_ids) for s in samples) / len(samples),
        "eval/num_samples": len(samples),
    })
    return out
