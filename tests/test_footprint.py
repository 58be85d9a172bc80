"""What start-up imports: a configuration loads only what it uses (the web stack with
--metrics, the simulator with --reader sim), and the modules `atopgpud_tw.lazy` defers
run when first used, as the real modules."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from daemon import Client, env_without_gpu, stop_process, unique_name

from atopgpud_tw import lazy

#: the web stack: --metrics alone loads it
WEB = ("twisted.web", "prometheus_client", "atopgpud_tw.server.web")
#: the simulator: --reader sim alone
SIMULATOR = ("atopgpud_tw.sim",)
#: the daemon's own modules loaded at their first use (docs/PERFORMANCE.md, "Footprint: the
#: daemon's own modules"): the table of figures (a scrape, GPM figures; the simulator reads it
#: too), health readings (a scrape), --workloads, the codec's reply parsing (clients) and P lines
OWN_LATER = ("atopgpud_tw.figures", "atopgpud_tw.health", "atopgpud_tw.workloads",
             "atopgpud_tw.codec.parse", "atopgpud_tw.codec.contexts")
#: what the deferred modules would bring were their bodies run (docs/PERFORMANCE.md)
DEFERRED_WEIGHT = ("OpenSSL", "cryptography",
                   "ssl", "_ssl", "_hashlib", "hashlib", "http.client", "email", "urllib.request",
                   "asyncio.base_events", "asyncio.unix_events", "pdb", "importlib.metadata")

#: runs the atopgpud command in this process and writes the modules (their bodies run) to argv[1] as it exits
PROBE = textwrap.dedent("""
    import atexit, sys

    def dump(path=sys.argv[1]):
        from atopgpud_tw.lazy import is_deferred

        with open(path, "w") as out:
            out.write("\\n".join(sorted(name for name, module in sys.modules.items()
                                        if module is not None and not is_deferred(module))))

    atexit.register(dump)  # start-up ended
    from atopgpud_tw.__main__ import main  # first, as in the command: before Twisted is imported
    from twisted.internet import reactor

    reactor.addSystemEventTrigger("after", "shutdown", dump)  # SIGTERM: twistd ends by the signal, no atexit
    sys.argv = ["atopgpud", *sys.argv[2:]]
    main()
