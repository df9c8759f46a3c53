"""The embedded engine against transformers and against its own naive (full-forward) path."""
import pytest
import torch

from vime.models.hf_format import load_hf_checkpoint
from mtp.sampling import token_logprobs
from rollout.embedded.engine import Engine, EngineConfig
from vime.sample import samples_for_prompts
from rollout.embedded.kv_cache import KVCache
from rollout.embedded.model import CausalLMWithMTP
from rollout.sampling_params import SamplingParams
from fp32_bounds import close, reduction_rtol


def load_model(path):
    cfg, state, _ = load_hf_checkpoint(path)
    model = CausalLMWithMTP(cfg)
    model.load_state_dict(state)
    return model.eval()


@pytest.fixture(scope="module")
def hf_model(small_ckpt):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(small_ckpt, dtype=torch.float32).eval()


def greedy(engine, prompts, n_new=24, **kw):
    return engine.generate(samples_for_prompts(prompts), SamplingParams(temperature=0, max_new_tokens=n_new, **kw))


def test_engine_logits_equal_transformers_logits(small_ckpt, hf_model, task_prompt_ids):
    model = load_model(small_ckpt)
    tokens = torch.tensor([task_prompt_ids[0] * 3])
    positions = torch.arange(tokens.shape[1])[None]
    with torch.no_grad():
        ours = model.logits(model(tokens, positions))
        theirs = hf_model(tokens).logits
    assert (ours - theirs).abs().max().item() <= 1e-5


def test_greedy_engine_output_equals_transformers_generate(small_ckpt, hf_model, task_prompt_ids):
    engine = Engine.from_checkpoint(small_ckpt, EngineConfig(max_batch_size=8))
    samples = greedy(engine, task_prompt_ids, n_new=20)
    varied = set()
    for s in samples:
        out = hf_model.generate(torch.tensor([s.prompt_ids]), max_new_tokens=20, do_sample=False,
                                eos_token_id=2, pad_token_id=0)
        expected = out[0, len(s.prompt_ids):].tolist()
        assert s.response_ids == expected
        varied.update(expected)
    assert len(varied) > 3  # the comparison is not between two constant outputs


def test_kv_cached_decoding_equals_full_sequence_forward(small_ckpt, task_prompt_ids):
    engine = Engine.from_checkpoint(small_ckpt, EngineConfig(max_batch_size=4))
    samples = engine.generate(samples_for_prompts(task_prompt_ids[:6]),
                              SamplingParams(temperature=0.8, max_new_tokens=20, seed=1))
    model = load_model(small_ckpt)
    for s in samples:
        tokens = torch.tensor([s.tokens])
        with torch.no_grad():
            logits = model.logits(model(tokens, torch.arange(tokens.shape[1])[None]))
        full = token_logprobs(logits[:, len(s.prompt_ids) - 1:-1], tokens[:, len(s.prompt_ids):], 0.8)[0]
        assert torch.allclose(full, torch.tensor(s.rollout_logprobs), atol=1e-5)


def full_forward_logprobs(model, sample, temperature):
    """The sample's response log-probs from one uncached forward over prompt + response."""
    tokens = torch.tensor([sample.tokens])
    with torch.no_grad():
        logits = model.logits(model(tokens, torch.arange(tokens.shape[1])[None]))
    return token_logprobs(logits[:, len(sample.prompt_ids) - 1:-1], tokens[:, len(sample.prompt_ids):], temperature)[0]


@pytest.mark.parametrize("max_batch_size", [32, 3])  # whole groups per admission / groups split across admissions
def test_a_prompt_shared_by_a_group_is_computed_once_and_every_sample_decodes_from_it(
        small_ckpt, task_prompt_ids, max_batch_size):
    engine = Engine.from_checkpoint(small_ckpt, EngineConfig(max_batch_size=max_batch_size))
    calls = []  # the prompts each prefill computed
    prompt_forward = engine._prompt_forward
    engine._prompt_forward = lambda reqs: calls.append([tuple(r.sample.prompt_ids) for r in reqs]) or prompt_forward(reqs)
    prompts = task_prompt_ids[:4]
    samples = engine.generate(samples_for_prompts(prompts, n=4), SamplingParams(temperature=1.0, max_new_tokens=16,
                                                                                seed=3))
    model, cfg = load_model(small_ckpt), engine.cfg
    assert all(len(set(call)) == len(call) for call in calls)  # no prompt computed twice in one prefill
    assert sum(map(len, calls)) < len(samples)
    if max_batch_size >= len(samples):
        assert sorted(calls[0]) == sorted(map(tuple, prompts))
    assert len({tuple(s.response_ids) for s in samples}) > len(prompts)  # members sample their own tokens
    rtol = reduction_rtol(max(cfg.intermediate_size, cfg.hidden_size, len(samples[0].tokens)), 2 * cfg.num_hidden_layers + 2)
    for s in samples:
        reference = full_forward_logprobs(model, s, 1.0)
        assert all(close(a, b, rtol) for a, b in zip(s.rollout_logprobs, reference.tolist()))


