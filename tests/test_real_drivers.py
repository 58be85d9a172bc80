"""What real drivers and hosts do that a tidy one would not, in both readers.

- two cards reporting one UUID (anonymised reports, VMs cloned from one image);
- product names with characters beyond printable ASCII;
- a GPU that cannot be read at start-up (lost, or one call failing);
- an NVML call that hangs in the driver;
- processes whose memory NVML cannot tell (WDDM, some vGPU guests).
"""

from __future__ import annotations

import time
import urllib.request
from pathlib import Path
from typing import Any, Iterator

import pytest
import render_oracle
from daemon import Daemon, first_reply, free_port, run_daemon, smi_stand_in
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from twisted.internet.task import Clock
from twisted.logger import formatEvent, globalLogPublisher

from atopgpud_tw import codec
from atopgpud_tw.counters import Counters
from atopgpud_tw.readers.identity import CardKeys
from atopgpud_tw.readers.nvml.reader import NvmlReader
from atopgpud_tw.readers.nvml.watchdog import CallWatch, HangWatchdog
from atopgpud_tw.readers.smi.report import parse_report
from atopgpud_tw.server.atop import render
from atopgpud_tw.server.atop.board import Board
from atopgpud_tw.server.web.metrics import BoardCollector
from atopgpud_tw.sim import parse_scenario, simulated_binding
from atopgpud_tw.snapshot import DeviceSample, ProcessSample, Snapshot, add_memory

HERE = Path(__file__).parent
FIXTURES = HERE / "fixtures" / "smi"
MIB = 1024
SHARED_UUID = "GPU-12345678-aaaa-bbbb-cccc-0123456789ab"
#: what T shows for clones.xml and for clones(): both cards, "®" and the space each "_"
CLONES_TYPES = b"2@00000000:01:00.0 NVIDIA_GeForce__RTX_2070 3@00000000:02:00.0 NVIDIA_GeForce__RTX_2070 3"


def card(busid: str, pid: int, memory_mib: int, **extra: Any) -> dict:
    return {
        "name": "NVIDIA GeForce\u00ae RTX 2070",
        "busid": busid,
        "uuid": SHARED_UUID,
        "memory_total_mib": 8192,
        "gpu_util": 30,
        "mem_util": 5,
        "samples_supported": False,
        "processes": [{"pid": pid, "memory_mib": memory_mib, "sm_util": 10, "mem_util": 1}],
        **extra,
    }


def clones(faults: tuple[list, list] = ([], [])) -> dict:
    """The host of clones.xml as a scenario: two cards with one UUID."""
    return {
        "gpus": [
            card("00000000:01:00.0", 301, 512, memory_used_mib=1024, faults=faults[0]),
            card("00000000:02:00.0", 302, 1536, memory_used_mib=2048, faults=faults[1]),
        ]
    }


class Host:
    """The NVML reader over a simulated host, read synchronously at simulated times."""

    def __init__(self, scenario: dict, mig: str = "instances") -> None:
        self.now = 0.0
        self.nvml = simulated_binding(parse_scenario(scenario), clock=lambda: self.now)
        self.reader = NvmlReader(self.nvml, reactor=None, mig=mig)
        self.layout = self.reader.open()
        self.counters = Counters()
        self.counters.declare(self.layout)
        self.problems: list[dict[str, str]] = []
        self.history: list[list[tuple[int, ...]]] = []

    def poll(self) -> Snapshot:
        snapshot, problems = self.reader.read(self.now)
        self.problems.append(problems)
        self.counters.fold(snapshot)
        self.history.append([
            (d.samples, d.gpu_busy_total, d.mem_busy_total, d.memory_used_cum_kib) for d in self.counters.devices
        ])
        return snapshot

    def until(self, seconds: float) -> None:
        while self.now < seconds:
            self.poll()
            self.now += 1.0

    def types(self) -> bytes:
        return render.render_types(self.counters.devices)

    def assert_monotonic(self) -> None:
        for before, after in zip(self.history, self.history[1:]):
            for old, new in zip(before, after):
                assert all(b >= a for a, b in zip(old, new)), (old, new)


# -- two cards with one UUID --


