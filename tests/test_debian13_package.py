"""The Debian package on Debian 13 (trixie): built there, checked by lintian there, installed and purged there.

A ``.deb`` built on Debian 12 has a Python 3.11 venv and cannot install on Debian 13,
so the same debian/ is built inside Debian 13, by its own debhelper and dh-virtualenv.
Two containers boot from debootstrapped trixie trees (tests/systemd_container.py):

* the build one: systemd and Debian's build environment in its cached tree
  (build-essential, debhelper, dh-virtualenv, python3-venv, lintian), so no run
  apt-gets them.  A clean copy of the checkout (tests/debian_build.py) is built
  there with ``dpkg-buildpackage -us -uc -b``; dh_virtualenv's pip fetches the
  pinned dependencies from PyPI over the host's network, trusting the host's
  certificate store (the container has none: its pip is given the host's bundle
  as ``PIP_CERT``, nothing of the host's pip configuration).  lintian runs there.
* the install one: systemd and nothing the package depends on, as on Debian 12.
  ``apt-get install ./the.deb`` must bring python3.13 and, recommended, atop.

Then, as on Debian 12 (tests/debian_checks.py): the simulator set in the
conffile serves atopgpu on both endpoints, Debian 13's atop.service with
``LOGOPTS="-k"`` logs both GPUs, and ``apt-get purge`` leaves nothing.

Skips when not root, or when a trixie tree, PyPI or the mirror cannot be reached;
with ``CI=true`` those but the first are failures.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import shlex
import subprocess
import threading
import time
from pathlib import Path
from typing import Iterator

import pytest
from debian_build import PACKAGE, Built, copy_source, field
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
    lintian_tags,
    serves_both,
    show,
    undocumented_warnings,
)
from systemd_container import VENV, Container, Unavailable, booted, cached_tree, not_possible, require

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(2400)]

SUITE = "trixie"
#: Debian 13's Python, which the package built there runs on
PYTHON = "python3.13"
#: the build tree: booting, and what building and checking the package need, cached with the tree
#: (build-essential: dpkg-checkbuilddeps requires it of every build; perl-openssl-defaults: lintian's
#: libnet-ssleay-perl depends on the virtual perl-openssl-abi-3 it provides, which debootstrap cannot resolve)
BUILD_PACKAGES = (*BOOT_PACKAGES, "build-essential", "debhelper", "dh-virtualenv", "python3-venv", "lintian",
                  "perl-openssl-defaults")
#: the host's certificate store (Debian's ca-certificates, with the CAs update-ca-certificates adds):
#: what the host's pip trusts to reach PyPI; the build container has no store of its own
HOST_CA = Path("/etc/ssl/certs/ca-certificates.crt")
SOURCE = "/var/tmp/build/atopgpud-tw"


@dataclasses.dataclass
class Built13(Built):
    """The package built in Debian 13, with lintian's output there."""

    lintian: str = ""
    #: lintian's exit status: 0 when it ran and found no error
    lintian_status: int = -1


def build_inside(box: Container, dest: Path) -> Built13:
    """A clean copy of the checkout built inside `box` with ``dpkg-buildpackage -us -uc -b`` (pip over the
    host's network with the host's CAs), lintian run on the .deb there; the .deb copied to `dest`."""
    copy_source(box.root / SOURCE.lstrip("/"))
    box.write_file("/etc/resolv.conf", Path("/etc/resolv.conf").read_text())
    box.write_file("/var/tmp/host-ca.crt", HOST_CA.read_text())
    began = time.monotonic()
    done = box.run(["sh", "-c", f"cd {SOURCE} && PIP_CERT=/var/tmp/host-ca.crt dpkg-buildpackage -us -uc -b 2>&1"],
                   host_network=True, timeout=1200)
    seconds = time.monotonic() - began
    log = done.stdout
    (dest / "build.log").write_text(log)
    if done.returncode != 0 and re.search(r"Could not fetch URL|SSLError|Failed to establish|No matching distribution",
                                          log):
        not_possible(f"pip in the Debian 13 container cannot reach PyPI:\n{log[-3000:]}")
    assert done.returncode == 0, f"dpkg-buildpackage exited {done.returncode} in Debian 13:\n{log[-6000:]}"
    debs = sorted((box.root / Path(SOURCE).parent.relative_to("/")).glob(f"{PACKAGE}_*.deb"))
    assert len(debs) == 1, f"{debs} built:\n{log[-3000:]}"
    inside = f"{Path(SOURCE).parent}/{debs[0].name}"
    checked = box.run(["sh", "-c", f"lintian --version && lintian --allow-root {shlex.quote(inside)} 2>&1"],
                      timeout=600)
    deb = dest / debs[0].name
    deb.write_bytes(debs[0].read_bytes())
    return Built13(deb, log, seconds, checked.stdout, checked.returncode)


def make_install_tree() -> None:
    """The install tree in the cache, if it can be made (`box` says why not)."""
    with contextlib.suppress(Unavailable):
        cached_tree(BOOT_PACKAGES, SUITE)


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Built13:
    require()
    if not HOST_CA.is_file():
        not_possible(f"no {HOST_CA} on the host for the build container's pip to trust "
                     "(apt-get install ca-certificates)")
    began = time.monotonic()
    # the install tree made (when not cached) while the build tree is and the package builds; `box`
    # boots it (an error there is `box`'s: cached_tree tries again and says why)
    prefetch = threading.Thread(target=make_install_tree)
    prefetch.start()
    try:
        with booted(tmp_path_factory.mktemp("nspawn-build"), install=False, suite=SUITE,
                    packages=BUILD_PACKAGES) as box:
            package = build_inside(box, tmp_path_factory.mktemp("deb13"))
            timings = {**box.timings, "build": package.seconds}
    finally:
        prefetch.join()
    timings["all"] = time.monotonic() - began
    print(f"Debian 13 build: {package.deb.name} {package.deb.stat().st_size} bytes; "
          f"timings {({key: round(value, 1) for key, value in timings.items()})}")
    return package


