"""Beam search's arithmetic: vLLM's candidates and scores, and the early-stopping rules."""

from __future__ import annotations

import math

import pytest
import torch

from engine_core.beam_scoring import Beam, expand, score_key, should_stop
from protocol.messages import EarlyStopping, FinishReason

EOS = 5


def logits_of(*rows: dict[int, float], vocab: int = 8) -> torch.Tensor:
    """Rows whose log-softmax puts these log-probabilities on these tokens (the rest share
    what is left)."""
    out = torch.full((len(rows), vocab), -30.0)
    for i, row in enumerate(rows):
        for token, logprob in row.items():
            out[i, token] = logprob
    return out


@pytest.mark.parametrize("penalty", [-1.5, 0.0, 0.5, 1.0, 2.0])
def test_score_key_orders_as_the_score(penalty):
    cases = [(-1.0, 3), (-2.0, 3), (-2.0, 9), (-7.5, 20), (-0.1, 1), (-30.0, 40)]
    by_score = sorted(cases, key=lambda c: c[0] / c[1] ** penalty)
    assert sorted(cases, key=lambda c: score_key(c[0], c[1], penalty)) == by_score


def test_score_key_never_overflows():
    assert score_key(-1.0, 2000, 1000.0) > score_key(-1.0, 1000, 1000.0)
    assert score_key(0.0, 5, 1.0) == math.inf


def test_an_eos_offered_by_any_beam_finishes_it_as_in_vllm():
    """Beam 1's EOS is not among the 4 best offers of the group, only among its own 4:
    vLLM finishes it anyway. The 2 best other offers live on."""
    parents = [Beam([1], 0.0), Beam([2], -1.0)]
    logits = logits_of({1: -0.5, 2: -1.0, 3: -1.5, 4: -2.0}, {EOS: -1.2, 1: -1.3, 2: -3.0, 3: -4.0})
    step = expand(parents, logits, 2, torch.tensor([EOS]), True, frozenset([EOS]), None)
    assert [(r, b.tokens) for r, b in step.live] == [(0, [1, 1]), (0, [1, 2])]
    (done,) = step.finished
    assert done.tokens == [2, EOS] and done.finish_reason == FinishReason.STOP
    assert done.stop_reason is None  # an EOS, not a stop token
    assert math.isclose(done.cum_logprob, -1.0 + torch.log_softmax(logits[1], -1)[EOS].item())


def test_without_stop_tokens_an_eos_lives_on():
    parents = [Beam([], 0.0)]
    step = expand(parents, logits_of({EOS: -0.1, 1: -3.0}), 1, None, True, frozenset([EOS]), None)
    assert [b.tokens for _, b in step.live] == [[EOS]] and not step.finished


def test_before_min_tokens_a_stop_token_is_never_chosen():
    parents = [Beam([], 0.0)]
    logits = logits_of({EOS: -0.1, 1: -3.0, 2: -4.0})
    step = expand(parents, logits, 1, torch.tensor([EOS]), False, frozenset([EOS]), None)
    assert [b.tokens for _, b in step.live] == [[1]] and not step.finished


def test_logprob_rows_put_the_chosen_token_first_with_its_rank():
    parents = [Beam([], 0.0, rows=[])]
    logits = logits_of({1: -0.5, 2: -1.0, 3: -1.5})
    step = expand(parents, logits, 2, None, True, frozenset(), 2)
    second = step.live[1][1]
    ((ids, lps, rank),) = second.rows
    assert ids == [2, 1, 2] and rank == 2
    assert lps[0] == lps[2]


def finished(*keys: float) -> list[Beam]:
    return [Beam([1], -1.0, finish_reason=FinishReason.STOP, key=k) for k in keys]


def test_true_stops_once_n_beams_finished():
    live = [Beam([1, 2], -0.1)]
    assert not should_stop(live, finished(-1.0), 2, 4, 20, 1.0, EarlyStopping.FIRST)
    assert should_stop(live, finished(-1.0, -2.0), 2, 4, 20, 1.0, EarlyStopping.FIRST)


def test_exact_waits_while_a_longer_beam_could_still_win():
    """With a positive penalty a live beam's score can still rise as it grows: the exact
    rule bounds it at the longest length; the heuristic only looks at it as it is now."""
    live = [Beam([1, 2], -3.0)]  # 4 + 2 tokens: score -0.5 now, -0.15 at 20 tokens
    done = [Beam([1], -1.5, key=score_key(-1.5, 4, 1.0))] * 2  # score -0.375
    assert should_stop(live, done, 2, 4, 20, 1.0, EarlyStopping.HEURISTIC)
    assert not should_stop(live, done, 2, 4, 20, 1.0, EarlyStopping.EXACT)
    # Without a length bonus no descendant beats the finished ones: stop.
    done = [Beam([1], -1.5, key=score_key(-1.5, 4, 0.0))] * 2
    assert should_stop(live, done, 2, 4, 20, 0.0, EarlyStopping.EXACT)
