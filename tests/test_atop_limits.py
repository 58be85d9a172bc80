"""atop's limits, each checked against the real atops: Debian's 2.8.1 over TCP (API 1) and
2.13 built from source (tests/atop_source.py) over the abstract socket (API 2).

docs/protocol.md lists the limits and the lines of atop's source that set them:
32 devices (``MAXGPU``), the last 12 characters of a bus id and of a type name,
255 processes per device, the widths of the numbers atop reads.  Every test runs
once per atop; one whose atop cannot be had here skips with the reason.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import pytest
from atop_helpers import (
    ATOP_HOST,
    ATOP_PORT,
    TCP_LISTEN,
    TcpDaemon,
    answers,
    atop_path,
    held_atop_port,
    run_atop,
    sleepers,
    unused_pids,
    write_scenario,
)
from atop_output import MIB, AtopRun, atop_id, check_gpu, check_gpus, no_length_error
from atop_source import LISTEN, LOCK_PATH, SOCKET_NAME, Unavailable, built_atop
from daemon import Client
from locks import file_lock

from atopgpud_tw import codec

DAEMON_INTERVAL = 0.25
ATOP_INTERVAL = 1


@dataclass
class Atop:
    """One real atop, and where a daemon must listen for it."""

    label: str
    binary: str
    #: the API version it asks for
    version: int
    listen: str
    address: Any
    family: int
    tmp: Path
    started: list[TcpDaemon]

    def start(self, gpus: Sequence[dict[str, Any]], *args: str) -> TcpDaemon:
        """``atopgpud --reader sim`` with these GPUs where this atop looks; stopped after the test."""
        scenario = write_scenario(self.tmp / f"scenario-{len(self.started)}.json", gpus)
        daemon = TcpDaemon(scenario, self.tmp / f"daemon-{len(self.started)}.log", DAEMON_INTERVAL,
                           self.listen, self.address, self.family)
        daemon.command += list(args)
        self.started.append(daemon)
        return daemon.start()

    def run(self, count: int, labels: str = "GPU,PRE") -> AtopRun:
        run = run_atop(ATOP_INTERVAL, count, labels, self.binary)
        assert run.returncode == 0, f"{self.label}: {run}"
        no_length_error(run)
        assert len(run.samples) == count, f"{self.label}: {run}"
        return run

    def ask(self, command: str, version: int | None = None) -> tuple[int, bytes]:
        """One request on a connection of our own, as this atop asks it (or with another version byte)."""
        client = Client(self.address, self.family)
        try:
            return client.ask(command, self.version if version is None else version)
        finally:
            client.close()


@pytest.fixture(params=["2.8.1", "2.13"])
def atop(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Atop]:
    """Each real atop in turn, with the place it looks for the daemon held for this test."""
    with ExitStack() as stack:
        if request.param == "2.8.1":
            stack.enter_context(held_atop_port("atop 2.8.1 needs that port"))
            binary = atop_path()
            assert binary is not None
            client = Atop("atop 2.8.1", binary, 1, TCP_LISTEN, (ATOP_HOST, ATOP_PORT), socket.AF_INET, tmp_path, [])
        else:
            try:
                binary = built_atop()
            except Unavailable as error:
                pytest.skip(str(error))
            stack.enter_context(file_lock(LOCK_PATH, 300.0))
            address = b"\0" + SOCKET_NAME.encode()
            if answers(address, socket.AF_UNIX):
                pytest.skip(f"something already answers on @{SOCKET_NAME}; atop 2.13 needs it")
            client = Atop("atop 2.13", binary, 2, LISTEN, address, socket.AF_UNIX, tmp_path, [])
        try:
            yield client
        finally:
            for daemon in client.started:
                daemon.stop()


@pytest.fixture
def processes() -> Iterator[Callable[[int], list[subprocess.Popen[bytes]]]]:
    """Real ``sleep`` processes for scenarios, killed afterwards."""
    with ExitStack() as stack:
        yield lambda count: stack.enter_context(sleepers(count))


# -- 32 devices -----------------------------------------------------------------------

#: instances per card (8 A100s in MIG mode) of the hosts checked: 33, 48 and 56 devices
HOSTS = {33: [7, 7, 4, 4, 4, 3, 2, 2], 48: [6] * 8, 56: [7] * 8}
INSTANCE_MIB = 9856


def _card_busid(card: int) -> str:
    return f"00000000:{0x10 + card:02X}:00.0"


def _mig_host(counts: Sequence[int], pids: dict[int, int]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """8 cards with `counts` instances; `pids` maps a device's place in T to a pid on it.

    Returns the scenario's GPUs and, in T order (card by card, as first seen), each
    instance as atop should show it.
    """
    cards, instances = [], []
    for card, count in enumerate(counts):
        mig = []
        for slot in range(count):
            place = len(instances)
            used = 1000 + 100 * card + 10 * slot
            procs = [{"pid": pids[place], "memory_mib": 64 + place}] if place in pids else []
            mig.append({"profile": "1g.10gb", "memory_total_mib": INSTANCE_MIB, "memory_used_mib": used,
                        "processes": procs})
            instances.append({"busid": f"{_card_busid(card)}/{slot + 1}.0", "name": "1g.10gb",
                              "memory_total_mib": INSTANCE_MIB, "memory_used_mib": used,
                              "gpu_util": None, "mem_util": None, "card": card})
        cards.append({"name": "NVIDIA A100-SXM4-80GB", "busid": _card_busid(card), "memory_total_mib": 81920,
                      "mig": mig})
    return cards, instances


@pytest.mark.parametrize("size", sorted(HOSTS))
def test_atop_shows_32_of_a_larger_host_and_every_card_with_mig_card(
    atop: Atop, size: int, processes: Callable[[int], list[subprocess.Popen[bytes]]]
) -> None:
    """33, 48 and 56 MIG instances: both atops show the first 32 in T order, with their figures and
    processes (sent more, they show no GPU at all); with --mig card, the 8 cards."""
    first, last, beyond = (p.pid for p in processes(3))
    pids = {0: first, 31: last, 32: beyond}
    cards, instances = _mig_host(HOSTS[size], pids)
    daemon = atop.start(cards)
    for command in ("T", "S"):
        version, body = atop.ask(command)
        listed = codec.parse_types(body) if command == "T" else codec.parse_stats(body, version)
        assert len(listed) == codec.ATOP_MAX_GPUS, (atop.label, command)
        # atopgpu's request, which atop never sends, carries more
        version, body = atop.ask(command, codec.WIDE_REQUEST)
        listed = codec.parse_types(body) if command == "T" else codec.parse_stats(body, 2)
        assert version == 2 and len(listed) == min(size, codec.MAX_WIRE_DEVICES), command
    run = atop.run(2)
    for number, sample in enumerate(run.samples):
        where = f"{atop.label}, {size} devices, sample {number}\n{run}"
        check_gpus(sample, instances[: codec.ATOP_MAX_GPUS], where)
        for place in (0, 31):
            line = sample.processes[pids[place]]
            assert (line.gpu_state, line.gpulist, line.mem_now_kib) == ("A", 1 << place, (64 + place) * MIB), where
        # on a device atop is not sent: no GPU figures
        line = sample.processes[beyond]
        assert line.gpu_state != "A" and line.mem_now_kib == 0, where
    log = daemon.log()
    said = f"{size} devices, more than atop's 32 (MAXGPU): replies to atop carry the first 32 in T order"
    assert log.count(said) == 1, log
    assert "--mig card" in log and "atopgpu" in log and "/metrics" in log, log

    atop.started.pop().stop()
    atop.start(cards, "--mig", "card")
    run = atop.run(2)
    per_card = [
        {"busid": _card_busid(card), "name": "NVIDIA A100-SXM4-80GB", "gpu_util": None, "mem_util": None,
         "memory_total_mib": sum(i["memory_total_mib"] for i in instances if i["card"] == card),
         "memory_used_mib": sum(i["memory_used_mib"] for i in instances if i["card"] == card)}
        for card in range(len(cards))
    ]
    for number, sample in enumerate(run.samples):
        where = f"{atop.label}, {size} devices as cards, sample {number}\n{run}"
        check_gpus(sample, per_card, where)
        for place, pid in pids.items():
            line = sample.processes[pid]
            card = instances[place]["card"]
            assert (line.gpu_state, line.gpulist, line.mem_now_kib) == ("A", 1 << card, (64 + place) * MIB), where


def test_atopgpu_shows_more_than_atop(atop: Atop) -> None:
    """atopgpu asks in a way atop never does and lists up to 48 devices of a 56-device host."""
    cards, _ = _mig_host(HOSTS[56], {})
    atop.start(cards)
    connect = atop.listen if atop.family == socket.AF_UNIX else f"tcp:{ATOP_HOST}:{ATOP_PORT}"
    command = Path(sys.executable).with_name("atopgpu")
    done = subprocess.run([str(command), "--connect", connect, "--json"], capture_output=True, text=True,
                          timeout=30)
    assert done.returncode == 0, done.stderr
    assert len(json.loads(done.stdout)["gpus"]) == codec.MAX_WIRE_DEVICES
    done = subprocess.run([str(command), "--connect", connect, "--json", "--version", "1"],
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    assert len(json.loads(done.stdout)["gpus"]) == codec.ATOP_MAX_GPUS


# -- bus ids and type names ------------------------------------------------------------------


def test_atop_keeps_the_last_12_characters_of_bus_ids_and_types(atop: Atop) -> None:
    """Names and bus ids of 11, 12, 13 and up to 64 characters (the most the daemon sends) are shown
    by their last 12 (MAXGPUBUS, MAXGPUTYPE); spaces are sent as _."""
    names = ["NVIDIA A10", "NVIDIA A100X", "NVIDIA H100 X", "NVIDIA " + "Z" * 50 + " last12chars",
             # NVML's names are at most 95 characters (96 with the NUL)
             "N" * 83 + " the end 012"]
    busids = ["0000:17:00.0", "00000000:18:00.0", "00000001:B3:00.0", "00000000:1A:00.0", "00000000:1B:00.0"]
    specs = [{"name": name, "busid": busid, "memory_total_mib": 1000 + i, "memory_used_mib": 10 + i,
              "gpu_util": 10 * i, "mem_util": i} for i, (name, busid) in enumerate(zip(names, busids))]
    atop.start(specs)
    _, body = atop.ask("T")
    sent = codec.parse_types(body)
    assert [len(t.name) for t in sent] == [min(len(n), codec.MAX_TOKEN_CHARS) for n in names]
    run = atop.run(2, "GPU")
    for number, sample in enumerate(run.samples):
        check_gpus(sample, specs, f"{atop.label}, sample {number}\n{run}")
        assert [g.type for g in sample.gpus] == [atop_id(n) for n in names], run
        assert len(sample.gpus[-1].type) == 12


def test_mig_instance_ids_stay_apart_in_atops_12_characters(atop: Atop) -> None:
    """Instances 1.0 and 13.0 of one card and the card's own bus id: atop tells them apart."""
    mig = [{"profile": "1g.10gb", "gpu_instance": gi, "memory_total_mib": INSTANCE_MIB, "memory_used_mib": 5 + gi}
           for gi in (1, 13)]
    specs = [{"name": "NVIDIA A100-SXM4-80GB", "busid": "00000000:17:00.0", "memory_total_mib": 81920, "mig": mig},
             {"name": "NVIDIA A100-SXM4-80GB", "busid": "00000000:65:00.0", "memory_total_mib": 81920,
              "memory_used_mib": 7, "gpu_util": 1, "mem_util": 1}]
    atop.start(specs)
    run = atop.run(2, "GPU")
    for sample in run.samples:
        assert [g.busid for g in sample.gpus] == [":17:00.0/1.0", "17:00.0/13.0", "0000:65:00.0"], run
        assert [g.type for g in sample.gpus] == ["1g.10gb", "1g.10gb", "A100-SXM4-80GB"[-12:]], run


