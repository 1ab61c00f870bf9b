"""The parity profiles of pooling servers (`zserve bench parity --profile pooling` and
`classify`): both servers --runner pooling on the same model, an embedding model or a
one-label classifier (a cross-encoder)."""

from __future__ import annotations

from benchmarks.parity_cases import USER, C, Case

EMBED = "/v1/embeddings"


def _vectors(d: dict) -> list:
    """Count, width and the usage of an embeddings answer, and each vector's first value
    to two places (both pool the same bf16 hidden states; the last digits may differ)."""
    key = "embedding" if d["data"][0]["object"] == "embedding" else "data"
    vectors = [x[key] for x in d["data"]]
    firsts = [round(v[0], 2) if isinstance(v, list) else len(v) for v in vectors]
    return [len(vectors), len(vectors[0]), d["usage"]["prompt_tokens"], firsts]


def _cohere(d: dict) -> list:
    """A /v2/embed answer's keys, each type's count and width, the floats' first values
    to two places, and the billed tokens."""
    e = d["embeddings"]
    shapes = {k: [len(v), len(v[0])] for k, v in e.items()}
    firsts = [round(v[0], 2) for v in e.get("float", [])]
    return [sorted(d), shapes, firsts, d["meta"]["billed_units"], d["response_type"]]


POOLING: list[Case] = [
    Case("-", "texts", "POST", EMBED, {"input": ["hello world", "def f(x): return x"]},
         probe=_vectors),
    Case("-", "token ids", "POST", EMBED, {"input": [[1, 283, 80]]}, probe=_vectors),
    Case("-", "a conversation", "POST", EMBED, {"messages": USER}, probe=_vectors),
    Case("-", "base64", "POST", EMBED, {"input": "hi", "encoding_format": "base64"},
         probe=_vectors),
    Case("-", "float16 base64", "POST", EMBED,
         {"input": "hi", "encoding_format": "base64", "embed_dtype": "float16"}, probe=_vectors),
    Case("-", "truncation keeps the first tokens", "POST", EMBED,
         {"input": [[1, 283, 80, 323]], "truncate_prompt_tokens": 2}, probe=_vectors),
    Case("-", "unnormalized", "POST", EMBED, {"input": "hi", "use_activation": False},
         probe=_vectors),
    Case("-", "/pooling", "POST", "/pooling", {"input": "hi"}, probe=_vectors),
    Case("-", "/invocations embeds", "POST", "/invocations", {"input": "hi"}, probe=_vectors),
    Case("-", "no input is a 400", "POST", EMBED, {"input": []}),
    Case("-", "dimensions without Matryoshka is a 400", "POST", EMBED,
         {"input": "hi", "dimensions": 8}),
    Case("-", "normalize is a 400", "POST", EMBED, {"input": "hi", "normalize": True}),
    Case("-", "a token past the vocabulary is a 400", "POST", EMBED, {"input": [[99999]]}),
    Case("-", "an input past the context is a 400", "POST", EMBED, {"input": [[1] * 2049]}),
    Case("-", "completions are not served", "POST", C, {"prompt": "hi"}),
    Case("-", "score 1:N", "POST", "/score",
         {"queries": "what is python", "documents": ["python is a language", "snakes"]},
         probe=lambda d: [d["usage"]["prompt_tokens"], [round(x["score"], 2) for x in d["data"]]]),
    Case("-", "score N:N, text_1/text_2", "POST", "/v1/score",
         {"text_1": ["a", "b"], "text_2": ["c", "d"]},
         probe=lambda d: [round(x["score"], 2) for x in d["data"]]),
    Case("-", "score with max_tokens_per_doc", "POST", "/score",
         {"queries": "hello world", "documents": "hello there world", "max_tokens_per_doc": 2},
         probe=lambda d: d["usage"]["prompt_tokens"]),
    Case("-", "rerank, top_n", "POST", "/rerank",
         {"query": "what is python", "documents": ["snakes", "python is a language", "x"],
          "top_n": 2}, probe=lambda d: [r["index"] for r in d["results"]]),
    Case("-", "score 2:3 is a 400", "POST", "/score",
         {"data_1": ["a", "b"], "data_2": ["c", "d", "e"]}),
    Case("-", "score without documents is a 400", "POST", "/score",
         {"queries": "a", "documents": []}),
    Case("-", "cohere embed", "POST", "/v2/embed",
         {"texts": ["hello world", "def f(x): return x"]}, probe=_cohere),
    Case("-", "cohere embed, every type", "POST", "/v2/embed",
         {"texts": ["hi"], "embedding_types": ["float", "binary", "ubinary", "base64"]},
         probe=_cohere),
    Case("-", "cohere inputs", "POST", "/v2/embed",
         {"inputs": [{"content": [{"type": "text", "text": "hi"}]}]}, probe=_cohere),
    Case("-", "cohere truncate START", "POST", "/v2/embed",
         {"texts": ["hello there world"], "truncate": "START", "max_tokens": 2}, probe=_cohere),
    Case("-", "cohere truncate NONE past max_tokens is a 400", "POST", "/v2/embed",
         {"texts": ["hello there world"], "truncate": "NONE", "max_tokens": 2}),
    Case("-", "cohere input_type the model has no prompt for is a 400", "POST", "/v2/embed",
         {"texts": ["hi"], "input_type": "search_query"}),
    Case("-", "cohere images are a 400", "POST", "/v2/embed",
         {"images": ["data:image/png;base64,AA=="]}),
]  # fmt: skip


