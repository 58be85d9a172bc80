"""The wire format: requests, replies, and atop's limits."""

from __future__ import annotations

import pytest
import render_oracle

from atopgpud_tw import codec
from atopgpud_tw.counters import DeviceTotals, ProcessTotals
from atopgpud_tw.server.atop import render


def device(procs: int = 0, memory: int = 1024, **fields: int) -> DeviceTotals:
    """A device's totals with `procs` processes of growing memory."""
    totals = DeviceTotals("key", "00000000:17:00.0", "NVIDIA H100", 3)
    for name, value in fields.items():
        setattr(totals, name, value)
    for i in range(procs):
        pid = 10000 + i
        totals.processes[pid] = ProcessTotals(pid, "C", 5, memory + i, 5 * (memory + i), 100, 50)
    return totals


def test_request_is_parsed():
    """T and S with a version byte are the only requests."""
    assert codec.parse_request(b"T\x01") == codec.Request(ord("T"), 1)
    assert codec.parse_request(b"S\x02").reply_version == 2


@pytest.mark.parametrize("data", [b"X\x01", b"s\x02", b"\x00\x00", b"S", b"S\x01\x02"])
def test_bad_request_is_a_protocol_error(data):
    """Unknown commands and wrong sizes raise ProtocolError."""
    with pytest.raises(codec.ProtocolError):
        codec.parse_request(data)


@pytest.mark.parametrize("asked,answered", [(0, 2), (1, 1), (2, 2), (3, 2), (255, 2)])
def test_version_zero_or_unknown_means_newest(asked, answered):
    """Version 0 and versions above the newest are answered in the newest."""
    assert codec.negotiate(asked) == answered


def test_frame_prelude_is_version_and_length():
    """The prelude is version << 24 | length, big-endian."""
    assert codec.frame(2, b"abc") == b"\x02\x00\x00\x03abc"
    assert codec.parse_prelude(b"\x01\x00\x01\x00") == (1, 256)


def test_types_body_lists_devices_with_safe_names():
    """T: count, then busid, name with spaces as _, and task support."""
    a = DeviceTotals("a", "00000000:17:00.0", "NVIDIA H100 80GB HBM3", 3)
    b = DeviceTotals("b", "00000000:65:00.0", "Odd@Name#1", 1)
    assert render.render_types([a, b]) == (
        b"2@00000000:17:00.0 NVIDIA_H100_80GB_HBM3 3@00000000:65:00.0 Odd_Name_1 1"
    )
    assert render.render_types([]) == b"0"


def test_wire_token_makes_every_odd_character_one_underscore() -> None:
    """Spaces, @, #, control characters and anything beyond ASCII: one "_" each; empty is "_"."""
    assert codec.wire_token("NVIDIA T\u00e9sla\tT4\x07") == b"NVIDIA_T_sla_T4_"
    assert codec.wire_token("A@B#C\u00ae\u2122") == b"A_B_C__"
    assert codec.wire_token("") == b"_"


def test_stats_v2_records_are_exact():
    """S v2: the device record and a process record with cumulative busy figures."""
    dev = device(
        gpu_busy_now=40, mem_busy_now=10, memory_total_kib=81559 * 1024, memory_used_kib=2048 * 1024,
        samples=3, gpu_busy_cum=120, mem_busy_cum=30, memory_used_cum_kib=3 * 2048 * 1024,
    )
    dev.processes[4242] = ProcessTotals(4242, "C+G", 3, 1048576, 3 * 1048576, 90, 15)
    body = render_oracle.render_stats([dev], 2).body
    assert body == (
        b"@40 10 83516416 2097152 3 120 30 6291456"
        b"#A 4242 C 90 15 1048576 3145728 3"
    )


def test_stats_v1_process_busy_is_an_average():
    """S v1: per-process busy figures are averages (atop multiplies by samples)."""
    dev = device()
    dev.processes[7] = ProcessTotals(7, "G", 4, 100, 400, 90, 10)
    body = render_oracle.render_stats([dev], 1).body
    assert body.endswith(b"#A 7 22 2 0 100 400 4")


def test_unsupported_busy_is_minus_one_in_both_versions():
    """-1 cumulative busy stays -1 (v2) and its average is -1 (v1)."""
    dev = device()
    dev.processes[7] = ProcessTotals(7, "C", 4, 100, 400, -1, -1)
    assert render_oracle.render_stats([dev], 2).body.endswith(b"#A 7 C -1 -1 100 400 4")
    assert render_oracle.render_stats([dev], 1).body.endswith(b"#A 7 -1 -1 0 100 400 4")


def test_exited_process_goes_under_its_own_device():
    """E records are listed under the device they ran on, not the first one."""
    first, second = device(), device()
    gone = ProcessTotals(99, "C", 2, 10, 20, 5, 1)
    body = render_oracle.render_stats([first, second], 2, exited=[(1, gone)]).body
    parts = body.split(b"@")
    assert b"#E 99" not in parts[1]
    assert parts[2].endswith(b"#E 99 C 5 1 10 20 2")