def test_card_keys_are_unique_and_stable() -> None:
    """The second card with a UUID is keyed by UUID and bus id, and keeps its key when the first is gone."""
    keys = CardKeys()
    assert keys.assign([("U", "01"), ("U", "02"), (None, "03")]) == ["U", "U@02", "03"]
    assert keys.assign([("U", "02")]) == ["U@02"]
    assert keys.assign([("U", "02"), ("U", "01")]) == ["U@02", "U"]
    assert keys.assign([("U", "05"), ("U", "05")]) == ["U", "U@05"]


def test_nvml_shows_both_cards_with_one_uuid() -> None:
    """NVML: two cards with one UUID are two devices, each with its own counters and processes."""
    host = Host(clones())
    assert len({d.key for d in host.layout.devices}) == 2
    host.until(3)
    assert host.types() == CLONES_TYPES
    first, second = host.counters.devices
    assert (first.samples, second.samples) == (3, 3)
    assert (first.memory_used_kib, second.memory_used_kib) == (1024 * MIB, 2048 * MIB)
    assert (list(first.processes), list(second.processes)) == ([301], [302])


def test_nvml_clone_keys_stay_when_one_card_is_lost() -> None:
    """The first of the two lost for a while: the second carries on under its key, the first comes back."""
    lost = [{"call": "*", "error": "NVML_ERROR_GPU_IS_LOST", "from": 3, "until": 9}]
    host = Host(clones((lost, [])))
    keys = [d.key for d in host.layout.devices]
    host.until(30)
    assert [d.key for d in host.counters.devices] == keys
    first, second = host.counters.devices
    assert second.samples == 30 and first.present and 3 + 10 <= first.samples < 30
    assert 301 in first.processes and 302 in second.processes
    host.assert_monotonic()


def test_smi_shows_both_cards_with_one_uuid() -> None:
    """nvidia-smi: the same two cards from clones.xml, T byte-identical to the NVML reader's."""
    data = (FIXTURES / "clones.xml").read_bytes()
    keys = CardKeys()
    counters = Counters()
    for _ in range(3):
        devices, problems = parse_report(data, keys=keys)
        assert problems == {}
        counters.fold(Snapshot(devices))
    assert render.render_types(counters.devices) == CLONES_TYPES
    first, second = counters.devices
    assert (first.samples, second.samples) == (3, 3)
    assert (first.processes[301].memory_now_kib, second.processes[302].memory_now_kib) == (512 * MIB, 1536 * MIB)


def test_smi_clone_keys_stay_when_one_card_is_missing() -> None:
    """A report without the first clone: the second keeps its key, so its counters carry on."""
    data = (FIXTURES / "clones.xml").read_bytes()
    start = data.index(b"\t<gpu ")
    second_start = data.index(b"\t<gpu ", start + 1)
    without_first = data[:start] + data[second_start:]
    keys = CardKeys()
    counters = Counters()
    for report in (data, without_first, data):
        devices, _ = parse_report(report, keys=keys)
        counters.fold(Snapshot(devices))
    first, second = counters.devices
    assert (len(counters.devices), first.samples, second.samples) == (2, 2, 3)


@pytest.fixture
def clone_daemons(tmp_path: Path) -> Iterator[tuple[Daemon, Daemon]]:
    """A simulated daemon and an nvidia-smi daemon, each on the clones host."""
    common = ["--interval", "0.2"]
    smi = ["--reader", "nvidia-smi", "--nvidia-smi", str(smi_stand_in(tmp_path, FIXTURES / "clones.xml"))]
    with run_daemon(tmp_path, common, scenario=clones()) as sim_daemon:
        with run_daemon(tmp_path, [*smi, *common]) as smi_daemon:
            yield sim_daemon, smi_daemon


@pytest.mark.e2e
def test_daemons_show_both_clones_with_safe_names(clone_daemons: tuple[Daemon, Daemon]) -> None:
    """Over the socket, from either reader: both cards in T, "®" as "_", each with its own process."""
    for daemon in clone_daemons:
        types, stats = first_reply(daemon)
        assert types == CLONES_TYPES
        assert [[p.pid for p in d.processes] for d in stats] == [[301], [302]]


# -- names beyond printable ASCII --


