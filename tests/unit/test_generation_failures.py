"""An engine output that ends a request in failure becomes the same API error for a
sampled generation and a beam search (frontend/generation.py: Generation._raise_failure):
refused (400, naming the field), asleep (503, Retry-After), failed (500)."""

from __future__ import annotations

import asyncio

import pytest
from tokenizers import Tokenizer

from frontend.beam_search import BeamGeneration
from frontend.engine_state import RequestStream
from frontend.errors import APIError
from frontend.generation import Generation
from protocol.messages import EngineCoreOutput, FinishReason, SamplingParams

pytestmark = pytest.mark.timeout(30)


class Client:
    """The engine client as a generation sees it: streams it is handed, aborts it sends."""

    def __init__(self) -> None:
        self.streams: list[RequestStream] = []
        self.aborted: list[str] = []

    def pick_engine(self, rank, prefer_lora=None):
        return None

    def new_group(self) -> int:
        return 1

    def add_request(self, request, engine, event) -> RequestStream:
        stream = RequestStream(request.request_id, engine, event)
        self.streams.append(stream)
        return stream

    def abort(self, ids: list[str]) -> None:
        self.aborted.extend(ids)


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    return Tokenizer.from_file(str(tiny_model("llama") / "tokenizer.json"))


def fail(tokenizer, beam: bool, reason: FinishReason, error: str) -> tuple[APIError, list[str]]:
    """The error a generation raises on an output `reason` with `error`; what it aborted."""
    client = Client()
    params = SamplingParams(max_tokens=4, beam_width=2 if beam else 0)
    kind = BeamGeneration if beam else Generation
    gen = kind(
        client,
        "r",
        [[5, 6, 7]],
        [params],
        n=2 if beam else 1,
        tokenizer=tokenizer,
        stop=[],
        include_stop=False,
        skip_special_tokens=True,
    )
    gen.start()
    (stream,) = client.streams
    stream.put(EngineCoreOutput(stream.request_id, [], reason, error=error))

    async def run() -> None:
        async for _ in gen.deltas():
            pass

    with pytest.raises(APIError) as caught:
        asyncio.run(run())
    return caught.value, client.aborted


@pytest.mark.parametrize("beam", [False, True], ids=["sampled", "beam search"])
def test_refused_asleep_and_failed_outputs_are_the_same_errors_for_either_kind(tokenizer, beam):
    refused, aborted = fail(tokenizer, beam, FinishReason.REFUSED, "structured_outputs.regex: bad")
    assert (refused.status, refused.param) == (400, "structured_outputs.regex")
    assert aborted  # the engine frees what is left of it
    asleep, _ = fail(tokenizer, beam, FinishReason.UNAVAILABLE, "the engine is asleep")
    assert asleep.status == 503
    assert "Retry-After" in asleep.headers
    failed, _ = fail(tokenizer, beam, FinishReason.ERROR, "out of memory")
    assert failed.status == 500
    assert "out of memory" in failed.message