def test_eight_gpus_forty_processes_fit_in_atop_limit():
    """8 GPUs x 40 processes: GPU records whole, reply within 8192 bytes, largest memory kept."""
    devices = [device(40, memory=1_000_000 * (g + 1)) for g in range(8)]
    for version in (1, 2):
        result = render_oracle.render_stats(devices, version)
        assert len(codec.frame(version, result.body)) <= codec.ATOP_REPLY_LIMIT
        assert result.active_cut
        parsed = codec.parse_stats(result.body, version)
        assert len(parsed) == 8
        kept = {(i, p.pid) for i, d in enumerate(parsed) for p in d.processes}
        dropped = [
            p.memory_now_kib for i, d in enumerate(devices) for p in d.processes.values()
            if (i, p.pid) not in kept
        ]
        smallest_kept = min(devices[i].processes[pid].memory_now_kib for i, pid in kept)
        assert dropped and smallest_kept >= max(dropped)


def test_at_most_255_processes_per_device():
    """atop counts processes per GPU in an unsigned char."""
    dev = device(300, memory=1)
    result = render_oracle.render_stats([dev], 2, exited=[])
    # short records: all would fit in the byte budget, but not in atop's count
    assert len(codec.parse_stats(result.body, 2)[0].processes) <= 255


def test_exited_go_first_and_the_rest_stay_queued():
    """When the budget is short, the oldest exits go first, in order, beside the active ones' share."""
    devices = [device(60, memory=1_000_000) for _ in range(4)]
    exited = [(i % 4, ProcessTotals(50000 + i, "C", 9, 123, 456, 7, 8)) for i in range(500)]
    records = [(i, render.render_process(t, 2, b"E")) for i, t in exited]
    result = render_oracle.assemble_stats(render.render_devices(devices, 2), records)
    assert len(result.body) + 4 <= codec.ATOP_REPLY_LIMIT
    parsed = codec.parse_stats(result.body, 2)
    sent = {p.pid for d in parsed for p in d.processes if p.state == "E"}
    assert sent == {50000 + i for i in result.exited_sent}
    assert 0 < len(sent) < 500
    assert sent == {50000 + i for i in range(len(sent))}, "the oldest go first"
    active = sum(len(p.state == "A" and b"x" or b"") for d in parsed for p in d.processes)
    room = codec.REPLY_LIMIT - codec.PRELUDE.size - sum(len(render.render_device(d)) for d in devices)
    exited_bytes = sum(len(render.render_process(t, 2, b"E")) for i, t in exited[: len(sent)])
    assert exited_bytes <= room - room // 2, "exited records stay within their share"
    assert active >= 80, "the active processes keep half the reply"


def test_full_reply_is_the_cached_rendering_plus_exited():
    """The cached rendering gives byte-identical replies to rendering from scratch."""
    devices = [device(3), device(2)]
    gone = ProcessTotals(5, "G", 1, 2, 3, 4, 5)
    rendered = render.render_devices(devices, 2)
    cached = render_oracle.assemble_stats(rendered, [(1, render.render_process(gone, 2, b"E"))])
    assert cached == render_oracle.render_stats(devices, 2, exited=[(1, gone)])


@pytest.mark.parametrize(
    "body",
    [b"2@a b 1", b"1@a b", b"x@a b 1", b"1@a b c", "1@\u00e9 b 1".encode()],
)
def test_malformed_types_reply_is_refused(body):
    """The T parser checks the count and every field."""
    with pytest.raises(codec.ProtocolError):
        codec.parse_types(body)


@pytest.mark.parametrize(
    "body",
    [b"1 2 3", b"@1 2 3", b"@1 2 3 4 5 6 7 x", b"@1 2 3 4 5 6 7 8#A 1 C 1", b"@1 2 3 4 5 6 7 8#X 1 C 1 2 3 4 5"],
)
def test_malformed_stats_reply_is_refused(body):
    """The S parser checks record shapes and numbers."""
    with pytest.raises(codec.ProtocolError):
        codec.parse_stats(body, 2)


def test_stats_round_trip():
    """What the daemon renders, the parser reads back field for field."""
    dev = device(2, samples=7, gpu_busy_cum=70, mem_busy_cum=35, gpu_busy_now=12, mem_busy_now=4,
                 memory_total_kib=81920, memory_used_kib=2048, memory_used_cum_kib=14336)
    (parsed,) = codec.parse_stats(render_oracle.render_stats([dev], 2).body, 2)
    assert (parsed.gpu_busy_now, parsed.mem_busy_now, parsed.memory_total_kib, parsed.memory_used_kib,
            parsed.samples, parsed.gpu_busy_cum, parsed.mem_busy_cum, parsed.memory_used_cum_kib) == (
        12, 4, 81920, 2048, 7, 70, 35, 14336)
    assert [p.pid for p in parsed.processes] == [10001, 10000]
    for proc in parsed.processes:
        totals = dev.processes[proc.pid]
        assert (proc.state, proc.kind, proc.gpu_busy, proc.mem_busy, proc.memory_now_kib, proc.memory_cum_kib,
                proc.samples) == ("A", totals.kind, totals.gpu_busy_cum, totals.mem_busy_cum,
                                  totals.memory_now_kib, totals.memory_cum_kib, totals.samples)
