"""Who waits in which order, and who gives way under pressure: `--scheduling-policy`.

A policy owns the requests that are not running. The scheduler asks it for the next
request to admit and, when KV blocks run out, for the running request to preempt.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Hashable, Mapping

from engine_core.request import Request


class FcfsPolicy:
    """First come, first served, with the sequences of one API request (n > 1, or
    several prompts) queued together in one lane: lanes take turns at admission, so
    one request's thousand children cannot keep a later request waiting behind all
    of them. A request alone is a lane of its own, so plain traffic is pure FCFS.
    Under block pressure the newest running request gives way."""

    def __init__(self) -> None:
        self._lanes: deque[deque[Request]] = deque()
        self._lane_of: dict[Hashable, deque[Request]] = {}
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def add(self, request: Request) -> None:
        lane = self._lane_of.get(request.group_key)
        if lane is None:
            lane = self._lane_of[request.group_key] = deque()
            self._lanes.append(lane)
        lane.append(request)
        self._count += 1

    def add_preempted(self, request: Request, behind_head: bool = False) -> None:
        """First in line again (or second, `behind_head`, when it made room for the
        request at the head)."""
        lane = self._lane_of.get(request.group_key)
        if lane is None:
            lane = self._lane_of[request.group_key] = deque()
            self._lanes.insert(1 if behind_head and self._lanes else 0, lane)
        lane.appendleft(request)
        self._count += 1

    def peek(self) -> Request:
        return self._lanes[0][0]

    def pop(self) -> Request:
        lane = self._lanes.popleft()
        request = lane.popleft()
        if lane:
            self._lanes.append(lane)  # its next sequence waits for the other lanes' turn
        else:
            del self._lane_of[request.group_key]
        self._count -= 1
        return request

    def remove(self, request: Request) -> None:
        lane = self._lane_of[request.group_key]
        lane.remove(request)
        if not lane:
            self._lanes.remove(lane)
            del self._lane_of[request.group_key]
        self._count -= 1

    def pick_victim(self, candidates: list[Request]) -> Request:
        return candidates[-1]

    def promote_newcomer(self, running_per_group: Mapping[Hashable, int]) -> Request | None:
        """Move the first lane whose group has nothing running to the front; return its
        request (None: every waiting lane already runs something)."""
        for i, lane in enumerate(self._lanes):
            if not running_per_group.get(lane[0].group_key):
                if i:
                    del self._lanes[i]
                    self._lanes.appendleft(lane)
                return lane[0]
        return None


class PriorityPolicy:
    """Lower `priority` first, then earlier arrival; under block pressure the least
    important running request gives way."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self._heap)

    def add(self, request: Request) -> None:
        heapq.heappush(self._heap, (*request.sort_key(), next(self._seq), request))

    def add_preempted(self, request: Request, behind_head: bool = False) -> None:
        self.add(request)  # its own key puts it back in place

    def peek(self) -> Request:
        return self._heap[0][3]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[3]

    def remove(self, request: Request) -> None:
        self._heap = [e for e in self._heap if e[3] is not request]
        heapq.heapify(self._heap)

    def pick_victim(self, candidates: list[Request]) -> Request:
        return max(candidates, key=Request.sort_key)

    def promote_newcomer(self, running_per_group: Mapping[Hashable, int]) -> Request | None:
        return None  # priority decides who runs, not turns


POLICIES = {"fcfs": FcfsPolicy, "priority": PriorityPolicy}


def make_policy(name: str) -> FcfsPolicy | PriorityPolicy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(
            f"scheduling_policy must be one of {', '.join(POLICIES)}; got {name!r}"
        ) from None
