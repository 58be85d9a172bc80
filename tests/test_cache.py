"""Replies rendered once per poll are byte-identical to replies rendered from scratch.

The uncached path is `render_oracle.render_stats` (every record rendered, then joined or
selected by `assemble_stats`); the cached one is what the Board serves
(`render.PreparedStats`, exited records rendered once per version, one body per
batch of exits).  Random counter states, with exited processes, replies cut to
atop's limit and devices at atop's 255-process cap, in both versions.
"""

from __future__ import annotations

import random

import pytest
import render_oracle
from snapshots import dev, proc, snap

from atopgpud_tw import codec
from atopgpud_tw.counters import DeviceTotals, ProcessTotals
from atopgpud_tw.server.atop import render
from atopgpud_tw.server.atop.board import Board

KINDS = ("C", "G", "C+G")


class Draws(random.Random):
    """A seeded random.Random whose randint, randrange(n) and choice skip the argument checks.

    They draw as Random._randbelow does (getrandbits(k) until below n), so a seed gives
    exactly the states random.Random gives; the states below take about a million draws,
    and the checks were most of their cost.
    """

    def _below(self, n: int) -> int:
        k = n.bit_length()
        r = self.getrandbits(k)
        while r >= n:
            r = self.getrandbits(k)
        return r

    def randint(self, a: int, b: int) -> int:
        if b < a:
            return super().randint(a, b)  # raises
        return a + self._below(b - a + 1)

    def randrange(self, start, stop=None, step=1):  # type: ignore[no-untyped-def]
        if stop is None and step == 1 and type(start) is int and start > 0:
            return self._below(start)
        return super().randrange(start, stop, step)

    def choice(self, seq):  # type: ignore[no-untyped-def]
        if not len(seq):
            return super().choice(seq)  # raises
        return seq[self._below(len(seq))]


def random_totals(rng: random.Random, pid: int) -> ProcessTotals:
    samples = rng.randint(0, 10 ** rng.randint(0, 6))
    busy = rng.choice((-1, 0, rng.randint(0, 100 * samples)))
    return ProcessTotals(
        pid,
        rng.choice(KINDS),
        samples,
        rng.randint(0, 10 ** rng.randint(0, 8)),
        rng.randint(0, 10 ** rng.randint(0, 12)),
        busy,
        rng.choice((busy, rng.randint(0, 100 * samples))),
    )


def random_devices(rng: random.Random) -> list[DeviceTotals]:
    devices = []
    for index in range(rng.choice((0, 1, 2, 4, 8))):
        device = DeviceTotals(
            f"gpu{index}", f"00000000:{index + 16:02X}:00.0", "NVIDIA Test GPU", 3,
            present=rng.random() > 0.1,
            gpu_busy_now=rng.randint(-1, 100),
            mem_busy_now=rng.randint(-1, 100),
            memory_total_kib=rng.randint(0, 10**8),
            memory_used_kib=rng.randint(0, 10**8),
            samples=rng.randint(0, 10**6),
            gpu_busy_cum=rng.choice((None, -1, rng.randint(0, 10**8))),
            mem_busy_cum=rng.choice((None, -1, rng.randint(0, 10**8))),
            memory_used_cum_kib=rng.randint(0, 10**13),
        )
        # 0 to 300 processes: from fitting easily to atop's 255 cap and the byte limit
        count = rng.choice((0, 1, 3, 20, 40, 120, 300))
        for pid in rng.sample(range(1, 4 * 10**6), count):
            device.processes[pid] = random_totals(rng, pid)
        devices.append(device)
    return devices


@pytest.mark.quick_cases(2)
@pytest.mark.parametrize("seed", range(8))
def test_prepared_bodies_match_uncached_rendering(seed):
    """PreparedStats gives the bytes, the sent exits and the cut flag of render_stats.

    render_stats is assemble_stats over render_devices; with exits, the reference
    selection (assemble_stats) is given the same rendered devices the cache is.
    """
    rng = Draws(seed)
    for _ in range(60):
        devices = random_devices(rng)
        for version in (1, 2):
            rendered = render.render_devices(devices, version)
            prepared = render.PreparedStats(rendered)
            assert prepared.full == render_oracle.render_stats(devices, version)
            for _ in range(3):
                count = rng.choice((0, 1, 5, 60, 400)) if devices else 0
                exited = [
                    (rng.randrange(len(devices)), random_totals(rng, rng.randint(1, 10**7))) for _ in range(count)
                ]
                records = [(i, render.render_process(t, version, b"E")) for i, t in exited]
                assert prepared.body(records) == render_oracle.assemble_stats(rendered, records)


