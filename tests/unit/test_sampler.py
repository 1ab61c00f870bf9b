"""The batched sampler on hand-made logits, and the request validation in front of it."""

from __future__ import annotations

import math

import pytest
import torch

from engine_core.logprobs import logprobs_per_row
from engine_core.request import Request
from engine_core.sampler import Sampler, draw, truncate
from engine_core.validation import validate_request
from protocol.messages import EngineCoreRequest, SamplingParams

V = 10
EOS = 9


def make_request(prompt=(1, 2, 3), output=(), **kw) -> Request:
    params = SamplingParams(**{"max_tokens": 16, **kw})
    request = Request(EngineCoreRequest("r", list(prompt), params, 0.0), frozenset([EOS]))
    request.all_token_ids += list(output)
    return request


def sample(logits, *requests, seed: int = 0) -> list[int]:
    sampler = Sampler(V, torch.device("cpu"), seed)
    with torch.inference_mode():
        return sampler.sample(torch.tensor(logits, dtype=torch.float32), list(requests)).tolist()


def ramp(top: int) -> list[float]:
    """Logits with `top` best, then descending by distance from it."""
    return [-abs(i - top) * 1.0 for i in range(V)]


def test_greedy_takes_the_argmax():
    assert sample([ramp(4), ramp(7)], make_request(temperature=0), make_request(temperature=0)) == [
        4,
        7,
    ]


@pytest.mark.parametrize(
    "params", [dict(top_k=1), dict(top_p=1e-6), dict(min_p=1.0), dict(temperature=1e-3)]
)
def test_truncation_to_one_token_is_the_argmax(params):
    for seed in range(5):
        assert sample([ramp(3)], make_request(**{"temperature": 1.0, **params}), seed=seed) == [3]


def test_top_k_keeps_only_the_k_best():
    logits = [[0.0] * V]
    logits[0][2] = logits[0][5] = 3.0
    seen = {sample(logits, make_request(temperature=1.0, top_k=2), seed=s)[0] for s in range(40)}
    assert seen == {2, 5}


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = [0.5, 0.3, 0.15, 0.05] + [0.0] * (V - 4)
    logits = [[math.log(p) if p else -1e9 for p in probs]]
    seen = {sample(logits, make_request(temperature=1.0, top_p=0.7), seed=s)[0] for s in range(60)}
    assert seen == {0, 1}


def test_min_p_drops_tokens_below_a_fraction_of_the_best():
    probs = [0.5, 0.3, 0.15, 0.05] + [0.0] * (V - 4)
    logits = [[math.log(p) if p else -1e9 for p in probs]]
    seen = {sample(logits, make_request(temperature=1.0, min_p=0.5), seed=s)[0] for s in range(60)}
    assert seen == {0, 1}


def test_top_p_nucleus_wider_than_the_head_falls_back_to_the_whole_vocabulary():
    flat = torch.zeros(2, 1000)
    flat[1, :3] = 10.0  # a peaked row: its nucleus is in the head
    kept = truncate(flat, [0, 0], [0.5, 0.5]).isfinite().sum(dim=1).tolist()
    assert kept == [500, 2]


def test_top_p_applies_to_the_distribution_left_by_top_k():
    logits = torch.tensor([[5.0, 5.0, 5.0] + [0.0] * (V - 3)] * 2)
    kept = truncate(logits, [2, 2], [0.6, 0.5]).isfinite().sum(dim=1).tolist()
    # After top_k=2: two tokens of 0.5 each; 0.6 needs both, 0.5 only the first.
    assert kept == [2, 1]


def test_temperature_sampling_follows_the_distribution():
    probs = torch.tensor([0.6, 0.3, 0.1] + [0.0] * (V - 3))
    logits = probs.clamp_min(1e-12).log()
    sampler = Sampler(V, torch.device("cpu"), seed=0)
    requests = [make_request(temperature=1.0) for _ in range(4000)]
    with torch.inference_mode():
        tokens = sampler.sample(logits.expand(4000, V).clone(), requests)
    freq = torch.bincount(tokens, minlength=V).float() / 4000
    assert torch.allclose(freq[:3], probs[:3], atol=0.04)


