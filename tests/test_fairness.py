"""What atop sees under churn, and replies within atop's limits whatever the input."""

from __future__ import annotations

import render_oracle
from hypothesis import given, settings
from hypothesis import strategies as st
from snapshots import dev, proc, snap
from twisted.logger import globalLogPublisher

from atopgpud_tw import codec
from atopgpud_tw.counters import DeviceTotals, ProcessTotals
from atopgpud_tw.server.atop import render
from atopgpud_tw.server.atop.board import Board

BIG = 30 * 1024 * 1024


def churned_board(exits: int, limit: int = 8192) -> tuple[Board, list]:
    """A board with four 30 GB processes and `exits` small ones that ended since a client's S."""
    board = Board(exited_limit=limit)
    queue = board.attach()
    big = tuple(proc(100 + i, memory=BIG) for i in range(4))
    small = tuple(proc(1000 + i, memory=1) for i in range(exits))
    board.fold(snap(dev("a", processes=big + small)))
    board.stats_body(2, queue)
    board.fold(snap(dev("a", processes=big)))
    return board, [queue]


def test_active_processes_keep_their_place_however_many_exits_are_queued():
    """300 exits queued: every reply still lists the four largest active processes."""
    board, (queue,) = churned_board(300)
    seen: list[int] = []
    for _ in range(10):
        body = board.stats_body(2, queue)
        assert len(codec.frame(2, body)) <= codec.ATOP_REPLY_LIMIT
        (device,) = codec.parse_stats(body, 2)
        assert {p.pid for p in device.processes if p.state == "A"} == {100, 101, 102, 103}
        seen.extend(p.pid for p in device.processes if p.state == "E")
        if not queue.entries:
            break
    assert seen == [1000 + i for i in range(300)], "each exit once, in order"
    assert not board.behind


def test_version_1_replies_share_the_same_way():
    """Version 1: the same fair share, every exit once and in order."""
    board, (queue,) = churned_board(300)
    seen: list[int] = []
    while queue.entries:
        (device,) = codec.parse_stats(board.stats_v1(queue), 1)
        assert len([p for p in device.processes if p.state == "A"]) == 4
        seen.extend(p.pid for p in device.processes if p.state == "E")
    assert seen == [1000 + i for i in range(300)]


def test_a_client_that_falls_behind_loses_the_oldest_and_the_log_counts_them():
    """A full queue drops its oldest exits: counted, one warning, one line with the count when it asks."""
    events: list[dict] = []
    globalLogPublisher.addObserver(events.append)
    try:
        board, (queue,) = churned_board(300, limit=100)
        body = board.stats_body(2, queue)
        board.stats_body(2, queue)
    finally:
        globalLogPublisher.removeObserver(events.append)
    assert board.exited_dropped == 200
    (device,) = codec.parse_stats(body, 2)
    assert [p.pid for p in device.processes if p.state == "E"][0] == 1200, "the newest 100 are kept"
    warnings = [e for e in events if "is full" in e.get("log_format", "")]
    counted = [e for e in events if "were dropped" in e.get("log_format", "")]
    assert len(warnings) == 1 and len(counted) == 1 and counted[0]["lost"] == 200


def test_a_queue_of_thousands_costs_no_more_than_a_reply():
    """8192 queued exits: a reply renders at most as many records as can fit."""
    board, (queue,) = churned_board(8192)
    before = list(queue.entries)
    board.stats_body(2, queue)
    assert sum(len(e.records) for e in before) <= render.EXITED_SCAN
    assert list(queue.entries) == before[len(before) - len(queue.entries) :], "sent from the front"


names = st.text(min_size=0, max_size=20_000)
numbers = st.integers(min_value=-(2**70), max_value=2**70)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(names, names), min_size=1, max_size=120),
    st.lists(numbers, min_size=14, max_size=14),
    st.integers(min_value=0, max_value=300),
)
def test_every_reply_fits_and_parses_whatever_the_input(cards, values, procs):
    """Huge names, many devices, absurd numbers: T and S fit in 8192 bytes and atop's types."""
    devices = []
    for index, (name, busid) in enumerate(cards):
        totals = DeviceTotals(f"k{index}", busid, name, values[13] % 8)
        (totals.gpu_busy_now, totals.mem_busy_now, totals.memory_total_kib, totals.memory_used_kib,
         totals.samples, totals.gpu_busy_cum, totals.mem_busy_cum, totals.memory_used_cum_kib) = values[:8]
        if index < 2:
            for pid in range(procs):
                totals.processes[pid] = ProcessTotals(values[8] + pid, "C", *values[9:13], values[0])
        devices.append(totals)
    types = render.render_types(devices)
    assert len(codec.frame(2, types)) <= codec.ATOP_REPLY_LIMIT
    listed = codec.parse_types(types)
    assert len(listed) == min(len(devices), codec.MAX_WIRE_DEVICES)
    assert all(len(t.busid) <= codec.MAX_TOKEN_CHARS and len(t.name) <= codec.MAX_TOKEN_CHARS for t in listed)
    exited = [(0, ProcessTotals(values[8], "G", *values[9:13], values[1]))] * 50
    for version in (1, 2):
        body = render_oracle.render_stats(devices, version, exited).body
        assert len(codec.frame(version, body)) <= codec.ATOP_REPLY_LIMIT
        parsed = codec.parse_stats(body, version)
        assert len(parsed) == len(listed)
        for token in body.replace(b"@", b" ").replace(b"#", b" ").split():
            if token.lstrip(b"-").isdigit():
                assert -1 <= int(token) <= codec.LLONG_MAX
        assert all(len(d.processes) <= codec.MAX_PROCESSES_PER_DEVICE for d in parsed)


def test_ordinary_names_and_numbers_are_unchanged():
    """Clamping and cutting leave ordinary input byte for byte as it was."""
    device = DeviceTotals("a", "00000000:17:00.0", "NVIDIA H100 80GB HBM3", 3)
    assert render.render_types([device]) == b"1@00000000:17:00.0 NVIDIA_H100_80GB_HBM3 3"
    gone = ProcessTotals(4242, "C+G", 3, -1, -1, 90, 15)
    assert render.render_process(gone, 2, b"E") == b"#E 4242 C 90 15 -1 -1 3"
    assert render.render_process(ProcessTotals(2**40, "C", 1, -7, 2**64, 1, 1), 2) == (
        b"#A %d C 1 1 -1 %d 1" % (codec.INT_MAX, codec.LLONG_MAX)
    )


def test_version_1_records_shared_between_clients_are_those_each_would_get_alone():
    """Clients asking in the same polls share their records; each gets what it would get alone."""
    def polls():
        for n in range(8):
            processes = [proc(7, gpu=10 * n % 100), proc(8, gpu=None if n in (3, 4) else 50)]
            if n < 5:
                processes.append(proc(9, gpu=90))
            yield snap(dev("a", processes=tuple(processes)))

    shared, alone = Board(), Board()
    a, b, c = shared.attach(), shared.attach(), alone.attach()
    schedule = {0: "ab", 1: "a", 2: "ab", 3: "ab", 4: "b", 5: "ab", 6: "ab", 7: "ab"}
    for n, snapshot in enumerate(polls()):
        shared.fold(snapshot)
        alone.fold(snapshot)
        for _ in range(2):
            if "a" in schedule[n]:
                assert shared.stats_v1(a) == alone.stats_v1(c)
            if "b" in schedule[n]:
                shared.stats_v1(b)
