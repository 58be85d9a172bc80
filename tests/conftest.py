"""What every test module shares: the ``e2e`` marker, log capture, and the helpers' home.

``e2e`` marks a test that starts a process: a daemon, a stand-in nvidia-smi, atop,
a booted systemd.  ``pytest -m "not e2e"`` is the quick inner loop; a test that
starts a process without the mark fails, so the marker stays true.  ``slow`` marks
a long run that starts nothing (a property test's hundreds of examples): it is
given ``e2e`` too, so the quick loop leaves it out.  ``quick_cases(n)`` on a parametrized
test keeps n of its cases in the quick loop (the same n on every run, spread over the
matrix) and marks the others ``slow``: the whole matrix runs in the suite.  ``lint`` marks a
test that runs a linter's command (ruff): it starts no daemon, and the quick loop keeps it.

The helper modules beside this file (``daemon``, ``scenarios``, ``snapshots``,
``connections``, ``sim_readers``, ``metrics_text``, ``clocked``, ``smi_doubles`` ...)
are imported as top-level modules in any import mode; no test module imports another.
"""

from __future__ import annotations

import gc
import os
import random
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Iterator

import pytest
from hypothesis import settings
from twisted.logger import capturedLogs, formatEvent

# no example has a deadline: these machines are shared and loaded, and a test that times its
# examples fails on a busy one (a test that wants one says so in its own settings)
settings.register_profile("untimed", deadline=None)
settings.load_profile("untimed")

sys.path.insert(0, str(Path(__file__).resolve().parent))

# pytest keeps each test module as rewritten (its assertions) in tests/__pycache__ and
# reads it back while the source is unchanged; where PYTHONDONTWRITEBYTECODE is set it
# rewrites all of them on every run instead, in every worker: about 2 s of each
# worker's 3.3 s of collection.  The package's modules are compiled when it is installed.
sys.dont_write_bytecode = False

#: modules whose every test starts a process
E2E_MODULES = {
    "test_activation", "test_atop", "test_daemon", "test_descriptors", "test_driver_behaviours_daemon",
    "test_listen_failures", "test_notify", "test_prometheus", "test_rules", "test_signals", "test_smi_daemon",
    "test_smi_reader", "test_startup_daemon", "test_systemd_boot",
    "test_atop_limits",
}

#: fixtures that start a daemon: a test using one is end-to-end too
E2E_FIXTURES = {
    "box", "clone_daemons", "daemon", "daemons", "hung_daemon", "late_gpu_daemon", "mig_card_daemon",
    "mig_daemon", "scraped", "unknown_memory_daemons",
}


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "e2e: starts a process (daemon, stand-in nvidia-smi, atop, systemd)")
    config.addinivalue_line("markers", "slow: a long run in one process (a property test's hundreds of examples): "
                            "marked e2e too, so the quick loop leaves it out")
    config.addinivalue_line("markers", "lint: runs a linter's command (ruff), and stays in the quick loop")
    config.addinivalue_line("markers", "quick_cases(n): n of a parametrized test's cases stay in the quick loop; "
                            "the others are marked slow")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # Which worker runs what is by file (pyproject's --dist loadfile): a module's module-scoped
    # daemon, container or package is one, and its tests may build on each other (install,
    # upgrade, remove, purge), in order. (Not xdist_group marks with --dist loadgroup: with
    # pytest 9.2 xdist 3.8 can no longer add a group to a test's node id, and every test went
    # to whichever worker was free.)
    _sample_matrices(items)
    for item in items:
        if Path(str(item.fspath)).stem in E2E_MODULES or E2E_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.e2e)
        if item.get_closest_marker("slow") is not None:
            # out of the quick loop (-m "not e2e"), though it starts nothing
            item.add_marker(pytest.mark.e2e)


def _sample_matrices(items: list[pytest.Item]) -> None:
    """Mark slow all but `quick_cases(n)`'s n cases of each test that has the marker: a choice
    seeded by the test's name, so every run and every xdist worker makes the same."""
    matrices: dict[str, list[pytest.Item]] = {}
    for item in items:
        if item.get_closest_marker("quick_cases") is not None:
            matrices.setdefault(item.nodeid.partition("[")[0], []).append(item)
    for name, cases in matrices.items():
        count = cases[0].get_closest_marker("quick_cases").args[0]  # type: ignore[union-attr]
        kept = set(random.Random(name).sample(range(len(cases)), min(count, len(cases))))
        for index, item in enumerate(cases):
            if index not in kept:
                item.add_marker(pytest.mark.slow)


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """Workers for ``-n auto`` (pyproject's addopts): for a run of whole folders (the
    suite, ``-m "not e2e"``) one per core, up to 4; none for named files or tests,
    which take less time than starting a worker does."""
    if any("::" in arg or Path(arg).is_file() for arg in config.args):
        return 0
    cores = len(os.sched_getaffinity(0))
    return min(cores, 4) if cores > 1 else 0


def _collect_and_freeze() -> None:
    """Collect the garbage, then freeze what is left: later collections skip it.

    What is alive at a module's end (the packages imported, hypothesis, what
    earlier modules' tests cached) is walked by every later full collection, most
    of a second in all over a run; pytest's unconfigure walks it twice more.
    Nothing is frozen that was garbage: it is collected first, and what a
    finalizer raises is reported as before.
    """
    gc.collect()
    gc.freeze()


@pytest.hookimpl(tryfirst=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    _collect_and_freeze()


_current: list[pytest.Item | None] = [None]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    _current[0] = item
    yield
    _current[0] = None
    if nextitem is None or nextitem.path != item.path:
        _collect_and_freeze()  # after the module's last test and its module-scoped fixtures


def _guarded(start: Any) -> Any:
    def guarded(*args: Any, **kwargs: Any) -> Any:
        item = _current[0]
        if item is not None and item.get_closest_marker("e2e") is None and item.get_closest_marker("lint") is None:
            raise AssertionError(f"{item.nodeid} starts a process: mark it @pytest.mark.e2e")
        return start(*args, **kwargs)

    return guarded


subprocess.Popen.__init__ = _guarded(subprocess.Popen.__init__)  # type: ignore[method-assign]
os.posix_spawn = _guarded(os.posix_spawn)
os.posix_spawnp = _guarded(os.posix_spawnp)


class LogText(Sequence[str]):
    """Captured events as their text, formatted when read (so later events show)."""

    def __init__(self, events: Sequence[Any]) -> None:
        self.events = events

    def __getitem__(self, index: Any) -> Any:
        return [formatEvent(event) for event in self.events][index]

    def __len__(self) -> int:
        return len(self.events)


@pytest.fixture
def logged() -> Iterator[LogText]:
    """The text of every event logged during the test."""
    with capturedLogs() as events:
        yield LogText(events)
