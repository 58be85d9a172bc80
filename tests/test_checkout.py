"""The tests run the checkout: the package and the twistd plugin are imported from this tree, in the
test process and in the daemons the tests start, so an edit is tested without a reinstall.

The README's test command installs the checkout in editable mode (``pip install -e
--config-settings editable_mode=compat``: a ``.pth`` file puts the checkout on ``sys.path``, where
Twisted also finds ``twisted/plugins/``).  A plain ``pip install .`` or a leftover copy in the venv
makes these tests fail.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest
from daemon import Daemon, env_without_gpu

import atopgpud_tw
import atopgpud_tw.tap  # noqa: F401  (and what it imports)
import twisted.plugins

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "atopgpud_tw"
PLUGIN = ROOT / "twisted" / "plugins" / "atopgpud_plugin.py"

#: a path a verbose interpreter (PYTHONVERBOSE=1) names for a module of the package or the plugin
LOADED = re.compile(r"(/[^\s'\"]*?(?:/atopgpud_tw/[^\s'\"]*\.pyc?|/atopgpud_plugin(?:\.\S*)?\.pyc?))")


def strays(paths: list[str]) -> list[str]:
    """The package's or the plugin's files in `paths` that are not the checkout's."""
    return [path for path in paths
            if not (Path(path).resolve().is_relative_to(PACKAGE) or Path(path).resolve().parent
                    in (PLUGIN.parent, PLUGIN.parent / "__pycache__"))]


def test_this_process_imports_the_checkout():
    """Every module of the package loaded here is a file of the checkout."""
    assert Path(atopgpud_tw.__file__).resolve() == PACKAGE / "__init__.py"
    files = [module.__file__ for name, module in list(sys.modules.items())
             if name.partition(".")[0] == "atopgpud_tw" and getattr(module, "__file__", None)]
    assert len(files) > 10 and strays(files) == []


def test_twistd_finds_the_checkout_s_plugin_only():
    """twistd looks for plugins in each folder of ``twisted.plugins.__path__``: the checkout's is one,
    and no other holds a copy of the plugin (a stale install would)."""
    folders = [Path(folder).resolve() for folder in twisted.plugins.__path__]
    assert PLUGIN.parent in folders
    copies = [folder for folder in folders if (folder / PLUGIN.name).exists()]
    assert copies == [PLUGIN.parent]
    spec = importlib.util.find_spec("twisted.plugins.atopgpud_plugin")
    assert spec is not None and Path(str(spec.origin)).resolve() == PLUGIN


def loaded_files(log: str) -> list[str]:
    found = LOADED.findall(log)
    assert any(path.endswith(("tap.py", "tap.cpython-311.pyc")) or "/tap." in path for path in found), log[-2000:]
    return found


@pytest.mark.e2e
def test_the_daemons_the_tests_start_import_the_checkout(tmp_path, monkeypatch):
    """``twistd -n atopgpud`` as tests/daemon.py starts it: PYTHONVERBOSE=1 makes the interpreter name the
    file of every module it loads, the plugin's and the package's included."""
    monkeypatch.setenv("PYTHONVERBOSE", "1")
    daemon = Daemon(tmp_path, ["--reader", "sim"]).start()
    try:
        log = daemon.log()
    finally:
        daemon.stop()
    found = loaded_files(log)
    assert any("atopgpud_plugin" in path for path in found), log[-2000:]
    assert strays(found) == []


@pytest.mark.e2e
@pytest.mark.parametrize("command", [
    [str(Path(sys.executable).with_name("atopgpud"))],
    [sys.executable, "-m", "atopgpud_tw"],
], ids=["atopgpud", "python -m atopgpud_tw"])
def test_the_commands_import_the_checkout(command: list[str], tmp_path: Path) -> None:
    """The console script and ``python -m`` (the other ways tests start a daemon), run from elsewhere."""
    env = {**env_without_gpu(), "PYTHONVERBOSE": "1"}
    done = subprocess.run([*command, "--version"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          stdin=subprocess.DEVNULL, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    assert strays(loaded_files(done.stderr)) == []
