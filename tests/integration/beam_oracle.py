"""Oracles of the beam-search tests: transformers' own generate(num_beams=...), and vLLM's
online beam search written out plainly over transformers' forward (each beam recomputed
from scratch every step: nothing shared, nothing cached)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
from hf_generate import reference_model


@dataclass
class Answer:
    token_ids: list[int]
    cumulative_logprob: float
    finish_reason: str  # "stop" or "length"


def load(model_dir: Path):
    return reference_model(model_dir)


@torch.no_grad()
def hf_beam_search(
    model,
    prompt: list[int],
    width: int,
    max_tokens: int,
    length_penalty: float,
    early_stopping: bool | str,
) -> list[Answer]:
    """transformers' beam search without EOS: `width` sequences of max_tokens tokens; the
    cumulative log-probability comes back from its length-penalised score."""
    ids = torch.tensor([prompt])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        num_beams=width,
        num_return_sequences=width,
        max_new_tokens=max_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=None,
        length_penalty=length_penalty,
        early_stopping=early_stopping,
        output_scores=True,
        return_dict_in_generate=True,
    )
    return [
        Answer(seq[len(prompt) :].tolist(), float(score) * max_tokens**length_penalty, "length")
        for seq, score in zip(out.sequences, out.sequences_scores)
    ]


@torch.no_grad()
def vllm_beam_search(
    model,
    prompt: list[int],
    width: int,
    max_tokens: int,
    eos: int,
    length_penalty: float = 1.0,
) -> list[Answer]:
    """vLLM's online beam search (vllm/entrypoints/generate/beam_search/online.py, v0.32):
    every step each beam offers its 2 x width best tokens; offered EOS tokens finish, the
    best `width` of the rest live on; after max_tokens steps the `width` best scores of
    all finished and live beams, score = logprob / (prompt + tokens - EOS) ** penalty."""
    beams: list[tuple[list[int], float]] = [([], 0.0)]
    done: list[Answer] = []
    for _ in range(max_tokens):
        offers = []
        # Live beams are all as long: one forward of the batch, no padding.
        logits = model(input_ids=torch.tensor([prompt + t for t, _ in beams])).logits[:, -1]
        top = torch.log_softmax(logits.float(), dim=-1).topk(2 * width)
        for (tokens, cum), values, indices in zip(beams, top.values, top.indices):
            for lp, token in zip(values.tolist(), indices.tolist()):
                if token == eos:
                    done.append(Answer(tokens + [token], cum + lp, "stop"))
                else:
                    offers.append((cum + lp, tokens + [token]))
        offers.sort(key=lambda o: -o[0])
        beams = [(tokens, cum) for cum, tokens in offers[:width]]
    pool = done + [Answer(tokens, cum, "length") for tokens, cum in beams]

    def score(a: Answer) -> float:
        length = len(prompt) + len(a.token_ids) - (a.token_ids[-1] == eos)
        return a.cumulative_logprob / length**length_penalty

    return sorted(pool, key=score, reverse=True)[:width]


def assert_same_answers(got, expected, tol: float = 1e-4) -> None:
    """Same sequences in the same order, log-probabilities within float tolerance."""
    assert [b.token_ids for b in got] == [a.token_ids for a in expected]
    for b, a in zip(got, expected):
        assert math.isclose(b.cumulative_logprob, a.cumulative_logprob, abs_tol=tol)
