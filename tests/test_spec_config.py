"""--vllm-speculative-config parsing: vLLM defaults, aliases, and a one-line error for every
bad input (naming the flag and what to do)."""
import dataclasses
import json

import pytest

from rollout.embedded.engine import EngineConfig
from rollout.embedded.engine_builder import build_proposer, engine_config_for
from vime.spec_config import (SpecConfig, check_against_checkpoint, require_lossless, parse_spec_config,
                              synthetic_position_rates)
from rollout.embedded.spec_policy import dense_schedule
from rollout.tiny_model import TINY_CONFIG
from vime.errors import UserError
from spec_fixtures import markov_model, save_checkpoint, one_thread  # noqa: F401

pytestmark = pytest.mark.usefixtures("one_thread")


def error_of(value):
    with pytest.raises(UserError) as e:
        parse_spec_config(value)
    msg = str(e.value)
    assert "\n" not in msg and "--vllm-speculative-config" in msg
    return msg


def test_defaults_follow_vllm_schema():
    s = parse_spec_config('{"method": "ngram", "num_speculative_tokens": 4}')
    assert (s.prompt_lookup_min, s.prompt_lookup_max) == (5, 5)
    assert (s.suffix_decoding_max_tree_depth, s.suffix_decoding_max_cached_requests) == (24, 10000)
    assert (s.suffix_decoding_max_spec_factor, s.suffix_decoding_min_token_prob) == (1.0, 0.1)
    assert s.rejection_sample_method == "strict" and not s.is_lossy
    assert parse_spec_config(None) is None and parse_spec_config("") is None


def test_lookup_bounds_mirror_each_other_when_one_is_given():
    assert parse_spec_config({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 2}) \
        .prompt_lookup_max == 2
    assert parse_spec_config({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}) \
        .prompt_lookup_min == 3


@pytest.mark.parametrize("alias", ["deepseek_mtp", "mimo_mtp", "glm4_moe_mtp", "mtp"])
def test_mtp_aliases_map_to_mtp(alias):
    assert parse_spec_config({"method": alias, "num_speculative_tokens": 1}).method == "mtp"


def test_synthetic_is_flagged_lossy_and_the_engine_gets_the_rejection_method():
    s = parse_spec_config({"method": "mtp", "num_speculative_tokens": 1, "rejection_sample_method": "synthetic",
                           "synthetic_acceptance_rate": 0.7})
    assert s.is_lossy
    with pytest.raises(UserError, match="benchmark-only"):
        require_lossless(s)
    require_lossless(parse_spec_config({"method": "mtp", "num_speculative_tokens": 1}))
    ec = engine_config_for(s, EngineConfig())
    assert (ec.rejection_sample_method, ec.synthetic_acceptance_rates) == ("synthetic", (0.7,))


def test_synthetic_rates_follow_vllm_unconditional_meaning():
    base = {"method": "mtp", "num_speculative_tokens": 3, "rejection_sample_method": "synthetic"}
    # vLLM: entry i = P(first i+1 drafts accepted); the engine wants P(i accepted | i-1 accepted)
    rates = synthetic_position_rates(parse_spec_config(dict(base, synthetic_acceptance_rates=[0.8, 0.4, 0.1])))
    assert rates == pytest.approx((0.8, 0.5, 0.25))
    # a mean length of 2.5 is one sure draft and a half
    rates = synthetic_position_rates(parse_spec_config(dict(base, synthetic_acceptance_length=2.5)))
    assert rates == pytest.approx((1.0, 0.5, 0.0))
    assert synthetic_position_rates(parse_spec_config(dict(base, synthetic_acceptance_rate=0.6))) == (0.6,) * 3


def test_batch_size_schedule_expands_like_vllm():
    spec = parse_spec_config({"method": "mtp", "num_speculative_tokens": 3,
                              "num_speculative_tokens_per_batch_size": [[32, 64, 1], [1, 16, 5]]})
    assert spec.num_speculative_tokens_per_batch_size == ((1, 16, 5), (32, 64, 1))
    table = dense_schedule(spec.num_speculative_tokens_per_batch_size, 3, 100)
    # capped at num_speculative_tokens; the gap 17..31 carries the previous k; the tail the last
    assert table[1] == table[16] == table[17] == table[31] == 3
    assert table[32] == table[64] == table[65] == table[100] == 1


