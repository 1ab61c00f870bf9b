"""--runner pooling: a request's prompt pooled into one vector instead of a generation.

The backend's head then answers the final (normed) hidden states where it would answer
logits (ModelBackend.pool_hidden_states), so a step gives one row per request whose
prompt ends in it, as a generating step gives a row to sample from. LAST pools that
row alone; MEAN and CLS need the prompt's other rows too, which the scheduler plans as
it plans a prompt's logprob rows (and so never serves them from the prefix cache).

A sequence-classification model (EngineConfig.classifier) then runs its score head
over the pooled state, in float32: the answer is the labels' logits, or with
use_activation their softmax (or sigmoid, or nothing: the model's config says).
"""

from __future__ import annotations

import torch

from engine_core.config import ClassifierConfig, EngineConfig
from engine_core.model_loader import CheckpointTensors, ModelInfo
from engine_core.request import Request
from engine_core.scheduler import SchedulerOutput
from protocol.messages import EngineCoreOutput, FinishReason

POOLING_TYPES = ("LAST", "MEAN", "CLS")


class Pooler:
    """Turns a pooling step's hidden-state rows into each finished request's vector."""

    def __init__(self, pooling_type: str, hidden_size: int, head: ScoreHead | None = None) -> None:
        if pooling_type not in POOLING_TYPES:
            raise ValueError(
                f"pooling_type must be one of {', '.join(POOLING_TYPES)}; got {pooling_type!r}"
            )
        self.pooling_type = pooling_type
        self.hidden_size = hidden_size
        self.head = head
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
        if dims is not None and self.head is not None:
            raise ValueError("dimensions: a classification model's answer has no dimensions")
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
                    pooled=self._answer(vector, request.pooling),
                )
            )
        return answers

    def _answer(self, vector: torch.Tensor, params) -> bytes:
        """The request's answer as the wire carries it: float32, little-endian (as x86
        and ARM hold it)."""
        v = vector.float()
        if self.head is not None:
            v = self.head(v, params.use_activation)
        else:
            if params.dimensions is not None:
                v = v[: params.dimensions]
            if params.use_activation:
                v = torch.nn.functional.normalize(v, dim=-1)
        return v.cpu().numpy().astype("<f4").tobytes()


class ScoreHead:
    """A classification model's head: the labels' logits from the pooled state, and
    their activation."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, activation: str) -> None:
        self.weight, self.bias = weight.float(), None if bias is None else bias.float()
        self.activation = activation

    def __call__(self, pooled: torch.Tensor, use_activation: bool) -> torch.Tensor:
        logits = self.weight @ pooled
        if self.bias is not None:
            logits = logits + self.bias
        if not use_activation or self.activation == "identity":
            return logits
        if self.activation == "sigmoid":
            return torch.sigmoid(logits)
        return torch.softmax(logits, dim=-1)


def make_pooler(config: EngineConfig, info: ModelInfo) -> Pooler | None:
    """The engine's pooler (None: the engine generates)."""
    if config.runner != "pooling":
        return None
    hidden_size = int(info.hf_config.hidden_size)
    head = None if config.classifier is None else load_score_head(config.classifier, info)
    return Pooler(config.pooling_type, hidden_size, head)


def load_score_head(spec: ClassifierConfig, info: ModelInfo) -> ScoreHead:
    """The checkpoint's score.weight (and score.bias), or for an LLM used as a
    classifier the rows of its LM head that `spec.from_tokens` name."""
    w = CheckpointTensors(info.path, torch.float32, torch.device("cpu"))
    if not spec.from_tokens:
        if not w.has("score.weight"):
            raise ValueError(
                f"{info.path}: a classification model needs its score head (score.weight), "
                "and the checkpoint has none"
            )
        weight = w.get("score.weight")
        bias = w.get("score.bias") if w.has("score.bias") else None
    else:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(info.path)
        ids = [tokenizer.convert_tokens_to_ids(t) for t in spec.from_tokens]
        if any(i is None or i == tokenizer.unk_token_id for i in ids):
            raise ValueError(f"classifier_from_token: {list(spec.from_tokens)} are not all tokens")
        rows = w.get("lm_head.weight" if w.has("lm_head.weight") else "model.embed_tokens.weight")
        weight, bias = rows[ids], None
        if spec.two_way:  # from_2_way_softmax: softmax([no, yes])[1] = sigmoid(yes - no)
            weight = weight[1:] - weight[:1]
    if weight.shape != (spec.num_labels, info.hf_config.hidden_size):
        raise ValueError(
            f"{info.path}: score head of shape {tuple(weight.shape)}, expected "
            f"({spec.num_labels}, {info.hf_config.hidden_size}) (num_labels, hidden_size)"
        )
    return ScoreHead(weight, bias, spec.activation)
