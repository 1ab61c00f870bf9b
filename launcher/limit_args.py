"""`zserve serve`'s limits on what one client may send, and the RequestLimits they make.

serve_args.py adds the group where it belongs in --help; plan.py reads it back.
"""

from __future__ import annotations

import argparse

from frontend.limits import RequestLimits
from launcher.arg_types import non_negative, parse_bytes, positive_int


def add_limit_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "limits", "what one client may send; every refusal names the field and the flag"
    )
    g.add_argument(
        "--max-request-body-bytes",
        type=parse_bytes,
        default=RequestLimits.max_body_bytes,
        help="largest request body (413 above it), e.g. 8MiB",
    )
    g.add_argument(
        "--max-header-bytes",
        "--h11-max-incomplete-event-size",
        dest="max_header_bytes",
        type=parse_bytes,
        default=RequestLimits.max_header_bytes,
        help="largest request line plus headers (431 above it); the second name is vLLM's",
    )
    g.add_argument(
        "--max-header-count",
        "--h11-max-header-count",
        dest="max_header_count",
        type=positive_int,
        default=RequestLimits.max_header_count,
        help="most headers in one request (431 above it); the second name is vLLM's",
    )
    g.add_argument(
        "--header-read-timeout",
        type=non_negative,
        default=RequestLimits.header_timeout_s,
        help="seconds a client has to send a request's headers (408 after; 0: no limit)",
    )
    g.add_argument(
        "--body-read-timeout",
        type=non_negative,
        default=RequestLimits.body_timeout_s,
        help="seconds a client has to send a request's body once its headers are in (408 "
        "after; 0: no limit)",
    )
    g.add_argument(
        "--max-prompt-chars",
        type=positive_int,
        default=None,
        help="longest prompt text, checked before tokenizing (default: what max_model_len can "
        "hold, max_model_len x the longest token's characters)",
    )
    g.add_argument(
        "--max-prompts-per-request",
        type=positive_int,
        default=RequestLimits.max_prompts,
        help="most prompts in one completions request",
    )
    g.add_argument(
        "--max-sequences-per-request",
        type=positive_int,
        default=RequestLimits.max_sequences,
        help="most sequences one request may run (prompts x n); also the largest n",
    )
    g.add_argument(
        "--max-stop-strings",
        type=positive_int,
        default=RequestLimits.max_stop_strings,
        help="most stop strings in one request",
    )
    g.add_argument(
        "--max-stop-string-length",
        type=positive_int,
        default=RequestLimits.max_stop_chars,
        help="longest stop string, in characters",
    )
    g.add_argument(
        "--max-request-id-length",
        type=positive_int,
        default=RequestLimits.max_request_id_chars,
        help="longest request_id or X-Request-Id, in characters",
    )
    g.add_argument(
        "--max-chat-messages",
        type=positive_int,
        default=RequestLimits.max_messages,
        help="most messages in one chat request",
    )
    g.add_argument(
        "--max-concurrent-streams",
        type=positive_int,
        default=RequestLimits.max_concurrent_streams,
        help="most gRPC streams (requests) one connection may hold open at once (--grpc)",
    )
    g.add_argument(
        "--tokenizer-pool-size",
        type=int,
        default=1,
        help="worker processes per API server that tokenize long texts, so they never hold "
        "the serving loop (0: a thread of the API server, which does hold it)",
    )
    g.add_argument(
        "--tokenize-timeout",
        type=non_negative,
        default=60.0,
        help="seconds one long text may take to tokenize before its request fails",
    )


def request_limits(args: argparse.Namespace) -> RequestLimits:
    return RequestLimits(
        max_body_bytes=args.max_request_body_bytes,
        max_header_bytes=args.max_header_bytes,
        max_header_count=args.max_header_count,
        header_timeout_s=args.header_read_timeout,
        body_timeout_s=args.body_read_timeout,
        max_prompt_chars=args.max_prompt_chars,
        max_prompts=args.max_prompts_per_request,
        max_sequences=args.max_sequences_per_request,
        max_stop_strings=args.max_stop_strings,
        max_stop_chars=args.max_stop_string_length,
        max_request_id_chars=args.max_request_id_length,
        max_messages=args.max_chat_messages,
        max_concurrent_streams=args.max_concurrent_streams,
    )