def test_random_states_reach_every_selection_rule():
    """The random states above include cut replies, capped devices and replies that fit."""
    rng = Draws(0)
    seen = set()
    for _ in range(60):
        devices = random_devices(rng)
        result = render_oracle.render_stats(devices, 2)
        seen.add("cut" if result.active_cut else "whole")
        if any(len(d.processes) > codec.MAX_PROCESSES_PER_DEVICE for d in devices):
            seen.add("capped")
    assert seen == {"cut", "whole", "capped"}


def churning_snapshot(rng: random.Random, alive: dict[int, set[int]]) -> object:
    """One poll of 3 GPUs whose processes start and end at random."""
    devices = []
    for index in range(3):
        pids = alive.setdefault(index, set())
        for pid in list(pids):
            if rng.random() < 0.2:
                pids.discard(pid)
        for _ in range(rng.choice((0, 2, 10, 40))):
            pids.add(rng.randint(1, 10**6))
        processes = tuple(
            proc(pid, rng.choice(KINDS), rng.randint(0, 10**8), rng.choice((None, -1, rng.randint(0, 100))),
                 rng.randint(0, 100))
            for pid in sorted(pids)
        )
        devices.append(dev(f"gpu{index}", processes=processes, busid=f"00000000:{index + 16:02X}:00.0"))
    return snap(*devices)


@pytest.mark.parametrize("limit", [8192, 50])
def test_board_replies_match_uncached_rendering_for_every_client(limit):
    """Clients asking at different rates get the uncached bytes (version 2: cached per poll).

    A model queue per client (its exits since its previous S, the oldest dropped
    beyond the limit, those left out of a cut reply kept) gives the expected reply.
    """
    rng = Draws(limit)
    board = Board(exited_limit=limit)
    clients = [(board.attach(), 2, every) for every in (1, 1, 2, 3, 1, 2)]
    silent = board.attach()  # never sends S: nothing may pile up for it
    models: list[list | None] = [None] * len(clients)
    alive: dict[int, set[int]] = {}
    for poll in range(60):
        exited = board.fold(churning_snapshot(rng, alive))
        for model in models:
            if model is not None:
                model.extend((e.device_index, e.totals) for e in exited)
                del model[: max(0, len(model) - limit)]
        for number, (queue, version, every) in enumerate(clients):
            if poll % every:
                continue
            expected = render_oracle.render_stats(board.counters.devices, version, models[number] or ())
            reply = board.reply(codec.Request(codec.COMMAND_STATS, version), queue)
            assert reply == codec.frame(version, expected.body)
            sent = set(expected.exited_sent)
            models[number] = [e for i, e in enumerate(models[number] or ()) if i not in sent]
            assert [(e.device_index, e.totals) for e in queue.entries] == models[number]
    assert not silent.entries
    assert (board.exited_dropped > 0) == (limit == 50)


def counting(monkeypatch, name: str) -> list[int]:
    """Count the calls of a render function, which keeps working, wherever it is called from."""
    calls = [0]
    original = getattr(render, name)

    def counted(*args, **kwargs):
        calls[0] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(render, name, counted)
    return calls


@pytest.mark.parametrize("clients", [1, 40])
def test_render_work_per_poll_does_not_grow_with_clients(monkeypatch, clients):
    """After a poll, every record is rendered once per version, however many clients ask."""
    active = tuple(proc(pid, memory=pid) for pid in range(100, 130))
    board = Board()
    queues = [board.attach() for _ in range(clients)]
    board.fold(snap(dev("a", processes=active + (proc(7), proc(8))), dev("b", processes=(proc(9),))))
    for queue in queues:
        board.reply(codec.Request(codec.COMMAND_STATS, 2), queue)  # subscribe
    board.fold(snap(dev("a", processes=active), dev("b", processes=())))  # 7, 8 and 9 end
    processes = counting(monkeypatch, "render_process")
    devices = counting(monkeypatch, "render_devices")
    types = counting(monkeypatch, "render_types")
    for _ in range(3):
        for queue in queues:
            for version in (2, 0):
                board.reply(codec.Request(codec.COMMAND_STATS, version), queue)
                board.reply(codec.Request(codec.COMMAND_TYPES, version), queue)
    assert devices[0] == 1  # one rendering for version 2 (0 means the newest)
    # 30 active once, and the 3 exits once each, shared by every client's queue
    assert processes[0] == len(active) + 3
    assert types[0] == 1


def test_clients_asking_once_per_poll_share_one_body(monkeypatch):
    """Clients whose queues hold just the last poll's exits get one shared rendering."""
    board = Board()
    queues = [board.attach() for _ in range(20)]
    board.fold(snap(dev("a", processes=(proc(1), proc(2)))))
    for queue in queues:
        board.stats_body(2, queue)
    board.fold(snap(dev("a", processes=(proc(2),))))
    original = render.PreparedStats.body
    bodies = [0]

    def counted(self, exited=()):
        bodies[0] += bool(exited)
        return original(self, exited)

    monkeypatch.setattr(render.PreparedStats, "body", counted)
    replies = {board.stats_body(2, queue) for queue in queues}
    assert len(replies) == 1 and b"#E 1 " in replies.pop()
    assert bodies[0] == 1  # one body with the exits, for all 20 clients
    assert all(not queue.entries for queue in queues)


