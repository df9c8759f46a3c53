"""The tiny task's formats and reward, the MTP-layout registry, and the sampling filters."""
import pytest
import torch

from vime.models.families import from_canonical, swap_halves, to_canonical
from mtp.sampling import filter_top_k_top_p, processed_logprobs, sample_with_uniforms
from rollout.task import direct_answer, extract_answer, make_prompts, tiny_add_reward, trace_answer


def test_trace_answer_works_the_sum_digit_by_digit_with_carries():
    assert trace_answer(347, 285) == "7+5=12;4+8+1=13;3+2+1=6;#632"
    assert trace_answer(100, 200) == "0+0=0;0+0=0;1+2=3;#300"
    assert direct_answer(347, 285) == "#632"


def test_reward_checks_only_the_answer_after_the_last_hash():
    assert tiny_add_reward("#632", "632") == 1.0
    assert tiny_add_reward("7+5=12;#632", "632") == 1.0
    assert tiny_add_reward("#631", "632") == 0.0
    assert tiny_add_reward("632", "632") == 0.0  # no '#': no answer
    assert tiny_add_reward("#6#632", "632") == 1.0
    assert extract_answer("no answer") is None


def test_prompt_sets_are_seeded_and_labels_are_correct():
    rows = make_prompts(50, seed=3)
    assert rows == make_prompts(50, seed=3) and rows != make_prompts(50, seed=4)
    for r in rows:
        a, b = r["prompt"].rstrip("=").split("+")
        assert int(r["label"]) == int(a) + int(b)


def test_layout_renames_round_trip_and_swap_the_eh_proj_halves():
    w = torch.arange(12.0).view(2, 6)
    state = {"model.layers.2.eh_proj.weight": torch.arange(8.0).view(2, 4), "model.layers.2.enorm.weight": w[0],
             "model.layers.2.mlp.up_proj.weight": w, "model.layers.1.mlp.up_proj.weight": w}
    mimo = from_canonical(state, "mimo", num_hidden_layers=2, num_mtp_layers=1)
    assert set(mimo) == {"model.mtp_layers.0.input_proj.weight", "model.mtp_layers.0.token_layernorm.weight",
                         "model.mtp_layers.0.mlp.up_proj.weight", "model.layers.1.mlp.up_proj.weight"}
    assert torch.equal(mimo["model.mtp_layers.0.input_proj.weight"], swap_halves(state["model.layers.2.eh_proj.weight"]))
    back = to_canonical(mimo, "mimo", 2, 1)
    assert set(back) == set(state) and all(torch.equal(back[k], state[k]) for k in state)


def test_top_k_and_top_p_keep_the_right_tokens():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    assert torch.isinf(filter_top_k_top_p(logits, 2, 1.0)).tolist() == [[False, False, True, True]]
    assert torch.isinf(filter_top_k_top_p(logits, 0, 0.8)).tolist() == [[False, False, True, True]]
    assert torch.isinf(filter_top_k_top_p(logits, 0, 0.81)).tolist() == [[False, False, False, True]]
    lp = processed_logprobs(logits, 1.0, 2, 1.0)
    assert torch.allclose(lp[0, :2].exp(), torch.tensor([0.625, 0.375]))


def test_inverse_cdf_sampling_follows_the_probabilities():
    probs = torch.tensor([[0.2, 0.0, 0.5, 0.3]]).expand(20000, -1)
    draws = sample_with_uniforms(probs, torch.rand(20000, generator=torch.Generator().manual_seed(0)))
    freq = torch.bincount(draws, minlength=4).float() / 20000
    assert freq[1] == 0 and torch.allclose(freq, probs[0], atol=0.015)