def test_mtp_layer_cached_forward_equals_full_sequence_forward(small_ckpt, task_prompt_ids):
    model = load_model(small_ckpt)
    tokens = torch.tensor([task_prompt_ids[0] + task_prompt_ids[1]])
    s = tokens.shape[1]
    positions = torch.arange(s)[None]
    with torch.no_grad():
        hidden = model(tokens, positions)
        full = model.mtp_forward(0, tokens[:, 1:], hidden[:, :-1], positions[:, :-1])
        cache = KVCache(1, 2, 64, model.cfg.num_key_value_heads, model.cfg.head_dim)
        pieces, start = [], 0
        for width in (5, 1, 1, 3, s - 1 - 10):  # ragged chunks, as prefill then decode/verify
            view = cache.step(torch.tensor([1]), torch.tensor([start]), torch.tensor([width]))
            pos = positions[:, start:start + width]
            pieces.append(model.mtp_forward(0, tokens[:, start + 1:start + 1 + width],
                                            hidden[:, start:start + width], pos, view.layers(1)[0]))
            start += width
    assert (torch.cat(pieces, 1) - full).abs().max().item() <= 1e-5


def test_greedy_output_does_not_depend_on_batch_companions(small_ckpt, task_prompt_ids):
    engine = Engine.from_checkpoint(small_ckpt, EngineConfig(max_batch_size=16))
    alone = [greedy(engine, [p])[0].response_ids for p in task_prompt_ids[:5]]
    together = [s.response_ids for s in greedy(engine, task_prompt_ids)][:5]
    reordered = [s.response_ids for s in greedy(engine, task_prompt_ids[::-1])][::-1][:5]
    assert alone == together == reordered


def test_continuous_batching_with_few_slots_equals_one_big_batch(small_ckpt, task_prompt_ids):
    small = Engine.from_checkpoint(small_ckpt, EngineConfig(max_batch_size=3))
    big = Engine.from_checkpoint(small_ckpt, EngineConfig(max_batch_size=32))
    kw = dict(temperature=1.0, max_new_tokens=16, seed=4)
    a = small.generate(samples_for_prompts(task_prompt_ids, n=2), SamplingParams(**kw))
    b = big.generate(samples_for_prompts(task_prompt_ids, n=2), SamplingParams(**kw))
    assert [s.response_ids for s in a] == [s.response_ids for s in b]
    assert all(len(s.response_ids) > 0 for s in a)


def test_seeded_sampling_is_reproducible_and_seed_dependent(small_ckpt, task_prompt_ids):
    engine = Engine.from_checkpoint(small_ckpt)

    def run(seed):
        return [s.response_ids for s in engine.generate(samples_for_prompts(task_prompt_ids[:8], n=2),
                                                        SamplingParams(temperature=1.0, max_new_tokens=12, seed=seed))]
    first = run(7)
    assert first == run(7)
    assert first != run(8)
    assert first[0] != first[1]  # the n samples of one prompt are distinct draws


def test_eos_and_stop_tokens_end_generation_and_max_new_tokens_is_honoured(small_ckpt, task_prompt_ids):
    engine = Engine.from_checkpoint(small_ckpt)
    free = greedy(engine, task_prompt_ids[:6], n_new=30)
    assert all(len(s.response_ids) <= 30 for s in free)
    assert all(s.finish_reason == ("stop" if s.response_ids[-1] == 2 else "length") for s in free)
    i = max(range(len(free)), key=lambda j: len(free[j].response_ids))  # random weights: some stop early
    target = free[i].response_ids[3]
    stopped = greedy(engine, [task_prompt_ids[i]], n_new=30, stop_token_ids=(target,))[0]
    assert stopped.response_ids == free[i].response_ids[:free[i].response_ids.index(target) + 1]
    assert stopped.finish_reason == "stop"
    short = greedy(engine, task_prompt_ids[:3], n_new=4)
    assert all(len(s.response_ids) <= 4 for s in short)
    assert all(s.finish_reason == "length" for s in short if 2 not in s.response_ids)


def test_eos_token_stops_a_request(small_ckpt, task_prompt_ids):
    engine = Engine.from_checkpoint(small_ckpt)
    outs = greedy(engine, task_prompt_ids[:6], n_new=30)
    i = max(range(len(outs)), key=lambda j: len(outs[j].response_ids))  # random weights: some stop early
    first = outs[i].response_ids
    engine.stop_ids = {first[2]}  # pretend the model's EOS is the token it emits third
    out = greedy(engine, [task_prompt_ids[i]], n_new=30)[0]
    assert out.response_ids == first[:first.index(first[2]) + 1] and out.finish_reason == "stop"


