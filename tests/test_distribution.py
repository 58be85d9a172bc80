"""The wheel and the sdist build from the source tree, pass ``twine check``, and carry
what docs/install.md says they carry, at the one version pyproject.toml names."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tarfile
import zipfile
from email.parser import Parser
from pathlib import Path
from typing import Iterator

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = None  # type: ignore[assignment]

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[1]


def _version() -> str:
    if tomllib is None:
        pytest.skip("reading pyproject.toml needs Python 3.11's tomllib")
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """dist/ with the sdist and the wheel, built by ``python -m build`` from a copy of the tree
    (the sdist first, the wheel from it, as PyPI tooling does)."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs a git checkout to copy the tracked files from")
    scratch = tmp_path_factory.mktemp("dist")
    source = scratch / "source"
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           check=True, capture_output=True).stdout.decode().split("\0")
    for name in filter(None, files):
        if (ROOT / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, source / name)
    out = scratch / "dist"
    done = subprocess.run([sys.executable, "-m", "build", "--outdir", str(out), str(source)],
                          capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    yield out


def _one(dist: Path, pattern: str) -> Path:
    found = sorted(dist.glob(pattern))
    assert len(found) == 1, found
    return found[0]


def test_twine_check_passes(dist: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "twine", "check", "--strict", *map(str, dist.iterdir())],
                          capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("PASSED") == 2, done.stdout


def test_the_wheel_is_the_version_and_licence_pyproject_names(dist: Path) -> None:
    version = _version()
    wheel = _one(dist, "atopgpud_tw-*.whl")
    assert wheel.name == f"atopgpud_tw-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel) as archive:
        metadata = Parser().parsestr(archive.read(f"atopgpud_tw-{version}.dist-info/METADATA").decode())
        names = set(archive.namelist())
    assert metadata["Version"] == version
    assert metadata["License-Expression"] == "Apache-2.0"
    assert f"atopgpud_tw-{version}.dist-info/licenses/LICENSE" in names


def test_the_wheel_carries_the_units_rules_dashboard_and_docs(dist: Path) -> None:
    version = _version()
    with zipfile.ZipFile(_one(dist, "atopgpud_tw-*.whl")) as archive:
        names = set(archive.namelist())
    data = f"atopgpud_tw-{version}.data/data/share/"
    expected = {
        "atopgpud_tw/systemd/atopgpud.service", "atopgpud_tw/systemd/atopgpud.socket",
        "atopgpud_tw/systemd/atopgpud-tcp.socket",
        "atopgpud_tw/prometheus/atopgpud-rules.yml", "atopgpud_tw/prometheus/atopgpud-workload-rules.yml",
        "atopgpud_tw/grafana/atopgpud.json",
        "doc/atopgpud_tw/README.md", "doc/atopgpud_tw/CHANGELOG.md", "doc/atopgpud_tw/LICENSE",
        "doc/atopgpud_tw/docs/install.md", "doc/atopgpud_tw/docs/metrics.md",
    }
    assert {data + name for name in expected} <= names
    assert "twisted/plugins/atopgpud_plugin.py" in names
    assert "atopgpud_tw/sim/demo.json" in names
    # the docs the wheel ships are every page of docs/
    shipped = {name.removeprefix(data + "doc/atopgpud_tw/docs/") for name in names
               if name.startswith(data + "doc/atopgpud_tw/docs/")}
    assert shipped == {path.name for path in (ROOT / "docs").glob("*.md")}


def test_the_sdist_is_the_whole_source(dist: Path) -> None:
    version = _version()
    with tarfile.open(_one(dist, "atopgpud_tw-*.tar.gz")) as archive:
        names = {name.removeprefix(f"atopgpud_tw-{version}/") for name in archive.getnames()}
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, check=True, capture_output=True,
                             text=True).stdout.split()
    wanted = {name for name in tracked if not name.startswith((".gitignore",))}
    missing = sorted(wanted - names)
    assert not missing, f"tracked files the sdist leaves out: {missing[:20]}"