@pytest.mark.parametrize("variant", ["add", "longtail"])
def test_corpus_slips_change_exactly_one_digit_and_only_direct_answers_are_noisy(variant):
    import random

    from rollout.task import BOS, EOS, multi_trace_answer
    from rollout.tiny_model import corpus_example, slip_one_digit
    from rollout.tokenizer import TextCodec, build_tokenizer

    rng = random.Random(0)
    for _ in range(200):
        slipped = slip_one_digit(rng, "1632")
        assert len(slipped) == 4 and sum(a != b for a, b in zip(slipped, "1632")) == 1 and slipped[0] != "0"

    codec = TextCodec(tokenizer=build_tokenizer())
    right = {"direct": 0, "trace": 0}
    total = {"direct": 0, "trace": 0}
    operand_counts = set()
    for _ in range(2000):
        ids, is_trace = corpus_example(rng, codec, trace_fraction=0.2, direct_error_rate=0.6, variant=variant)
        assert ids[0] == BOS and ids[-1] == EOS
        text = codec.decode(ids[1:-1])
        prompt, answer = text.split("=", 1)
        operands = [int(x) for x in prompt.split("+")]
        operand_counts.add(len(operands))
        fmt = "trace" if is_trace else "direct"
        total[fmt] += 1
        right[fmt] += tiny_add_reward(answer, sum(operands))
        if is_trace:
            assert answer == multi_trace_answer(operands)
    assert right["trace"] == total["trace"]
    assert abs(right["direct"] / total["direct"] - 0.4) < 0.05
    assert abs(total["trace"] / 2000 - 0.2) < 0.03
    assert operand_counts == ({2} if variant == "add" else {2, 3, 4, 5})


def test_a_uniform_that_rounds_up_never_picks_a_zero_probability_token():
    # 1 - 1e-9 rounds to 1.0 in fp32, so u * cdf[-1] == cdf[-1]: without the clamp the
    # search runs past the last positive token into the zero-probability tail
    probs = torch.tensor([[0.3, 0.7, 0.0, 0.0], [0.0, 0.5, 0.0, 0.5], [0.2, 0.0, 0.0, 0.0]])
    u = torch.tensor([1 - 1e-9] * 3, dtype=torch.float64)
    picked = sample_with_uniforms(probs, u)
    assert picked.tolist() == [1, 3, 0]
    assert bool((probs.gather(1, picked[:, None]) > 0).all())


def test_prompt_sampler_shuffles_once_per_epoch_and_keeps_the_seeded_order():
    import random

    from rollout.data import PromptDataset

    rows = [(f"p{i}", str(i)) for i in range(50)]
    data = PromptDataset(rows, batch_size=20, seed=7)
    shuffles = []
    original = data._order
    data._order = lambda epoch: shuffles.append(epoch) or original(epoch)
    drawn = [r for _ in range(6) for r in data.next_batch()]  # 120 prompts: 2.4 epochs
    assert shuffles == [0, 1, 2]  # one permutation per epoch, not one per prompt drawn
    expected = []
    for epoch in range(3):
        order = list(range(50))
        random.Random(7 + epoch).shuffle(order)
        expected += [rows[i] for i in order]
    assert drawn == expected[:120]


def test_longtail_variant_has_correct_labels_and_widely_varying_trace_lengths():
    from rollout.task import TASK_VARIANTS, multi_trace_answer

    assert TASK_VARIANTS["add"].prompts(50, 3) == make_prompts(50, seed=3)  # the default task is unchanged
    rows = TASK_VARIANTS["longtail"].prompts(2000, 5)
    assert rows == TASK_VARIANTS["longtail"].prompts(2000, 5)
    lengths = []
    for r in rows:
        operands = [int(x) for x in r["prompt"].rstrip("=").split("+")]
        assert int(r["label"]) == sum(operands)
        trace = multi_trace_answer(operands)
        assert tiny_add_reward(trace, r["label"]) == 1.0
        lengths.append(len(trace))
    lengths.sort()
    # most responses short, a long tail: ~10 at the 10th percentile, ~40+ at the 90th, ~100 at the end
    assert lengths[len(lengths) // 10] <= 15 and lengths[9 * len(lengths) // 10] >= 35 and lengths[-1] >= 80


def test_multi_operand_trace_works_each_column_with_its_carry():
    from rollout.task import multi_trace_answer

    assert multi_trace_answer([347, 285]) == trace_answer(347, 285)
    assert multi_trace_answer([99, 9, 5]) == "9+9+5=23;9+0+0+2=11;#113"  # like trace_answer: no final-carry step
    for step in multi_trace_answer([987, 654, 321, 99]).split(";")[:-1]:
        terms, total = step.split("=")
        assert sum(int(t) for t in terms.split("+")) == int(total)
