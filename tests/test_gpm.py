"""GPU Performance Monitoring: the simulator's GPM beneath the real binding, and the NVML reader's
GPM figures, buffers and MIG busy figures (readers/nvml/gpm.py; docs/mig.md, docs/simulator.md)."""

from __future__ import annotations

import re
from typing import Any

import pytest
from sim_readers import make_reader, poll

from atopgpud_tw.counters import Counters, GpmTotals
from atopgpud_tw.figures import MIB
from atopgpud_tw.readers.nvml.gpm import MIN_SPAN
from atopgpud_tw.server.atop.render import render_types
from atopgpud_tw.sim import parse_scenario, simulated_binding
from atopgpud_tw.sim.scenario import ScenarioError, Timeline
from atopgpud_tw.snapshot import TASK_BUSY_GPM, GpmFigures, Snapshot

#: busy the first quarter of every second, memory 30 %
TIMELINE = {"period": 1.0, "busy": [[0, 0.25]]}
H200 = {
    "name": "NVIDIA H200", "busid": "00000000:19:00.0", "gpu_timeline": TIMELINE, "mem_util": 30,
    "samples_supported": False,
    "gpm": {"sm_share": 0.8, "tensor_share": 0.5, "pcie_tx_mib_s": 1000, "nvlink_rx_mib_s": 200},
}
MIG = {
    "name": "NVIDIA H200", "busid": "00000000:1A:00.0", "gpm": True,
    "mig": [
        {"profile": "3g.71gb", "memory_total_mib": 70000, "memory_used_mib": 10, "gpu_instance": 2, "gpu_util": 60},
        {"profile": "1g.18gb", "memory_total_mib": 18000, "gpu_instance": 9, "slot": 1, "start": 5, "stop": 9,
         "gpu_timeline": {"period": 0.5, "busy": [[0, 0.1]]}},
    ],
}
OLD = {"name": "NVIDIA A100", "busid": "00000000:1B:00.0", "gpu_util": 10, "samples_supported": False}


def _model(nvml: Any) -> Any:
    return nvml._nvml.nvmlLib.model


def _device(snapshot: Snapshot, name: str) -> Any:
    (found,) = [d for d in snapshot.devices if d.name == name]
    return found


def _metrics(binding: Any, first: Any, second: Any, ids: list[int]) -> list[tuple[int, float]]:
    request = binding.c_nvmlGpmMetricsGet_t()
    request.version, request.numMetrics = binding.NVML_GPM_METRICS_GET_VERSION, len(ids)
    request.sample1, request.sample2 = first, second
    for index, metric in enumerate(ids):
        request.metrics[index].metricId = metric
    binding.nvmlGpmMetricsGet(request)
    return [(int(request.metrics[i].nvmlReturn), request.metrics[i].value) for i in range(len(ids))]


def test_simulated_gpm_through_the_real_binding_is_the_exact_average_of_the_timeline() -> None:
    """Two samples 2.5 s apart: graphics activity is the timeline's busy share of exactly that span,
    SM and tensor its shares, PCIe its rate times the activity; an unplayed metric is NOT_SUPPORTED."""
    clock = [10.1]
    binding = simulated_binding(parse_scenario({"gpus": [H200, OLD]}), clock=lambda: clock[0])
    binding.nvmlInit()
    card, old = (binding.nvmlDeviceGetHandleByIndex(i) for i in range(2))
    assert binding.nvmlGpmQueryDeviceSupport(card).isSupportedDevice == 1
    assert binding.nvmlGpmQueryDeviceSupport(old).isSupportedDevice == 0
    first, second = binding.nvmlGpmSampleAlloc(), binding.nvmlGpmSampleAlloc()
    binding.nvmlGpmSampleGet(card, first)
    clock[0] = 12.6
    binding.nvmlGpmSampleGet(card, second)
    exact = Timeline(1.0, ((0.0, 0.25),)).percent(10.1, 12.6)
    answers = _metrics(binding, first, second, [1, 2, 5, 20, 4])
    assert [code for code, _ in answers] == [0, 0, 0, 0, binding.NVML_ERROR_NOT_SUPPORTED]
    graphics, sm, tensor, pcie, _ = (value for _, value in answers)
    assert graphics == pytest.approx(exact) and graphics == pytest.approx(26.0)
    assert (sm, tensor, pcie) == pytest.approx((0.8 * exact, 0.5 * exact, 1000 * exact / 100))
    with pytest.raises(binding.NVMLError_InvalidArgument):
        _metrics(binding, second, first, [1])  # out of order
    with pytest.raises(binding.NVMLError_NotSupported):
        binding.nvmlGpmSampleGet(old, first)
    binding.nvmlGpmSampleFree(first)
    binding.nvmlGpmSampleFree(second)
    with pytest.raises(binding.NVMLError_InvalidArgument):
        binding.nvmlGpmSampleFree(second)
    # a NULL pointer to allocate into: refused, and no buffer allocated that nothing could free
    assert binding._nvmlGetFunctionPointer("nvmlGpmSampleAlloc")(None) == binding.NVML_ERROR_INVALID_ARGUMENT
    assert binding.nvmlLib.model.gpm_buffers == 0


