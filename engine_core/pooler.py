"""--runner pooling: a request's prompt pooled into one vector instead of a generation.

The backend's head then answers the final (normed) hidden states where it would answer
logits (ModelBackend.pool_hidden_states), so a step gives one row per request whose
prompt ends in it, as a generating step gives a row to sample from. LAST pools that
row alone; MEAN and CLS need the prompt's other rows too, which the scheduler plans as
it plans a prompt's logprob rows (and so never serves them from the prefix cache).
"""

from __future__ import annotations

import torch

from engine_core.request import Request
from engine_core.scheduler import SchedulerOutput
from protocol.messages import EngineCoreOutput, FinishReason

POOLING_TYPES = ("LAST", "MEAN", "CLS")


class Pooler:
    """Turns a pooling step's hidden-state rows into each finished request's vector."""

    def __init__(self, pooling_type: str, hidden_size: int) -> None:
        if pooling_type not in POOLING_TYPES:
            raise ValueError(
                f"pooling_type must be one of {', '.join(POOLING_TYPES)}; got {pooling_type!r}"
            )
        self.pooling_type = pooling_type
        self.hidden_size = hidden_size
        # MEAN and CLS read rows before the prompt's last one.
        self.needs_prompt_rows = pooling_type != "LAST"

    def admit(self, request: Request) -> None:
        """A new request: refuse what this pooler cannot answer, naming the field; plan
        its prompt's rows when the pooler needs them."""
        params = request.pooling
        if params is None:
            raise ValueError(
                "this engine pools (--runner pooling): it answers embeddings, not generations"
            )
        dims = params.dimensions
        if dims is not None and not 1 <= dims <= self.hidden_size:
            raise ValueError(f"dimensions must be in 1..{self.hidden_size}; got {dims}")
        if self.needs_prompt_rows:
            request.prompt_logprobs_done = False

    def step(self, plan: SchedulerOutput, hidden: torch.Tensor) -> None:
        """Keep what this step's rows add to each request's pool: `hidden` holds one row
        per `plan.sampling` request (its prompt's last), then the rows of
        `plan.prompt_logprob_rows` in order."""
        if not self.needs_prompt_rows:
            return
        offset = len(plan.sampling)
        for request, first, end in plan.prompt_logprob_rows:
            rows = hidden[offset : offset + end - first]
            offset += end - first
            if self.pooling_type == "MEAN":
                request.prompt_logprobs_parts.append(rows.sum(dim=0))
            elif first == 0:  # CLS: the prompt's first row
                request.prompt_logprobs_parts.append(rows[0])

    def outputs(self, plan: SchedulerOutput, hidden: torch.Tensor) -> list[EngineCoreOutput]:
        """The answer of each request whose prompt ended this step (after step())."""
        answers = []
        for i, request in enumerate(plan.sampling):
            last = hidden[i]
            parts = request.prompt_logprobs_parts
            if self.pooling_type == "MEAN":
                vector = (
                    torch.stack(parts).sum(dim=0) + last if parts else last
                ) / request.prompt_len
            elif self.pooling_type == "CLS":
                vector = parts[0] if parts else last  # a one-token prompt: its only row
            else:
                vector = last
            request.prompt_logprobs_parts = []
            answers.append(
                EngineCoreOutput(
                    request_id=request.request_id,
                    new_token_ids=[],
                    finish_reason=FinishReason.STOP,
                    num_cached_tokens=max(request.num_cached_tokens, 0),
                    pooled=_encode(vector, request.pooling.dimensions, request.pooling.normalize),
                )
            )
        return answers


def _encode(vector: torch.Tensor, dimensions: int | None, normalize: bool) -> bytes:
    """The vector as the wire carries it: float32, little-endian (as x86 and ARM hold it)."""
    v = vector.float()
    if dimensions is not None:
        v = v[:dimensions]
    if normalize:
        v = torch.nn.functional.normalize(v, dim=-1)
    return v.cpu().numpy().astype("<f4").tobytes()