def test_nvml_names_beyond_ascii_are_underscores() -> None:
    """NVML: a name with a control character and an accent: each "_" in T."""
    host = Host({"gpus": [card("00000000:01:00.0", 301, 512, name="NVIDIA T\u00e9sla\x07T4")]})
    host.until(1)
    assert host.types() == b"1@00000000:01:00.0 NVIDIA_T_sla_T4 3"


# -- a GPU that cannot be read at start-up --


def two_cards(faults: list) -> dict:
    """Two plain cards; the second has `faults`."""
    plain = {"gpu_util": 40, "mem_util": 10, "samples_supported": False,
             "processes": [{"pid": 500, "memory_mib": 64, "sm_util": 20, "mem_util": 2}]}
    return {"gpus": [{"busid": "00000000:17:00.0", **plain}, {"busid": "00000000:65:00.0", **plain, "faults": faults}]}


def counting(host: Host, name: str) -> list[float]:
    """Record the simulated time of every call of `name`."""
    real = getattr(host.nvml, name)
    times: list[float] = []

    def counted(*args: Any) -> Any:
        times.append(host.now)
        return real(*args)

    setattr(host.nvml, name, counted)
    host.reader.session._bound.pop(name, None)  # (the session looks each function up once)
    return times


UNUSABLE = "index 1 unusable"


@pytest.mark.parametrize(
    "call, error",
    [
        ("nvmlDeviceGetHandleByIndex", "NVML_ERROR_GPU_IS_LOST"),
        ("nvmlDeviceGetHandleByIndex", "NVML_ERROR_GPU_NOT_FOUND"),
        ("nvmlDeviceGetPciInfo", "NVML_ERROR_GPU_IS_LOST"),
        ("nvmlDeviceGetName", "NVML_ERROR_UNKNOWN"),
        ("nvmlDeviceGetUUID", "NVML_ERROR_GPU_IS_LOST"),
    ],
)
def test_gpu_unusable_at_start_up_joins_when_it_works(call: str, error: str) -> None:
    """A card whose discovery fails is looked for again with backoff and joins T when it works."""
    host = Host(two_cards([{"call": call, "error": error, "until": 5}]))
    handles = counting(host, "nvmlDeviceGetHandleByIndex")
    assert [d.busid for d in host.layout.devices] == ["00000000:17:00.0"]
    host.until(30)
    # looked for at the first poll, then 1, 2, 4 s later: found at 7 (its fault ended at 5)
    assert sorted(set(handles)) == [0.0, 1.0, 3.0, 7.0]
    assert [UNUSABLE in p for p in host.problems] == [True] * 7 + [False] * 23
    assert host.types() == b"2@00000000:17:00.0 NVIDIA_Simulated_GPU 3@00000000:65:00.0 NVIDIA_Simulated_GPU 3"
    first, second = host.counters.devices
    assert (first.samples, second.samples) == (30, 23)
    assert second.key == "GPU-5111a7ed-0000-4000-8000-000000000001" and 500 in second.processes
    host.assert_monotonic()


def test_only_gpu_lost_at_start_up_is_looked_for_with_backoff() -> None:
    """The one card lost at start-up: no "no GPU" case, looked for with backoff, not at every poll."""
    lost = {"call": "nvmlDeviceGetHandleByIndex", "error": "NVML_ERROR_GPU_IS_LOST", "until": 40}
    host = Host({"gpus": [{"busid": "00000000:17:00.0", "faults": [lost]}]})
    handles = counting(host, "nvmlDeviceGetHandleByIndex")
    assert host.layout.devices == ()
    host.until(40)
    assert host.counters.devices == []
    assert sorted(set(handles)) == [0.0, 1.0, 3.0, 7.0, 15.0, 31.0]
    assert all(list(p) == ["index 0 unusable"] for p in host.problems)
    host.until(120)
    assert host.counters.devices[0].present and host.counters.devices[0].samples == 120 - 61