def test_ignore_eos_generates_the_whole_budget_through_the_models_eos(small_ckpt, task_prompt_ids):
    """vLLM's ignore_eos: the model's EOS no longer ends a request (a request's own stop ids still
    do), and the tokens up to where EOS stood are unchanged."""
    from rollout.sampling_params import SamplingParams
    from vime.sample import samples_for_prompts

    engine = Engine.from_checkpoint(small_ckpt)
    outs = greedy(engine, task_prompt_ids[:6], n_new=30)
    i = max(range(len(outs)), key=lambda j: len(outs[j].response_ids))
    first = outs[i].response_ids
    engine.stop_ids = {first[2]}  # the model's EOS is the token it emits third
    cut = greedy(engine, [task_prompt_ids[i]], n_new=30)[0]
    assert cut.finish_reason == "stop" and len(cut.response_ids) < 30
    whole = samples_for_prompts([task_prompt_ids[i]])
    engine.generate(whole, SamplingParams(temperature=0, max_new_tokens=30, ignore_eos=True))
    assert len(whole[0].response_ids) == 30 and whole[0].finish_reason == "length"
    assert whole[0].response_ids[:len(first)] == first  # the real EOS (if any) did not end it either
    own_stop = samples_for_prompts([task_prompt_ids[i]])
    engine.generate(own_stop, SamplingParams(temperature=0, max_new_tokens=30, ignore_eos=True,
                                             stop_token_ids=(first[2],)))
    assert own_stop[0].response_ids == cut.response_ids


def test_generation_stops_at_the_context_length(small_ckpt, task_prompt_ids):
    engine = Engine.from_checkpoint(small_ckpt, EngineConfig(max_len=20))
    s = greedy(engine, [task_prompt_ids[0]], n_new=100)[0]
    assert len(s.tokens) <= 20
    assert s.finish_reason in ("length", "stop")


def test_load_weights_changes_outputs_and_records_the_version(small_ckpt, task_prompt_ids):
    engine = Engine.from_checkpoint(small_ckpt)
    before = [s.response_ids for s in greedy(engine, task_prompt_ids[:4])]
    new = {n: p * 1.5 for n, p in engine.model.named_parameters()}
    engine.load_weights(new.items(), version=3)
    after = greedy(engine, task_prompt_ids[:4])
    assert engine.weight_version == 3 and after[0].weight_version == 3
    assert [s.response_ids for s in after] != before
    assert all(torch.equal(p, new[n]) for n, p in engine.model.named_parameters())


def test_top_k_one_equals_greedy(small_ckpt, task_prompt_ids):
    engine = Engine.from_checkpoint(small_ckpt)
    g = [s.response_ids for s in greedy(engine, task_prompt_ids[:6])]
    k1 = engine.generate(samples_for_prompts(task_prompt_ids[:6]),
                         SamplingParams(temperature=1.0, top_k=1, max_new_tokens=24, seed=3))
    assert [s.response_ids for s in k1] == g
    assert all(abs(lp) < 1e-6 for s in k1 for lp in s.rollout_logprobs)  # point mass after top-k


def test_paused_engine_refuses_to_generate(small_ckpt, task_prompt_ids):
    from vime.errors import UserError

    engine = Engine.from_checkpoint(small_ckpt)
    engine.pause()
    with pytest.raises(UserError, match="paused"):
        greedy(engine, task_prompt_ids[:1])
    engine.resume()
    assert greedy(engine, task_prompt_ids[:1])[0].response_ids



def test_autotokenizer_loads_the_checkpoint_tokenizer_and_agrees_with_the_engine(small_ckpt):
    from transformers import AutoTokenizer

    from rollout.tokenizer import TextCodec

    hf_tok = AutoTokenizer.from_pretrained(small_ckpt)
    codec = TextCodec(small_ckpt)
    text = "347+285=7+5=12;#632"
    assert hf_tok(text, add_special_tokens=False)["input_ids"] == codec.encode(text)
    assert hf_tok.decode(codec.encode(text)) == codec.decode(codec.encode(text)) == text
    assert hf_tok.eos_token_id == 2


def test_fast_path_logits_equal_transformers_logits(small_ckpt, hf_model, task_prompt_ids):
    engine = Engine.from_checkpoint(small_ckpt, EngineConfig(max_batch_size=2))
    tokens = torch.tensor([task_prompt_ids[0] * 3, task_prompt_ids[1] * 3])[:, :20]
    n = tokens.shape[1]
    view = engine.cache.step(torch.tensor([0, 1]), torch.zeros(2, dtype=torch.long), torch.tensor([n, n]))
    with torch.no_grad():
        ours = engine.model.logits(engine.fast(tokens, torch.arange(n).expand(2, n), view.layers(engine.cfg.num_hidden_layers)))
        theirs = hf_model(tokens).logits
    assert (ours - theirs).abs().max().item() <= 1e-5
