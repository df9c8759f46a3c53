"""The vLLM rollout backend: a `vllm.LLM` of the policy, its weights reloaded in place (target and
drafter) every step. `worker` holds the functions that run inside vLLM's worker process."""
