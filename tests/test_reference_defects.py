"""One test per defect of the reference daemon (docs/protocol.md, "What the reference daemon got wrong", 1 to 8).

Each fails on the reference's behaviour: the comment names what it did.
"""

from __future__ import annotations

from connections import connect, replies, turns
from sim_readers import SkewedNvml, make_reader
from snapshots import dev, proc, snap

from atopgpud_tw import codec
from atopgpud_tw.counters import Counters
from atopgpud_tw.readers.nvml.reader import NvmlReader
from atopgpud_tw.server.atop import render
from atopgpud_tw.server.atop.board import Board
from atopgpud_tw.sim import binding_over, parse_scenario


def test_defect_1_exited_process_is_under_its_own_gpu():
    """Reference: every exited process appeared under the first GPU."""
    board = Board()
    protocol, transport = connect(board)
    a, b = dev("a"), dev("b", processes=(proc(42),))
    board.fold(snap(a, b))
    protocol.dataReceived(b"S\x02")
    board.fold(snap(a, dev("b")))
    transport.clear()
    protocol.dataReceived(b"S\x02")
    (_, body), = replies(transport.value())
    first, second = codec.parse_stats(body, 2)
    assert [p.pid for p in first.processes] == []
    assert [(p.state, p.pid) for p in second.processes] == [("E", 42)]


def test_defect_2_process_busy_sum_is_not_undercounted():
    """Reference: sums started at -1, so n samples of 30 % summed to 30n - 1."""
    counters = Counters()
    for _ in range(3):
        counters.fold(snap(dev(processes=(proc(7, gpu=30, mem=5),))))
    totals = counters.devices[0].processes[7]
    assert (totals.gpu_busy_cum, totals.mem_busy_cum) == (90, 15)


def test_defect_3_one_failed_read_does_not_poison_the_sum():
    """Reference: one failed read set the sums to -1, later reads added to -1."""
    counters = Counters()
    totals = []
    for value in (40, None, 40, 40):
        counters.fold(snap(dev(gpu=value)))
        totals.append(counters.devices[0].gpu_busy_total)
    assert totals == [40, 40, 80, 120]
    assert counters.devices[0].samples == 3


def test_defect_4_compute_and_graphics_process_counted_once():
    """Reference: a C+G process was counted twice per sample through the sim's two lists."""
    clock = [0.0]
    reader, _ = make_reader(
        {"gpus": [{"processes": [{"pid": 9, "type": "C+G", "memory_mib": 1, "sm_util": 10}]}]}, clock
    )
    counters = Counters()
    for second in range(3):
        clock[0] = float(second)
        counters.fold(reader.read(clock[0])[0])
    totals = counters.devices[0].processes[9]
    assert (totals.kind, totals.samples, totals.memory_cum_kib) == ("C+G", 3, 3 * 1024)
    assert render.render_process(totals, 2).startswith(b"#A 9 C ")


def test_defect_5_last_seen_timestamp_is_per_gpu():
    """Reference: one shared timestamp let GPU 0's clock hide GPU 1's samples."""
    clock = [0.0]
    process = {"pid": 5, "memory_mib": 1, "sm_util": 50, "mem_util": 5}
    scenario = parse_scenario({"gpus": [{"processes": [process]}, {"processes": [dict(process, pid=6)]}]})
    reader = NvmlReader(binding_over(SkewedNvml(scenario, clock=lambda: clock[0])), reactor=None)
    reader.open()
    counters = Counters()
    for second in range(4):
        clock[0] = float(second)
        counters.fold(reader.read(clock[0])[0])
    assert counters.devices[0].processes[5].gpu_busy_cum == 200
    assert counters.devices[1].processes[6].gpu_busy_cum == 200


def test_defect_6_one_process_query_unsupported_keeps_sampling():
    """Reference: a GPU with only one process query raised NameError and froze the counters."""
    clock = [0.0]
    reader, _ = make_reader(
        {"gpus": [{"graphics_list": False, "gpu_util": 40, "processes": [{"pid": 3, "memory_mib": 2}]}]},
        clock,
    )
    counters = Counters()
    for second in range(3):
        clock[0] = float(second)
        counters.fold(reader.read(clock[0])[0])
    device = counters.devices[0]
    assert (device.samples, device.gpu_busy_total, device.task_support) == (3, 120, 1)
    assert device.processes[3].samples == 3


def test_defect_6_library_mismatch_is_contained():
    """Reference: NVMLLibraryMismatchError (not an NVMLError) killed the sampling thread."""
    clock = [0.0]
    reader, _ = make_reader(
        {
            "gpus": [
                {
                    "gpu_util": 40,
                    "processes": [{"pid": 3, "memory_mib": 2}],
                    "faults": [
                        {"call": "nvmlDeviceGetComputeRunningProcesses", "error": "NVMLLibraryMismatchError", "from": 1}
                    ],
                }
            ]
        },
        clock,
    )
    counters = Counters()
    for second in range(4):
        clock[0] = float(second)
        counters.fold(reader.read(clock[0])[0])
    assert counters.devices[0].samples == 4


def test_defect_7_two_requests_in_one_read_are_both_answered():
    """Reference: anything but exactly 2 bytes in one recv closed the connection."""
    board = Board()
    board.fold(snap(dev()))
    protocol, transport = connect(board)
    protocol.dataReceived(b"T\x02S\x02")
    turns(protocol)
    assert len(replies(transport.value())) == 2
    assert not transport.disconnecting


def test_defect_8_client_that_never_asks_s_keeps_nothing():
    """Reference: a client that never sent S kept every exited process, forever."""
    board = Board()
    protocol, _ = connect(board)
    protocol.dataReceived(b"T\x02")
    for i in range(1000):
        board.fold(snap(dev(processes=(proc(100 + i),))))
    board.fold(snap(dev()))
    assert len(protocol.queue.entries) == 0


def test_client_queue_is_bounded():
    """Even a client that asked S once and then stopped holds at most the limit."""
    board = Board(exited_limit=50)
    protocol, _ = connect(board)
    protocol.dataReceived(b"S\x02")
    for i in range(200):
        board.fold(snap(dev(processes=(proc(100 + i),))))
    assert len(protocol.queue.entries) == 50
    assert protocol.queue.dropped == 149
    assert board.exited_dropped == 149


def test_full_queue_is_logged_once_per_client():
    """A client that stops asking is reported once when its queue fills, not every poll."""
    from twisted.logger import capturedLogs

    with capturedLogs() as events:
        board = Board(exited_limit=5)
        protocol, _ = connect(board)
        protocol.dataReceived(b"S\x02")
        for i in range(50):
            board.fold(snap(dev(processes=(proc(100 + i),))))
    assert sum("queue of exited processes is full" in e.get("log_format", "") for e in events) == 1
    assert board.exited_dropped == 44
