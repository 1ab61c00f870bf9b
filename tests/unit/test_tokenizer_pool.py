"""The tokenizer pool: long texts encoded in worker processes, exactly as inline, with
bounded waiting, a timeout that replaces the worker, and fresh workers after huge inputs."""

from __future__ import annotations

import asyncio

import orjson
import pytest

from frontend.errors import APIError
from frontend.renderer import Renderer
from frontend.tokenizer_pool import RECYCLE_BYTES, TokenizerPool

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def renderer(tiny_model) -> Renderer:
    path = str(tiny_model("llama"))
    return Renderer(path)


def run(coro):
    return asyncio.new_event_loop().run_until_complete(coro)


def test_worker_encodes_and_decodes_exactly_as_the_renderer_does(renderer):
    text = "héllo wörld <|im_start|> " * 2000
    pool = TokenizerPool(renderer.serialized(), size=1)
    try:

        async def all_ops():
            count, ids = await pool.encode(text, True, None, None)
            _, plain = await pool.encode(text, False, None, None)
            _, last = await pool.encode(text, False, None, 7)
            _, first = await pool.encode(text, False, None, 7, keep_first=True)
            last = (last, first)
            too_many, none = await pool.encode(text, False, 100, None)
            back = await pool.decode(ids, True)
            json_count, tokens, strs = await pool.tokenize_json(text, False, True)
            return count, ids, plain, last, (too_many, none), back, (json_count, tokens, strs)

        count, ids, plain, last, refused, back, as_json = run(all_ops())
    finally:
        pool.close()
    assert ids == renderer.encode(text, True) and count == len(ids)
    assert plain == renderer.encode(text, False)
    assert last == (plain[-7:], plain[:7])  # truncation_side left, right
    assert refused == (len(plain), [])  # over at_most: the count only, no ids
    assert back == renderer.decode(ids, True)
    json_count, tokens, strs = as_json
    assert json_count == len(plain) and orjson.loads(tokens) == plain
    assert orjson.loads(strs) == renderer.tokenizer.convert_ids_to_tokens(plain)


def test_a_text_over_the_timeout_fails_clearly_and_a_fresh_worker_takes_over(renderer):
    pool = TokenizerPool(renderer.serialized(), size=1, timeout_s=0.001)
    try:

        async def attempt():
            with pytest.raises(APIError) as e:
                await pool.encode("a" * 4_000_000, False, None, None)
            assert e.value.status == 400 and e.value.param == "prompt"
            assert "could not be tokenized within" in e.value.message
            pool.timeout_s = 30.0
            return (await pool.encode("ok " * 10, False, None, None))[1]

        old = pool._workers[0].process
        assert run(attempt()) == renderer.encode("ok " * 10, False)
        assert not old.is_alive() and pool._workers[0].process is not old
    finally:
        pool.close()


def test_waiting_work_is_bounded_with_a_retryable_503(renderer):
    pool = TokenizerPool(renderer.serialized(), size=1, max_pending=2)
    try:

        async def flood():
            text = "b" * 200_000
            jobs = [asyncio.ensure_future(pool.encode(text, False, None, None)) for _ in range(3)]
            return await asyncio.gather(*jobs, return_exceptions=True)

        results = run(flood())
    finally:
        pool.close()
    refused = [r for r in results if isinstance(r, APIError)]
    assert len(refused) == 1 and refused[0].status == 503
    assert refused[0].headers == {"Retry-After": "1"}
    assert sum(isinstance(r, tuple) for r in results) == 2


def test_a_worker_is_replaced_after_a_huge_input(renderer):
    pool = TokenizerPool(renderer.serialized(), size=1)
    try:

        async def huge_then_small():
            await pool.encode("c" * (RECYCLE_BYTES + 1), False, None, None)
            return (await pool.encode("small", False, None, None))[1]

        old = pool._workers[0].process
        assert run(huge_then_small()) == renderer.encode("small", False)
        assert not old.is_alive() and pool._workers[0].process is not old
    finally:
        pool.close()