def test_simulated_mig_samples_follow_the_gpu_instance_and_its_life() -> None:
    """nvmlGpmMigSampleGet: a GPU instance's own activity; NOT_FOUND before it exists; its counters
    stop with it; NOT_SUPPORTED on a card out of MIG mode."""
    clock = [1.0]
    binding = simulated_binding(parse_scenario({"gpus": [MIG, H200]}), clock=lambda: clock[0])
    binding.nvmlInit()
    card, whole = (binding.nvmlDeviceGetHandleByIndex(i) for i in range(2))
    first, second = binding.nvmlGpmSampleAlloc(), binding.nvmlGpmSampleAlloc()
    with pytest.raises(binding.NVMLError_NotFound):
        binding.nvmlGpmMigSampleGet(card, 9, first)
    with pytest.raises(binding.NVMLError_NotSupported):
        binding.nvmlGpmMigSampleGet(whole, 2, first)
    binding.nvmlGpmMigSampleGet(card, 2, first)
    clock[0] = 3.0
    binding.nvmlGpmMigSampleGet(card, 2, second)
    assert _metrics(binding, first, second, [1])[0][1] == pytest.approx(60.0)
    clock[0] = 6.0
    binding.nvmlGpmMigSampleGet(card, 9, first)
    clock[0] = 8.9
    binding.nvmlGpmMigSampleGet(card, 9, second)
    exact = Timeline(0.5, ((0.0, 0.1),)).percent(6.0, 8.9)
    assert _metrics(binding, first, second, [1])[0][1] == pytest.approx(exact) and 20 < exact < 21


def test_scenario_gpm_fields_are_checked() -> None:
    """gpm is true, false or an object of known fields in range."""
    assert parse_scenario({"gpus": [{"gpm": False}]}).gpus[0].gpm is None
    assert parse_scenario({"gpus": [{"gpm": True}]}).gpus[0].gpm is not None
    for bad, words in (({"gpm": {"sm": 1}}, "gpus[0].gpm.sm is not a known field"),
                       ({"gpm": {"sm_share": 2}}, "gpus[0].gpm.sm_share must be a number from 0 to 1"),
                       ({"gpm": 3}, "gpus[0].gpm must be true, false or an object")):
        with pytest.raises(ScenarioError, match=re.escape(words)):
            parse_scenario({"gpus": [bad]})


