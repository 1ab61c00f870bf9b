"""What each API server has heard of this engine's load, and when it must hear more.

An API server balances by the other servers' unfinished requests on each engine (it
counts its own itself, at once) and shows the engine's stats as metrics. Load reaches
it four ways, each paced or recorded here:

- with each step's outputs, in the stats made after that step;
- a stats-only message to a server that had no outputs to carry a change, at most
  every STATS_INTERVAL_S (`stats_due`), idle included: a server keeps steering by what
  it last heard until told otherwise, and the final "all done" matters most;
- a load update, at once, to each server whose count of the *other* servers' requests
  here is stale, after requests arrive or settle (`claim_update`, `begin_update`):
  what a server balances by must not lag behind a burst;
- the heartbeat, every HEARTBEAT_S, to every server (liveness).

Three threads share one ClientLoad, and each field has one writer. The input thread
counts a request in as it arrives, not when the busy loop gets to it: a step can take
a while (a long prefill, a core shared with the API servers). The busy loop settles
requests and paces stats-only messages; the output thread records what each server
heard. The reasons and the races behind this are in BENCHMARKS.md §5.
"""

from __future__ import annotations

from protocol.messages import SchedulerStats, others_requests

# Stats reach every API server at least this often while they change (metrics), and
# every HEARTBEAT_S regardless (liveness).
STATS_INTERVAL_S = 0.1
HEARTBEAT_S = 1.0

LoadKey = tuple[int, int, int]


def load_key(stats: SchedulerStats) -> LoadKey:
    """The stats an API server needs fresh between outputs: the engine's load (for
    balancing) and its free KV blocks (for metrics)."""
    return stats.num_running, stats.num_waiting, stats.num_free_blocks


class ClientLoad:
    """Unfinished requests per API server (received - settled) and what each heard."""

    def __init__(self, num_clients: int) -> None:
        # Sequences, not requests: a beam search of width n weighs n (protocol:
        # EngineCoreRequest.num_sequences), as n separate samples would.
        self.received = [0] * num_clients  # the input thread's
        self.settled = [0] * num_clients  # the busy loop's: finished, aborted or refused
        # The others' requests each server last heard of; the output thread's.
        self.told_others = [0] * num_clients
        self._update_queued = False
        # The busy loop's: the load key each server last heard, and when.
        self._told_key: list[LoadKey | None] = [None] * num_clients
        self._last_sent = [0.0] * num_clients
        self._settled_since_publish = False

    # --- the input thread -----------------------------------------------------------

    def count_in(self, client_index: int, weight: int = 1) -> bool:
        """A request arrived from this API server (`weight`: the sequences it runs, a
        beam search's width); False for an index no server has."""
        if 0 <= client_index < len(self.received):
            self.received[client_index] += weight
            return True
        return False

    # --- the busy loop --------------------------------------------------------------

    def settle(self, client_index: int, weight: int = 1) -> None:
        """A request counted in is done with (any outcome), with the weight it came in with."""
        if 0 <= client_index < len(self.settled):
            self.settled[client_index] += weight
            self._settled_since_publish = True

    def by_client(self) -> list[int]:
        return [r - s for r, s in zip(self.received, self.settled)]

    def heard(self, client_index: int, key: LoadKey, now: float) -> None:
        """This server's outputs were queued with stats of this load key."""
        self._told_key[client_index] = key
        self._last_sent[client_index] = now

    def stats_due(self, key: LoadKey, now: float) -> list[int]:
        """The servers to send a stats-only message now, counted as told: the load key
        changed since they last heard, and STATS_INTERVAL_S has passed since then."""
        due = []
        for index, told in enumerate(self._told_key):
            if told != key and now - self._last_sent[index] >= STATS_INTERVAL_S:
                self.heard(index, key, now)
                due.append(index)
        return due

    def settled_since_publish(self) -> bool:
        """Whether requests settled since the last call: the others' counts changed."""
        settled, self._settled_since_publish = self._settled_since_publish, False
        return settled

    # --- the input thread and the busy loop -----------------------------------------

    def claim_update(self) -> bool:
        """Whether the caller should queue a load update: at most one waits."""
        if self._update_queued:
            return False
        self._update_queued = True
        return True

    # --- the output thread ----------------------------------------------------------

    def begin_update(self) -> list[int]:
        """The counts a load update carries. The queued update is taken before they are
        read, so a change after this queues another."""
        self._update_queued = False
        return self.by_client()

    def is_stale(self, client_index: int, by_client: list[int]) -> bool:
        """Whether this server's count of the other servers' requests is out of date."""
        return others_requests(by_client, client_index) != self.told_others[client_index]

    def note_told(self, client_index: int, stats: SchedulerStats) -> None:
        """This server is being sent these stats."""
        if stats.num_requests_by_client:
            self.told_others[client_index] = others_requests(
                stats.num_requests_by_client, client_index
            )
