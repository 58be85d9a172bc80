"""A trouble is logged once when it starts and once when it ends; one that keeps coming back, by a count."""

from __future__ import annotations

import re
import time

import pytest
from twisted.logger import capturedLogs, formatEvent

from atopgpud_tw.problems import ProblemLog


def test_each_cause_logged_once_and_its_recovery_once_in_its_first_words():
    """Repeated reports log nothing new; the recovery names the problem as first logged."""
    with capturedLogs() as events:
        log = ProblemLog("nvml")
        log.report({"init": "driver gone"})
        log.report({"init": "being set up again"})
        log.report({"init": "being set up again", "gpu0": "GPU 0 lost"})
        log.report({})
    lines = [
        (e["log_level"].name, e.get("problem")) for e in events if e.get("log_namespace", "").endswith("ProblemLog")
    ]
    assert lines == [("warn", "driver gone"), ("warn", "GPU 0 lost"), ("info", "driver gone"), ("info", "GPU 0 lost")]


def test_a_report_the_same_as_the_last_keeps_the_first_words_whatever_its_text():
    """The same causes again (the common poll) say nothing, keep the words first logged, and a
    cause that ends after them is said in those; as `Problems` or as a plain mapping."""
    from atopgpud_tw.problems import Problems

    with capturedLogs() as events:
        log = ProblemLog("nvml")
        log.report({})
        log.report(Problems())
        problems = Problems()
        problems.add("gpu0", "GPU 0 lost")
        log.report(problems)
        again = Problems()
        again.add("gpu0", "GPU 0 lost again, in other words")
        log.report(again)
        assert log.active == {"gpu0": "GPU 0 lost"}
        log.report({})
        log.report({})
    lines = [
        (e["log_level"].name, e.get("problem")) for e in events if e.get("log_namespace", "").endswith("ProblemLog")
    ]
    assert lines == [("warn", "GPU 0 lost"), ("info", "GPU 0 lost")]


def test_a_latch_says_when_a_condition_changes_and_only_then():
    from atopgpud_tw.problems import Latch

    latch = Latch()
    assert [latch.change(v) for v in (None, "boom", "boom", "bang", None, None)] == [
        False, True, False, True, True, False
    ]
    assert latch.value is None


# -- a cause that keeps coming back ---------------------------------------------


class Flapping:
    """A ProblemLog on an injected clock, and its lines as (level, text)."""

    def __init__(self) -> None:
        self.now = 0.0
        self.events: list[dict] = []
        self.log = ProblemLog("nvml", lambda: self.now)
        self.log.log = type(self.log.log)(observer=self.events.append)

    def at(self, now: float, *causes: str) -> None:
        self.now = now
        self.log.report({cause: f"GPU 0: {cause}: NVML_ERROR_UNKNOWN" for cause in causes})

    def lines(self) -> list[tuple[str, str]]:
        return [(e["log_level"].name, formatEvent(e)) for e in self.events]

    def flap(self, start: float, end: float, period: float = 1.0, failing: float = 0.5, cause: str = "mem") -> None:
        """`cause` failing for `failing` s of every `period` s, reported every 0.5 s."""
        steps = round((end - start) / 0.5)
        for step in range(steps):
            now = start + step * 0.5
            self.at(now, *([cause] if (now - start) % period < failing else []))


def test_the_third_start_says_it_flaps_and_the_rest_is_counted():
    """Two flaps are logged one by one; the third start says it is damped; 30 s of flapping: 5 lines, not 60."""
    flapping = Flapping()
    flapping.flap(0.0, 30.0)
    lines = flapping.lines()
    assert [level for level, _ in lines] == ["warn", "info", "warn", "info", "warn"]
    assert lines[4][1] == (
        "nvml: GPU 0: mem: NVML_ERROR_UNKNOWN (again: 3 times in 2 s; from now on counted, "
        "and said at most once every 1 min)"
    )


def test_one_count_per_window_the_windows_growing():
    """A count at 1 min, then 10 min, then every hour, with what was held back and the state now."""
    flapping = Flapping()
    flapping.flap(0.0, 2 * 3600 + 700.0)
    counts = [text for _, text in flapping.lines()[5:]]
    assert len(counts) == 4, counts
    assert counts[0] == (
        "nvml: GPU 0: mem: NVML_ERROR_UNKNOWN: 60 more failures and 60 recoveries in the last 1 min, "
        "not logged one by one; failing now; counted again for 10 min"
    )
    assert "in the last 10 min" in counts[1] and "counted again for 1 h" in counts[1]
    assert "in the last 1 h" in counts[2] and "counted again for 1 h" in counts[3]
    # every failure is said once: logged, counted, or held back for the next count
    held = flapping.log._damping.flaps["mem"].held_starts
    counted = sum(event["failed"] for event in flapping.events[5:])
    assert 3 + counted + held == 2 * 3600 + 700


def test_a_count_ending_in_failure_is_a_warning_and_says_so():
    """The window's count says the cause is failing now, as a warning."""
    flapping = Flapping()
    flapping.flap(0.0, 10.0)
    for now in range(10, 80):
        flapping.at(float(now), "mem")  # failing from 10 s on, for good
    level, text = flapping.lines()[-1]
    assert level == "warn" and "8 more failures and 8 recoveries in the last 1 min" in text
    assert "failing now" in text
    flapping.at(700.0, "mem")
    assert len(flapping.lines()) == 6  # quiet: nothing held back, nothing said