@pytest.mark.parametrize("vocab", [300, 256, 7])
def test_draw_follows_the_distribution_across_blocks(vocab):
    g = torch.Generator().manual_seed(0)
    probs = torch.rand(vocab, generator=g) * (torch.rand(vocab, generator=g) < 0.5)
    probs[vocab // 2] = 1.0  # at least one token with mass
    n = 40_000
    tokens = draw(probs.expand(n, vocab).clone(), torch.rand(n, 1, generator=g), block=16)
    freq = torch.bincount(tokens, minlength=vocab).double() / n
    expected = probs.double() / probs.sum()
    assert (freq[expected == 0] == 0).all()
    assert torch.allclose(freq, expected, atol=0.01)


def test_draw_never_picks_zero_mass_tokens_at_the_edges():
    # Mass only in the middle of the middle block; u at 0, just below 1, and exactly
    # the boundaries of the cumulative mass.
    probs = torch.zeros(5, 48)
    probs[:, 20] = 0.25
    probs[:, 21] = 0.75
    u = torch.tensor([[0.0], [0.25], [0.9999999], [1.0 - 2.0**-24], [0.5]])
    assert draw(probs, u, block=16).tolist() == [20, 21, 21, 21, 21]
    # Mass in the last token of the vocabulary, not a multiple of the block.
    tail = torch.zeros(2, 37)
    tail[:, 36] = 1e-30
    assert draw(tail, torch.tensor([[0.0], [0.9999999]]), block=16).tolist() == [36, 36]


def test_seeded_rows_do_not_depend_on_the_rest_of_the_batch():
    logits = torch.zeros(1, V)
    alone = [sample(logits.tolist(), make_request(temperature=1.0, seed=11))[0] for _ in range(1)]
    crowd = [make_request(temperature=1.0) for _ in range(5)]
    seeded = make_request(temperature=1.0, seed=11)
    batch = sample(torch.zeros(6, V).tolist(), *crowd[:3], seeded, *crowd[3:], seed=123)
    assert batch[3] == alone[0]
    # The seeded generator advances per token: a sequence of draws repeats too.
    a, b = make_request(temperature=1.0, seed=5), make_request(temperature=1.0, seed=5)
    sampler1, sampler2 = Sampler(V, torch.device("cpu"), 1), Sampler(V, torch.device("cpu"), 2)
    with torch.inference_mode():
        draws_a = [sampler1.sample(torch.zeros(1, V), [a]).item() for _ in range(10)]
        draws_b = [
            sampler2.sample(torch.zeros(2, V), [make_request(temperature=1.0), b])[1].item()
            for _ in range(10)
        ]
    assert draws_a == draws_b
    assert len(set(draws_a)) > 1


def test_logit_bias_and_allowed_token_ids():
    assert sample([ramp(4)], make_request(temperature=0, logit_bias={8: 10.0})) == [8]
    assert sample([ramp(4)], make_request(temperature=0, allowed_token_ids=[0, 1])) == [1]


def test_min_tokens_masks_eos_and_stop_tokens_until_reached():
    logits = [ramp(EOS)]
    assert sample(logits, make_request(temperature=0, min_tokens=2, output=[5])) == [8]
    assert sample(logits, make_request(temperature=0, min_tokens=1, output=[5])) == [EOS]
    stop_first = [ramp(6)]
    assert sample(stop_first, make_request(temperature=0, min_tokens=3, stop_token_ids=[6])) in (
        [5],
        [7],
    )


def test_repetition_penalty_is_multiplicative_over_prompt_and_output():
    logits = [[2.0, -2.0, 1.9, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]]
    request = make_request(temperature=0, repetition_penalty=2.0, prompt=(0,), output=(1,))
    sampler = Sampler(V, torch.device("cpu"), 0)
    with torch.inference_mode():
        t = torch.tensor(logits)
        sampler.sample(t, [request])
    assert t[0, :3].tolist() == pytest.approx([1.0, -4.0, 1.9])


def test_presence_and_frequency_penalties_are_additive_over_output_only():
    logits = torch.zeros(1, V)
    request = make_request(
        temperature=0, presence_penalty=0.5, frequency_penalty=0.25, prompt=(4,), output=(2, 2, 3)
    )
    with torch.inference_mode():
        Sampler(V, torch.device("cpu"), 0).sample(logits, [request])
    assert logits[0, 2].item() == pytest.approx(-1.0)  # 0.5 + 2 * 0.25
    assert logits[0, 3].item() == pytest.approx(-0.75)
    assert logits[0, 4].item() == 0.0  # prompt tokens are not penalised additively


def test_logprobs_are_from_raw_logits_with_rank_and_top_n():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0] + [-5.0] * (V - 4)])
    (lp,) = logprobs_per_row(logits, torch.tensor([2]), [2])
    expected = torch.log_softmax(logits, -1)[0]
    assert lp.token_ids == [[2, 1, 3]]
    assert lp.ranks == [3]
    assert lp.logprobs[0] == pytest.approx(
        [expected[2].item(), expected[1].item(), expected[3].item()]
    )


def test_logprob_token_ids_rows_hold_the_chosen_then_exactly_the_listed_tokens():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0] + [-5.0] * (V - 4)] * 2)
    listed, plain = logprobs_per_row(logits, torch.tensor([2, 1]), [0, 1], [[5, 0, 3], None])
    expected = torch.log_softmax(logits, -1)[0]
    assert listed.token_ids == [[2, 5, 0, 3]] and listed.ranks == [3]
    assert listed.logprobs[0] == pytest.approx([expected[i].item() for i in (2, 5, 0, 3)])
    assert plain.token_ids == [[1, 1]] and plain.ranks == [1]  # top-1 beside it, as before


