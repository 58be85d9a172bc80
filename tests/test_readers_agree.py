"""The NVML reader and the nvidia-smi reader agree on the same MIG host.

Three fixtures describe one host, by hand, with the same UUIDs, bus ids, product
names, instance ids, memory and processes:

- ``agree-mixed-host.json``: the simulator's scenario (the NVML reader's view);
- ``agree-mixed-host.xml``: what ``nvidia-smi -q -x`` prints for it (driver 570);
- ``agree-mixed-host-list.txt``: what ``nvidia-smi -L`` prints for it.

Card 0, ``00000000:18:00.0``, is an H100 in MIG mode carved into 3g.40gb (GPU
instance 2), 2g.20gb (3) and 1g.10gb (9), each with its own memory and processes;
card 1, ``00000000:2A:00.0``, is a whole H100 running a compute, a graphics and a
C+G process.  Both readers are folded into `Counters` and rendered with the codec;
the replies must agree except where docs/nvidia-smi.md says they differ: nvidia-smi
has no per-process utilization, so its per-process busy figures are -1.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Iterator

import pytest
import render_oracle
from daemon import Daemon, first_reply, run_daemon, smi_stand_in

from atopgpud_tw import codec
from atopgpud_tw.counters import Counters
from atopgpud_tw.readers.nvml.reader import NvmlReader
from atopgpud_tw.readers.smi.mig import mig_slots, name_slots, parse_mig_names
from atopgpud_tw.readers.smi.report import parse_report, read_report
from atopgpud_tw.server.atop import render
from atopgpud_tw.sim import load_scenario, simulated_binding
from atopgpud_tw.snapshot import Snapshot

HERE = Path(__file__).parent
FIXTURES = HERE / "fixtures" / "smi"
SCENARIO = FIXTURES / "agree-mixed-host.json"
REPORT = FIXTURES / "agree-mixed-host.xml"
LISTING = FIXTURES / "agree-mixed-host-list.txt"
POLLS = 3
MIB = 1024
MIG_CARD, WHOLE_CARD = "00000000:18:00.0", "00000000:2A:00.0"
NAME = "NVIDIA_H100_80GB_HBM3"
EXPECTED_TYPES = {
    "instances": (
        f"4@{MIG_CARD}/2.0 3g.40gb 3@{MIG_CARD}/3.0 2g.20gb 3@{MIG_CARD}/9.0 1g.10gb 3"
        f"@{WHOLE_CARD} {NAME} 3"
    ).encode(),
    "card": f"2@{MIG_CARD} {NAME} 3@{WHOLE_CARD} {NAME} 3".encode(),
}
#: per MIG instance, as the fixtures give it: MiB total, MiB used, {pid: MiB}
INSTANCES = [
    (40320, 12838, {31001: 12288, 31002: 512}),
    (20096, 6169, {32001: 6144}),
    (9856, 13, {}),
]
#: the whole card: MiB total, MiB used, gpu %, memory %, {pid: (type on the wire, MiB, sm %, mem %)}
WHOLE = (81559, 21786, 63, 21, {41001: ("C", 20480, 50, 15), 41002: ("G", 256, 3, 1), 41003: ("C", 1024, 7, 2)})


def nvml_counters(mig: str, driver: str = "current") -> Counters:
    """The NVML reader over the simulated host, `POLLS` polls one second apart."""
    now = [0.0]
    scenario = dataclasses.replace(load_scenario(SCENARIO), driver=driver)
    reader = NvmlReader(simulated_binding(scenario, clock=lambda: now[0]), reactor=None, mig=mig)
    reader.open()
    counters = Counters()
    for poll in range(1, POLLS + 1):
        now[0] = float(poll)
        snapshot, problems = reader.read(now[0])
        assert problems == {}
        counters.fold(snapshot)
    return counters


def smi_counters(mig: str) -> Counters:
    """The nvidia-smi parser over the report, named from ``-L`` as the reader names them."""
    data = REPORT.read_bytes()
    profiles = {}
    if mig == "instances":  # the reader runs -L only to name instances
        root, _ = read_report(data)
        profiles, _ = name_slots(mig_slots(root), parse_mig_names(LISTING.read_text()))
    counters = Counters()
    for _ in range(POLLS):
        devices, problems = parse_report(data, mig, profiles)
        assert problems == {}
        counters.fold(Snapshot(devices))
    return counters


def stats(counters: Counters, version: int = 2) -> list[codec.DeviceStats]:
    return codec.parse_stats(render_oracle.render_stats(counters.devices, version).body, version)


def device_figures(device: codec.DeviceStats) -> tuple[int, ...]:
    """The ``@`` record: busy now, memory, samples, cumulative figures."""
    return (
        device.gpu_busy_now, device.mem_busy_now, device.memory_total_kib, device.memory_used_kib,
        device.samples, device.gpu_busy_cum, device.mem_busy_cum, device.memory_used_cum_kib,
    )


def process_memory(device: codec.DeviceStats) -> dict[int, tuple[str, str, int, int, int]]:
    """Per pid: state, type, memory now, cumulative memory, samples (no busy figures)."""
    return {p.pid: (p.state, p.kind, p.memory_now_kib, p.memory_cum_kib, p.samples) for p in device.processes}


def process_busy(device: codec.DeviceStats) -> dict[int, tuple[int, int]]:
    return {p.pid: (p.gpu_busy, p.mem_busy) for p in device.processes}


@pytest.fixture(scope="module")
def nvml() -> dict[str, Counters]:
    return {mig: nvml_counters(mig) for mig in ("instances", "card")}


@pytest.fixture(scope="module")
def smi() -> dict[str, Counters]:
    return {mig: smi_counters(mig) for mig in ("instances", "card")}


@pytest.mark.parametrize("mig", ["instances", "card"])
def test_types_are_byte_identical(nvml: dict[str, Counters], smi: dict[str, Counters], mig: str) -> None:
    """T: the same bus ids, names (profiles, or the product name with '_') and task support."""
    from_nvml = render.render_types(nvml[mig].devices)
    from_smi = render.render_types(smi[mig].devices)
    assert from_nvml == from_smi == EXPECTED_TYPES[mig]


@pytest.mark.parametrize("version", [1, 2])
def test_mig_instances_agree_on_memory_and_processes(
    nvml: dict[str, Counters], smi: dict[str, Counters], version: int
) -> None:
    """S per instance: the same @ record and per-process memory; every busy figure -1 in both."""
    n = POLLS
    for from_nvml, from_smi, (total, used, processes) in zip(
        stats(nvml["instances"], version), stats(smi["instances"], version), INSTANCES
    ):
        expected = (-1, -1, total * MIB, used * MIB, n, -1, -1, used * MIB * n)
        assert device_figures(from_nvml) == device_figures(from_smi) == expected
        kind = "C" if version == 2 else "U"  # version 1 does not carry the type
        wanted = {pid: ("A", kind, mib * MIB, mib * MIB * n, n) for pid, mib in processes.items()}
        assert process_memory(from_nvml) == process_memory(from_smi) == wanted
        # NVML has no per-process utilization under MIG and is not asked: -1, as nvidia-smi
        assert process_busy(from_nvml) == process_busy(from_smi) == {pid: (-1, -1) for pid in processes}


def test_mig_card_mode_sums_its_instances(nvml: dict[str, Counters], smi: dict[str, Counters]) -> None:
    """--mig card: memory is the instances' sum (not the card's 81559 MiB), all their processes, -1 busy."""
    n = POLLS
    total = sum(t for t, _, _ in INSTANCES)
    used = sum(u for _, u, _ in INSTANCES)
    from_nvml, from_smi = stats(nvml["card"])[0], stats(smi["card"])[0]
    assert device_figures(from_nvml) == device_figures(from_smi) == (
        -1, -1, total * MIB, used * MIB, n, -1, -1, used * MIB * n
    )
    everyone = {pid: mib for _, _, processes in INSTANCES for pid, mib in processes.items()}
    wanted = {pid: ("A", "C", mib * MIB, mib * MIB * n, n) for pid, mib in everyone.items()}
    assert process_memory(from_nvml) == process_memory(from_smi) == wanted
    assert process_busy(from_nvml) == process_busy(from_smi) == {pid: (-1, -1) for pid in everyone}


@pytest.mark.parametrize("mig", ["instances", "card"])
def test_whole_card_agrees_but_for_per_process_busy(
    nvml: dict[str, Counters], smi: dict[str, Counters], mig: str
) -> None:
    """The whole card: same figures and process memory; only NVML has per-process busy figures."""
    n = POLLS
    total, used, gpu, mem, processes = WHOLE
    from_nvml, from_smi = stats(nvml[mig])[-1], stats(smi[mig])[-1]
    # equal here because the load is constant: NVML folds every buffered sample since the
    # previous poll while nvidia-smi shows its last sample period; a varying load would differ
    expected = (gpu, mem, total * MIB, used * MIB, n, gpu * n, mem * n, used * MIB * n)
    assert device_figures(from_nvml) == device_figures(from_smi) == expected
    wanted = {pid: ("A", kind, mib * MIB, mib * MIB * n, n) for pid, (kind, mib, _, _) in processes.items()}
    assert process_memory(from_nvml) == process_memory(from_smi) == wanted
    # the documented difference (docs/nvidia-smi.md): -q -x has no per-process utilization
    assert process_busy(from_nvml) == {pid: (sm * n, pm * n) for pid, (_, _, sm, pm) in processes.items()}
    assert process_busy(from_smi) == {pid: (-1, -1) for pid in processes}


def test_reserved_memory_is_left_out_of_used_as_nvidia_smi_does(smi: dict[str, Counters]) -> None:
    """The whole card reserves 469 MiB: v2 memory info (drivers from 510) agrees with nvidia-smi's
    "Used"; a 470 driver has only v1, whose "used" includes the reserved memory."""
    reserved = 469 * MIB
    smi_used = stats(smi["card"])[-1].memory_used_kib
    assert smi_used == WHOLE[1] * MIB
    assert stats(nvml_counters("card"))[-1].memory_used_kib == smi_used
    assert stats(nvml_counters("card", driver="470"))[-1].memory_used_kib == smi_used + reserved


def test_version_1_differs_only_in_per_process_busy(nvml: dict[str, Counters], smi: dict[str, Counters]) -> None:
    """S v1: per-process busy is an average (NVML) or -1 (nvidia-smi); everything else is the same bytes."""
    from_nvml, from_smi = stats(nvml["instances"], 1), stats(smi["instances"], 1)
    assert [device_figures(d) for d in from_nvml] == [device_figures(d) for d in from_smi]
    assert [process_memory(d) for d in from_nvml] == [process_memory(d) for d in from_smi]
    *_, processes = WHOLE
    assert process_busy(from_nvml[-1]) == {pid: (sm, pm) for pid, (_, _, sm, pm) in processes.items()}
    assert process_busy(from_smi[-1]) == {pid: (-1, -1) for pid in processes}


# -- the same through the installed daemon --


@pytest.fixture
def smi_binary(tmp_path: Path) -> Path:
    """An executable nvidia-smi printing the fixtures."""
    return smi_stand_in(tmp_path, REPORT, LISTING)


@pytest.fixture(params=["instances", "card"])
def daemons(
    request: pytest.FixtureRequest, tmp_path: Path, smi_binary: Path
) -> Iterator[tuple[str, Daemon, Daemon]]:
    """The --mig mode, and a simulated daemon and an nvidia-smi daemon on the same host with it."""
    common = ["--interval", "0.2", "--mig", request.param]
    sim_args = ["--reader", "sim", "--scenario", str(SCENARIO), *common]
    smi_args = ["--reader", "nvidia-smi", "--nvidia-smi", str(smi_binary), "--smi-timeout", "5", *common]
    with run_daemon(tmp_path, sim_args) as sim:
        with run_daemon(tmp_path, smi_args) as smi:
            yield request.param, sim, smi


@pytest.mark.e2e
def test_daemons_on_either_reader_agree(daemons: tuple[str, Daemon, Daemon]) -> None:
    """Over the socket: T byte-identical, S memory and processes the same, from either reader."""
    mig, sim, smi = daemons
    sim_types, sim_stats = first_reply(sim)
    smi_types, smi_stats = first_reply(smi)
    assert sim_types == smi_types == EXPECTED_TYPES[mig]
    for a, b in zip(sim_stats, smi_stats, strict=True):
        assert (a.memory_total_kib, a.memory_used_kib) == (b.memory_total_kib, b.memory_used_kib)
        assert {p.pid: (p.kind, p.memory_now_kib) for p in a.processes} == {
            p.pid: (p.kind, p.memory_now_kib) for p in b.processes
        }