# -- processes per device ---------------------------------------------------------------------


def test_atop_is_sent_at_most_255_processes_on_a_device(
    atop: Atop, processes: Callable[[int], list[subprocess.Popen[bytes]]]
) -> None:
    """300 processes on one GPU: 255 are sent (atop counts a GPU's processes in an unsigned char),
    those with the most memory, and atop shows them with their figures."""
    real = processes(4)
    listed = [{"pid": p.pid, "memory_mib": 900 + n, "sm_util": 10 + n, "mem_util": 1} for n, p in enumerate(real)]
    listed += [{"pid": pid, "memory_mib": 0, "sm_util": 0, "mem_util": 0} for pid in unused_pids(296)]
    gpu = {"name": "NVIDIA H100 80GB HBM3", "busid": "00000000:17:00.0", "memory_total_mib": 81559,
           "memory_used_mib": 4000, "gpu_util": 40, "mem_util": 10, "processes": listed}
    atop.start([gpu])
    version, body = atop.ask("S")
    assert len(body) + 4 <= codec.ATOP_REPLY_LIMIT
    (device,) = codec.parse_stats(body, version)
    assert len(device.processes) == codec.MAX_PROCESSES_PER_DEVICE == 255
    assert {p.pid for p in real} <= {p.pid for p in device.processes}
    run = atop.run(2)
    for number, sample in enumerate(run.samples):
        where = f"{atop.label}, sample {number}\n{run}"
        check_gpu(sample.gpus[0], gpu, where)
        for n, proc in enumerate(real):
            line = sample.processes[proc.pid]
            assert (line.gpu_state, line.gpulist, line.gpu_busy) == ("A", 1, 10 + n), where
            assert line.mem_now_kib == (900 + n) * MIB, where