@pytest.mark.parametrize("value, expected", [
    ('{"method": "mtp", ', "malformed JSON"),
    ('[1, 2]', "must be a JSON object"),
    ('{"method": "mtp", "num_speculative_token": 3}', "did you mean 'num_speculative_tokens'"),
    ('{"method": "mtp", "num_speculative_tokens": "3"}', "num_speculative_tokens must be an integer"),
    ('{"method": "mtp", "num_speculative_tokens": true}', "num_speculative_tokens must be an integer"),
    ('{"method": "mtp", "num_speculative_tokens": 0}', "num_speculative_tokens must be > 0"),
    ('{"method": "mtp"}', "'num_speculative_tokens' is required"),
    ('{"num_speculative_tokens": 2}', "'method' is required"),
    ('{"method": "eagle", "num_speculative_tokens": 2}', "--rollout-backend vllm"),
    ('{"method": "eagle3", "num_speculative_tokens": 2}', "method 'eagle3' needs \"model\""),
    ('{"method": "magic", "num_speculative_tokens": 2}', "unknown method 'magic'"),
    ('{"method": "mtp", "num_speculative_tokens": 2, "parallel_drafting": true}', "--rollout-backend vllm"),
    ('{"method": "mtp", "num_speculative_tokens": 2, "draft_sample_method": "greedy"}', "--rollout-backend vllm"),
    ('{"method": "mtp", "num_speculative_tokens": 2, "tensor_parallel_size": 2}', "use draft_tensor_parallel_size"),
    ('{"method": "mtp", "num_speculative_tokens": 2, "temperature": 0.7}', "is a sampling parameter"),
    ('{"method": "mtp", "num_speculative_tokens": 2, "top_p": 0.9}', "is a sampling parameter"),
    ('{"method": "mtp", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 2}', "must be 1"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0}', "prompt_lookup_min must be >= 1"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}',
     "must be <= prompt_lookup_max"),
    ('{"method": "suffix", "num_speculative_tokens": 2, "suffix_decoding_min_token_prob": 1.5}', "in [0, 1]"),
    ('{"method": "suffix", "num_speculative_tokens": 2, "suffix_decoding_max_tree_depth": 0}', ">= 1"),
    ('{"method": "suffix", "num_speculative_tokens": 2, "suffix_decoding_max_cached_requests": -1}', ">= 0"),
    ('{"method": "suffix", "num_speculative_tokens": 2, "suffix_decoding_max_spec_factor": 0}', "> 0"),
    ('{"method": "mtp", "num_speculative_tokens": 2, "rejection_sample_method": "lossy"}', "must be one of"),
    ('{"method": "mtp", "num_speculative_tokens": 2, "rejection_sample_method": "synthetic"}',
     "needs exactly one of synthetic_acceptance_rate"),
    ('{"method": "mtp", "num_speculative_tokens": 2, "rejection_sample_method": "synthetic", '
     '"synthetic_acceptance_rates": [0.5, 0.7]}', "must be non-increasing"),
    ('{"method": "mtp", "num_speculative_tokens": 2, "rejection_sample_method": "synthetic", '
     '"synthetic_acceptance_rates": [0.5]}', "must be 2 numbers in [0, 1]"),
    ('{"method": "mtp", "num_speculative_tokens": 2, "rejection_sample_method": "synthetic", '
     '"synthetic_acceptance_rates": [0.5, 0.4], "synthetic_acceptance_rate": 0.5}', "needs exactly one of"),
    ('{"method": "mtp", "num_speculative_tokens": 2, "rejection_sample_method": "synthetic", '
     '"synthetic_acceptance_length": 3.5}', "synthetic_acceptance_length must be in [1, 3]"),
    ('{"method": "mtp", "num_speculative_tokens": 2, "synthetic_acceptance_rate": 0.5}',
     "only applies with rejection_sample_method 'synthetic'"),
    ('{"method": "mtp", "num_speculative_tokens": 2, "num_speculative_tokens_per_batch_size": []}', "must not be empty"),
    ('{"method": "mtp", "num_speculative_tokens": 2, "num_speculative_tokens_per_batch_size": [[2, 8, 1]]}',
     "must start at 1"),
    ('{"method": "mtp", "num_speculative_tokens": 2, "num_speculative_tokens_per_batch_size": [[1, 8, 1], [8, 9, 0]]}',
     "ranges overlap at 8"),
    ('{"method": "mtp", "num_speculative_tokens": 2, "num_speculative_tokens_per_batch_size": [[1, 8]]}',
     "each entry must be [range_start, range_end, k]"),
    ('{"method": "mtp", "num_speculative_tokens": 2, "num_speculative_tokens_per_batch_size": [[4, 2, 1]]}',
     "range start must be <= end"),
    ('{"method": "mtp", "num_speculative_tokens": 2, "num_speculative_tokens_per_batch_size": [[1, 2, -1]]}',
     "k must be >= 0"),
    ('{"method": "mtp", "num_speculative_tokens": 2, "num_speculative_tokens_per_batch_size": 3}',
     "must be a list of [range_start, range_end, k] entries"),
    ('{"method": "mtp", "num_speculative_tokens": 2, "rejection_sample_method": "synthetic", '
     '"synthetic_acceptance_rate": 1.2}', "synthetic_acceptance_rate must be in [0, 1]"),
    ('{"method": "draft_model", "num_speculative_tokens": 2}', "needs \"model\""),
    ('{"method": "draft_model", "num_speculative_tokens": 2, "model": 5}', "model must be a string"),
])
def test_bad_config_gives_one_line_actionable_error(value, expected):
    assert expected in error_of(value)


