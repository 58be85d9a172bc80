"""The driver's lifecycle, as the NVML reader lives through it and says it: a driver upgraded
(version mismatch), a driver not loaded at start-up, GPUs enumerated in another order, a
GPU lost for good.  On the simulator, through the real nvidia-ml-py, on an injected clock."""

from __future__ import annotations

from typing import Any, Iterator

import pytest
from sim_readers import ScenarioRun, scenario_gpu
from twisted.internet.task import Clock
from twisted.logger import globalLogPublisher

from atopgpud_tw.readers.nvml.reader import NvmlReader
from atopgpud_tw.sim import parse_scenario, simulated_binding


@pytest.fixture
def lines() -> Iterator[list[tuple[str, str]]]:
    """Every log line while the test runs, as (level, text)."""
    from twisted.logger import formatEvent

    seen: list[tuple[str, str]] = []

    def observe(event: dict[str, Any]) -> None:
        seen.append((event["log_level"].name, formatEvent(event)))

    globalLogPublisher.addObserver(observe)
    yield seen
    globalLogPublisher.removeObserver(observe)


def lifecycle_run(scenario: dict[str, Any]) -> ScenarioRun:
    """The reader over `scenario`, each poll's problems logged as the poller logs them, a poll
    that raises failing the test."""
    return ScenarioRun(scenario, report=True, contain=False)


def nvml_lines(lines: list[tuple[str, str]]) -> list[tuple[str, str]]:
    return [(level, text) for level, text in lines if text.startswith("nvml:") and " GPU 0000" not in text[:10]]


def test_a_version_mismatch_is_said_once_with_its_cause_and_once_when_it_recovers(lines):
    """LIB_RM_VERSION_MISMATCH from every call for 5 s: one warning naming it, its usual cause and
    remedy, and that the daemon keeps looking; one line when NVML works again; nothing between."""
    fault = {"call": "*", "error": "NVML_ERROR_LIB_RM_VERSION_MISMATCH", "from": 3, "until": 8}
    run = lifecycle_run({"gpus": [scenario_gpu(0), scenario_gpu(1)], "faults": [fault]})
    run.until(40)
    said = [(level, text) for level, text in nvml_lines(lines) if "GPU 00000000" not in text]
    assert len(said) == 2, said
    (level, warning), (back_level, back) = said
    assert level == "warn" and back_level == "info"
    assert "NVML_ERROR_LIB_RM_VERSION_MISMATCH" in warning
    assert "the driver was upgraded and its module not yet reloaded" in warning
    assert "reboot" in warning and "keeps looking" in warning
    assert back.startswith("nvml: NVML works again after ") and "reading 2 GPUs" in back, back
    assert run.device(0).present and run.device(1).present
    run.assert_monotonic()


def test_driver_not_loaded_at_start_up_is_waited_for_and_found_within_a_second(lines):
    """nvmlInit answers DRIVER_NOT_LOADED for the first 10 s (a boot): opening does not fail, no
    GPU is served meanwhile, the reader says what it waits for, and the GPUs are read within a
    second of the driver's arrival; one line each way."""
    fault = {"call": "nvmlInit", "error": "NVML_ERROR_DRIVER_NOT_LOADED", "until": 10}
    run = lifecycle_run({"gpus": [scenario_gpu(0), scenario_gpu(1)], "faults": [fault]})
    assert run.board.counters.devices == [] or not run.board.counters.devices
    assert run.reader.waiting_for() == "waiting for the NVIDIA driver (DRIVER_NOT_LOADED)"
    run.until(10)
    assert len(run.board.counters.devices) == 0
    run.until(12)
    assert run.reader.waiting_for() is None
    assert [d.present for d in run.board.counters.devices] == [True, True]
    assert run.device(0).samples >= 1
    said = [(level, text) for level, text in nvml_lines(lines) if "GPU 00000000" not in text]
    assert [level for level, _ in said] == ["warn", "info"], said
    assert "the NVIDIA driver is not loaded (at boot the daemon may start before it" in said[0][1]
    assert said[1][1] == "nvml: the NVIDIA driver answers: reading 2 GPUs", said
    # every second while waiting at start-up, not backing off
    assert 10 <= run.calls["nvmlInit"] <= 13


def test_a_library_that_is_not_installed_still_ends_start_up():
    """Waiting is for a driver on its way; a library that is not there is one line at start."""
    from atopgpud_tw.readers.base import ReaderUnavailable

    fault = {"call": "nvmlInit", "error": "NVML_ERROR_LIBRARY_NOT_FOUND"}
    reader = NvmlReader(simulated_binding(parse_scenario({"gpus": [scenario_gpu(0)], "faults": [fault]})), reactor=None)
    with pytest.raises(ReaderUnavailable, match="not installed"):
        reader.open()