def test_uuid_not_supported_keys_by_bus_id_at_once() -> None:
    """No UUID at all (NOT_SUPPORTED) is no failure: the card is keyed by its bus id from the start."""
    host = Host(two_cards([{"call": "nvmlDeviceGetUUID", "error": "NVML_ERROR_NOT_SUPPORTED"}]))
    assert [d.key for d in host.layout.devices] == ["GPU-5111a7ed-0000-4000-8000-000000000000", "00000000:65:00.0"]
    host.until(2)
    assert not any(host.problems)


@pytest.fixture
def late_gpu_daemon(tmp_path: Path) -> Iterator[Daemon]:
    """The second card cannot be identified for the first simulated second."""
    fault = {"call": "nvmlDeviceGetPciInfo", "error": "NVML_ERROR_GPU_IS_LOST", "until": 1.0}
    with run_daemon(tmp_path, ["--interval", "0.2"], scenario=two_cards([fault])) as daemon:
        yield daemon


@pytest.mark.e2e
def test_daemon_logs_an_unusable_gpu_once_and_its_recovery_once(late_gpu_daemon: Daemon) -> None:
    """Over the socket: T gains the card when it works; one warning, however many retries, one recovery."""
    daemon = late_gpu_daemon
    deadline = time.monotonic() + 15
    while True:
        client = daemon.client()
        try:
            types = codec.parse_types(client.ask("T")[1])
        finally:
            client.close()
        if len(types) == 2 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert [t.busid for t in types] == ["00000000:17:00.0", "00000000:65:00.0"], daemon.log()
    log = daemon.log()
    assert log.count("GPU index 1 cannot be used: NVML_ERROR_GPU_IS_LOST") == 2, log  # the warning, the recovery
    assert log.count("nvml: recovered (GPU index 1 cannot be used") == 1, log


# -- process memory the driver cannot tell --


def test_process_memory_unknown_is_minus_one_and_poisons_nothing() -> None:
    """Unknown from the first sample: -1 now and summed, still counted, its busy sums go on."""
    counters = Counters()
    for _ in range(3):
        counters.fold(Snapshot((DeviceSample("k", "b", "n", gpu_busy=50, mem_busy=5, memory_total_kib=100,
                                             memory_used_kib=40, processes=(ProcessSample(9, "C", -1, 20, 2),)),)))
    device = counters.devices[0]
    totals = device.processes[9]
    assert (totals.samples, totals.memory_now_kib, totals.memory_cum_kib) == (3, -1, -1)
    assert (totals.gpu_busy_cum, totals.mem_busy_cum) == (60, 6)
    assert (device.samples, device.memory_used_cum_kib) == (3, 120)
    v2 = render.render_process(totals, 2)
    assert v2 == b"#A 9 C 60 6 -1 -1 3"
    assert render.render_process(totals, 1) == b"#A 9 20 2 0 -1 -1 3"


def test_process_memory_known_then_unknown_is_a_failed_read() -> None:
    """Known first, then not: that poll is not counted (the sum stays exact); unknown first stays -1."""
    def fold(counters: Counters, memory: int) -> None:
        counters.fold(Snapshot((DeviceSample("k", "b", "n", processes=(ProcessSample(9, "C", memory, 0, 0),)),)))

    known_first = Counters()
    for memory in (100, -1, 100):
        fold(known_first, memory)
    totals = known_first.devices[0].processes[9]
    assert (totals.samples, totals.memory_now_kib, totals.memory_cum_kib) == (2, 100, 200)
    unknown_first = Counters()
    for memory in (-1, 100):
        fold(unknown_first, memory)
    totals = unknown_first.devices[0].processes[9]
    assert (totals.samples, totals.memory_now_kib, totals.memory_cum_kib) == (2, 100, -1)


def test_add_memory() -> None:
    """A pid on two MIG instances: its memory is added, unknown if either is, failed if either failed."""
    assert (add_memory(1, 2), add_memory(1, -1), add_memory(-1, None), add_memory(None, 3)) == (3, -1, None, None)


def unknown_memory_host() -> dict:
    """One card: a process whose memory NVML cannot tell (memory_mib null) and one it can."""
    return {"gpus": [{
        "busid": "00000000:0A:00.0", "gpu_util": 10, "mem_util": 1, "samples_supported": False,
        "processes": [
            {"pid": 7724, "type": "C+G", "memory_mib": None, "sm_util": 5, "mem_util": 1},
            {"pid": 8000, "memory_mib": 64, "sm_util": 5, "mem_util": 1},
        ],
    }]}