def test_version_1_busy_figures_are_per_client_intervals():
    """Version 1 sends busy figures over each client's own interval, as atop shows them.

    Everything else in the reply is what the uncached rendering gives.
    """
    busy = [0, 0, 0, 0, 100, 100, 100, 100]
    board = Board()
    fast, slow = board.attach(), board.attach()
    seen: dict[int, tuple[int, int]] = {}  # per client: (cumulative busy, samples) at its last S
    sums = [0, 0]
    for poll in range(16):
        value = busy[poll % 8]
        board.fold(snap(dev("a", processes=(proc(7, gpu=value, mem=value // 10),))))
        sums = [sums[0] + value, sums[1] + 1]
        for name, queue, every in (("fast", fast, 1), ("slow", slow, 4)):
            if poll % every != every - 1:
                continue
            reply = board.reply(codec.Request(codec.COMMAND_STATS, 1), queue)
            (device,) = codec.parse_stats(reply[4:], 1)
            (record,) = device.processes
            before = seen.get(id(queue), (0, 0))
            expected = (sums[0] - before[0]) // (sums[1] - before[1])
            assert record.gpu_busy == expected, (name, poll)
            seen[id(queue)] = tuple(sums)
            uncached = codec.parse_stats(render_oracle.render_stats(board.counters.devices, 1).body, 1)[0].processes[0]
            assert (record.memory_now_kib, record.memory_cum_kib, record.samples) == (
                uncached.memory_now_kib, uncached.memory_cum_kib, uncached.samples
            )
    # the slow client saw 0 then 100 in alternate 4-poll intervals, not a drifting average
    assert seen[id(slow)] == (sums[0], 16)


def test_version_1_exited_process_busy_covers_the_rest_of_its_life():
    """An E record in version 1 carries the busy figure since the client's previous S."""
    board = Board()
    queue = board.attach()
    board.fold(snap(dev("a", processes=(proc(7, gpu=10),))))
    board.reply(codec.Request(codec.COMMAND_STATS, 1), queue)
    board.fold(snap(dev("a", processes=(proc(7, gpu=90),))))
    board.fold(snap(dev("a", processes=())))
    reply = board.reply(codec.Request(codec.COMMAND_STATS, 1), queue)
    (device,) = codec.parse_stats(reply[4:], 1)
    (record,) = device.processes
    assert (record.state, record.pid, record.gpu_busy, record.samples) == ("E", 7, 90, 2)
    assert board.v1_session(queue).seen == {}


def test_atop_is_sent_the_first_32_devices_and_only_their_exits():
    """40 GPUs: T and S as atop asks for them (versions 1 and 2) list the first 32, and an exit on a device
    beyond them is not sent; asked with the version byte only atopgpu sends, all 40, with both exits."""
    def host(ended: bool) -> object:
        devices = []
        for index in range(40):
            alive = () if ended and index in (2, 35) else (proc(1000 + index, "C", 2**20, 10, 1),)
            devices.append(dev(f"gpu{index}", processes=alive, busid=f"00000000:{index + 16:02X}:00.0"))
        return snap(*devices)

    board = Board()
    asked = (1, 2, codec.WIDE_REQUEST)
    queues = {version: board.attach() for version in asked}
    board.fold(host(False))
    for version, queue in queues.items():
        board.reply(codec.Request(codec.COMMAND_STATS, version), queue)
    board.fold(host(True))
    stats = {}
    for version, queue in queues.items():
        # the body follows the 4-byte prelude; the wide request is answered in version 2
        reply_version = codec.negotiate(version)
        types_reply = board.reply(codec.Request(codec.COMMAND_TYPES, version), queue)
        stats_reply = board.reply(codec.Request(codec.COMMAND_STATS, version), queue)
        assert codec.parse_prelude(types_reply[:4])[0] == codec.parse_prelude(stats_reply[:4])[0] == reply_version
        types = codec.parse_types(types_reply[4:])
        stats[version] = codec.parse_stats(stats_reply[4:], reply_version)
        assert len(types) == len(stats[version]) == (40 if version == codec.WIDE_REQUEST else codec.ATOP_MAX_GPUS)
        assert not queue.entries
    ended = {v: [(i, p.pid) for i, d in enumerate(s) for p in d.processes if p.state == "E"] for v, s in stats.items()}
    assert ended == {1: [(2, 1002)], 2: [(2, 1002)], codec.WIDE_REQUEST: [(2, 1002), (35, 1035)]}