def test_gpus_enumerated_in_another_order_after_a_reinit_keep_their_counters_and_places():
    """The driver is re-initialised (UNINITIALIZED for 2 s) and comes back with the two GPUs at
    each other's index: each keeps its counters (keyed by its identity, not its index), its
    place in T, and its processes."""
    fault = {"call": "*", "error": "NVML_ERROR_UNINITIALIZED", "from": 5, "until": 7}
    scenario = {"gpus": [scenario_gpu(0, gpu_util=30), scenario_gpu(1, gpu_util=70)], "faults": [fault],
                "reorder": [{"from": 6, "order": [1, 0]}]}
    run = lifecycle_run(scenario)
    run.until(5)
    busids = [d.busid for d in run.board.counters.devices]
    before = [(d.samples, d.gpu_busy_total) for d in run.board.counters.devices]
    run.until(40)
    assert run.reader.nvml.nvmlDeviceGetPciInfo(run.reader.nvml.nvmlDeviceGetHandleByIndex(0)).busId \
        == busids[1], "the scenario did not swap the indices"
    after = run.board.counters.devices
    assert [d.busid for d in after] == busids
    assert all(d.present for d in after) and len(after) == 2
    for (samples, _busy), device, util in zip(before, after, (30, 70)):
        assert device.samples > samples
        # every sample summed at its own GPU's figure: no sum crossed over to the other GPU
        assert device.gpu_busy_total == util * device.samples, (device.busid, device.gpu_busy_total)
    assert sorted(after[0].processes) == [100] and sorted(after[1].processes) == [101]
    run.assert_monotonic()


def test_a_gpu_reset_keeps_its_counters():
    """A GPU reset: lost for 2 s (GPU_IS_LOST), then enumerated again with its identity: its
    counters carry on from where they were."""
    reset = {"call": "*", "error": "NVML_ERROR_GPU_IS_LOST", "from": 4, "until": 6}
    run = lifecycle_run({"gpus": [scenario_gpu(0, [reset], gpu_util=50), scenario_gpu(1)]})
    run.until(4)
    samples = run.device(0).samples
    run.until(30)
    assert run.device(0).present and run.device(0).samples > samples
    assert run.device(0).gpu_busy_total == 50 * run.device(0).samples
    run.assert_monotonic()


def test_a_gpu_lost_for_good_is_said_once(lines):
    """A GPU lost for good: one line, however many polls and re-discoveries follow."""
    gone = {"call": "*", "error": "NVML_ERROR_GPU_IS_LOST", "from": 2}
    run = lifecycle_run({"gpus": [scenario_gpu(0, [gone]), scenario_gpu(1)]})
    run.until(600)
    mentioned = [text for _, text in lines if ("00000000:17:00.0" in text or "index 0" in text)
                 and "process utilization" not in text]
    # the GPU's own line at discovery, then its loss once
    assert len(mentioned) == 2, mentioned
    assert "NVML_ERROR_GPU_IS_LOST" in mentioned[1]


class Sent:
    """A notifier that keeps what it would send."""

    active = True

    def __init__(self) -> None:
        self.messages: list[dict[str, str]] = []

    def send(self, **fields: str) -> None:
        self.messages.append(fields)


class RunningClock(Clock):
    def callWhenRunning(self, f: Any, *args: Any) -> None:  # noqa: N802 - Twisted's name
        f(*args)


def test_ready_is_held_while_the_driver_is_waited_for(lines):
    """READY=1 waits for the reader's driver, with a status line saying so; it is sent once the
    GPUs are known, within half a second."""
    from atopgpud_tw.server.system.notify import NotifyService

    sent, clock = Sent(), RunningClock()
    waiting: list[str | None] = ["waiting for the NVIDIA driver (DRIVER_NOT_LOADED)"]
    service = NotifyService(sent, lambda: f"sim: 0 GPUs; {waiting[0]}" if waiting[0] else "sim: 2 GPUs",
                            clock, lambda: waiting[0], 60.0)  # type: ignore[arg-type]
    service.startService()
    clock.advance(10)
    assert sent.messages == [{"STATUS": "sim: 0 GPUs; waiting for the NVIDIA driver (DRIVER_NOT_LOADED)"}]
    waiting[0] = None
    clock.advance(0.5)
    assert sent.messages[-1] == {"READY": "1", "STATUS": "sim: 2 GPUs"} and service.ready
    service.stopService()
    assert not clock.getDelayedCalls()


def test_ready_is_sent_after_the_bound_without_the_driver_with_a_warning(lines):
    """A driver that does not come: READY=1 after --driver-wait all the same, with one warning
    saying what an atop started now will miss."""
    from atopgpud_tw.server.system.notify import NotifyService

    sent, clock = Sent(), RunningClock()
    service = NotifyService(sent, lambda: "sim: 0 GPUs; waiting", clock, lambda: "waiting for it", 5.0)  # type: ignore[arg-type]
    service.startService()
    clock.advance(4.5)
    assert all("READY" not in m for m in sent.messages)
    clock.advance(0.5)
    assert sent.messages[-1] == {"READY": "1", "STATUS": "sim: 0 GPUs; waiting"}
    warned = [text for level, text in lines if level == "warn"]
    assert warned == ["ready without GPUs: still waiting for it after 5 s (--driver-wait); an atop that starts "
                      "before the driver is loaded shows no GPU until it is restarted"]
    service.stopService()