def _req(params: SamplingParams, prompt=(1, 2)) -> EngineCoreRequest:
    return EngineCoreRequest("v", list(prompt), params, 0.0)


@pytest.mark.parametrize(
    "params,field",
    [
        (SamplingParams(temperature=float("inf")), "temperature"),
        (SamplingParams(top_p=1.5), "top_p"),
        (SamplingParams(top_k=-3), "top_k"),
        (SamplingParams(min_p=-0.1), "min_p"),
        (SamplingParams(repetition_penalty=-1.0), "repetition_penalty"),
        (SamplingParams(presence_penalty=-2.5), "presence_penalty"),
        (SamplingParams(frequency_penalty=2.5), "frequency_penalty"),
        (SamplingParams(max_tokens=0), "max_tokens"),
        (SamplingParams(min_tokens=-1), "min_tokens"),
        (SamplingParams(logprobs=100), "logprobs"),
        (SamplingParams(stop_token_ids=[V]), "stop_token_ids"),
        (SamplingParams(logit_bias={0: float("nan")}), "logit_bias"),
        (SamplingParams(allowed_token_ids=[V + 1]), "allowed_token_ids"),
    ],
)
def test_validation_names_the_field_and_the_limit(params, field):
    with pytest.raises(ValueError, match=field):
        validate_request(_req(params), V)


def test_valid_params_pass_validation():
    params = SamplingParams(
        temperature=0.7, top_p=0.9, top_k=-1, min_p=0.05, repetition_penalty=1.1,
        presence_penalty=-2.0, frequency_penalty=2.0, seed=-5, min_tokens=3,
        stop_token_ids=[1], logit_bias={3: -100.0}, logprobs=20, prompt_logprobs=0,
        allowed_token_ids=[1, 2, 3],
    )  # fmt: skip
    validate_request(_req(params), V)


# --- --logprobs-mode processed_*: what each row's draw saw ----------------------------------


def _keeping(logits, requests, keep, seed=0):
    sampler = Sampler(V, torch.device("cpu"), seed)
    with torch.inference_mode():
        return sampler.sample_keeping(torch.tensor(logits, dtype=torch.float32), requests, keep)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_kept_rows_are_the_processed_logits_and_the_draws_are_unchanged(seed):
    greedy = make_request(temperature=0, logit_bias={3: 5.0})
    warm = make_request(temperature=0.5)
    narrow = make_request(temperature=2.0, top_k=2)
    requests = [greedy, warm, narrow]
    logits = [ramp(4), ramp(6), ramp(1)]
    tokens, kept = _keeping(logits, requests, [0, 2, 1], seed)
    assert tokens.tolist() == sample(logits, *requests, seed=seed)
    expected_greedy = torch.tensor(ramp(4))
    expected_greedy[3] += 5.0  # the bias, no temperature
    assert torch.equal(kept[0], expected_greedy)
    assert torch.allclose(kept[2], torch.tensor(ramp(6)) / 0.5)  # row 1, at keep's 3rd
    narrow_row = kept[1]  # top_k 2 of ramp(1): tokens 0, 1 and 2 tie for second place
    assert torch.isfinite(narrow_row).sum() == 2 and narrow_row[1] == 0.0
    assert narrow_row.max() == 0.0 and narrow_row.topk(2).values[1] == -0.5  # -1 / 2.0


def test_all_random_and_all_greedy_batches_keep_their_rows():
    tokens, kept = _keeping([ramp(2), ramp(5)], [make_request(temperature=0.25)] * 2, [1])
    assert kept.shape == (1, V) and torch.allclose(kept[0], torch.tensor(ramp(5)) * 4)
    tokens, kept = _keeping([ramp(2), ramp(5)], [make_request(temperature=0)] * 2, [0, 1])
    assert tokens.tolist() == [2, 5] and torch.equal(kept, torch.tensor([ramp(2), ramp(5)]))
    assert _keeping([ramp(2)], [make_request(temperature=0)], None)[1] is None


def test_logits_mode_gives_the_values_themselves_with_the_same_ranks():
    scores = torch.tensor([ramp(3)])
    as_logprobs = logprobs_per_row(scores, torch.tensor([4]), [2])[0]
    as_logits = logprobs_per_row(scores, torch.tensor([4]), [2], as_logits=True)[0]
    assert as_logits.token_ids == as_logprobs.token_ids and as_logits.ranks == [2]
    assert as_logits.logprobs == [[-1.0, 0.0, -1.0]]
    assert as_logprobs.logprobs[0][1] < 0
