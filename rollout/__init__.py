"""The rollout side. `embedded/` (vime's engine) and `vllm/` (the vLLM backend) sit side by side
behind `backend.py`'s protocol; the modules here are what both engines and the RL rollout share
(speculative config, statistics, sampling parameters, task, tokenizer) and the RL rollout itself
(prompt data, rewards, advantages, Ray rollout workers)."""