def test_reader_gpm_figures_cover_exactly_each_poll() -> None:
    """One sample per poll: each poll's figures are the timeline's exact average since the poll before
    (the first poll has none); a card without GPM is asked once and never sampled."""
    clock = [0.0]
    reader, nvml = make_reader({"gpus": [H200, OLD]}, clock)
    assert _device(poll(reader, clock, 1.0)[0], "NVIDIA H200").gpm is None
    timeline = Timeline(1.0, ((0.0, 0.25),))
    last = 1.0
    for now in (1.6, 2.9, 3.3, 5.0):
        snapshot, problems = poll(reader, clock, now)
        figures = _device(snapshot, "NVIDIA H200").gpm
        assert figures.seconds == pytest.approx(now - last)
        assert figures.get("graphics") == pytest.approx(timeline.percent(last, now))
        assert figures.get("sm") == pytest.approx(0.8 * timeline.percent(last, now))
        assert figures.get("dram") == pytest.approx(30.0)
        assert figures.get("pcie_tx") == pytest.approx(10 * timeline.percent(last, now))
        assert _device(snapshot, "NVIDIA A100").gpm is None and not problems
        last = now
    assert nvml.calls["nvmlGpmQueryDeviceSupport"] == 2  # once per card
    assert nvml.calls["nvmlGpmSampleGet"] == 5
    # the whole card's busy figure is GPM's (docs/fidelity.md); the A100's digit is as it was
    assert _device(snapshot, "NVIDIA H200").task_support == 3 | TASK_BUSY_GPM
    assert _device(snapshot, "NVIDIA H200").gpu_busy == round(timeline.percent(3.3, 5.0))
    assert _device(snapshot, "NVIDIA A100").task_support == 3


def test_reader_asks_nothing_of_gpm_on_a_driver_without_it() -> None:
    """A driver before GPM (R470): its library lacks the functions; the reader asks once per card."""
    clock = [0.0]
    reader, nvml = make_reader({"driver": "470", "gpus": [H200]}, clock)
    for now in (1.0, 2.0, 3.0):
        snapshot, problems = poll(reader, clock, now)
        assert snapshot.devices[0].gpm is None and not problems
    assert nvml.calls["nvmlGpmQueryDeviceSupport"] == 1
    assert nvml.calls["nvmlGpmSampleAlloc"] == 0


def test_mig_instance_busy_is_its_gpu_instances_graphics_activity() -> None:
    """A MIG instance's busy figure is GPM's, with the task-support digit's third bit from the start;
    the first poll of an instance has none yet (None: not counted)."""
    clock = [0.0]
    reader, _ = make_reader({"gpus": [MIG]}, clock)
    layout = reader.open()
    assert [d.task_support for d in layout.devices] == [3 | TASK_BUSY_GPM]
    assert render_types(_counted(layout).devices) == b"1@00000000:1A:00.0/2.0 3g.71gb 7"
    first = _device(poll(reader, clock, 1.0)[0], "3g.71gb")
    assert first.gpu_busy is None and first.task_support == 7
    later = _device(poll(reader, clock, 2.0)[0], "3g.71gb")
    assert (later.gpu_busy, later.memory_used_kib) == (60, 10 * 1024)


def _counted(snapshot: Snapshot) -> Counters:
    counters = Counters()
    counters.declare(snapshot)
    return counters


def test_mig_instances_created_and_destroyed_under_running_gpm() -> None:
    """An instance created later gets buffers of its own and figures from its second poll; when it is
    destroyed its buffers are freed; closing the reader frees every buffer."""
    clock = [0.0]
    reader, nvml = make_reader({"gpus": [MIG]}, clock)
    model = _model(nvml)
    for now in (1.0, 2.0, 5.5):
        poll(reader, clock, now)
    assert model.gpm_buffers == 2 + 1  # GPU instance 2: two; 9: its first
    assert _device(poll(reader, clock, 6.0)[0], "1g.18gb").gpu_busy == 20
    assert model.gpm_buffers == 4
    snapshot, _ = poll(reader, clock, 9.5)
    assert [d.name for d in snapshot.devices if d.present] == ["3g.71gb"]
    assert model.gpm_buffers == 2
    reader.close()
    assert model.gpm_buffers == 0