def test_nvml_lists_a_process_whose_memory_is_not_available() -> None:
    """usedGpuMemory None: the process is listed, memory -1 on the wire; the other as usual."""
    host = Host(unknown_memory_host())
    (proc,) = [p for p in host.nvml.nvmlDeviceGetComputeRunningProcesses(host.nvml.nvmlDeviceGetHandleByIndex(0))
               if p.pid == 7724]
    assert proc.usedGpuMemory is None
    host.until(3)
    (device,) = codec.parse_stats(render_oracle.render_stats(host.counters.devices, 2).body, 2)
    figures = {p.pid: (p.kind, p.memory_now_kib, p.memory_cum_kib, p.samples) for p in device.processes}
    assert figures == {7724: ("C", -1, -1, 3), 8000: ("C", 64 * MIB, 3 * 64 * MIB, 3)}
    assert device.samples == 3


def test_smi_lists_a_process_whose_memory_is_n_a() -> None:
    """nvidia-smi's used_memory N/A (WDDM): listed, memory -1, as the NVML reader shows it."""
    counters = Counters()
    for _ in range(3):
        devices, _ = parse_report((FIXTURES / "not-available.xml").read_bytes())
        counters.fold(Snapshot(devices))
    wddm = codec.parse_stats(render_oracle.render_stats(counters.devices, 2).body, 2)[0]
    assert {p.pid: (p.memory_now_kib, p.memory_cum_kib, p.samples) for p in wddm.processes} == {
        7724: (-1, -1, 3), 10808: (-1, -1, 3),
    }


def test_metrics_leave_out_unknown_process_memory() -> None:
    """/metrics: a process whose memory is not known has no memory series (not -1024 bytes)."""
    board = Board()
    board.fold(Snapshot((DeviceSample("k", "00000000:0A:00.0", "n", processes=(ProcessSample(9, "C", -1, 0, 0),)),)))
    text = generate_latest(BoardCollector(board, Poller(), 1.0, processes=True)).decode()
    assert "atopgpud_process_samples_total{" in text
    assert "atopgpud_process_memory_used_bytes{" not in text
    assert "atopgpud_nvml_" not in text  # no NVML watchdog given (the nvidia-smi reader has none)


class Poller:
    polls = 0
    failed_polls: dict[str, int] = {}


@pytest.fixture
def unknown_memory_daemons(tmp_path: Path) -> Iterator[tuple[Daemon, Daemon]]:
    smi = ["--reader", "nvidia-smi", "--nvidia-smi", str(smi_stand_in(tmp_path, FIXTURES / "not-available.xml"))]
    with run_daemon(tmp_path, ["--interval", "0.2"], scenario=unknown_memory_host()) as sim_daemon:
        with run_daemon(tmp_path, [*smi, "--interval", "0.2"]) as smi_daemon:
            yield sim_daemon, smi_daemon


@pytest.mark.e2e
def test_daemons_send_minus_one_for_unknown_process_memory(unknown_memory_daemons: tuple[Daemon, Daemon]) -> None:
    """Over the socket, from either reader: pid 7724 is listed with memory -1 now and summed."""
    for daemon in unknown_memory_daemons:
        _, stats = first_reply(daemon)
        (proc,) = [p for p in stats[0].processes if p.pid == 7724]
        assert (proc.memory_now_kib, proc.memory_cum_kib) == (-1, -1)
        assert proc.samples >= 1


# -- a hung NVML call --


@pytest.fixture
def log_lines() -> Iterator[list[str]]:
    """The text of every log event while the test runs."""
    lines: list[str] = []

    def observe(event: dict) -> None:
        lines.append(formatEvent(event))

    globalLogPublisher.addObserver(observe)
    yield lines
    globalLogPublisher.removeObserver(observe)


