#!/usr/bin/env python3
"""What each part of the daemon's import graph costs at start-up: milliseconds and RSS.

    .venv/bin/python bench/imports.py [--twistd] [--traced] [--seconds 3] [--modules 25]
                                      [--beside FILE] [-- DAEMON OPTIONS]

Runs the daemon in this process (the ``atopgpud`` command, or ``twistd -n
atopgpud`` with ``--twistd``; default options ``--reader sim --listen
unix:@<unique>``) with a finder first on ``sys.meta_path`` that times every
module's execution and reads the process's RSS (/proc/self/statm) before and
after it.  A module's own cost is what its execution added less what the
imports it made added; the parts below group modules by name.  After
``--seconds`` (polls have run) it prints, for every part, the modules, the
milliseconds and the KiB of RSS the part's modules added, then the RSS and peak
RSS (VmHWM) of the whole process; the difference between the sum of the parts
and the RSS is the interpreter before the first import, the finder's own few
hundred KiB, and what the daemon allocates once it runs.  ``--modules N`` also
lists the N costliest modules.  ``--beside FILE`` (module names, one a line: another
process's ``sys.modules``) adds a column, the KiB of the modules that process has
not loaded (what this one pays beyond it).  Then it stops the daemon (SIGTERM).

``--traced`` counts, in place of RSS, the bytes Python's allocators hold
(``tracemalloc``, from before the first import): what a module's body left
allocated, to the byte, where pages are shared between modules (the same from
run to run; the allocator's own overhead and free space not counted).

RSS is counted in pages where they are first touched: a shared library mapped
by one module (OpenSSL's by ``_ssl`` or ``_hashlib``) counts where it is first
loaded, so the figures depend on the order, which is the daemon's own.
"""

from __future__ import annotations

# the fewest imports of its own: every module imported here is left out of the figures
# (argparse and importlib.abc alone are 4 MB), and os, sys, time, signal, threading
# are the daemon's anyway
import os
import signal
import sys
import threading
import time
from types import ModuleType

_PAGE_KIB = os.sysconf("SC_PAGE_SIZE") // 1024

#: (part, name prefixes), the first that matches names a module's part
PARTS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("asyncio, concurrent", ("asyncio", "concurrent")),
    ("ssl, hashlib (OpenSSL)", ("ssl", "_ssl", "hashlib", "_hashlib")),
    ("email, http, urllib.request", ("email", "http", "urllib.request", "urllib.response", "urllib.error")),
    ("pdb, getpass, cmd, code", ("pdb", "bdb", "cmd", "code", "codeop", "getpass", "glob", "pprint")),
    ("zope.interface", ("zope",)),
    ("attrs", ("attr", "attrs")),
    ("incremental, constantly, automat, hyperlink", ("incremental", "constantly", "automat", "hyperlink", "idna")),
    ("twistd (twisted.application, scripts, persisted)", ("twisted.application", "twisted.scripts",
                                                          "twisted.persisted", "twisted.copyright", "twisted.plugin")),
    ("twisted.web", ("twisted.web",)),
    ("twisted.internet", ("twisted.internet", "twisted.protocols")),
    ("twisted.logger, twisted.python, twisted", ("twisted",)),
    ("prometheus_client", ("prometheus_client",)),
    ("nvidia-ml-py (pynvml)", ("pynvml",)),
    ("atopgpud_tw.sim (the simulator)", ("atopgpud_tw.sim",)),
    ("atopgpud_tw.readers", ("atopgpud_tw.readers",)),
    ("atopgpud_tw.server.web", ("atopgpud_tw.server.web",)),
    ("atopgpud_tw.server.atop", ("atopgpud_tw.server.atop",)),
    ("atopgpud_tw.server.system", ("atopgpud_tw.server.system",)),
    ("atopgpud_tw (the rest)", ("atopgpud_tw", "twisted.plugins")),
    ("other standard library", ("",)),
)


def part_of(name: str) -> str:
    for part, prefixes in PARTS:
        if any(p == "" or name == p or name.startswith(p + ".") for p in prefixes):
            return part
    return PARTS[-1][0]


def rss_kib() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * _PAGE_KIB


def traced_kib() -> float:
    import tracemalloc  # imported at start-up with --traced, before the daemon's first import

    return tracemalloc.get_traced_memory()[0] / 1024


#: what a module's body is measured with: `rss_kib`, or `traced_kib` (--traced)
measure = rss_kib