def test_mtp_on_a_checkpoint_without_mtp_layers_is_refused():
    with pytest.raises(UserError, match="needs a checkpoint with MTP layers"):
        check_against_checkpoint(parse_spec_config({"method": "mtp", "num_speculative_tokens": 1}),
                                 dataclasses.replace(TINY_CONFIG, num_nextn_predict_layers=0))


def test_draft_model_with_a_different_vocabulary_is_refused(tmp_path):
    draft = save_checkpoint(markov_model(vocab_size=40), str(tmp_path / "draft"))
    spec = parse_spec_config({"method": "draft_model", "num_speculative_tokens": 2, "model": draft})
    with pytest.raises(UserError, match="vocab_size 40 but the target has 32"):
        check_against_checkpoint(spec, TINY_CONFIG)


def test_every_method_builds_a_proposer_through_the_registry(tmp_path):
    draft = save_checkpoint(markov_model(), str(tmp_path / "d"))
    for method in ["mtp", "ngram", "suffix", "draft_model"]:
        spec = parse_spec_config({"method": method, "num_speculative_tokens": 2, "model": draft})
        assert build_proposer(spec).num_speculative_tokens == 2
    assert build_proposer(None).num_speculative_tokens == 0
    assert isinstance(parse_spec_config(json.dumps({"method": "suffix", "num_speculative_tokens": 3})), SpecConfig)


def test_each_backend_reads_the_config_and_vllm_gets_it_as_written():
    from rollout.backend import BACKEND_CHECKS, BACKENDS
    from vime.spec_config import SPEC_READERS

    assert set(SPEC_READERS) == set(BACKENDS) == set(BACKEND_CHECKS)
    written = {"method": "deepseek_mtp", "num_speculative_tokens": 2, "parallel_drafting": True}
    spec = parse_spec_config(json.dumps(written), backend="vllm")  # a vLLM-only key: vLLM judges it
    assert (spec.method, spec.num_speculative_tokens) == ("mtp", 2) and spec.to_vllm() == written
    with pytest.raises(UserError, match="is vLLM's; the embedded engine does not implement it"):
        parse_spec_config(written)
    embedded = parse_spec_config({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3})
    assert embedded.prompt_lookup_min == 3  # vime's reading; vLLM is handed only what was written
    assert embedded.to_vllm() == {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}
    moved = parse_spec_config({"method": "eagle3", "num_speculative_tokens": 2, "model": "d"}).with_model("/abs/d")
    assert moved.model == "/abs/d" and moved.to_vllm()["model"] == "/abs/d"
    with pytest.raises(UserError, match="--rollout-backend 'sglang': choose one of embedded, vllm"):
        parse_spec_config(None, backend="sglang")


