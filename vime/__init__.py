"""Shared records and helpers used by both the rollout and the trainer side."""
