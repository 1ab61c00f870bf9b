"""Dataset builders: exact prompt lengths with the project's real tokenizers, ShareGPT parsing."""

from __future__ import annotations

import json
import random

import pytest

from benchmarks.datasets import (
    DatasetConfig,
    build_requests,
    exact_text,
    prefix_repetition_requests,
    random_requests,
    sharegpt_requests,
)
from benchmarks.tokenizer import BenchTokenizer

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module", params=["tiny-bytes", "small-bpe"])
def tok(request: pytest.FixtureRequest) -> BenchTokenizer:
    """The byte-level tokenizer of the tiny test models and the trained BPE of the
    benchmark model (where decode → encode is not an identity)."""
    if request.param == "tiny-bytes":
        folder = request.getfixturevalue("tiny_model")("llama")
    else:
        folder = request.getfixturevalue("small_model")
    return BenchTokenizer.load(folder)


def test_tokenizer_counts_the_tokens_the_server_adds(tok: BenchTokenizer):
    added = tok._tok.encode("abc", add_special_tokens=True).ids
    assert len(added) == len(tok.encode("abc")) + tok.num_special_tokens_to_add
    assert tok.special_ids and not tok.special_ids & set(tok.allowed_ids())


def test_random_prompts_have_exactly_the_requested_length(tok: BenchTokenizer):
    reqs = random_requests(tok, random.Random(0), 40, input_len=64, output_len=32)
    assert len(reqs) == 40
    for r in reqs:
        assert r.prompt_len == 64
        assert len(tok.encode(r.prompt)) + tok.num_special_tokens_to_add == 64
        assert r.output_len == 32
    assert len({r.prompt for r in reqs}) == 40


def test_random_lengths_stay_within_the_range_ratio(tok: BenchTokenizer):
    reqs = random_requests(tok, random.Random(1), 60, input_len=101, output_len=40, range_ratio=0.5)
    n = tok.num_special_tokens_to_add
    for r in reqs:
        assert len(tok.encode(r.prompt)) + n == r.prompt_len
        # the random part: [(101 − n)·0.5, (101 − n)·1.5]
        assert (101 - n) // 2 <= r.prompt_len - n <= (101 - n) * 3 // 2 + 1
        assert 20 <= r.output_len <= 60
    assert len({r.prompt_len for r in reqs}) > 10


def test_random_prefix_is_shared_and_counted(tok: BenchTokenizer):
    reqs = random_requests(tok, random.Random(2), 10, input_len=33, output_len=8, prefix_len=50)
    prefix_ids = tok.encode(reqs[0].prompt)[:50]
    for r in reqs:
        ids = tok.encode(r.prompt)
        assert ids[:50] == prefix_ids
        assert len(ids) + tok.num_special_tokens_to_add == r.prompt_len == 50 + 33


def test_same_seed_same_prompts_other_seed_other_prompts(tok: BenchTokenizer):
    cfg = DatasetConfig(num_prompts=5, random_input_len=20, random_output_len=4, seed=7)
    again = DatasetConfig(num_prompts=5, random_input_len=20, random_output_len=4, seed=7)
    other = DatasetConfig(num_prompts=5, random_input_len=20, random_output_len=4, seed=8)
    assert build_requests(cfg, tok) == build_requests(again, tok)
    assert build_requests(cfg, tok) != build_requests(other, tok)


def test_prefix_repetition_shares_each_prefix_token_for_token(tok: BenchTokenizer):
    reqs = prefix_repetition_requests(
        tok, random.Random(3), 12, prefix_len=40, suffix_len=24, num_prefixes=3, output_len=9
    )
    assert len(reqs) == 12
    prefixes: dict[tuple[int, ...], int] = {}
    for r in reqs:
        ids = tok.encode(r.prompt)
        assert len(ids) == 64 and r.output_len == 9
        assert r.prompt_len == 64 + tok.num_special_tokens_to_add
        key = tuple(ids[:40])
        prefixes[key] = prefixes.get(key, 0) + 1
    assert sorted(prefixes.values()) == [4, 4, 4]


def test_exact_text_after_a_head_keeps_the_head_tokens(tok: BenchTokenizer):
    rng = random.Random(4)
    head = exact_text(tok, rng, 30)
    for _ in range(20):
        text, ids = exact_text(tok, rng, 17, head=head)
        assert tok.encode(head[0] + text) == head[1] + ids
        assert len(ids) == 17


def test_too_short_random_input_is_refused(tok: BenchTokenizer):
    with pytest.raises(ValueError, match="leaves no prompt token"):
        random_requests(
            tok, random.Random(0), 1, input_len=tok.num_special_tokens_to_add, output_len=4
        )


def _write_sharegpt(path) -> None:
    data = [
        {
            "id": "a",
            "conversations": [
                {"from": "human", "value": "Write a function that adds two numbers in Python."},
                {"from": "gpt", "value": "def add(a, b):\n    return a + b\n# done, simply."},
            ],
        },
        {"id": "one-turn", "conversations": [{"from": "human", "value": "only a question"}]},
        {
            "id": "short",
            "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}],
        },
        {
            "id": "b",
            "conversations": [
                {"from": "human", "value": "Explain what a context manager does, briefly."},
                {"from": "gpt", "value": "It runs setup code on entry and cleanup on exit."},
                {"from": "human", "value": "a later turn is ignored"},
            ],
        },
    ]
    path.write_text(json.dumps(data))


def test_sharegpt_takes_first_turns_and_skips_unusable_ones(tok: BenchTokenizer, tmp_path):
    path = tmp_path / "sharegpt.json"
    _write_sharegpt(path)
    reqs = sharegpt_requests(tok, random.Random(0), path, 2)
    prompts = {r.prompt for r in reqs}
    assert prompts == {
        "Write a function that adds two numbers in Python.",
        "Explain what a context manager does, briefly.",
    }
    for r in reqs:
        assert r.prompt_len == len(tok.encode(r.prompt)) + tok.num_special_tokens_to_add
    replies = {
        "Write a function that adds two numbers in Python.": "def add(a, b):\n    return a + b\n"
        "# done, simply.",
        "Explain what a context manager does, briefly.": "It runs setup code on entry and "
        "cleanup on exit.",
    }
    for r in reqs:
        assert r.output_len == len(tok.encode(replies[r.prompt]))


def test_sharegpt_fixed_output_len_and_repetition_when_short_of_prompts(
    tok: BenchTokenizer, tmp_path
):
    path = tmp_path / "sharegpt.json"
    _write_sharegpt(path)
    cfg = DatasetConfig(
        name="sharegpt", num_prompts=5, dataset_path=str(path), sharegpt_output_len=12
    )
    reqs = build_requests(cfg, tok)
    assert len(reqs) == 5
    assert {r.output_len for r in reqs} == {12}
    assert len({r.prompt for r in reqs}) == 2


def test_sharegpt_without_path_or_usable_entries_is_a_clear_error(tok: BenchTokenizer, tmp_path):
    with pytest.raises(ValueError, match="dataset-path"):
        build_requests(DatasetConfig(name="sharegpt"), tok)
    empty = tmp_path / "empty.json"
    empty.write_text("[]")
    with pytest.raises(ValueError, match="no usable conversation"):
        sharegpt_requests(tok, random.Random(0), empty, 3)
