"""Log lines for the journal (server/system/journal.py): each with its syslog priority and no
timestamp of its own under systemd, ``--log-level`` everywhere standard output is the log."""

from __future__ import annotations

import io
import os
from pathlib import Path

import pytest
from twisted.logger import LogLevel, formatEvent
from twisted.python.failure import Failure

from atopgpud_tw.server.system import journal
from atopgpud_tw.tap import Options


def event(level: LogLevel, text: str, **more: object) -> dict:
    return {"log_level": level, "log_format": text, "log_namespace": "atopgpud_tw.test", "log_time": 0.0,
            **more}


@pytest.mark.parametrize(("level", "priority"), [
    (LogLevel.debug, 7), (LogLevel.info, 6), (LogLevel.warn, 4), (LogLevel.error, 3), (LogLevel.critical, 2),
])
def test_each_line_carries_its_syslog_priority_and_no_timestamp(level: LogLevel, priority: int) -> None:
    out = io.StringIO()
    journal.JournalObserver(out)(event(level, "GPU {busid}: gone", busid="00000000:17:00.0"))
    assert out.getvalue() == f"<{priority}>[atopgpud_tw.test#{level.name}] GPU 00000000:17:00.0: gone\n"


def test_every_line_of_a_traceback_has_the_priority() -> None:
    """The journal takes each line as an entry: a traceback's lines are errors too, not info."""
    try:
        raise ValueError("broken")
    except ValueError:
        failure = Failure()
    out = io.StringIO()
    journal.JournalObserver(out)(event(LogLevel.critical, "it broke", log_failure=failure))
    lines = out.getvalue().splitlines()
    assert len(lines) > 3 and all(line.startswith("<2>") for line in lines), lines
    assert any("ValueError: broken" in line for line in lines)


def test_the_level_leaves_out_what_is_below_it() -> None:
    out = io.StringIO()
    observe = journal.observer(False, "warn", out)
    observe(event(LogLevel.info, "quiet"))
    observe(event(LogLevel.warn, "loud"))
    assert "quiet" not in out.getvalue() and "loud" in out.getvalue()


def test_the_journal_is_known_by_the_stream_systemd_names(tmp_path: Path) -> None:
    path = tmp_path / "stream"
    with open(path, "w") as stream:
        found = os.fstat(stream.fileno())
        named = {"JOURNAL_STREAM": f"{found.st_dev}:{found.st_ino}"}
        assert journal.to_journal(stream, named)
        assert not journal.to_journal(stream, {"JOURNAL_STREAM": f"{found.st_dev}:{found.st_ino + 1}"})
        assert not journal.to_journal(stream, {})
        assert not journal.to_journal(stream, {"JOURNAL_STREAM": "nonsense"})


def parsed(twistd: dict, *args: str) -> dict:
    options = Options()
    options.parent = twistd
    options.parseOptions(["--reader", "sim", *args])
    return twistd


def test_twistd_is_given_the_observer_only_where_something_changes(monkeypatch) -> None:
    monkeypatch.setattr(journal, "to_journal", lambda: False)
    assert parsed({"nodaemon": True, "logger": None}).get("logger") is None
    twistd = parsed({"nodaemon": True, "logger": None}, "--log-level", "error")
    assert twistd["logger"] == "atopgpud_tw.server.system.journal.twistd_observer"
    shown = io.StringIO()
    monkeypatch.setattr("sys.stdout", shown)
    observe = journal.twistd_observer()
    observe(event(LogLevel.warn, "left out"))
    observe(event(LogLevel.error, "kept"))
    assert "left out" not in shown.getvalue() and "kept" in shown.getvalue()


def test_the_journal_is_used_under_systemd(monkeypatch) -> None:
    monkeypatch.setattr(journal, "to_journal", lambda: True)
    twistd = parsed({"nodaemon": True, "logger": None})
    assert twistd["logger"] == "atopgpud_tw.server.system.journal.twistd_observer"
    shown = io.StringIO()
    monkeypatch.setattr("sys.stdout", shown)
    journal.twistd_observer()(event(LogLevel.warn, "to the journal"))
    assert shown.getvalue() == "<4>[atopgpud_tw.test#warn] to the journal\n"


@pytest.mark.parametrize("twistd", [
    {"nodaemon": True, "logfile": "/var/log/atopgpud.log"}, {"nodaemon": True, "syslog": True}, {"nodaemon": False},
])
def test_a_level_where_twistd_logs_elsewhere_is_one_line(twistd: dict) -> None:
    from twisted.python import usage

    with pytest.raises(usage.UsageError, match="--log-level is for a daemon that logs to standard output"):
        parsed({"logger": None, **twistd}, "--log-level", "warn")
    assert parsed({"logger": None, **twistd}).get("logger") is None  # the default level: twistd's own


def test_formatting_is_twisteds_own() -> None:
    """The text of an event is Twisted's formatting of it, nothing retyped."""
    out = io.StringIO()
    journal.JournalObserver(out)(event(LogLevel.info, "{a} and {b}", a=1, b="two"))
    assert out.getvalue().endswith(formatEvent(event(LogLevel.info, "{a} and {b}", a=1, b="two")) + "\n")