# -- number widths ------------------------------------------------------------------------------


def test_atop_reads_numbers_past_32_bits_exactly(atop: Atop) -> None:
    """Memory of 2^44 - 1 MiB (NVML's bytes fill 64 bits): its KiB, near 2^54, and their sums over
    the samples reach atop exactly (it reads them as long long); busy figures of 100 as int."""
    mib = 2**44 - 1
    gpu = {"name": "NVIDIA H100 80GB HBM3", "busid": "00000000:17:00.0", "memory_total_mib": mib,
           "memory_used_mib": mib, "gpu_util": 100, "mem_util": 100}
    atop.start([gpu])
    version, body = atop.ask("S")
    (device,) = codec.parse_stats(body, version)
    assert device.memory_total_kib == mib * MIB > 2**53, device
    # the first sample runs from boot: the daemon's own figures, as sent
    run = atop.run(2, "GPU")
    for sample in run.samples:
        (line,) = sample.gpus
        assert (line.mem_total_kib, line.mem_used_kib) == (mib * MIB, mib * MIB), line
        assert line.mem_used_cum_kib == line.samples * mib * MIB, line
        assert (line.gpu_now, line.mem_now, line.gpu_cum, line.mem_cum) == (100, 100, *[100 * line.samples] * 2), line


# -- reply length -----------------------------------------------------------------------------------


