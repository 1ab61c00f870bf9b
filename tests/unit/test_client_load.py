"""ClientLoad: what each API server has heard of an engine's load, and when it hears more."""

from __future__ import annotations

from engine_core.client_load import STATS_INTERVAL_S, ClientLoad
from protocol.messages import SchedulerStats


def test_unfinished_requests_per_server_are_received_less_settled():
    load = ClientLoad(2)
    assert load.count_in(0) and load.count_in(0) and load.count_in(1)
    assert not load.count_in(2)  # no such API server: not counted
    load.settle(0)
    load.settle(5)  # ignored likewise
    assert load.by_client() == [1, 1]


def test_a_beam_search_weighs_its_width_until_it_settles():
    load = ClientLoad(2)
    load.count_in(0, 4)  # n=4 beams: as much work as four samples
    load.count_in(1)
    assert load.by_client() == [4, 1]
    load.settle(0, 4)
    assert load.by_client() == [0, 1]


def test_a_settled_request_is_published_once():
    load = ClientLoad(1)
    load.count_in(0)
    assert not load.settled_since_publish()
    load.settle(0)
    assert load.settled_since_publish()
    assert not load.settled_since_publish()


def test_stats_only_messages_go_to_servers_that_missed_a_change_at_most_every_interval():
    load = ClientLoad(2)
    now = 100.0
    load.heard(0, (1, 0, 10), now)  # server 0 got outputs with this load
    assert load.stats_due((1, 0, 10), now) == [1]  # server 1 has heard nothing yet
    assert load.stats_due((2, 0, 9), now + STATS_INTERVAL_S / 2) == []  # too soon for both
    assert load.stats_due((2, 0, 9), now + 2 * STATS_INTERVAL_S) == [0, 1]
    assert load.stats_due((2, 0, 9), now + 9 * STATS_INTERVAL_S) == []  # nothing new, idle


def test_at_most_one_load_update_waits_and_a_later_change_queues_another():
    load = ClientLoad(2)
    assert load.claim_update()
    assert not load.claim_update()
    load.begin_update()
    assert load.claim_update()


def test_a_server_is_stale_until_told_the_other_servers_requests():
    load = ClientLoad(2)
    load.count_in(1)
    by_client = load.begin_update()
    assert load.is_stale(0, by_client)  # server 1's request is news to server 0
    assert not load.is_stale(1, by_client)  # its own requests are not counted for it
    load.note_told(0, SchedulerStats(num_requests_by_client=by_client))
    assert not load.is_stale(0, by_client)