def test_a_failing_gpm_sample_degrades_gpm_alone_and_the_next_poll_covers_both() -> None:
    """nvmlGpmSampleGet fails for a poll: a problem, no figures, the rest of the poll read; the next
    poll's figures reach back to the last good sample."""
    fault = {"call": "nvmlGpmSampleGet", "error": "NVML_ERROR_UNKNOWN", "from": 2.5, "until": 3.5}
    clock = [0.0]
    reader, _ = make_reader({"gpus": [{**H200, "faults": [fault]}]}, clock)
    for now in (1.0, 2.0):
        poll(reader, clock, now)
    snapshot, problems = poll(reader, clock, 3.0)
    device = snapshot.devices[0]
    assert device.gpm is None and device.gpu_busy is not None and device.memory_used_kib is not None
    assert any("nvmlGpmSampleGet: NVML_ERROR_UNKNOWN" in text for text in problems.values()), problems
    figures = poll(reader, clock, 4.4)[0].devices[0].gpm
    assert figures.seconds == pytest.approx(2.4)
    assert figures.get("graphics") == pytest.approx(Timeline(1.0, ((0.0, 0.25),)).percent(2.0, 4.4))


def test_a_poll_too_soon_after_the_last_sample_carries_the_figures_over_no_time() -> None:
    """Samples closer than 100 ms make no figures: the last ones stand, covering 0 s (counted once)."""
    clock = [0.0]
    reader, _ = make_reader({"gpus": [H200]}, clock)
    for now in (1.0, 2.0):
        poll(reader, clock, now)
    again = poll(reader, clock, 2.0 + MIN_SPAN / 2)[0].devices[0].gpm
    assert again.seconds == 0.0 and again.get("graphics") == pytest.approx(25.0)


def test_gpm_totals_sum_each_figure_times_its_seconds() -> None:
    """Percent-seconds and bytes: their increase over polls divided by the seconds is the average."""
    totals = GpmTotals()
    totals.add(GpmFigures(2.0, (("sm", 50.0), ("pcie_tx", 10.0))))
    totals.add(GpmFigures(0.0, (("sm", 99.0),)))
    totals.add(GpmFigures(1.0, (("sm", 20.0), ("pcie_tx", 4.0))))
    assert (totals.seconds, totals.polls) == (3.0, 2)
    assert totals.sums == {"sm": 120.0, "pcie_tx": 24.0 * MIB}


def test_counters_keep_gpm_totals_per_device_and_none_without_gpm() -> None:
    """The counters fold each device's GPM figures; a device without them has none."""
    clock = [0.0]
    reader, _ = make_reader({"gpus": [H200, OLD]}, clock)
    counters = Counters()
    for now in (1.0, 2.0, 3.0):
        counters.fold(poll(reader, clock, now)[0], now, now - 1.0)
    card, old = counters.devices
    assert old.gpm is None
    assert card.gpm is not None and card.gpm.seconds == pytest.approx(2.0)
    assert card.gpm.sums["graphics"] == pytest.approx(25.0 * 2.0)


def test_a_lost_card_has_its_gpm_buffers_freed_and_starts_afresh_when_back() -> None:
    """GPU_IS_LOST: the card's buffers are freed in that poll; found again, it is sampled anew."""
    lost = {"call": "nvmlDeviceGetComputeRunningProcesses", "error": "NVML_ERROR_GPU_IS_LOST", "from": 2.5,
            "until": 3.5}
    clock = [0.0]
    reader, nvml = make_reader({"gpus": [{**H200, "faults": [lost]}]}, clock)
    model = _model(nvml)
    for now in (1.0, 2.0):
        poll(reader, clock, now)
    assert model.gpm_buffers == 2
    snapshot, _ = poll(reader, clock, 3.0)
    assert not snapshot.devices[0].present and model.gpm_buffers == 0
    for now in (5.0, 6.0, 7.0):
        snapshot, _ = poll(reader, clock, now)
    assert snapshot.devices[0].present and snapshot.devices[0].gpm is not None
    assert model.gpm_buffers == 2


def test_nvml_set_up_again_frees_every_gpm_buffer_first() -> None:
    """A lifecycle answer (UNINITIALIZED) makes the reader shut NVML down: the buffers go before it."""
    gone = {"call": "nvmlDeviceGetMemoryInfo", "error": "NVML_ERROR_UNINITIALIZED", "from": 2.5, "until": 3.5}
    clock = [0.0]
    reader, nvml = make_reader({"gpus": [{**H200, "faults": [gone]}]}, clock)
    model = _model(nvml)
    for now in (1.0, 2.0):
        poll(reader, clock, now)
    assert model.gpm_buffers == 2
    poll(reader, clock, 3.0)
    assert model.gpm_buffers == 0 and nvml.calls["nvmlShutdown"] == 1


