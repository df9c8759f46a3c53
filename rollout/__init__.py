"""Rollout side: the embedded inference engine, proposers, rewards and Ray rollout workers."""