""")


def loaded(names: list[str], parts: tuple[str, ...]) -> list[str]:
    return [name for name in names if any(name == part or name.startswith(part + ".") for part in parts)]


def start_up_modules(tmp_path: Path, *args: str, serve: bool, ask: tuple[str, ...] = ()) -> list[str]:
    """The modules (their bodies run) of an atopgpud command started with `args`, as it exits:
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
    nvidia-smi reader, none of what the deferred modules would bring."""
    modules = start_up_modules(tmp_path, "--reader", "nvml", serve=False)
    assert "atopgpud_tw.readers.nvml.reader" in modules and "atopgpud_tw.tap" in modules
    assert loaded(modules, WEB + SIMULATOR + ("atopgpud_tw.readers.smi",) + DEFERRED_WEIGHT) == []
    assert loaded(modules, OWN_LATER) == []


@pytest.mark.e2e
def test_default_start_up_loads_neither_web_stack_nor_simulator(tmp_path):
    """The default reader (auto: nvml, then nvidia-smi) loads no web stack and no simulator."""
    modules = start_up_modules(tmp_path, "--nvidia-smi", str(tmp_path / "absent"), serve=False)
    assert "atopgpud_tw.readers.nvml.reader" in modules
    assert loaded(modules, WEB + SIMULATOR + DEFERRED_WEIGHT) == []


@pytest.mark.e2e
def test_a_serving_daemon_loads_no_web_stack(tmp_path):
    """A daemon that has polled and answered T (the simulator's reader, so that it runs
    here) has loaded no web stack, no nvidia-smi reader, none of what deferring saves."""
    modules = start_up_modules(tmp_path, "--reader", "sim", serve=True)
    assert "atopgpud_tw.sim" in modules and "twisted.internet.epollreactor" in modules
    assert loaded(modules, WEB + ("atopgpud_tw.readers.smi",) + DEFERRED_WEIGHT) == []
    assert loaded(modules, OWN_LATER) == ["atopgpud_tw.figures"]  # the simulator's own


@pytest.mark.e2e
def test_a_p_request_loads_the_codec_s_p_lines(tmp_path):
    """``P`` (atopgpu's) loads codec/contexts.py when first asked, and is answered."""
    modules = start_up_modules(tmp_path, "--reader", "sim", serve=True, ask=("P", "S"))
    assert "atopgpud_tw.codec.contexts" in modules and "atopgpud_tw.codec.parse" not in modules


OWN_LATER_PROBE = textwrap.dedent("""
    import sys
    from atopgpud_tw import codec, gpm_counters, tap
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
    defaults = (workloads.DEFAULT_LIMIT, workloads.DEFAULT_EXPIRY)
    assert (options["workload-limit"], options["workload-expiry"]) == defaults
    # the P lines and reply parsing: at their first name
    records = [codec.ProcessInfo(7, 1000, "ann", "unit", "train.service", "python3")]
    assert "atopgpud_tw.codec.contexts" in sys.modules and "atopgpud_tw.codec.parse" not in sys.modules
    assert codec.parse_contexts(codec.render_contexts(records)) == {7: records[0]}
    assert callable(codec.parse_types) and codec.parse is sys.modules["atopgpud_tw.codec.parse"]
    # the table of figures: at the first GPM figures, or a health reading's rows
    assert "atopgpud_tw.figures" not in sys.modules
    totals = gpm_counters.GpmTotals()
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


@pytest.mark.e2e
def test_deferred_modules_work_when_used():
    """Twisted over the deferred modules: coroutines through Deferreds, asyncio, cookies,
    pdb, HTML escapes, getopt's messages, temporary names, JSON logs and the plugin scan
    as the real modules, each one object."""
    code = textwrap.dedent("""
        import sys
        from atopgpud_tw import lazy
        deferred = lazy.defer_unused()
        def base64_real():
            import base64
            return base64.b64encode(b"x") == b"eA==" and not lazy.is_deferred(base64)
        from twisted.internet import defer
        import asyncio, http.cookiejar, pdb, getpass
        assert all(lazy.is_deferred(sys.modules[name]) for name in deferred), deferred
        async def three():
            return 3
        results = []
        defer.ensureDeferred(three()).addCallback(results.append)
        assert results == [3] and "asyncio.base_events" not in sys.modules
        import asyncio.base_events  # a submodule first: its siblings come, the package's body waits
        assert lazy.is_deferred(sys.modules["asyncio"])
        assert asyncio.run(asyncio.sleep(0, "slept")) == "slept"
        assert defer.Future is asyncio.Future is asyncio.futures.Future
        assert http.cookiejar.CookieJar() is not None and "http.client" in sys.modules
        assert callable(pdb.Pdb) and callable(getpass.getpass)
        # the functions taken at import run their module's body at their first call
        from twisted.python import compat, filepath, logfile
        from twisted import logger, plugin
        from twisted.internet import process
        import getopt
        assert lazy.is_deferred(sys.modules["html"]) and compat.escape("<&>") == "&lt;&amp;&gt;"
        assert compat.escape is not sys.modules["html"].escape  # the stand-in, as bound at import
        try:
            getopt.getopt(["--bogus"], "", [])
        except getopt.GetoptError as error:
            assert str(error) == "option --bogus not recognized"
        assert filepath.armor(b"abcdef") == b"YWJjZGVm" and base64_real()
        assert logger.eventFromJSON(logger.eventAsJSON({"log_format": "x"}))["log_format"] == "x"
        assert "uuid" in sys.modules and sys.modules["twisted.logger"]._json is sys.modules["twisted.logger._json"]
        assert any(getattr(p, "shortName", "") == "epoll" for p in plugin.getPlugins(plugin.IPlugin))
        assert "zipfile" in sys.modules and callable(logfile.glob.glob) and callable(process.pty.openpty)
        assert not any(lazy.is_deferred(sys.modules[name]) for name in deferred)
        print(" ".join(deferred))
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == list(lazy.DEFERRED)


def write_package(root: Path) -> None:
    """A package whose body counts its runs (in `sys`) and takes `Thing` from a submodule."""
    package = root / "deferprobe"
    package.mkdir()
    (package / "__init__.py").write_text(textwrap.dedent("""
        import sys
        sys.deferprobe_runs = getattr(sys, "deferprobe_runs", 0) + 1
        from deferprobe.parts import Thing
        from deferprobe import other
        if getattr(sys, "deferprobe_fail", False):
            raise RuntimeError("the body fails")
        answer = 42
    """))
    (package / "parts.py").write_text("from . import other\n\nclass Thing:\n    pass\n")
    (package / "other.py").write_text("value = 1\n")


@pytest.fixture
def probe_package(tmp_path, monkeypatch):
    write_package(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    for name in [n for n in sys.modules if n == "deferprobe" or n.startswith("deferprobe.")]:
        del sys.modules[name]
    for attribute in ("deferprobe_runs", "deferprobe_fail"):
        if hasattr(sys, attribute):
            delattr(sys, attribute)


def test_defer_runs_the_body_at_first_use(probe_package):
    """A deferred package is in sys.modules unrun; the early name comes from its submodule
    (whose own imports of siblings do not run it), the next lookup runs it, once."""
    assert lazy.defer("deferprobe", {"Thing": "deferprobe.parts"})
    module = sys.modules["deferprobe"]
    from deferprobe import Thing

    assert getattr(sys, "deferprobe_runs", 0) == 0 and lazy.is_deferred(module)
    assert module.answer == 42 and sys.deferprobe_runs == 1
    assert module.Thing is Thing is sys.modules["deferprobe.parts"].Thing
    assert not lazy.is_deferred(module) and sys.modules["deferprobe"] is module
    with pytest.raises(AttributeError):
        module.missing  # noqa: B018
    assert sys.deferprobe_runs == 1


def test_a_submodule_imported_first_leaves_the_body_for_later(probe_package):
    """Importing a submodule (which imports a sibling from its package) does not run the
    package's body; the first lookup after it does."""
    assert lazy.defer("deferprobe", {})
    import deferprobe.parts

    assert getattr(sys, "deferprobe_runs", 0) == 0 and "deferprobe.other" in sys.modules
    assert deferprobe.answer == 42 and sys.deferprobe_runs == 1
    assert deferprobe.Thing is deferprobe.parts.Thing


def test_an_early_name_not_where_it_is_said_runs_the_body(probe_package):
    """An early name its module does not define (another Python's layout) runs the body instead."""
    assert lazy.defer("deferprobe", {"Thing": "deferprobe.other", "answer": "no_such_module_here"})
    from deferprobe import Thing, answer

    assert sys.deferprobe_runs == 1 and answer == 42 and Thing is sys.modules["deferprobe.parts"].Thing


def test_a_failing_body_is_a_failed_import(probe_package):
    """A body that raises leaves no module behind: the next import starts afresh."""
    sys.deferprobe_fail = True
    assert lazy.defer("deferprobe", {})
    module = sys.modules["deferprobe"]
    with pytest.raises(RuntimeError):
        module.answer  # noqa: B018
    assert "deferprobe" not in sys.modules
    sys.deferprobe_fail = False
    import deferprobe

    assert deferprobe.answer == 42 and deferprobe is not module


def test_a_function_taken_at_import_runs_the_body_at_its_first_call(tmp_path, monkeypatch):
    """``from module import function`` of a name in `later` binds a stand-in without running
    the body (nor does the import's question whether the module is a package); its first
    call runs the body, once, and calls the module's own function."""
    (tmp_path / "laterprobe.py").write_text(
        "import sys\nsys.laterprobe_runs = getattr(sys, 'laterprobe_runs', 0) + 1\n\n"
        "def twice(value):\n    return 2 * value\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        assert lazy.defer("laterprobe", {}, ("twice",))
        from laterprobe import twice

        assert getattr(sys, "laterprobe_runs", 0) == 0 and lazy.is_deferred(sys.modules["laterprobe"])
        assert twice(21) == 42 and twice(1) == 2 and sys.laterprobe_runs == 1
        assert twice is not sys.modules["laterprobe"].twice and not lazy.is_deferred(sys.modules["laterprobe"])
    finally:
        sys.modules.pop("laterprobe", None)
        if hasattr(sys, "laterprobe_runs"):
            delattr(sys, "laterprobe_runs")


def test_imported_or_built_in_modules_are_left_alone():
    """defer_unused skips what is imported already; a built-in module has no body to defer."""
    assert lazy.defer_unused({"sys": "", "os": ""}) == []
    assert lazy.defer("sys", {}) is False and lazy.defer("no_such_module_here", {}) is False


def test_docs_give_the_import_costs():
    """docs/PERFORMANCE.md names every deferred module."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "PERFORMANCE.md").read_text()
    assert all(f"`{name}`" in text for name in lazy.DEFERRED)


TLS_PROBE = textwrap.dedent("""
    import sys
    from atopgpud_tw.lazy import without_tls_unless_asked
    hidden = without_tls_unless_asked(sys.argv[1:])
    from twisted.internet import tcp, unix  # Twisted's branch for a host without pyOpenSSL when hidden
    try:
        import OpenSSL  # noqa: F401
        available = True
    except ImportError:
        available = False
    print(hidden, available, "twisted.internet._newtls" in sys.modules)
""")


@pytest.mark.e2e
@pytest.mark.parametrize("argv, expected", [
    ((), "True False False"),
    (("--reader", "sim", "--metrics", "tcp:0"), "True False False"),
    (("--web-config", "web.yml", "--metrics", "tcp:0"), "False True True"),
    (("--web-config=web.yml",), "False True True"),
    (("--metrics", "ssl:9445:privateKey=k.pem"), "False True True"),
])
def test_pyopenssl_only_for_a_command_line_that_serves_tls(argv: tuple[str, ...], expected: str) -> None:
    """The command keeps pyOpenSSL (and Twisted's TLS mixins) out unless TLS is asked for."""
    out = subprocess.run([sys.executable, "-c", TLS_PROBE, *argv], capture_output=True, text=True, check=True)
    assert out.stdout.split() == expected.split()
