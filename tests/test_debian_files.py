"""debian/ and the unit agree with each other and with the project, read as files (no build: the build and
the install are tests/test_debian_package.py's)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = None  # type: ignore[assignment]

ROOT = Path(__file__).resolve().parents[1]
DEBIAN = ROOT / "debian"
UNIT = (ROOT / "etc" / "atopgpud.service").read_text()
RULES = (DEBIAN / "rules").read_text()


def links() -> dict[str, str]:
    """debian/atopgpud-tw.links as {link: target}, both absolute."""
    pairs = [line.split() for line in (DEBIAN / "atopgpud-tw.links").read_text().splitlines() if line.strip()]
    return {"/" + link: "/" + target for target, link in pairs}


def installs() -> dict[str, str]:
    """debian/atopgpud-tw.install as {installed path: source path}."""
    found = {}
    for line in (DEBIAN / "atopgpud-tw.install").read_text().splitlines():
        if line.strip():
            source, directory = line.split()
            found["/" + directory.rstrip("/") + "/" + Path(source).name] = source
    return found


def project_version() -> str:
    return re.search(r'^version = "([^"]+)"$', (ROOT / "pyproject.toml").read_text(), re.M).group(1)


def test_changelog_version_is_pyprojects_with_a_debian_revision() -> None:
    """debian/changelog's top entry is pyproject.toml's version, Debian revision 1 or more."""
    top = (DEBIAN / "changelog").read_text().splitlines()[0]
    match = re.match(r"^atopgpud-tw \(([^)-]+)-(\d+)\) ", top)
    assert match, top
    assert match.group(1) == project_version()


def test_exec_start_runs_the_link_into_the_venv() -> None:
    """The unit's ExecStart program is /usr/sbin/atopgpud, a link the package makes into its venv."""
    command = shlex.split(re.search(r"^ExecStart=(.+)$", UNIT, re.M).group(1))
    assert command == ["/usr/sbin/atopgpud", "$ATOPGPUD_OPTS"]
    assert links() == {"/usr/sbin/atopgpud": "/opt/venvs/atopgpud-tw/bin/atopgpud",
                       "/usr/bin/atopgpu": "/opt/venvs/atopgpud-tw/bin/atopgpu"}
    rules = (DEBIAN / "rules").read_text()
    assert "DH_VIRTUALENV_INSTALL_ROOT = /opt/venvs" in rules  # dh_virtualenv's venv: /opt/venvs/<package>


def test_the_options_come_from_the_conffile_and_default_to_both_protocols() -> None:
    """EnvironmentFile= is the conffile the package installs (optional: a pip install has none); the
    unit's own default and the conffile's are the same options."""
    assert re.search(r"^EnvironmentFile=-/etc/default/atopgpud$", UNIT, re.M)
    assert installs()["/etc/default/atopgpud"] == "debian/default/atopgpud"
    default = re.search(r'^Environment="ATOPGPUD_OPTS=(.+)"$', UNIT, re.M).group(1)
    conffile = re.search(r'^ATOPGPUD_OPTS="(.+)"$', (DEBIAN / "default" / "atopgpud").read_text(), re.M).group(1)
    assert default == conffile == "--listen unix:@atopgpud_nvidia --listen tcp:59123:interface=127.0.0.1"


def test_units_conflict_with_atops_own_and_name_what_the_package_installs() -> None:
    """Conflicts=atopgpu.service; User=_atopgpud is the sysusers.d user; every Documentation= the
    package installs (the man page, the README under /usr/share/doc/atopgpud-tw)."""
    assert re.search(r"^Conflicts=atopgpu\.service$", UNIT, re.M)
    assert re.search(r"^User=_atopgpud$", UNIT, re.M)
    assert re.match(r"^u _atopgpud ", (DEBIAN / "atopgpud-tw.sysusers").read_text().splitlines()[-1])
    docs = (DEBIAN / "atopgpud-tw.docs").read_text().split()
    manpages = (DEBIAN / "atopgpud-tw.manpages").read_text().split()
    assert manpages == ["docs/man/atopgpud.8", "docs/man/atopgpu.1"]
    for name in ("atopgpud.service", "atopgpud.socket", "atopgpud-tcp.socket"):
        # installed by dh_installsystemd --name (debian/rules) where the Debian's debhelper puts units
        stem, kind = name.rsplit(".", 1)
        link = DEBIAN / f"atopgpud-tw.{stem}.{kind}"
        assert link.is_symlink() and link.resolve() == ROOT / "etc" / name, link
        assert re.search(rf"dh_installsystemd --name={re.escape(stem)} .*\b{re.escape(name)}\b", RULES), name
        line = re.search(r"^Documentation=(.+)$", (ROOT / "etc" / name).read_text(), re.M).group(1)
        for uri in line.split():
            if uri.startswith("man:"):
                page, section = re.match(r"man:(\S+)\((\d)\)$", uri).groups()
                assert f"docs/man/{page}.{section}" in manpages, uri
            else:
                assert uri.startswith("file:///usr/share/doc/atopgpud-tw/"), uri
                assert uri.rsplit("/", 1)[1] in [Path(doc).name for doc in docs], uri


@pytest.mark.skipif(tomllib is None, reason="tomllib is Python 3.11's")
def test_requirements_pin_every_dependency_exactly() -> None:
    """debian/requirements.txt pins each of pyproject's runtime dependencies with ==."""
    pins = {}
    for line in (DEBIAN / "requirements.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, version = line.split("==")
            pins[re.sub(r"[-_.]+", "-", name).lower()] = version
    wanted = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    for requirement in wanted:
        name = re.sub(r"[-_.]+", "-", re.match(r"[A-Za-z0-9_.-]+", requirement).group(0)).lower()
        assert name in pins, requirement


def test_build_dependencies_are_in_the_readmes_test_command() -> None:
    """Every Build-Depends of debian/control is installed by README's test command (debhelper-compat
    is debhelper's)."""
    control = (DEBIAN / "control").read_text()
    field = re.search(r"^Build-Depends:(.+?)^\S", control, re.M | re.S).group(1)
    needed = {re.match(r"\s*([a-z0-9.+-]+)", item).group(1) for item in field.split(",") if item.strip()}
    needed = {"debhelper" if name == "debhelper-compat" else name for name in needed}
    readme = (ROOT / "README.md").read_text()
    command = re.findall(r"apt-get install -y ([^']+)'", readme)[-1].split()
    # python3 and python3-venv: python3-venv is in the command and depends on python3
    assert needed - {"python3"} <= set(command), needed - set(command)
    assert {"dpkg-dev", "lintian"} <= set(command)