def status_kib(key: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return 0


class Costs:
    """Own milliseconds and KiB of every module executed, in the order they finished."""

    def __init__(self) -> None:
        self.own: dict[str, list[float]] = {}
        self.parent: dict[str, str] = {}
        self._names: list[str] = []
        self._stack: list[list[float]] = []  # per module being executed: children's ms and KiB
        self.lock = threading.Lock()

    def run(self, name: str, execute: object) -> None:
        if threading.current_thread() is not threading.main_thread():
            execute()
            return
        children = [0.0, 0.0]
        self.parent[name] = self._names[-1] if self._names else "-"
        self._names.append(name)
        self._stack.append(children)
        start, before = time.perf_counter(), measure()
        try:
            execute()
        finally:
            took, grew = 1000 * (time.perf_counter() - start), measure() - before
            self._stack.pop()
            self._names.pop()
            with self.lock:
                self.own[name] = [took - children[0], grew - children[1]]
            if self._stack:
                self._stack[-1][0] += took
                self._stack[-1][1] += grew


class _Timed:
    """A loader that runs another's exec_module under `Costs.run`."""

    def __init__(self, loader: object, costs: Costs) -> None:
        self.loader, self.costs = loader, costs

    def create_module(self, spec: object) -> ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.costs.run(module.__name__, lambda: self.loader.exec_module(module))

    def __getattr__(self, name: str) -> object:  # get_resource_reader, is_package, ...
        return getattr(self.loader, name)


class TimingFinder:
    """Asks the finders after it, and wraps the loader they find in `_Timed`."""

    def __init__(self, costs: Costs) -> None:
        self.costs = costs

    def find_spec(self, fullname: str, path: object, target: ModuleType | None = None) -> object:
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _Timed(spec.loader, self.costs)
                return spec
        return None


def table(costs: Costs, modules: int, beside: set[str] | None = None) -> list[str]:
    """Modules, ms and KiB per part; with `beside` (another process's modules) also the
    KiB of the modules that process has not loaded."""
    with costs.lock:
        own = dict(costs.own)
    parts: dict[str, list[float]] = {}
    for name, (took, grew) in own.items():
        entry = parts.setdefault(part_of(name), [0, 0.0, 0.0, 0.0])
        entry[0] += 1
        entry[1] += took
        entry[2] += grew
        entry[3] += grew if beside is not None and name not in beside else 0.0
    extra = f"{'KiB not beside':>16}" if beside is not None else ""
    lines = [f"{'part':<52}{'modules':>8}{'ms':>8}{'KiB':>8}{extra}"]
    order = [p for p, _ in PARTS if p in parts]
    for part in order:
        count, took, grew, beyond = parts[part]
        lines.append(f"{part:<52}{count:>8}{took:>8.1f}{grew:>8.0f}" + (f"{beyond:>16.0f}" if extra else ""))
    total = [sum(parts[p][i] for p in order) for i in range(4)]
    lines.append(f"{'all imports':<52}{total[0]:>8.0f}{total[1]:>8.1f}{total[2]:>8.0f}"
                 + (f"{total[3]:>16.0f}" if extra else ""))
    if modules:
        lines.append("")
        lines.append(f"the {modules} costliest modules (own KiB, own ms, imported by):")
        for name, (took, grew) in sorted(own.items(), key=lambda item: -item[1][1])[:modules]:
            lines.append(f"  {name:<44}{grew:>8.0f}{took:>8.1f}  {costs.parent.get(name, '-')}")
    return lines


def main() -> None:
    argv = sys.argv[1:]
    daemon_args: list[str] = []
    if "--" in argv:
        at = argv.index("--")
        argv, daemon_args = argv[:at], argv[at + 1:]
    options = {"--twistd": False, "--traced": False, "--seconds": 3.0, "--modules": 25, "--beside": ""}
    flags = ("--twistd", "--traced")
    while argv:
        flag = argv.pop(0)
        if flag not in options or (flag not in flags and not argv):
            raise SystemExit(__doc__.split("\n\n")[1])
        options[flag] = True if flag in flags else type(options[flag])(argv.pop(0))
    twistd, seconds, modules = bool(options["--twistd"]), float(options["--seconds"]), int(options["--modules"])
    beside = None
    if options["--beside"]:
        with open(str(options["--beside"])) as listing:
            beside = set(listing.read().split())
    if not daemon_args:
        daemon_args = ["--reader", "sim", "--listen", f"unix:@atopgpud-imports-{os.getpid()}"]
    global measure
    if options["--traced"]:
        import tracemalloc

        tracemalloc.start()
        measure = traced_kib
    interpreter = rss_kib()
    costs = Costs()
    sys.meta_path.insert(0, TimingFinder(costs))

    def report() -> None:
        time.sleep(seconds)
        lines = [f"# {time.strftime('%Y-%m-%d %H:%M %Z')}, load average {os.getloadavg()[0]:.2f}; "
                 f"{'twistd -n atopgpud' if twistd else 'atopgpud'} {' '.join(daemon_args)}",
                 f"RSS before the first import: {interpreter} KiB"
                 + (" (KiB below: bytes traced, not RSS)" if options["--traced"] else ""),
                 *table(costs, modules, beside),
                 f"RSS now {status_kib('VmRSS')} KiB, peak {status_kib('VmHWM')} KiB, "
                 f"{len(sys.modules)} modules in sys.modules"]
        sys.__stdout__.write("\n".join(lines) + "\n")
        sys.__stdout__.flush()
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=report, daemon=True).start()
    if twistd:
        sys.argv = ["twistd", "-n", "--pidfile=", "atopgpud", *daemon_args]
        from twisted.scripts.twistd import run

        run()
    else:
        sys.argv = ["atopgpud", *daemon_args]
        from atopgpud_tw.__main__ import main as command

        command()


if __name__ == "__main__":
    main()
