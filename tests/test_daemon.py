"""The installed daemon (twistd -n atopgpud --reader sim) over real sockets."""

from __future__ import annotations

import signal
import socket
import time

import pytest
from daemon import Client, Daemon, free_port, run_daemon
from scenarios import A10, H100

from atopgpud_tw import codec

GPU_A = H100
GPU_B = {
    **A10,
    "memory_used_mib": [100, 300],
    "gpu_util": [10, 20, 30],
    "mem_util": [1, 2],
    "processes": [
        {"pid": 77, "type": "G", "memory_mib": 50, "sm_util": 4, "mem_util": 1, "stop": 0.9},
    ],
}


@pytest.fixture
def daemon(tmp_path):
    with run_daemon(tmp_path, ["--interval", "0.2"], scenario={"gpus": [GPU_A, GPU_B]}) as daemon:
        yield daemon


def test_types_lists_the_scenario(daemon):
    """T names both GPUs with bus ids, names and task support, in v1 and v2."""
    client = daemon.client()
    for version in (1, 2, 0):
        got, body = client.ask("T", version)
        assert got == codec.negotiate(version)
        assert body == b"2@00000000:17:00.0 NVIDIA_H100_80GB_HBM3 3@00000000:65:00.0 NVIDIA_A10 3"
    client.close()


def test_counters_are_exact_after_n_samples(daemon):
    """After n samples: gpuperccum = 40 n, cycled values summed, unsupported -1."""
    stats = daemon.wait_samples(4)
    a, b = stats[0], stats[1]
    n = a.samples
    assert (a.gpu_busy_now, a.mem_busy_now) == (40, 10)
    assert (a.gpu_busy_cum, a.mem_busy_cum) == (40 * n, 10 * n)
    assert (a.memory_total_kib, a.memory_used_kib) == (81559 * 1024, 2048 * 1024)
    assert a.memory_used_cum_kib == n * 2048 * 1024
    m = b.samples
    cycle = [10, 20, 30]
    assert b.gpu_busy_cum == sum(cycle[i % 3] for i in range(m))
    assert b.mem_busy_cum == sum((1, 2)[i % 2] for i in range(m))
    assert b.memory_used_cum_kib == sum((100, 300)[i % 2] for i in range(m)) * 1024
    (proc,) = a.processes
    assert 1 <= proc.samples <= n  # it may have started after the first poll, never before it
    assert (proc.pid, proc.kind, proc.gpu_busy, proc.memory_cum_kib) == (
        4242, "C", 30 * proc.samples, 1024 * 1024 * proc.samples
    )


def test_unsupported_utilization_is_minus_one(tmp_path):
    """A GPU whose utilization NVML does not support shows -1 now and cumulative."""
    with run_daemon(tmp_path, ["--interval", "0.2"], scenario={"gpus": [dict(GPU_A, gpu_util=None)]}) as daemon:
        (a,) = daemon.wait_samples(2)
        assert (a.gpu_busy_now, a.mem_busy_now, a.gpu_busy_cum, a.mem_busy_cum) == (-1, -1, -1, -1)
        assert a.memory_used_cum_kib == a.samples * 2048 * 1024


def test_exited_process_appears_once_under_its_own_gpu(tmp_path):
    """A process that stops on GPU 2 is reported as E once, under GPU 2, to a client that asked before."""
    daemon = Daemon(tmp_path, ["--interval", "0.2"], scenario={"gpus": [GPU_A, dict(GPU_B, processes=[
        {"pid": 77, "type": "G", "memory_mib": 50, "sm_util": 4, "mem_util": 1, "stop": 2.5}])]})
    daemon.start()
    try:
        client = daemon.client()
        seen = []
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            stats = client.stats()
            seen.append(stats)
            if stats[1].samples > 20:
                break
            time.sleep(0.1)
        exits = [(i, p) for stats in seen for i, d in enumerate(stats) for p in d.processes if p.state == "E"]
        assert [(i, p.pid) for i, p in exits] == [(1, 77)]
        assert exits[0][1].kind == "G" and exits[0][1].samples >= 1
        assert any(p.pid == 77 and p.state == "A" for stats in seen for p in stats[1].processes)
        client.close()
    finally:
        daemon.stop()


def test_split_and_pipelined_requests_over_a_socket(daemon):
    """Bytes one at a time and many requests in one send are answered in order."""
    client = daemon.client()
    for byte in b"T\x01":
        client.send(bytes([byte]))
        time.sleep(0.05)
    assert client.read_reply()[0] == 1
    client.send(b"S\x01T\x02S\x02S")
    client.send(b"\x00")
    versions = [client.read_reply()[0] for _ in range(4)]
    assert versions == [1, 2, 2, 2]
    client.close()


