"""Wiring without sockets: options, the service tree, the plugin, start-up errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from daemon import env_without_gpu, twistd
from twisted.internet.testing import MemoryReactorClock
from twisted.python import usage

from atopgpud_tw import tap
from atopgpud_tw.server.atop.poller import PollerService
from atopgpud_tw.server.system.listening import ListeningService


def options(*args: str) -> tap.Options:
    parsed = tap.Options()
    parsed.parseOptions(list(args))
    return parsed


def test_defaults():
    """Default: the abstract socket atop 2.13 uses, auto reader, 1 s interval."""
    parsed = options()
    assert parsed["listen"] == ["unix:@atopgpud_nvidia"]
    assert (parsed["reader"], parsed["interval"], parsed["mig"]) == ("auto", 1.0, "instances")


@pytest.mark.parametrize(
    "args",
    [["--interval", "0"], ["--interval", "x"], ["--reader", "gpu"], ["--mig", "both"], ["--scenario", "a.json"]],
)
def test_bad_options_are_usage_errors(args):
    """Each bad value is refused with a UsageError."""
    with pytest.raises(usage.UsageError):
        options(*args)


def test_service_listens_where_asked():
    """makeService wires a poller and one listening port per --listen, on the given reactor."""
    reactor = MemoryReactorClock()
    service = tap.makeService(
        options("--reader", "sim", "--listen", "unix:@test-name", "--listen", "tcp:59123:interface=127.0.0.1"),
        reactor=reactor,
    )
    children = list(service)
    assert sum(isinstance(c, PollerService) for c in children) == 1
    assert sum(isinstance(c, ListeningService) for c in children) == 2
    # listening while the service is built, before twistd daemonizes: a failure is the exit status
    assert [port[0] for port in reactor.unixServers] == ["\0test-name"]
    assert [(port[0], port[3]) for port in reactor.tcpServers] == [(59123, "127.0.0.1")]


def test_bad_listen_is_one_line():
    """A --listen that is not an endpoint ends start-up with one line."""
    with pytest.raises(SystemExit) as raised:
        tap.makeService(options("--reader", "sim", "--listen", "carrier-pigeon:1"), reactor=MemoryReactorClock())
    assert str(raised.value).startswith("atopgpud: --listen carrier-pigeon:1:")
    assert "\n" not in str(raised.value)


def test_bad_scenario_is_one_line(tmp_path):
    """A scenario that is not JSON, or has a bad field, is named in one line."""
    broken = tmp_path / "broken.json"
    broken.write_text("{")
    wrong = tmp_path / "wrong.json"
    wrong.write_text(json.dumps({"gpus": [{"gpu_util": 140}]}))
    for path, words in ((broken, "not JSON"), (wrong, "gpus[0].gpu_util")):
        with pytest.raises(SystemExit) as raised:
            tap.makeService(options("--reader", "sim", "--scenario", str(path)), reactor=MemoryReactorClock())
        assert words in str(raised.value) and "\n" not in str(raised.value)


def test_plugin_is_found():
    """twistd finds the atopgpud plugin through getPlugins."""
    from twisted.application.service import IServiceMaker
    from twisted.plugin import IPlugin, getPlugins

    names = [p.tapname for p in getPlugins(IServiceMaker) if IPlugin.providedBy(p)]
    assert "atopgpud" in names


@pytest.mark.e2e
def test_twistd_help_lists_every_option():
    """twistd -n atopgpud --help shows every option of the contract."""
    out = subprocess.run([*twistd(), "-n", "atopgpud", "--help"], capture_output=True, text=True, check=True).stdout
    for option in ("--listen", "--reader", "--scenario", "--interval", "--nvidia-smi", "--mig"):
        assert option in out


@pytest.mark.e2e
def test_nvml_without_library_is_one_line_and_status_1():
    """--reader nvml where libnvidia-ml is missing: one line naming the cause, exit 1."""
    result = subprocess.run(
        [sys.executable, "-m", "atopgpud_tw", "--reader", "nvml", "--listen", "unix:@atopgpud-never"],
        capture_output=True, text=True, env=env_without_gpu(), timeout=60,
    )
    assert result.returncode == 1
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "libnvidia-ml" in lines[0], result.stderr
    assert "Traceback" not in result.stdout + result.stderr


@pytest.mark.e2e
def test_console_script_reports_bad_option_in_one_line():
    """atopgpud --interval x: one line on stderr, exit 2."""
    result = subprocess.run(
        [sys.executable, "-m", "atopgpud_tw", "--interval", "x"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1 and "--interval" in result.stderr


def test_version_names_the_daemon_the_binding_and_twisted(capsys):
    """--version: the daemon's version (pyproject's), the NVML binding's and Twisted's; exit 0."""
    import re
    from importlib import metadata

    from atopgpud_tw import __main__ as console

    pyproject = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    version = re.search(r'^version = "([^"]+)"$', pyproject, re.M).group(1)
    with pytest.raises(SystemExit) as stopped:
        console.main(["--version"])
    assert stopped.value.code == 0
    assert capsys.readouterr().out.splitlines() == [
        f"atopgpud (atopgpud_tw) {version}",
        f"nvidia-ml-py {metadata.version('nvidia-ml-py')}",
        f"Twisted {metadata.version('twisted')}",
    ]


@pytest.mark.parametrize(("argv0", "usage_line"), [
    ("/usr/sbin/atopgpud", "Usage: atopgpud [options]"),
    ("/x/atopgpud_tw/__main__.py", f"Usage: {Path(sys.executable).name} -m atopgpud_tw [options]"),
])
def test_usage_names_the_command_run(capsys, monkeypatch, argv0, usage_line):
    """The atopgpud command's --help names it, not twistd; twistd's own says twistd."""
    from atopgpud_tw import __main__ as console

    monkeypatch.setattr(sys, "argv", [argv0, "--help"])
    with pytest.raises(SystemExit):
        console.main()
    assert capsys.readouterr().out.splitlines()[0] == usage_line
    from twisted.scripts import twistd as twistd_script

    parent = twistd_script.ServerOptions()
    parent.subCommand = "atopgpud"
    options = tap.Options()
    options.parent = parent
    assert options.getSynopsis() == "Usage: twistd [options] atopgpud [options]"
