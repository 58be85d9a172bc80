"""A trouble is logged once when it starts and once when it ends."""

from __future__ import annotations

from twisted.logger import capturedLogs

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


def test_a_latch_says_when_a_condition_changes_and_only_then():
    from atopgpud_tw.problems import Latch

    latch = Latch()
    assert [latch.change(v) for v in (None, "boom", "boom", "bang", None, None)] == [
        False, True, False, True, True, False
    ]
    assert latch.value is None
