"""``--metrics``: the Prometheus page, from a daemon over HTTP and from a Board in-process."""

from __future__ import annotations

import urllib.request

import pytest
from daemon import free_port, run_daemon
from metrics_text import FakePoller, samples_of, series
from prometheus_client.exposition import generate_latest
from prometheus_server import promtool
from scenarios import A10, H100
from twisted.internet.testing import MemoryReactorClock
from twisted.python import usage
from twisted.web.test.requesthelper import DummyRequest

from atopgpud_tw import tap
from atopgpud_tw.server.atop.board import Board
from atopgpud_tw.server.web.metrics import BoardCollector, MetricsResource, MetricsSite
from atopgpud_tw.snapshot import UNSUPPORTED, DeviceSample, ProcessSample, Snapshot

INTERVAL = 0.2
MIB = 1024 * 1024
SCENARIO = {
    "gpus": [H100, A10]
}



@pytest.fixture(scope="module")
def scraped(tmp_path_factory) -> str:
    """One daemon with --metrics (processes on), scraped once it has 3 samples."""
    port = free_port()
    metrics = f"tcp:{port}:interface=127.0.0.1"
    args = ["--interval", str(INTERVAL), "--metrics", metrics, "--metrics-processes"]
    with run_daemon(tmp_path_factory.mktemp("metrics"), args, scenario=SCENARIO) as daemon:
        daemon.wait_samples(3)
        client = daemon.client()
        try:
            client.ask("T")  # one atop-like client connected during the scrape
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
                assert response.headers["content-type"].startswith("text/plain")
                text = response.read().decode()
        finally:
            client.close()
    return text


@pytest.mark.e2e
def test_page_passes_promtool(scraped, tmp_path):
    """promtool check metrics finds nothing wrong with the page."""
    promtool("check", "metrics", input=scraped.encode(), timeout=30)


def test_page_matches_the_scenario(scraped):
    """Samples, busy totals (sum x interval) and memory in bytes agree with the scenario."""
    page = samples_of(scraped)
    a = {"busid": "00000000:17:00.0", "type": "NVIDIA H100 80GB HBM3", "index": "0"}
    (n,) = series(page, "atopgpud_gpu_samples_total", **a)
    assert n >= 3
    assert series(page, "atopgpud_gpu_busy_percent", **a) == [40]
    assert series(page, "atopgpud_gpu_busy_percent_seconds_total", **a) == [pytest.approx(40 * n * INTERVAL)]
    assert series(page, "atopgpud_gpu_memory_busy_percent_seconds_total", **a) == [
        pytest.approx(10 * n * INTERVAL)
    ]
    assert series(page, "atopgpud_gpu_memory_used_bytes", **a) == [2048 * MIB]
    assert series(page, "atopgpud_gpu_memory_total_bytes", **a) == [81559 * MIB]
    assert series(page, "atopgpud_gpu_memory_used_byte_seconds_total", **a) == [
        pytest.approx(2048 * MIB * n * INTERVAL)
    ]
    (m,) = series(page, "atopgpud_process_samples_total", pid="4242", busid=a["busid"])
    assert series(page, "atopgpud_process_memory_used_bytes", pid="4242") == [1024 * MIB]
    assert series(page, "atopgpud_process_busy_percent_seconds_total", pid="4242") == [
        pytest.approx(30 * m * INTERVAL)
    ]
    assert series(page, "atopgpud_poll_interval_seconds") == [INTERVAL]
    assert series(page, "atopgpud_polls_total")[0] >= n
    assert series(page, "atopgpud_clients_connected")[0] >= 1


def test_unsupported_values_are_left_out(scraped):
    """A GPU without utilization has no busy series at all, but its samples and memory."""
    page = samples_of(scraped)
    b = {"busid": "00000000:65:00.0"}
    assert series(page, "atopgpud_gpu_busy_percent", **b) == []
    assert series(page, "atopgpud_gpu_busy_percent_seconds_total", **b) == []
    assert series(page, "atopgpud_gpu_memory_used_bytes", **b) == [100 * MIB]
    assert series(page, "atopgpud_gpu_samples_total", **b)[0] >= 3
    assert all(value >= 0 for value in page.values())


def device(present: bool = True, **values) -> DeviceSample:
    fields = {
        "gpu_busy": 40, "mem_busy": UNSUPPORTED, "memory_total_kib": 4096, "memory_used_kib": 1024,
        "processes": (ProcessSample(77, "C", 512, 30, UNSUPPORTED),),
    }
    fields.update(values)
    return DeviceSample("uuid-a", "00000000:17:00.0", "NVIDIA A10", present=present, **fields)


def page_of(board: Board, poller: FakePoller | None = None, processes: bool = False) -> dict:
    registry = BoardCollector(board, poller or FakePoller(), 0.5, processes)
    return samples_of(generate_latest(registry).decode())