def test_unknown_command_closes_only_that_connection(daemon):
    """A bad request closes its connection; another client is still served."""
    bad, good = daemon.client(), daemon.client()
    bad.send(b"Q\x02")
    assert bad.sock.recv(10) == b""
    assert good.ask("T")[0] == 2
    bad.close()
    good.close()
    assert "unknown command byte 0x51" in daemon.log()


def test_eight_gpus_forty_processes_fit(tmp_path):
    """8 GPUs x 40 processes: every reply within 8192 bytes with all 8 GPUs."""
    gpus = [
        {
            "busid": f"00000000:{0x10 + g:02X}:00.0",
            "processes": [
                {"pid": 100000 + 1000 * g + p, "memory_mib": 1000 + p, "sm_util": 99, "mem_util": 99}
                for p in range(40)
            ],
        }
        for g in range(8)
    ]
    with run_daemon(tmp_path, ["--interval", "0.2"], scenario={"gpus": gpus}) as daemon:
        daemon.wait_samples(2)
        client = daemon.client()
        for version in (1, 2):
            client.send(codec.encode_request("S", version))
            prelude = client.read_exact(4)
            _, length = codec.parse_prelude(prelude)
            assert 4 + length <= 8192
            stats = codec.parse_stats(client.read_exact(length), version)
            assert len(stats) == 8 and all(d.processes for d in stats)
        client.close()
        assert "too many processes for atop's 8192-byte limit" in daemon.log()


def test_tcp_listener_serves_old_atop(tmp_path):
    """--listen tcp:PORT:interface=127.0.0.1 answers API version 1 as atop 2.8 asks."""
    port = free_port()
    with run_daemon(tmp_path, ["--reader", "sim", "--listen", f"tcp:{port}:interface=127.0.0.1"]) as _:
        client = Client(("127.0.0.1", port), socket.AF_INET)
        version, body = client.ask("T", 1)
        assert version == 1 and body.startswith(b"2@00000000:17:00.0 NVIDIA_H100_80GB_HBM3 3@")
        client.close()


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_signal_stops_cleanly(tmp_path, signum):
    """SIGTERM and SIGINT end the daemon cleanly: NVML shut down, socket freed."""
    daemon = Daemon(tmp_path, ["--reader", "sim"]).start()
    assert daemon.stop(signum) in (0, -signum)
    log = daemon.log()
    assert "nvml: shut down" in log and "Server Shut Down." in log and "Traceback" not in log
    with pytest.raises(OSError):
        daemon.client()


def test_nvml_call_stuck_in_the_driver_stalls_nothing(tmp_path):
    """A hung NVML call: clients are still answered at once, and the daemon still stops."""
    stuck = {"call": "nvmlDeviceGetMemoryInfo", "error": "hang", "from": 1.5}
    daemon = Daemon(tmp_path, ["--interval", "0.2"], scenario={"gpus": [dict(GPU_A, faults=[stuck])]}).start()
    try:
        client = daemon.client()
        history = [client.stats()[0].samples]
        deadline = time.monotonic() + 30
        while len(history) < 6 or len(set(history[-6:])) > 1:  # frozen for a second: the call hangs
            assert time.monotonic() < deadline, history
            time.sleep(0.2)
            history.append(client.stats()[0].samples)
        frozen = history[-1]
        for _ in range(10):
            time.sleep(0.2)
            (device,) = client.stats()  # the client's socket times out after 5 s: a reply came
            assert device.samples == frozen
        client.close()
    finally:
        status = daemon.stop()
    assert status in (0, -signal.SIGTERM)
    (line,) = [line for line in daemon.log().splitlines() if "nvml: not shut down" in line]
    # a sentence naming the stuck call, not the Deferred's timeout tuple
    assert line.endswith(
        "nvml: not shut down: NVML call nvmlDeviceGetMemoryInfo on GPU 00000000:17:00.0 has not returned, "
        "and stopping waits no more than 0.5 s"
    ), line


def test_types_lists_the_gpus_before_the_first_poll(tmp_path):
    """T is right from the start (atop asks it once), even while the first poll is still running."""
    stuck = {"call": "nvmlDeviceGetMemoryInfo", "error": "hang"}
    daemon = Daemon(tmp_path, [], scenario={"gpus": [dict(GPU_A, faults=[stuck]), GPU_B]}).start()
    try:
        client = daemon.client()
        assert [d.busid for d in client.types()] == ["00000000:17:00.0", "00000000:65:00.0"]
        assert [d.samples for d in client.stats()] == [0, 0]
        client.close()
    finally:
        daemon.stop()