def test_a_draft_method_needs_its_draft_on_every_backend():
    for backend in ("embedded", "vllm"):
        with pytest.raises(UserError, match="method 'eagle3' needs \"model\""):
            parse_spec_config({"method": "eagle3", "num_speculative_tokens": 2}, backend=backend)


def run_cli(args, tmp_path):
    import subprocess
    import sys

    root = __import__("os").path.dirname(__import__("os").path.dirname(__file__))
    return subprocess.run([sys.executable, "-m", "rollout.generate", *args], cwd=root, capture_output=True, text=True)


def test_cli_bad_speculative_config_exits_2_with_one_line_and_no_traceback(tmp_path):
    ckpt = save_checkpoint(markov_model(), str(tmp_path / "m"))
    (tmp_path / "p.jsonl").write_text('{"prompt": "12+34="}\n')
    res = run_cli(["--hf-checkpoint", ckpt, "--prompts", str(tmp_path / "p.jsonl"), "--output",
                   str(tmp_path / "o.jsonl"), "--vllm-speculative-config", '{"method": "mtp", "num_spec": 2}'],
                  tmp_path)
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert res.stderr.strip().count("\n") == 0 and "--vllm-speculative-config" in res.stderr


def test_cli_with_speculation_writes_per_sample_spec_and_prints_the_aggregate(tmp_path):
    ckpt = save_checkpoint(markov_model(), str(tmp_path / "m"))
    (tmp_path / "p.jsonl").write_text('{"prompt": "12+34="}\n{"prompt": "567+89="}\n')
    res = run_cli(["--hf-checkpoint", ckpt, "--prompts", str(tmp_path / "p.jsonl"), "--output",
                   str(tmp_path / "o.jsonl"), "--temperature", "0", "--max-new-tokens", "12",
                   "--vllm-speculative-config", '{"method": "ngram", "num_speculative_tokens": 2, '
                   '"prompt_lookup_min": 1}'], tmp_path)
    assert res.returncode == 0, res.stderr
    assert "spec: accept_rate" in res.stdout
    rows = [json.loads(line) for line in (tmp_path / "o.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(r["spec"]["verify_steps"] >= 1 for r in rows)
    assert sum(r["spec"]["draft_tokens"] for r in rows) > 0


@pytest.mark.parametrize("backend", ["embedded", "vllm"])
@pytest.mark.parametrize("value, expected", [
    ('{"method": "mtp", "num_speculative_tokens": 2, "num_speculative_tokens": 3}',
     "key 'num_speculative_tokens' is given twice (2 and 3); give it once"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 4, "prompt_lookup_max": 5}',
     "key 'prompt_lookup_max' is given twice (4 and 5)"),
    ('{"method": "mtp", "num_speculative_tokens": "2"}', 'num_speculative_tokens must be an integer (got "2")'),
    ('{"method": "mtp", "num_speculative_tokens": 2, "rejection_sample_method": 1}',
     "rejection_sample_method must be a string (got 1)"),
])
def test_a_duplicate_key_or_a_wrong_json_type_is_refused_alike_on_both_backends_as_the_config_loads(
        backend, value, expected):
    from vime.cli_config import load_config

    with pytest.raises(UserError) as e:
        load_config(["--rollout-backend", backend, "--vllm-speculative-config", value])
    assert str(e.value) == f"--vllm-speculative-config: {expected}" or expected in str(e.value)
    assert "\n" not in str(e.value)
    fixed = value.replace('"2"', "2").replace(', "num_speculative_tokens": 3', "").replace(
        ', "prompt_lookup_max": 5', "").replace('"rejection_sample_method": 1', '"rejection_sample_method": "strict"')
    load_config(["--rollout-backend", backend, "--vllm-speculative-config", fixed])  # the control
