"""A seated rank's presence at the membership service (live/presence.py): the bookkeeping
and the address convention, without sockets (the wire is tests/integration/test_live_service.py)."""

from __future__ import annotations

from torchlaunch.live import presence


def test_the_presence_port_is_the_lighthouses_next_and_only_of_an_http_address() -> None:
    assert presence.address_of("http://lh.example:29510") == ("lh.example", 29511)
    assert presence.address_of("http://[::1]:29510") == ("::1", 29511)
    assert presence.address_of("http://lh:65535") is None  # no next port
    for bad in ("", "lh:29510", "http://lh:0", "http://lh:29510/x", "http://l h:1", "http://lh:\u0661"):
        assert presence.address_of(bad) is None, bad


def test_the_board_counts_the_ranks_heard_from_within_the_bound() -> None:
    board = presence.Board(bound_s=1.0)
    board.hello("rank000000", key=3, now=10.0)
    board.hello("rank000001", key=4, now=10.0)
    assert board.alive(10.5) == 2
    board.beat("rank000000", key=3, now=10.9)
    assert board.alive(11.5) == 1  # rank 1 last heard at 10.0
    assert board.newly_lapsed(11.5) == ["rank000001"]
    assert board.newly_lapsed(11.6) == []  # reported once
    board.beat("rank000001", key=4, now=11.7)  # heard again: counted, and may lapse again
    assert board.alive(11.7) == 2
    assert board.newly_lapsed(12.8) == ["rank000000", "rank000001"]


def test_a_rank_connected_again_is_not_lost_with_its_old_connection() -> None:
    board = presence.Board(bound_s=1.0)
    board.hello("rank000001", key=4, now=0.0)
    board.hello("rank000001", key=9, now=0.1)  # the same rank on a new connection
    board.beat("rank000001", key=4, now=5.0)  # the old connection's lines count no more
    assert board.alive(1.2) == 0 and board.alive(1.0) == 1
    assert board.leave("rank000001", key=4) is False  # the old one closing is no loss
    assert board.alive(0.5) == 1
    assert board.leave("rank000001", key=9) is True
    assert board.alive(0.5) == 0 and board.leave("rank000001", key=9) is False


def test_replica_ids_on_the_wire_are_short_and_plain() -> None:
    for good in ("rank000000", "rejoin001-rank000003"):
        assert presence.REPLICA_ID.fullmatch(good)
    for bad in ("", "-x", "rank 1", "rank\u0661", "r" * 65, "rank\x00", "../rank"):
        assert not presence.REPLICA_ID.fullmatch(bad), bad