def test_collector_reads_the_board():
    """Gauges and counters come from the Board as it is at collection time."""
    board = Board()
    for _ in range(3):
        board.fold(Snapshot((device(),)))
    page = page_of(board)
    assert series(page, "atopgpud_gpu_samples_total") == [3]
    assert series(page, "atopgpud_gpu_busy_percent_seconds_total") == [40 * 3 * 0.5]
    assert series(page, "atopgpud_gpu_memory_used_bytes") == [1024 * 1024]
    assert series(page, "atopgpud_gpu_memory_used_byte_seconds_total") == [3 * 1024 * 1024 * 0.5]
    assert series(page, "atopgpud_gpu_memory_busy_percent") == []
    assert series(page, "atopgpud_gpu_memory_busy_percent_seconds_total") == []
    board.fold(Snapshot((device(gpu_busy=100),)))
    page = page_of(board)
    assert series(page, "atopgpud_gpu_busy_percent") == [100]
    assert series(page, "atopgpud_gpu_busy_percent_seconds_total") == [(3 * 40 + 100) * 0.5]


def test_process_series_only_when_asked():
    """Per-process series appear with --metrics-processes only; -1 figures are left out."""
    board = Board()
    board.fold(Snapshot((device(),)))
    assert not any(name.startswith("atopgpud_process_") for name, _ in page_of(board))
    page = page_of(board, processes=True)
    assert series(page, "atopgpud_process_memory_used_bytes", pid="77") == [512 * 1024]
    assert series(page, "atopgpud_process_busy_percent_seconds_total", pid="77") == [30 * 0.5]
    assert series(page, "atopgpud_process_memory_busy_percent_seconds_total", pid="77") == []


def test_absent_gpu_keeps_counters_without_now_figures():
    """A GPU that is gone shows present 0 and its counters, but no current figures."""
    board = Board()
    board.fold(Snapshot((device(),)))
    board.fold(Snapshot((device(present=False),)))
    page = page_of(board)
    assert series(page, "atopgpud_gpu_present") == [0]
    assert series(page, "atopgpud_gpu_busy_percent") == []
    assert series(page, "atopgpud_gpu_memory_used_bytes") == []
    assert series(page, "atopgpud_gpu_samples_total") == [1]


def test_daemon_health():
    """Polls, failed polls by cause, clients, cut replies and dropped exits are exported."""
    board = Board()
    board.attach()
    board.attach()
    board.replies_cut, board.exited_dropped = 2, 5
    page = page_of(board, FakePoller(7, {"PollError: nvidia-smi timed out": 3}))
    assert series(page, "atopgpud_polls_total") == [7]
    assert series(page, "atopgpud_failed_polls_total", cause="PollError: nvidia-smi timed out") == [3]
    assert series(page, "atopgpud_clients_connected") == [2]
    assert series(page, "atopgpud_replies_cut_total") == [2]
    assert series(page, "atopgpud_exited_dropped_total") == [5]


def test_resource_negotiates_the_format():
    """GET /metrics gives the text format, or OpenMetrics when the scraper asks for it."""
    board = Board()
    board.fold(Snapshot((device(),)))
    resource = MetricsResource(BoardCollector(board, FakePoller(), 1.0))
    plain = DummyRequest([b""])
    body = resource.render(plain)
    assert plain.responseHeaders.getRawHeaders(b"content-type")[0].startswith(b"text/plain")
    assert b"atopgpud_gpu_samples_total" in body
    open_metrics = DummyRequest([b""])
    open_metrics.requestHeaders.setRawHeaders(b"accept", [b"application/openmetrics-text; version=1.0.0"])
    body = resource.render(open_metrics)
    assert body.endswith(b"# EOF\n")


def test_metrics_options_and_wiring():
    """--metrics adds one web listener; --metrics-processes alone is a usage error."""
    with pytest.raises(usage.UsageError):
        tap.Options().parseOptions(["--metrics-processes"])
    options = tap.Options()
    options.parseOptions(
        ["--reader", "sim", "--listen", "unix:@test-name", "--metrics", "tcp:9445:interface=127.0.0.1"]
    )
    reactor = MemoryReactorClock()
    service = tap.makeService(options, reactor=reactor)
    for child in service:
        if hasattr(child, "endpoint"):
            child.startService()
    ((port, factory, _, interface),) = reactor.tcpServers
    assert (port, interface) == (9445, "127.0.0.1")
    assert isinstance(factory, MetricsSite)


def test_exits_queued_and_clients_behind_are_exported():
    """The exits waiting for clients and the clients that fell behind are gauges."""
    from snapshots import dev, proc, snap

    board = Board()
    queue = board.attach()
    board.fold(snap(dev("a", processes=tuple(proc(1000 + i) for i in range(400)))))
    board.stats_body(2, queue)
    board.fold(snap(dev("a", processes=())))
    assert series(page_of(board, FakePoller(1, {})), "atopgpud_exited_queued") == [400]
    board.stats_body(2, queue)
    page = page_of(board, FakePoller(1, {}))
    assert series(page, "atopgpud_clients_behind") == [1]
    assert 0 < series(page, "atopgpud_exited_queued")[0] < 400
