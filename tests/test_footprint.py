"""What start-up imports: a configuration loads only what it uses (the web stack with
--metrics, the simulator with --reader sim)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from daemon import Client, env_without_gpu, stop_process, unique_name

#: the web stack: --metrics alone loads it
WEB = ("twisted.web", "prometheus_client", "atopgpud_tw.server.web")
#: the simulator: --reader sim alone
SIMULATOR = ("atopgpud_tw.sim",)
#: the daemon's own modules loaded at their first use (docs/PERFORMANCE.md, "Footprint: the
#: daemon's own modules"): the table of figures (a scrape, GPM figures; the simulator reads it
#: too), health readings (a scrape), --workloads, the codec's reply parsing (clients) and P lines
OWN_LATER = ("atopgpud_tw.figures", "atopgpud_tw.health", "atopgpud_tw.workloads",
             "atopgpud_tw.codec.parse", "atopgpud_tw.codec.contexts")
#: importlib.metadata (--version), pyOpenSSL (TLS): loaded only when asked for
ONLY_WHEN_ASKED = ("importlib.metadata", "OpenSSL", "cryptography")

#: runs the atopgpud command in this process and writes its modules to argv[1] as it exits
PROBE = textwrap.dedent("""
    import atexit, sys

    def dump(path=sys.argv[1]):
        with open(path, "w") as out:
            out.write("\\n".join(sorted(name for name, module in sys.modules.items() if module is not None)))

    atexit.register(dump)  # start-up ended
    from atopgpud_tw.__main__ import main
    from twisted.internet import reactor

    reactor.addSystemEventTrigger("after", "shutdown", dump)  # SIGTERM: twistd ends by the signal, no atexit
    sys.argv = ["atopgpud", *sys.argv[2:]]
    main()
