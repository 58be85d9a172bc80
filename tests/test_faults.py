"""GPU and driver faults from simulator scenarios: contained, recovered, counters monotonic."""

from __future__ import annotations

import pytest
from sim_readers import ScenarioRun, scenario_gpu
from twisted.internet.defer import succeed
from twisted.internet.task import Clock

from atopgpud_tw.readers.nvml.reader import BACKOFF, NvmlReader
from atopgpud_tw.server.atop.board import Board
from atopgpud_tw.server.atop.poller import PollerService
from atopgpud_tw.sim import parse_scenario, simulated_binding


def test_lost_gpu_comes_back_with_its_counters():
    """GPU_IS_LOST on every call of GPU 0 for a while: absent, then back, counters monotonic."""
    lost = {"call": "*", "error": "NVML_ERROR_GPU_IS_LOST", "from": 3, "until": 8}
    run = ScenarioRun({"gpus": [scenario_gpu(0, [lost]), scenario_gpu(1)]})
    queue = run.board.attach()
    run.board.stats_body(2, queue)
    run.until(5)
    first, second = run.device(0), run.device(1)
    assert not first.present and first.gpu_busy_now == -1 and first.processes == {}
    assert [e.totals.pid for e in queue.entries] == [100]
    assert second.present and second.samples == 5
    run.until(30)
    assert first.present and first.samples >= 20 and 100 in first.processes
    assert first.key == run.device(0).key and len(run.board.counters.devices) == 2
    assert second.samples == 30
    run.assert_monotonic()


def test_gpu_that_stays_gone_is_absent_and_others_go_on():
    """A GPU lost for good is shown -1, its processes ended once; the other GPU is read every poll."""
    gone = {"call": "*", "error": "NVML_ERROR_GPU_IS_LOST", "from": 2}
    run = ScenarioRun({"gpus": [scenario_gpu(0, [gone]), scenario_gpu(1)]})
    queue = run.board.attach()
    run.board.stats_body(2, queue)
    run.until(120)
    first, second = run.device(0), run.device(1)
    assert (first.present, first.gpu_busy_now, first.mem_busy_now, first.samples) == (False, -1, -1, 2)
    assert [e.totals.pid for e in queue.entries] == [100]
    assert second.samples == 120
    # looked for again with backoff, not at every poll
    assert run.calls["nvmlDeviceGetCount"] < 20
    run.assert_monotonic()


@pytest.mark.parametrize(
    "error", ["NVML_ERROR_DRIVER_NOT_LOADED", "NVML_ERROR_UNINITIALIZED", "NVML_ERROR_LIB_RM_VERSION_MISMATCH"]
)
def test_driver_faults_set_nvml_up_again_with_backoff(error):
    """Driver-wide faults: every device absent meanwhile, NVML re-initialised with backoff, counters kept."""
    fault = {"call": "*", "error": error, "from": 5, "until": 40}
    run = ScenarioRun({"gpus": [scenario_gpu(0), scenario_gpu(1)], "faults": [fault]})
    run.until(40)
    assert not run.device(0).present and not run.device(1).present
    inits_while_broken = run.calls.get("nvmlInit", 0)
    assert 2 <= inits_while_broken <= 10, "backoff: a few attempts in 35 s, not one per poll"
    run.until(120)
    assert run.device(0).present and run.device(1).present
    assert len(run.board.counters.devices) == 2
    # back within the longest backoff after the driver is; nothing counted while it was gone
    assert 5 + (120 - 40 - BACKOFF[-1]) <= run.device(0).samples <= 5 + (120 - 40)
    run.assert_monotonic()


def test_driver_fault_on_one_call_of_one_gpu_reinitialises():
    """UNINITIALIZED from one call mid-run also has NVML set up again."""
    fault = {"call": "nvmlDeviceGetMemoryInfo", "error": "NVML_ERROR_UNINITIALIZED", "from": 3, "until": 4}
    run = ScenarioRun({"gpus": [scenario_gpu(0, [fault]), scenario_gpu(1)]})
    run.until(30)
    assert run.calls["nvmlInit"] >= 2
    assert run.device(0).present and run.device(1).present
    run.assert_monotonic()


def test_library_mismatch_is_contained():
    """NVMLLibraryMismatchError from a process list: that list is treated as unsupported, polls go on."""
    fault = {"call": "nvmlDeviceGetGraphicsRunningProcesses", "error": "NVMLLibraryMismatchError"}
    run = ScenarioRun({"gpus": [scenario_gpu(0, [fault]), scenario_gpu(1)]})
    run.until(10)
    assert run.device(0).samples == 10 and 100 in run.device(0).processes
    assert run.failed_polls == 0


def test_unexpected_exception_in_one_call_fails_only_that_reading():
    """An exception from inside the binding (a process list it cannot copy): the processes
    are not counted in those polls; everything else is."""
    fault = {"call": "nvmlDeviceGetGraphicsRunningProcesses", "error": "RuntimeError", "from": 3, "until": 5}
    run = ScenarioRun({"gpus": [scenario_gpu(0, [fault]), scenario_gpu(1)]})
    run.until(10)
    assert run.failed_polls == 0
    assert run.device(0).samples == 10 and run.device(1).samples == 10
    assert run.device(0).processes[100].samples == 8
    assert run.device(1).processes[101].samples == 10
    run.assert_monotonic()


def test_exception_escaping_the_reader_fails_the_poll_and_recovers():
    """A bug that raises out of the reader fails that poll; NVML is set up again and polls resume."""
    run = ScenarioRun({"gpus": [scenario_gpu(0)]})
    run.until(3)
    original = run.reader._with_vanished
    calls = {"n": 0}

    def broken(samples):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("a bug")
        return original(samples)

    run.reader._with_vanished = broken
    run.until(20)
    assert run.failed_polls == 1
    assert run.calls["nvmlInit"] == 2
    assert run.device(0).present and run.device(0).samples >= 15
    run.assert_monotonic()


def test_poller_keeps_polling_through_faults():
    """On task.Clock: a reader failing and recovering never stops the LoopingCall."""
    clock = Clock()
    nvml = simulated_binding(
        parse_scenario({"gpus": [scenario_gpu(0, [{"call": "*", "error": "NVML_ERROR_GPU_IS_LOST", "from": 2,
                                                    "until": 4}])]}),
        clock=clock.seconds,
    )
    reader = NvmlReader(nvml, reactor=None)
    reader.open()

    class Synchronous:
        name = "sim"

        def poll(self):
            return succeed(reader.read(clock.seconds())[0])

        def close(self):
            pass

    board = Board()
    poller = PollerService(Synchronous(), board, 1.0, clock)
    poller.startService()
    for _ in range(20):
        clock.advance(1.0)
    poller.stopService()
    assert poller.polls == 21 and board.counters.devices[0].present
