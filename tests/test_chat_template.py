"""Chat prompts through the checkpoint's own HF tokenizer: the ids the rollout makes for a `messages`
row equal `transformers.AutoTokenizer.apply_chat_template`'s (the reference, loaded independently),
and the embedded engine and vLLM serve those very ids (same greedy tokens from them)."""
import json

import pytest

from rollout.tiny_model import make_random_chat_checkpoint

ROWS = [
    [{"role": "user", "content": "237+682="}],
    [{"role": "system", "content": "Answer in \\boxed{}."}, {"role": "user", "content": "12+5+77="}],
    [{"role": "user", "content": "1+1="}, {"role": "assistant", "content": "\\boxed{2}"},
     {"role": "user", "content": "héllo ✓ 3+4="}],  # bytes outside the corpus: byte-level BPE has no unknown
]


@pytest.fixture(scope="module")
def chat_ckpt(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tiny_chat"))
    make_random_chat_checkpoint(path, seed=3, std=0.3)
    return path


def reference_ids(path, messages):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    out = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out), tok


def test_shipped_tokenizer_is_byte_level_bpe_with_a_chat_template(chat_ckpt):
    with open(f"{chat_ckpt}/tokenizer.json") as f:
        tok = json.load(f)
    assert tok["model"]["type"] == "BPE" and tok["model"]["merges"]
    assert "ByteLevel" in json.dumps(tok["pre_tokenizer"])
    with open(f"{chat_ckpt}/tokenizer_config.json") as f:
        assert "chat_template" in json.load(f)


@pytest.mark.parametrize("messages", ROWS)
def test_rollout_prompt_ids_equal_autotokenizer_apply_chat_template(chat_ckpt, messages):
    from rollout.ray_workers import RolloutManagerImpl
    from rollout.tokenizer import TextCodec
    from vime.config import RolloutSection

    want, tok = reference_ids(chat_ckpt, messages)
    manager = RolloutManagerImpl.__new__(RolloutManagerImpl)  # only its sample making, no actors
    manager.cfg = RolloutSection(apply_chat_template=True, n_samples_per_prompt=2)
    manager.codec, manager.bos = TextCodec(chat_ckpt), None
    samples = manager._samples([(messages, "7")], version=0)
    assert [s.prompt_ids for s in samples] == [want, want]
    # the rendered text decodes back from the ids byte for byte (byte-level BPE loses nothing)
    assert tok.decode(want) == samples[0].prompt
    assert samples[0].prompt.endswith("<|im_start|>assistant\n")


def test_chat_rows_are_read_with_the_flag_and_refused_without(chat_ckpt, tmp_path):
    from rollout.data import read_prompt_file
    from vime.errors import UserError

    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"messages": m, "label": "1"}) + "\n" for m in ROWS))
    rows = read_prompt_file(str(path), "messages", "label", apply_chat_template=True)
    assert [r[0] for r in rows] == ROWS
    with pytest.raises(UserError, match="--apply-chat-template"):
        read_prompt_file(str(path), "messages", "label")


@pytest.mark.slow
def test_embedded_engine_and_vllm_serve_the_template_ids_alike(chat_ckpt):
    """Both backends from the same rendered ids: greedy tokens equal, so both read the same prompt."""
    pytest.importorskip("vllm")
    from rollout.embedded.engine_builder import build_engine
    from rollout.sampling_params import SamplingParams
    from rollout.vllm.backend import VLLMBackend
    from vime.sample import samples_for_prompts

    prompts = [reference_ids(chat_ckpt, m)[0] for m in ROWS]
    engine = build_engine(chat_ckpt, {"method": "mtp", "num_speculative_tokens": 2})
    ours = samples_for_prompts(prompts)
    engine.generate(ours, SamplingParams(temperature=0, max_new_tokens=12))
    backend = VLLMBackend(chat_ckpt, {"method": "mtp", "num_speculative_tokens": 2}, max_batch_size=8)
    try:
        theirs = samples_for_prompts(prompts)
        backend.generate(theirs, SamplingParams(temperature=0, max_new_tokens=12))
    finally:
        backend.close()
    assert [s.response_ids for s in theirs] == [s.response_ids for s in ours]
    assert [s.response for s in theirs] == [s.response for s in ours]
