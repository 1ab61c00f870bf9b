"""The engine controls an API server may invoke (development and profiler routes, the
gRPC door's FlushCache / StartProfile / StopProfile): their utility-method names and
the values each argument may take. Both sides check against these: the API server
answers a 4xx before sending, the engine refuses anything else.
"""

from __future__ import annotations

SLEEP_LEVELS = (1, 2)  # 1: the KV cache goes; 2: the weights too (reloaded from disk)
# What happens to an engine's requests when it is put to sleep (vLLM's PauseMode):
#   abort: they end at once, with a 503 error (retry once awake);
#   wait:  new ones are refused, the sleep happens once the engine's own have finished;
#   keep:  they are frozen (their KV cache goes; recomputed after wake-up) and resume.
SLEEP_MODES = ("abort", "wait", "keep")
# POST /pause takes the same modes, but a paused engine takes new requests: they queue
# until POST /resume. abort: in-flight requests end (a 503 error); wait: they finish
# first, the pause answers then; keep: they are frozen where they are, KV cache kept.
PAUSE_MODES = SLEEP_MODES
# What a paused engine holds back (its scheduler's `hold`, and SchedulerStats'
# generation_hold, "" when not paused): HOLD_NEW, waiting requests (running ones go on:
# modes abort and wait); HOLD_ALL, everything (running ones frozen where they are: keep).
HOLD_NEW = "new"
HOLD_ALL = "all"
WAKE_TAGS = ("weights", "kv_cache")  # what a wake-up may restore (all when none given)

# Utility methods behind the dedicated routes.
SLEEP = "sleep"
WAKE_UP = "wake_up"
IS_SLEEPING = "is_sleeping"
RESET_PREFIX_CACHE = "reset_prefix_cache"
START_PROFILE = "start_profile"
STOP_PROFILE = "stop_profile"
COLLECTIVE_RPC = "collective_rpc"  # args: [one of COLLECTIVE_RPC_METHODS]
PAUSE = "pause"  # args: [mode, clear_cache]
RESUME = "resume"
IS_PAUSED = "is_paused"
# args: [API request ids]: end their engine requests, whichever API server sent them;
# the answer lists the ids the engine had.
ABORT_REQUESTS = "abort_requests"
MAX_ABORT_IDS = 1024  # request ids per call
CONTROL_METHODS = frozenset(
    (SLEEP, WAKE_UP, IS_SLEEPING, RESET_PREFIX_CACHE, START_PROFILE, STOP_PROFILE)
    + (COLLECTIVE_RPC, PAUSE, RESUME, IS_PAUSED, ABORT_REQUESTS)
)

# What POST /collective_rpc may run on every engine: read-only or harmless methods that
# take no arguments and answer JSON. Everything else is refused (vLLM runs any worker
# method by name there; zserve does not).
COLLECTIVE_RPC_METHODS = {
    "ping": "answers 'pong': the engine's busy loop is responsive",
    "is_sleeping": "whether the engine sleeps",
    "sleep_state": "the sleep level, whether new requests are refused, what is released",
    "memory_usage": "resident bytes of the engine process, KV cache and device bytes",
    "get_stats": "the engine's scheduler statistics, as /server_info shows them",
    "reset_prefix_cache": "forget the cached prefix blocks (false while blocks are in use)",
}

# A control result that is not a failure of the engine but a refusal of the request in
# the engine's current state (sleep while asleep, stop a profiler never started):
# {"conflict": message}. The API server answers 409 when every engine refused.
CONFLICT = "conflict"
