"""atop's busy sums on /metrics: gpuperccum and memperccum exactly as the S reply gives them."""

from __future__ import annotations

from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from atopgpud_tw.server.atop.board import Board
from atopgpud_tw.server.web.metrics import Families, atop_sums
from atopgpud_tw.snapshot import UNSUPPORTED, DeviceSample, Snapshot


def sample(gpu_busy: int, mem_busy: int = UNSUPPORTED, present: bool = True) -> DeviceSample:
    return DeviceSample("uuid-a", "00000000:17:00.0", "NVIDIA A10", gpu_busy=gpu_busy, mem_busy=mem_busy,
                        memory_total_kib=4096, memory_used_kib=1024, processes=(), present=present)


def page(board: Board) -> dict[str, list[float]]:
    found: dict[str, list[float]] = {}
    for family in text_string_to_metric_families(generate_latest(Families(lambda: atop_sums(board))).decode()):
        for s in family.samples:
            found.setdefault(s.name, []).append(s.value)
    return found


def test_sums_are_atops_and_unsupported_has_no_series():
    """One percentage per sample, summed, as gpuperccum; a figure the GPU cannot report has no series."""
    board = Board()
    for busy in (10, 40, 70):
        board.fold(Snapshot((sample(busy),)))
    totals = board.counters.devices[0]
    assert page(board) == {"atopgpud_gpu_busy_percent_sum_total": [120]}
    assert totals.gpu_busy_cum == 120
    board.fold(Snapshot((sample(0, present=False),)))  # gone: the sum is kept
    assert page(board)["atopgpud_gpu_busy_percent_sum_total"] == [120]