def _classes(d: dict) -> list:
    """Each answer's class count, label and probabilities to two places, and the usage."""
    data = [x for x in d["data"]]
    probs = [[round(p, 2) for p in x.get("probs", x.get("data"))] for x in data]
    return (
        [[x.get("num_classes"), x.get("label")] for x in data],
        probs,
        d["usage"]["prompt_tokens"],
    )


def _scores(d: dict) -> list:
    return [d["usage"]["prompt_tokens"], [round(x["score"], 2) for x in d["data"]]]


# Both servers on a one-label *ForSequenceClassification model (a cross-encoder).
CLASSIFY: list[Case] = [
    Case("-", "classify texts", "POST", "/classify",
         {"input": ["hello world", "def f(x): return x"]}, probe=_classes),
    Case("-", "classify token ids", "POST", "/classify", {"input": [[1, 283, 80]]},
         probe=_classes),
    Case("-", "classify a conversation", "POST", "/classify", {"messages": USER}, probe=_classes),
    Case("-", "classify without the activation", "POST", "/classify",
         {"input": "hi", "use_activation": False}, probe=_classes),
    Case("-", "/pooling classifies", "POST", "/pooling", {"input": "hi"}, probe=_classes),
    Case("-", "/invocations classifies", "POST", "/invocations", {"input": "hi"},
         probe=_classes),
    Case("-", "classify nothing is a 400", "POST", "/classify", {"input": []}),
    Case("-", "classify past the context is a 400", "POST", "/classify",
         {"input": [[1] * 2049]}),
    Case("-", "embeddings are not served", "POST", EMBED, {"input": "hi"}),
    Case("-", "score 1:N", "POST", "/score",
         {"queries": "what is python", "documents": ["python is a language", "snakes"]},
         probe=_scores),
    Case("-", "score N:N, text_1/text_2", "POST", "/v1/score",
         {"text_1": ["a", "b"], "text_2": ["c", "d"]}, probe=_scores),
    Case("-", "score without the activation", "POST", "/score",
         {"queries": "a", "documents": ["b"], "use_activation": False}, probe=_scores),
    Case("-", "score with max_tokens_per_doc", "POST", "/score",
         {"queries": "hello world", "documents": "hello there world", "max_tokens_per_doc": 2},
         probe=_scores),
    Case("-", "rerank, top_n", "POST", "/rerank",
         {"query": "what is python", "documents": ["snakes", "python is a language", "x"],
          "top_n": 2}, probe=lambda d: [[r["index"], round(r["relevance_score"], 2)]
                                        for r in d["results"]]),
    Case("-", "score 2:3 is a 400", "POST", "/score",
         {"data_1": ["a", "b"], "data_2": ["c", "d", "e"]}),
]  # fmt: skip


PROFILES = {"pooling": POOLING, "classify": CLASSIFY}