def test_atop_accepts_a_full_reply(atop: Atop, processes: Callable[[int], list[subprocess.Popen[bytes]]]) -> None:
    """8 GPUs x 40 processes would be over 8192 bytes: the reply is cut to fit and atop shows every GPU."""
    real = processes(8)
    fake = iter(unused_pids(8 * 39))
    specs = []
    for index, proc in enumerate(real):
        listed = [{"pid": proc.pid, "memory_mib": 9000 + index, "sm_util": 20, "mem_util": 3}]
        listed += [{"pid": next(fake), "memory_mib": 100 + n, "sm_util": 3, "mem_util": 1} for n in range(39)]
        specs.append({"name": "NVIDIA A100-SXM4-80GB", "busid": _card_busid(index), "memory_total_mib": 81920,
                      "memory_used_mib": 4000, "gpu_util": 50, "mem_util": 20, "processes": listed})
    atop.start(specs)
    _, body = atop.ask("S")
    assert 8000 < len(body) + 4 <= codec.ATOP_REPLY_LIMIT, len(body)
    run = atop.run(2)
    for number, sample in enumerate(run.samples):
        check_gpus(sample, specs, f"{atop.label}, sample {number}\n{run}")
        for index, proc in enumerate(real):
            line = sample.processes[proc.pid]
            assert (line.gpu_state, line.gpulist, line.mem_now_kib) == ("A", 1 << index, (9000 + index) * MIB), line