def test_an_hour_without_change_ends_the_damping():
    """A cause that kept still for an hour is logged one by one again, as a new count."""
    flapping = Flapping()
    flapping.flap(0.0, 10.0)
    before = len(flapping.lines())
    for now in range(10, 3 * 3600, 30):
        flapping.at(float(now))  # working
    said = flapping.lines()[before:]
    assert len(said) == 1 and "recovered now" in said[0][1]
    flapping.flap(3 * 3600.0, 3 * 3600.0 + 3.0)
    assert [level for level, _ in flapping.lines()[before + 1:]] == ["warn", "info", "warn", "info", "warn"]


def test_causes_are_damped_each_on_its_own_and_a_rare_fault_never():
    """A flapping cause does not hold back another; a fault once every two hours is never damped."""
    flapping = Flapping()
    for hour in range(0, 12, 2):
        flapping.at(hour * 3600.0, "rare")
        flapping.at(hour * 3600.0 + 5, )
    assert [level for level, _ in flapping.lines()] == ["warn", "info"] * 6
    flapping = Flapping()
    for step in range(60):
        now = step * 0.5
        flapping.at(now, *(["mem"] if step % 2 == 0 else []), *(["lost"] if now == 20.0 else []))
    lost = [text for _, text in flapping.lines() if "lost" in text]
    assert lost == ["nvml: GPU 0: lost: NVML_ERROR_UNKNOWN", "nvml: recovered (GPU 0: lost: NVML_ERROR_UNKNOWN)"]


def test_a_long_recovered_cause_is_forgotten():
    """What the log remembers of causes is bounded: an hour after a cause last changed, it is dropped."""
    flapping = Flapping()
    for pid in range(1000):
        flapping.at(float(pid), f"pid {pid}")
        flapping.at(pid + 0.5)
    flapping.at(1000.0 + 3600.0)
    assert flapping.log._damping.flaps == {}


def test_logged_texts_are_shown_as_data():
    """A problem's words from the driver or nvidia-smi: escapes logged visibly, never raw."""
    flapping = Flapping()
    flapping.log.report({"gpu": "GPU \x1b[2J\x1b]0;PWN\x07: lost"})
    flapping.log.report({})
    assert [text for _, text in flapping.lines()] == [
        "nvml: GPU \\x1b[2J\\x1b]0;PWN\\x07: lost", "nvml: recovered (GPU \\x1b[2J\\x1b]0;PWN\\x07: lost)"
    ]


def test_the_readers_log_a_gpus_name_and_bus_id_as_data():
    """Names and bus ids the driver gives reach the log escaped: a GPU line, a problem and its recovery."""
    from sim_readers import make_reader, poll

    hostile = "GPU\x1b]0;PWN\x07"
    scenario = {"gpus": [{"name": hostile, "busid": "00000000:17:00.0\x1b[2J",
                          "faults": [{"call": "nvmlDeviceGetMemoryInfo", "error": "NVML_ERROR_UNKNOWN",
                                      "from": 1, "until": 2}]}]}
    clock = [0.0]
    with capturedLogs() as events:
        reader, _ = make_reader(scenario, clock)
        problem_log = ProblemLog("nvml", lambda: clock[0])
        for second in range(4):
            problem_log.report(poll(reader, clock, float(second))[1])
    lines = [formatEvent(event) for event in events]
    assert "nvml: GPU 00000000:17:00.0\\x1b[2J GPU\\x1b]0;PWN\\x07 (processes: compute and graphics)" in lines
    assert "nvml: GPU 00000000:17:00.0\\x1b[2J: nvmlDeviceGetMemoryInfo: NVML_ERROR_UNKNOWN" in lines
    assert not [line for line in lines if "\x1b" in line or "\x07" in line]


@pytest.mark.e2e
def test_a_flapping_call_through_the_daemon_costs_a_bounded_number_of_lines(tmp_path):
    """nvmlDeviceGetMemoryInfo failing for 0.3 s of every 0.6 s: five lines, however long it flaps."""
    from daemon import run_daemon
    from scenarios import H100

    faults = [{"call": "nvmlDeviceGetMemoryInfo", "error": "NVML_ERROR_UNKNOWN", "from": k * 0.6 + 0.3,
               "until": k * 0.6 + 0.6} for k in range(200)]
    with run_daemon(tmp_path, ["--interval", "0.1"], scenario={"gpus": [dict(H100, faults=faults)]}) as daemon:
        daemon.wait_samples(3)
        started = time.monotonic()
        # a third of the polls fail in the sample count: the fault really flaps all along
        first = daemon.wait_samples(1)[0].samples
        time.sleep(8)
        samples = daemon.wait_samples(1)[0].samples - first
        took = time.monotonic() - started
    assert samples < 0.75 * took / 0.1, (samples, took)
    lines = [line for line in daemon.log().splitlines() if "nvmlDeviceGetMemoryInfo" in line]
    assert len(lines) == 5, "\n".join(lines)
    assert re.search(
        r"nvml: GPU 00000000:17:00.0: nvmlDeviceGetMemoryInfo: NVML_ERROR_UNKNOWN \(again: 3 times in \d+ s; "
        r"from now on counted, and said at most once every 1 min\)$", lines[4]
    ), lines[4]