def test_a_card_in_mig_mode_without_instances_keeps_its_digit() -> None:
    """No instance yet: the card is shown as it is, digit 3 from the start and after a poll."""
    clock = [0.0]
    empty = {**MIG, "mig": [{**MIG["mig"][0], "start": 100}]}
    reader, _ = make_reader({"gpus": [empty]}, clock)
    assert [d.task_support for d in reader.open().devices] == [3]
    assert [d.task_support for d in poll(reader, clock, 1.0)[0].devices] == [3]


def test_a_failing_gpu_instance_sample_fails_that_instances_busy_figure_alone() -> None:
    """An instance's own fault on nvmlGpmMigSampleGet: its busy figure fails for that poll (None),
    the other instance's does not, and the next poll reaches back to the last good sample."""
    failing = {**MIG["mig"][0], "gpu_util": 60,
               "faults": [{"call": "nvmlGpmMigSampleGet", "error": "NVML_ERROR_UNKNOWN", "from": 2.5, "until": 3.5}]}
    other = {"profile": "2g.35gb", "memory_total_mib": 35000, "gpu_instance": 5, "slot": 2, "gpu_util": 30}
    clock = [0.0]
    reader, _ = make_reader({"gpus": [{**MIG, "mig": [failing, other]}]}, clock)
    for now in (1.0, 2.0):
        poll(reader, clock, now)
    snapshot, problems = poll(reader, clock, 3.0)
    assert _device(snapshot, "3g.71gb").gpu_busy is None
    assert _device(snapshot, "3g.71gb").memory_used_kib == 10 * 1024
    assert _device(snapshot, "2g.35gb").gpu_busy == 30
    line = "GPU instance 2: GPM: nvmlGpmMigSampleGet: NVML_ERROR_UNKNOWN"
    assert any(line in text for text in problems.values()), problems
    figures = _device(poll(reader, clock, 4.0)[0], "3g.71gb").gpm
    assert figures.seconds == pytest.approx(2.0) and figures.get("graphics") == pytest.approx(60.0)


def test_gpm_back_after_not_supported_starts_afresh_and_the_gap_is_not_counted() -> None:
    """nvmlGpmSampleGet answers NOT_SUPPORTED for a while, then samples again: the stream was
    dropped, so the first poll after takes a sample (no figures) and the next covers one poll,
    not the whole gap (which GPM did not measure); the problem names the function once."""
    fault = {"call": "nvmlGpmSampleGet", "error": "NVML_ERROR_NOT_SUPPORTED", "from": 2.5, "until": 6.5}
    clock = [0.0]
    reader, _ = make_reader({"gpus": [{**H200, "faults": [fault]}]}, clock)
    for now in (1.0, 2.0):
        poll(reader, clock, now)
    texts = []
    for now in (3.0, 4.0, 5.0, 6.0):
        snapshot, problems = poll(reader, clock, now)
        assert snapshot.devices[0].gpm is None
        texts += problems.values()
    assert texts and all(text.count("nvmlGpmSampleGet") <= 1 for text in texts), texts
    assert poll(reader, clock, 7.0)[0].devices[0].gpm is None  # a sample, nothing to compare it with
    figures = poll(reader, clock, 8.0)[0].devices[0].gpm
    assert figures.seconds == pytest.approx(1.0)


def test_a_failing_gpm_sample_names_its_function_once() -> None:
    """A GPU instance's failing GPM sample: one problem line, the function named once."""
    fault = {"call": "nvmlGpmSampleGet", "error": "NVML_ERROR_UNKNOWN", "from": 2.5, "until": 3.5}
    clock = [0.0]
    reader, _ = make_reader({"gpus": [{**H200, "faults": [fault]}]}, clock)
    for now in (1.0, 2.0):
        poll(reader, clock, now)
    _, problems = poll(reader, clock, 3.0)
    texts = [text for text in problems.values() if "GpmSampleGet" in text]
    assert texts and all(text.count("nvmlGpmSampleGet") == 1 for text in texts), texts