@pytest.fixture(scope="module")
def box(built: Built13, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Container]:
    """Debian 13 with systemd and nothing the package needs, the package copied in and apt's lists fetched."""
    with booted(tmp_path_factory.mktemp("nspawn"), install=False, suite=SUITE, packages=BOOT_PACKAGES) as box:
        began = time.monotonic()
        copy_in(box, built.deb)
        apt_update(box)
        box.timings["apt-update"] = time.monotonic() - began
        yield box
        print("Debian 13 container timings:", {key: round(value, 1) for key, value in box.timings.items()})


@pytest.fixture(scope="module")
def installed(box: Container, built: Built13) -> str:
    """``apt-get install ./the.deb``: what apt said."""
    for name in (PYTHON, "atop"):
        assert box.run(["dpkg-query", "-W", name]).returncode != 0, f"{name} already in the tree"
    began = time.monotonic()
    out = apt(box, "install", f"/var/tmp/debs/{built.deb.name}").stdout
    box.timings["apt-install"] = time.monotonic() - began
    return out


def test_it_builds_in_debian_13_for_its_python(built: Built13) -> None:
    """The package built in Debian 13 depends on python3.13, its venv is Python 3.13's, its units are in
    /usr/lib/systemd/system (Debian 13's debhelper)."""
    assert re.search(rf"(^|, ){re.escape(PYTHON)}(,|$)", field(built.deb, "Depends")), field(built.deb, "Depends")
    assert field(built.deb, "Version") == "0.2.0-1"
    listing = subprocess.run(["dpkg-deb", "-c", str(built.deb)], capture_output=True, text=True, check=True).stdout
    assert f"{VENV}/lib/{PYTHON}/site-packages/atopgpud_tw/" in listing
    for unit in ("atopgpud.service", "atopgpud.socket", "atopgpud-tcp.socket"):
        assert f"./usr/lib/systemd/system/{unit}\n" in listing, listing[-3000:]
    assert not re.search(r" \./lib/", listing), listing[-3000:]  # /lib is an alias of /usr/lib in Debian 13
    print(f"Installed-Size (control) {field(built.deb, 'Installed-Size')} KiB")


def test_lintian_in_debian_13_has_no_errors_and_every_warning_is_in_the_docs(built: Built13) -> None:
    """Debian 13's lintian on the .deb: no error; each warning tag left is named in docs/install.md."""
    tags = lintian_tags(built.lintian)
    print(built.lintian.splitlines()[0], "in Debian 13:", sorted({f"{severity}: {tag}" for severity, tag in tags}))
    assert [tag for severity, tag in tags if severity == "E"] == [], built.lintian
    assert built.lintian_status == 0, built.lintian
    assert undocumented_warnings(tags) == [], f"lintian warnings not named in docs/install.md:\n{built.lintian}"


def test_install_pulls_python_313_and_atop(box: Container, installed: str) -> None:
    """apt brings python3.13 and atop; the units are enabled and the socket listening; the user exists;
    the links point into the venv, which has Twisted's plugin cache."""
    for name in (PYTHON, "atop"):
        assert box.run(["dpkg-query", "-W", name]).returncode == 0, f"apt did not install {name}:\n{installed}"
    assert installed_version(box) == "0.2.0-1 ii"
    assert box.run(["readlink", "/usr/sbin/atopgpud"], check=True).stdout.strip() == f"{VENV}/bin/atopgpud"
    assert box.run(["readlink", ATOPGPU], check=True).stdout.strip() == f"{VENV}/bin/atopgpu"
    for unit in (SERVICE, "atopgpud.socket"):
        assert box.systemctl("is-enabled", unit, check=False).stdout.strip() == "enabled", unit
    assert box.is_active("atopgpud.socket")
    assert box.run(["getent", "passwd", "_atopgpud"]).returncode == 0
    plugins = f"{VENV}/lib/{PYTHON}/site-packages/twisted/plugins/dropin.cache"
    assert box.run(["test", "-f", plugins]).returncode == 0
    print(installed_size(box, VENV))  # shown with -s


def test_on_the_simulator_it_serves_debian_13s_atop(box: Container, installed: str) -> None:
    """--reader sim in /etc/default/atopgpud and a restart: the unit runs as _atopgpud and answers
    atopgpu on both endpoints; Debian 13's atop.service with LOGOPTS="-k" logs both GPUs in every sample."""
    cursor = box.journal_cursor()
    box.write_file(CONFFILE, SIM_OPTS)
    box.systemctl("restart", SERVICE)
    box.wait_for(lambda: serves_both(box), timeout=120, what="atopgpud serving on both endpoints")
    state = show(box, SERVICE, "ActiveState", "SubState", "User")
    assert (state["ActiveState"], state["SubState"], state["User"]) == ("active", "running", "_atopgpud"), state
    log = box.journal(SERVICE, cursor=cursor)
    assert not re.search(r"#(warn|error|critical)\]|Unable to write|Traceback", log, re.I), log
    print("Debian 13's atop:", box.run(["atop", "-V"]).stdout.strip())
    counts = atop_logs_gpus(box)
    assert len(counts) >= 3 and counts == [2] * len(counts), f"GPU lines per sample: {counts}"


def test_purge_leaves_nothing(box: Container, installed: str) -> None:
    """apt-get purge: no file named after it anywhere, no user or group, no unit systemd knows of."""
    apt(box, "purge", PACKAGE)
    assert_purged(box)
