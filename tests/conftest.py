"""Shared fixtures: tiny random-weight checkpoints built in seconds, never downloaded."""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from vime.models.families import MTP_FAMILIES  # noqa: E402
from rollout.tiny_model import make_random_checkpoint  # noqa: E402

SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16)


def pytest_configure(config):
    torch.set_num_threads(2)


@pytest.fixture(scope="session", params=sorted(MTP_FAMILIES))
def small_ckpt(request, tmp_path_factory):
    """A small random checkpoint of each model family (1 MTP layer) with peaked, varied outputs."""
    path = str(tmp_path_factory.mktemp(f"small_ckpt_{request.param}"))
    make_random_checkpoint(path, seed=3, std=0.3, family=request.param, **SMALL)
    return path


@pytest.fixture(scope="session")
def task_prompt_ids(small_ckpt):
    """Token ids of 40 prompts of the tiny task (BOS + text), of different lengths."""
    from rollout.task import make_prompts
    from rollout.tokenizer import TextCodec

    codec = TextCodec(small_ckpt)
    rows = make_prompts(36, seed=5) + make_prompts(4, seed=6, digits=2)
    return [codec.encode_prompt(r["prompt"], 1) for r in rows]
