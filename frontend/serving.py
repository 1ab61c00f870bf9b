"""What every route of one API server shares: the engines, the tokenizer, admission,
metrics; and the life of a generation from submit to finish."""

from __future__ import annotations

import asyncio
import logging
import os
import time

from frontend.admission import Admission, AdmissionRejected
from frontend.beam_search import BeamGeneration
from frontend.chat_tools import load_chat_parsers
from frontend.config import FrontendConfig
from frontend.engine_client import EngineClient
from frontend.engine_state import EngineAsleepError, EngineDeadError
from frontend.errors import APIError, asleep_error
from frontend.generation import Choice, Generation
from frontend.limits import check_prompt_chars
from frontend.lora_adapters import LoraAdapters
from frontend.metrics import Metrics
from frontend.openai_models import SamplingFields
from frontend.renderer import Renderer
from frontend.request_inputs import RequestInputs
from frontend.sampling import Truncation, context_length_error
from frontend.tokenizer_pool import INLINE_CHARS, TokenizerPool
from frontend.tracing import RequestTracer
from protocol.messages import PoolingParams, SamplingParams

log = logging.getLogger("zserve.api")

# A request with this many sequences leaves the C heap at a new peak (see server.py).
LARGE_FAN_OUT = 64


class ServingContext:
    """Shared state of one API server's routes; also the observer of every generation."""

    def __init__(
        self,
        config: FrontendConfig,
        client: EngineClient,
        renderer: Renderer,
        admission: Admission,
        metrics: Metrics | None = None,
        tokenizers: TokenizerPool | None = None,
    ) -> None:
        self.config = config
        self.limits = config.limits
        self.client = client
        self.renderer = renderer
        self.admission = admission
        self.metrics = metrics
        self.tracer: RequestTracer | None = None  # --otlp-traces-endpoint
        self.tokenizers = tokenizers
        self.model_name = config.served_model_names[0]
        self.chat_parsers = load_chat_parsers(config)  # tool and reasoning formats
        # --generation-config: the fields a request leaves unset (launcher/generation_config.py)
        self.defaults = config.sampling_defaults
        self.client_index = client.client_index
        self.pid = os.getpid()
        self.in_flight = 0  # HTTP requests being handled, any route
        self.active: set[Generation] = set()  # started and not yet finished
        self.draining = False
        self.large_request_seen = False  # the heap may hold its peak: release it (server.py)
        self.loras = LoraAdapters(config, client)

    # --- what the engines announced ---------------------------------------------------

    @property
    def max_model_len(self) -> int:
        return self.client.max_model_len

    @property
    def max_request_tokens(self) -> int:
        """Prompt + max_tokens that one request may need, as every engine announced it:
        the context length, or less where an engine's KV cache is smaller."""
        return self.client.max_request_tokens

    @property
    def vocab_size(self) -> int:
        return self.client.vocab_size

    @property
    def eos_token_ids(self) -> list[int]:
        """The model's end-of-sequence tokens, as the engines reported them."""
        return self.client.engines[0].ready.eos_token_ids

    def tokens_as_ids(self, body: SamplingFields) -> bool:
        """return_tokens_as_token_ids: the request's, else --return-tokens-as-token-ids."""
        if body.return_tokens_as_token_ids is None:
            return self.config.return_tokens_as_token_ids
        return body.return_tokens_as_token_ids

    # --- cheap checks ---------------------------------------------------------------------

    def preflight(self) -> None:
        """Before any work is done for a request: can this server take it at all?"""
        if self.draining:
            raise APIError("the server is shutting down", 503, headers={"Retry-After": "5"})
        if self.client.dead:
            raise APIError("no engine is alive", 503)
        if self.asleep:
            raise asleep_error("the model is asleep (sleep mode): retry once it is awake")

    @property
    def asleep(self) -> bool:
        """Every engine alive refuses new requests: asleep, or going to sleep (as each
        last told this server: at once on every change, engine_core/controls.py)."""
        alive = [e for e in self.client.engines if e.alive]
        return bool(alive) and all(e.stats.paused for e in alive)

    async def wait_until_awake(self) -> None:
        """--wait-while-asleep: a request that arrives while the engines sleep waits up
        to that long for a wake-up (preflight then refuses it if they still sleep)."""
        deadline = time.monotonic() + self.config.wait_while_asleep_s
        while self.asleep and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

    def resolve_model(self, name: str | None) -> str:
        if not name or name in self.config.served_model_names:
            return self.model_name
        raise APIError(f"The model `{name}` does not exist.", 404, param="model")

    async def resolve_target(self, name: str | None) -> tuple[str, str | None]:
        """The name responses report and the LoRA adapter (None: the base model) that
        `model` selects; 404 for a name that is neither."""
        if not name or name in self.config.served_model_names:
            return self.model_name, None
        if await self.loras.find(name):
            return name, name
        raise APIError(f"The model `{name}` does not exist.", 404, param="model")

    @property
    def max_prompt_chars(self) -> int:
        """Characters beyond which no text can fit the context (--max-prompt-chars)."""
        if self.limits.max_prompt_chars is not None:
            return self.limits.max_prompt_chars
        return self.max_model_len * self.renderer.max_token_chars

    def check_text_length(self, text: str, field: str, truncating: bool = False) -> None:
        """A text that cannot fit the context is refused before tokenization; with
        truncate_prompt_tokens it may be longer (its start is cut), up to the body limit."""
        if not truncating:
            check_prompt_chars(len(text), self.max_prompt_chars, field)

    # --- tokenizing -----------------------------------------------------------------------

    async def encode(
        self, text: str, add_special_tokens: bool, cut: Truncation | None = None, room: int = 1
    ) -> list[int]:
        """A prompt's token ids; long texts go to the tokenizer pool (tokenizer_pool.py).

        `cut`: truncate_prompt_tokens. Without it a prompt that does not leave `room`
        tokens of the context (0: an input to pool) is a 400, and a huge one's ids are
        never listed on this loop."""
        at_most = None if cut else self.max_model_len - room
        if len(text) > INLINE_CHARS and self.tokenizers is not None:
            count, ids = await self.tokenizers.encode(
                text,
                add_special_tokens,
                at_most,
                cut.count if cut else None,
                keep_first=bool(cut and not cut.left),
            )
        else:
            if len(text) > INLINE_CHARS:
                ids = await asyncio.to_thread(self.renderer.encode, text, add_special_tokens)
            else:
                ids = self.renderer.encode(text, add_special_tokens)
            count = len(ids)
        if at_most is not None and count > at_most:
            raise context_length_error(count, self.max_model_len, room)
        return cut.apply(ids) if cut else ids

    async def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        if len(ids) > INLINE_CHARS and self.tokenizers is not None:
            return await self.tokenizers.decode(ids, skip_special_tokens)
        return self.renderer.decode(ids, skip_special_tokens)

    # --- a generation's life --------------------------------------------------------------

    def submit(
        self,
        inputs: RequestInputs,
        prompts: list[list[int]],
        params: list[SamplingParams],
        pooling: PoolingParams | None = None,
    ) -> Generation:
        """Admit and send the generation of one request (its prompts × n, `params` one
        per prompt; with `pooling`, each prompt's pooled vector instead); every
        submitted generation reaches finish()."""
        body = inputs.body
        kind = BeamGeneration if params[0].beam_width else Generation
        generation = kind(
            self.client,
            inputs.request_id,
            prompts,
            params,
            n=body.n,
            tokenizer=self.renderer.raw,
            stop=body.stop_strings,
            include_stop=body.include_stop_str_in_output,
            skip_special_tokens=body.skip_special_tokens,
            priority=inputs.priority,
            engine_rank=inputs.engine_rank,
            observer=self,
            lora_name=inputs.lora,
            cache_salt=body.cache_salt,
            pooling=pooling,
        )
        generation.trace_headers = inputs.trace_headers
        self.preflight()  # again: the engines may have died while this one was rendered
        choices = generation.choices
        try:
            self.admission.admit(len(choices), sum(len(c.prompt_ids) for c in choices))
        except AdmissionRejected as e:
            if self.metrics is not None:
                self.metrics.admission_rejected(e.reason)
            raise
        self.active.add(generation)
        try:
            generation.start()
        except EngineAsleepError as e:
            self.finish(generation)
            raise asleep_error(f"the engine is not available: {e}") from None
        except EngineDeadError as e:
            self.finish(generation)
            raise APIError(f"the engine is not available: {e}", 503) from None
        except BaseException:
            self.finish(generation)
            raise
        if self.config.enable_log_requests:
            c = choices[0]
            log.info(
                "request %s: %d choice(s), %d prompt tokens, max_tokens %d, engine %d",
                generation.request_id,
                len(choices),
                len(c.prompt_ids),
                c.params.max_tokens,
                generation.engine.rank,
            )
        return generation

    def finish(self, generation: Generation) -> None:
        """Release what submit() reserved and record the request (idempotent)."""
        if generation.done:
            return
        generation.done = True
        self.active.discard(generation)
        if len(generation.choices) > LARGE_FAN_OUT:
            self.large_request_seen = True
        generation.abort()
        waiting = sum(len(c.prompt_ids) for c in generation.choices if not c.first_token_time)
        self.admission.release(len(generation.choices), waiting)
        if self.metrics is not None:
            self.metrics.observe_request(generation, generation.params_n)
        if self.tracer is not None:
            self.tracer.record(generation, time.time_ns())

    # GenerationObserver
    def first_token(self, choice: Choice) -> None:
        self.admission.prefilled(len(choice.prompt_ids))

    def token_gap(self, seconds: float) -> None:
        if self.metrics is not None:
            self.metrics.observe_gap(seconds)