def test_watchdog_warns_once_after_ten_seconds_and_once_on_return(log_lines: list[str]) -> None:
    """On task.Clock: one warning at 10 s naming the call and GPU, one line with the time it took."""
    clock = Clock()
    watch = CallWatch(clock.seconds)
    watchdog = HangWatchdog(watch, clock)
    watchdog.arm()
    watch.begin("nvmlDeviceGetSamples", "GPU 00000000:17:00.0")
    clock.pump([1.0] * 9)
    assert log_lines == [] and watchdog.hung_calls == 0
    clock.pump([1.0] * 21)
    assert log_lines == [
        "NVML call nvmlDeviceGetSamples on GPU 00000000:17:00.0 has not returned for 10 s; "
        "no poll starts until it does"
    ]
    assert (watchdog.hung_calls, watchdog.running_seconds()) == (1, 30.0)
    clock.advance(0.5)
    watch.end()
    clock.pump([1.0] * 5)
    assert log_lines[1:] == ["NVML call nvmlDeviceGetSamples on GPU 00000000:17:00.0 returned after 30.5 s"]
    assert (watchdog.hung_calls, watchdog.running_seconds()) == (1, 0.0)
    watchdog.stop()
    assert clock.getDelayedCalls() == []


def test_watchdog_is_quiet_about_quick_calls(log_lines: list[str]) -> None:
    """Many short calls, a library call of 9 s: nothing logged, nothing counted."""
    clock = Clock()
    watch = CallWatch(clock.seconds)
    watchdog = HangWatchdog(watch, clock)
    watchdog.arm()
    for _ in range(50):
        watch.begin("nvmlDeviceGetMemoryInfo", "GPU 00000000:17:00.0")
        clock.advance(0.3)
        watch.end()
    watch.begin("nvmlInit")
    clock.pump([1.0] * 9)
    watch.end()
    clock.pump([1.0] * 20)
    assert log_lines == [] and watchdog.hung_calls == 0


def test_watchdog_names_a_library_call_without_a_gpu(log_lines: list[str]) -> None:
    """A hung nvmlInit has no GPU to name; a second hung call is warned of again."""
    clock = Clock()
    watch = CallWatch(clock.seconds)
    watchdog = HangWatchdog(watch, clock, after=2.0)
    watchdog.arm()
    for function in ("nvmlInit", "nvmlDeviceGetCount"):
        watch.begin(function)
        clock.pump([0.2] * 15)
        watch.end()
        clock.pump([0.2] * 2)
    assert [line.split(" has ")[0].split(" returned")[0] for line in log_lines] == [
        "NVML call nvmlInit", "NVML call nvmlInit", "NVML call nvmlDeviceGetCount", "NVML call nvmlDeviceGetCount",
    ]
    assert watchdog.hung_calls == 2


def test_watchdog_armed_for_a_poll_ticks_only_while_it_runs(log_lines: list[str]) -> None:
    """Armed per poll: nothing scheduled between polls; a hung call warned of, its return said when the poll ends."""
    clock = Clock()
    watch = CallWatch(clock.seconds)
    watchdog = HangWatchdog(watch, clock)
    for _ in range(3):
        watchdog.arm()
        watch.begin("nvmlDeviceGetMemoryInfo", "GPU 00000000:17:00.0")
        clock.advance(0.001)
        watch.end()
        watchdog.disarm()
        assert clock.getDelayedCalls() == []
        clock.advance(1.0)
    watchdog.arm()
    watch.begin("nvmlDeviceGetSamples", "GPU 00000000:17:00.0")
    clock.pump([1.0] * 12)
    assert log_lines == [
        "NVML call nvmlDeviceGetSamples on GPU 00000000:17:00.0 has not returned for 10 s; "
        "no poll starts until it does"
    ]
    clock.advance(0.5)
    watch.end()
    watchdog.disarm()
    assert log_lines[1:] == ["NVML call nvmlDeviceGetSamples on GPU 00000000:17:00.0 returned after 12.5 s"]
    assert watchdog.hung_calls == 1 and clock.getDelayedCalls() == []