""")


def loaded(names: list[str], parts: tuple[str, ...]) -> list[str]:
    return [name for name in names if any(name == part or name.startswith(part + ".") for part in parts)]


def start_up_modules(tmp_path: Path, *args: str, serve: bool, ask: tuple[str, ...] = ()) -> list[str]:
    """The modules of an atopgpud command started with `args`, as it exits:
    once it has answered T (and each of `ask`) if `serve`, else once start-up has ended by itself."""
    dump = tmp_path / "modules.txt"
    name = unique_name()
    proc = subprocess.Popen(
        [sys.executable, "-c", PROBE, str(dump), "--listen", f"unix:@{name}", *args],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, env=env_without_gpu(),
    )
    try:
        if serve:
            wait_for_t(proc, name, ask)
        else:
            proc.wait(60)
    finally:
        stop_process(proc)
    assert proc.stderr is not None
    errors = proc.stderr.read().decode(errors="replace")
    proc.stderr.close()
    assert dump.exists(), errors
    return dump.read_text().split()


def wait_for_t(proc: subprocess.Popen[bytes], name: str, ask: tuple[str, ...] = ()) -> None:
    import time

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the daemon exited"
        try:
            client = Client(b"\0" + name.encode())
            try:
                client.ask("T")
                for command in ask:
                    version, _ = client.ask(command)
                    assert version == 2, command
                return
            finally:
                client.close()
        except OSError:
            time.sleep(0.05)
    raise AssertionError("no T reply")


@pytest.mark.e2e
def test_nvml_start_up_loads_neither_web_stack_nor_simulator(tmp_path):
    """--reader nvml (here it finds no GPU and ends start-up): no web stack, simulator or
    nvidia-smi reader."""
    modules = start_up_modules(tmp_path, "--reader", "nvml", serve=False)
    assert "atopgpud_tw.readers.nvml.reader" in modules and "atopgpud_tw.tap" in modules
    assert loaded(modules, WEB + SIMULATOR + ("atopgpud_tw.readers.smi",) + ONLY_WHEN_ASKED) == []
    assert loaded(modules, OWN_LATER) == []


@pytest.mark.e2e
def test_default_start_up_loads_neither_web_stack_nor_simulator(tmp_path):
    """The default reader (auto: nvml, then nvidia-smi) loads no web stack and no simulator."""
    modules = start_up_modules(tmp_path, "--nvidia-smi", str(tmp_path / "absent"), serve=False)
    assert "atopgpud_tw.readers.nvml.reader" in modules
    assert loaded(modules, WEB + SIMULATOR + ONLY_WHEN_ASKED) == []


@pytest.mark.e2e
def test_a_serving_daemon_loads_no_web_stack(tmp_path):
    """A daemon that has polled and answered T (the simulator's reader, so that it runs
    here) has loaded no web stack, no nvidia-smi reader."""
    modules = start_up_modules(tmp_path, "--reader", "sim", serve=True)
    assert "atopgpud_tw.sim" in modules and "twisted.internet.epollreactor" in modules
    assert loaded(modules, WEB + ("atopgpud_tw.readers.smi",) + ONLY_WHEN_ASKED) == []
    assert loaded(modules, OWN_LATER) == ["atopgpud_tw.figures"]  # the simulator's own


@pytest.mark.e2e
def test_a_p_request_loads_the_codec_s_p_lines(tmp_path):
    """``P`` (atopgpu's) loads codec/contexts.py when first asked, and is answered."""
    modules = start_up_modules(tmp_path, "--reader", "sim", serve=True, ask=("P", "S"))
    assert "atopgpud_tw.codec.contexts" in modules and "atopgpud_tw.codec.parse" not in modules


OWN_LATER_PROBE = textwrap.dedent("""
    import sys
    from atopgpud_tw import codec, counters, tap
    from atopgpud_tw.readers.nvml import gpm, health
    from atopgpud_tw.snapshot import GpmFigures

    def later():
        return [name for name in LATER if name in sys.modules]

    LATER = sys.argv[1:]
    assert later() == [], later()
    options = tap.Options()
    options.parseOptions(["--metrics", "tcp:0", "--workloads", "unit"])
    assert later() == [], later()
    from atopgpud_tw import workloads
    book = workloads.WorkloadBook(counters.Counters())
    assert (options["workload-limit"], options["workload-expiry"]) == (book.limit, book.expiry)
    # the P lines and reply parsing: at their first name
    records = [codec.ProcessInfo(7, 1000, "ann", "unit", "train.service", "python3")]
    assert "atopgpud_tw.codec.contexts" in sys.modules and "atopgpud_tw.codec.parse" not in sys.modules
    assert codec.parse_contexts(codec.render_contexts(records)) == {7: records[0]}
    assert callable(codec.parse_types) and codec.parse is sys.modules["atopgpud_tw.codec.parse"]
    # the table of figures: at the first GPM figures, or a health reading's rows
    assert "atopgpud_tw.figures" not in sys.modules
    totals = counters.GpmTotals()
    totals.add(GpmFigures(2.0, (("sm", 50.0), ("pcie_tx", 3.0))))
    assert totals.sums == {"sm": 100.0, "pcie_tx": 6.0 * 1048576} and "atopgpud_tw.figures" in sys.modules
    from atopgpud_tw import figures
    assert health.asked() == tuple(f for f in figures.FIGURES if f.nvml is not None)
    assert gpm.metrics()[0][0] == figures.GPM_FIGURES[0].gpm.name
    print("ok")
""")


@pytest.mark.e2e
def test_own_modules_load_when_first_used():
    """The daemon's own modules that start-up leaves out (`OWN_LATER`) load, and work, when used."""
    done = subprocess.run([sys.executable, "-c", OWN_LATER_PROBE, *OWN_LATER], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["ok"]


@pytest.mark.e2e
def test_metrics_loads_the_web_stack(tmp_path):
    """--metrics loads the web stack (and what prometheus_client imports) when asked for."""
    modules = start_up_modules(tmp_path, "--reader", "sim", "--metrics", f"unix:@{unique_name()}", serve=True)
    assert loaded(modules, ("twisted.web.server", "prometheus_client", "atopgpud_tw.server.web.metrics"))
    assert "ssl" in modules  # prometheus_client's own import
    assert "atopgpud_tw.workloads" not in modules  # --workloads alone


TLS_PROBE = textwrap.dedent("""
    import sys
    import atopgpud_tw.__main__  # the command: it looks at sys.argv before it imports Twisted
    from twisted.internet import tcp, unix  # Twisted's branch for a host without pyOpenSSL when hidden
    try:
        import OpenSSL  # noqa: F401
        available = True
    except ImportError:
        available = False
    print(available, "twisted.internet._newtls" in sys.modules)
""")


@pytest.mark.e2e
@pytest.mark.parametrize("argv, expected", [
    ((), "False False"),
    (("--reader", "sim", "--metrics", "tcp:0"), "False False"),
    (("--web-config", "web.yml", "--metrics", "tcp:0"), "True True"),
    (("--web-config=web.yml",), "True True"),
    (("--metrics", "ssl:9445:privateKey=k.pem"), "True True"),
])
def test_pyopenssl_only_for_a_command_line_that_serves_tls(argv: tuple[str, ...], expected: str) -> None:
    """The command keeps pyOpenSSL (and Twisted's TLS mixins, which Twisted imports whenever it
    can) out unless TLS is asked for."""
    out = subprocess.run([sys.executable, "-c", TLS_PROBE, *argv], capture_output=True, text=True, check=True)
    assert out.stdout.split() == expected.split()
