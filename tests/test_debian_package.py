"""The Debian package (debian/): built with ``dpkg-buildpackage -us -uc -b`` from a clean copy of the checkout,
checked by lintian, and installed, upgraded, removed and purged by apt in a booted Debian 12
(tests/systemd_container.py).

The container's tree has systemd and little else: no Python, no atop.  ``apt-get install
./atopgpud-tw_*.deb`` (apt run with the host's network, the container's own services on
its private loopback) must bring python3.11 and, recommended, atop.  Before it, a stand-in
for atop's own daemon runs: /usr/sbin/atopgpud (holding @atopgpud_nvidia and TCP 59123)
under an enabled atopgpu.service, as atop's upstream ``make install`` leaves them.

The tests run in order on one container, each on what the one before left:
install, atop's log, a broken conffile, an upgrade, remove, purge.

Skips when not root, without the build tools (README's test command installs them:
dpkg-dev debhelper dh-virtualenv lintian), or without a Debian mirror; with ``CI=true``
those but the first are failures.
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Iterator

import pytest
from debian_build import PACKAGE, Built, build_package, field, missing_tools, repacked
from debian_checks import (
    ATOPGPU,
    BOOT_PACKAGES,
    CONFFILE,
    SERVICE,
    SIM_OPTS,
    apt,
    apt_update,
    assert_purged,
    atop_logs_gpus,
    copy_in,
    installed_size,
    installed_version,
    lintian,
    lintian_tags,
    serves_both,
    show,
    undocumented_warnings,
)
from systemd_container import SUITE, VENV, Container, booted, not_possible, require

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(2400)]

#: the stand-in for atop's own daemon and its unit (upstream's atopgpu.service runs /usr/sbin/atopgpud)
FOREIGN_DAEMON = "#!/bin/sh\n# atop's own atopgpud (a stand-in): holds what it would hold\n" \
                 "exec systemd-socket-activate -l @atopgpud_nvidia -l 127.0.0.1:59123 sleep infinity\n"
FOREIGN_UNIT = "[Unit]\nDescription=atop's own GPU daemon (a stand-in)\n" \
               "[Service]\nExecStart=/usr/sbin/atopgpud\n[Install]\nWantedBy=multi-user.target\n"
#: where a name with atopgpud in it may be found after purge: the stand-in, given back
LEFT_AFTER_PURGE = ["/usr/sbin/atopgpud"]


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Built:
    require()
    absent = missing_tools()
    if absent:
        not_possible(f"{', '.join(absent)} not installed (Debian: apt-get install dpkg-dev debhelper "
                     "dh-virtualenv lintian)")
    package = build_package(tmp_path_factory.mktemp("deb"))
    print(f"dpkg-buildpackage took {package.seconds:.1f} s; {package.deb.name} {package.deb.stat().st_size} bytes")
    return package


@pytest.fixture(scope="module")
def box(built: Built, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Container]:
    """The container, with the package and the stand-in's files copied in and apt's lists fetched."""
    with booted(tmp_path_factory.mktemp("nspawn"), install=False, packages=BOOT_PACKAGES) as box:
        began = time.monotonic()
        copy_in(box, built.deb)
        apt_update(box)
        box.timings["apt-update"] = time.monotonic() - began
        yield box
        print("container timings:", {key: round(value, 1) for key, value in box.timings.items()})


@pytest.fixture(scope="module")
def installed(box: Container, built: Built) -> str:
    """atop's own daemon running under its enabled atopgpu.service, then ``apt-get install ./the.deb``:
    what apt said."""
    box.write_file("/usr/sbin/atopgpud", FOREIGN_DAEMON, mode=0o755)
    box.write_file("/etc/systemd/system/atopgpu.service", FOREIGN_UNIT)
    box.systemctl("daemon-reload")
    box.systemctl("enable", "--now", "atopgpu.service")
    box.wait_for(lambda: "@atopgpud_nvidia" in box.run(["cat", "/proc/net/unix"]).stdout, what="the stand-in listening")
    for name in ("python3.11", "atop"):
        assert box.run(["dpkg-query", "-W", name]).returncode != 0, f"{name} already in the tree"
    began = time.monotonic()
    out = apt(box, "install", f"/var/tmp/debs/{built.deb.name}").stdout
    box.timings["apt-install"] = time.monotonic() - began
    return out


def test_install_pulls_the_dependencies_and_takes_over_from_atops_own_daemon(box: Container, installed: str) -> None:
    """apt brings python3.11 and atop; the install says that atop's daemon is set aside, stops and
    disables atopgpu.service, keeps its binary as /usr/sbin/atopgpud.atop; atopgpud.service and
    atopgpud.socket are enabled and were started; the system user exists; the links point into the venv."""
    for name in ("python3.11", "atop"):
        assert box.run(["dpkg-query", "-W", name]).returncode == 0, f"apt did not install {name}:\n{installed}"
    assert "atop's own /usr/sbin/atopgpud is kept as /usr/sbin/atopgpud.atop" in installed, installed
    assert "stopping atop's own atopgpu.service" in installed, installed
    assert "disabling atopgpu.service" in installed, installed
    assert installed_version(box) == "0.2.0-1 ii"
    assert box.read_file("/usr/sbin/atopgpud.atop") == FOREIGN_DAEMON
    assert box.run(["readlink", "/usr/sbin/atopgpud"], check=True).stdout.strip() == f"{VENV}/bin/atopgpud"
    assert box.run(["readlink", ATOPGPU], check=True).stdout.strip() == f"{VENV}/bin/atopgpu"
    assert box.systemctl("is-enabled", "atopgpu.service", check=False).stdout.strip() == "disabled"
    assert not box.is_active("atopgpu.service")
    for unit in (SERVICE, "atopgpud.socket"):
        assert box.systemctl("is-enabled", unit, check=False).stdout.strip() == "enabled", unit
    assert box.systemctl("is-enabled", "atopgpud-tcp.socket", check=False).stdout.strip() == "disabled"
    assert box.is_active("atopgpud.socket")
    # started: on this host without a GPU the default reader (auto) fails, in one line, and is retried
    log = box.journal(SERVICE)
    assert "atopgpud: " in log and "Traceback" not in log, log
    assert box.run(["getent", "passwd", "_atopgpud"]).returncode == 0
    assert box.run(["test", "-f", f"{VENV}/lib/python3.11/site-packages/twisted/plugins/dropin.cache"]).returncode == 0
    print(installed_size(box, VENV))  # shown with -s


def test_on_the_simulator_set_in_the_conffile_it_serves_atop(box: Container, installed: str) -> None:
    """--reader sim written into /etc/default/atopgpud and a restart: the unit runs as _atopgpud,
    answers atopgpu on both endpoints, its start logs no warning (the plugin cache is there); Debian's
    atop.service with LOGOPTS="-k" logs both GPUs in every sample."""
    cursor = box.journal_cursor()
    box.write_file(CONFFILE, SIM_OPTS)
    box.systemctl("restart", SERVICE)
    box.wait_for(lambda: serves_both(box), timeout=120, what="atopgpud serving on both endpoints")
    state = show(box, SERVICE, "ActiveState", "SubState", "User", "MainPID")
    assert (state["ActiveState"], state["SubState"], state["User"]) == ("active", "running", "_atopgpud"), state
    owner = box.run(["ps", "-o", "user=", "-p", state["MainPID"]], check=True).stdout.strip()
    assert owner == "_atopgpud", owner
    log = box.journal(SERVICE, cursor=cursor)
    assert not re.search(r"#(warn|error|critical)\]|Unable to write|Traceback", log, re.I), log
    counts = atop_logs_gpus(box)
    assert len(counts) >= 3 and counts == [2] * len(counts), f"GPU lines per sample: {counts}"


def test_a_broken_conffile_fails_the_unit_in_one_line(box: Container, installed: str) -> None:
    """An option the daemon does not know: the unit fails (exit status 2), one line from atopgpud in
    the journal, no restart, no listener left behind; the good file back, it serves again."""
    good = box.read_file(CONFFILE)
    cursor = box.journal_cursor()
    box.write_file(CONFFILE, good.replace("--reader sim", "--reader sim --no-such-option"))
    box.systemctl("restart", SERVICE, check=False)
    box.wait_for(lambda: show(box, SERVICE, "ActiveState")["ActiveState"] == "failed", timeout=120,
                 what="the unit failed")
    time.sleep(6)  # past RestartSec=5: no restart may come
    state = show(box, SERVICE, "ActiveState", "Result", "ExecMainStatus", "NRestarts", "ExecMainPID")
    pid = state.pop("ExecMainPID")
    assert state == {"ActiveState": "failed", "Result": "exit-code", "ExecMainStatus": "2", "NRestarts": "0"}, state
    lines = [line for line in box.journal(SERVICE, cursor=cursor, output="short").splitlines()
             if f" atopgpud[{pid}]:" in line]
    assert len(lines) == 1 and "--no-such-option" in lines[0], lines
    assert box.run([ATOPGPU, "--connect", "tcp:127.0.0.1:59123", "--version", "1"]).returncode != 0
    box.write_file(CONFFILE, good)
    box.systemctl("reset-failed", SERVICE)
    box.systemctl("restart", SERVICE)
    box.wait_for(lambda: serves_both(box), timeout=120, what="serving again")


def test_upgrade_keeps_the_edited_conffile_and_serves_again(box: Container, built: Built,
                                                             tmp_path: Path) -> None:
    """A newer build installed over it: /etc/default/atopgpud as edited, the service restarted
    (a new main pid) and serving with it."""
    newer = repacked(built.deb, f"{field(built.deb, 'Version')}+test1", tmp_path)
    (box.root / "var/tmp/debs" / newer.name).write_bytes(newer.read_bytes())
    before = show(box, SERVICE, "MainPID")["MainPID"]
    edited = box.read_file(CONFFILE)
    apt(box, "install", f"/var/tmp/debs/{newer.name}")
    assert installed_version(box) == "0.2.0-1+test1 ii"
    assert box.read_file(CONFFILE) == edited
    box.wait_for(lambda: serves_both(box), timeout=120, what="serving after the upgrade")
    after = show(box, SERVICE, "MainPID")["MainPID"]
    assert after not in ("0", before), (before, after)
    assert box.is_active("atopgpud.socket")


def test_remove_stops_it_and_gives_atops_daemon_back(box: Container) -> None:
    """apt-get remove: the service and sockets stopped, their files gone, the conffile kept, the user
    kept, /usr/sbin/atopgpud atop's own again."""
    box.systemctl("enable", "--now", "atopgpud-tcp.socket", check=False)  # enabled by hand: stopped too
    apt(box, "remove", PACKAGE)
    box.systemctl("daemon-reload")
    for unit in (SERVICE, "atopgpud.socket", "atopgpud-tcp.socket"):
        assert not box.is_active(unit), unit
    assert box.run(["pgrep", "-f", f"{VENV}/bin/atopgpud"]).returncode == 1
    assert box.run(["test", "-e", "/lib/systemd/system/atopgpud.service"]).returncode != 0
    assert box.run(["test", "-e", VENV]).returncode != 0
    assert box.run(["test", "-f", CONFFILE]).returncode == 0
    assert box.read_file("/usr/sbin/atopgpud") == FOREIGN_DAEMON
    assert box.run(["dpkg-divert", "--list", "*atopgpud*"], check=True).stdout.strip() == ""


def test_purge_leaves_nothing(box: Container) -> None:
    """apt-get purge: no file named after it anywhere (the venv, dropin.cache, the conffile, units,
    their enablement links and state; the test's own .debs aside), no user or group, no unit
    systemd knows of."""
    apt(box, "purge", PACKAGE)
    assert_purged(box, LEFT_AFTER_PURGE)


def test_the_suite_is_debian_12() -> None:
    """The proof above is Debian 12's (docs/install.md says what was found on Debian 13)."""
    assert SUITE == "bookworm"


def test_lintian_has_no_errors_and_every_warning_is_in_the_docs(built: Built) -> None:
    """lintian on the .deb: no error; each warning tag left is named in docs/install.md with its reason."""
    tags = lintian_tags(lintian(built.deb))
    print("lintian:", sorted({f"{severity}: {tag}" for severity, tag in tags}))
    assert [tag for severity, tag in tags if severity == "E"] == []
    assert undocumented_warnings(tags) == [], "lintian warnings not named in docs/install.md"