def test_every_nvml_call_of_a_poll_is_noted_with_its_gpu() -> None:
    """The reader notes the call in progress, and what it is on, for device and library calls alike."""
    host = Host(two_cards([]))
    seen: list[tuple[str, str | None]] = []
    # the memory call goes through the binding's function table, beneath its wrapper: it is
    # watched in the simulated driver, where the call lands
    model = host.nvml.nvmlLib.model
    for owner, name in ((model, "nvmlDeviceGetMemoryInfo"), (host.nvml, "nvmlDeviceGetCount"),
                        (host.nvml, "nvmlDeviceGetHandleByIndex")):
        real = getattr(owner, name)

        def noted(*args: Any, real: Any = real) -> Any:
            call = host.reader.calls.current
            seen.append((call.function, call.where))
            return real(*args)

        setattr(owner, name, noted)
    host.reader.session._bound.clear()  # (the session looks each function up once)
    host.reader._rediscover()
    host.poll()
    assert seen == [
        ("nvmlDeviceGetCount", None),
        ("nvmlDeviceGetHandleByIndex", "GPU index 0"),
        ("nvmlDeviceGetHandleByIndex", "GPU index 1"),
        ("nvmlDeviceGetMemoryInfo", "GPU 00000000:17:00.0"),
        ("nvmlDeviceGetMemoryInfo", "GPU 00000000:65:00.0"),
    ]
    assert host.reader.calls.current is None


@pytest.fixture
def hung_daemon(tmp_path: Path) -> Iterator[tuple[Daemon, int]]:
    """GPU 0's samples call hangs from 0.6 s (simulated) until 2.2 s; --hang-warning 0.5."""
    hang = {"call": "nvmlDeviceGetSamples", "error": "hang", "from": 0.6, "until": 2.2}
    port = free_port()
    args = ["--interval", "0.2", "--hang-warning", "0.5", "--metrics", f"tcp:{port}:interface=127.0.0.1"]
    scenario = two_cards([])
    scenario["gpus"][0].update(samples_supported=True, faults=[hang])
    with run_daemon(tmp_path, args, scenario=scenario) as daemon:
        yield daemon, port


def scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name.startswith("atopgpud_nvml_")
    }


@pytest.mark.e2e
def test_daemon_warns_of_a_hung_call_and_shows_it_in_metrics(hung_daemon: tuple[Daemon, int]) -> None:
    """Installed daemon: one warning naming the call and GPU, /metrics counting it, one line on return."""
    daemon, port = hung_daemon
    warning = "NVML call nvmlDeviceGetSamples on GPU 00000000:17:00.0 has not returned for 0.5 s"
    returned = "NVML call nvmlDeviceGetSamples on GPU 00000000:17:00.0 returned after"
    deadline = time.monotonic() + 15
    while warning not in daemon.log():
        assert time.monotonic() < deadline, daemon.log()
        time.sleep(0.05)
    during = scrape(port)
    assert during["atopgpud_nvml_hung_calls_total"] == 1
    assert during["atopgpud_nvml_call_seconds"] >= 0.5
    client = daemon.client()
    try:
        assert len(client.stats()) == 2  # still answered at once
    finally:
        client.close()
    while returned not in daemon.log():
        assert time.monotonic() < deadline, daemon.log()
        time.sleep(0.05)
    daemon.wait_samples(daemon.wait_samples(1)[0].samples + 2)  # polls go on
    after = scrape(port)
    assert after["atopgpud_nvml_hung_calls_total"] == 1 and after["atopgpud_nvml_call_seconds"] < 0.5
    log = daemon.log()
    assert (log.count(warning), log.count(returned)) == (1, 1), log
    took = float(log.split(returned)[1].split()[0])
    assert 0.5 <= took <= 2.2


def test_a_known_gpu_lost_is_one_problem_until_it_is_back() -> None:
    """A card lost mid-run stays one "lost" problem while re-discovery misses it: no false recovery, no second line."""
    lost = {"call": "*", "error": "NVML_ERROR_GPU_IS_LOST", "from": 3, "until": 12}
    host = Host(two_cards([lost]))
    host.until(30)
    key = "GPU-5111a7ed-0000-4000-8000-000000000001 lost"
    spells = [sorted(p) for p in host.problems]
    back = next(i for i in range(3, 30) if not spells[i])
    assert spells[:3] == [[]] * 3 and spells[3:back] == [[key]] * (back - 3)
    assert 12 <= back <= 12 + 8 and not any(spells[back:])
    assert host.counters.devices[1].present
