"""What the Debian package tests check in a booted container, on any suite (tests/test_debian_package.py
on Debian 12, tests/test_debian13_package.py on Debian 13).

`apt` runs apt-get inside with the host's network; `serves_both` asks atopgpu on both endpoints;
`atop_logs_gpus` has Debian's atop.service log with ``-k`` and counts the GPUs per sample;
`lintian_tags` and `undocumented_warnings` read lintian's output against docs/install.md;
`purge_leftovers` is what ``apt-get purge`` must not leave.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Sequence

from atop_output import parse_output
from debian_build import PACKAGE
from systemd_container import Container, not_possible

ROOT = Path(__file__).resolve().parents[1]
#: a tree to install the package in: what booting and testing need, and nothing the package depends on
BOOT_PACKAGES = ("systemd", "systemd-sysv", "dbus", "procps", "util-linux")
SERVICE = "atopgpud.service"
CONFFILE = "/etc/default/atopgpud"
ATOPGPU = "/usr/bin/atopgpu"
ENDPOINTS = (["--connect", "unix:@atopgpud_nvidia"], ["--connect", "tcp:127.0.0.1:59123", "--version", "1"])
#: the simulator, set in the conffile as a user would (no GPU in the container)
SIM_OPTS = 'ATOPGPUD_OPTS="--reader sim --listen unix:@atopgpud_nvidia --listen tcp:59123:interface=127.0.0.1"\n'


def apt(box: Container, *args: str, timeout: float = 600.0) -> subprocess.CompletedProcess[str]:
    """``apt-get -y ARGS`` inside, with the host's network; stdout and stderr together."""
    command = ["sh", "-c", 'DEBIAN_FRONTEND=noninteractive apt-get -y -q "$@" 2>&1', "-", *args]
    return box.run(command, host_network=True, timeout=timeout, check=True)


def apt_update(box: Container) -> None:
    """The host's resolv.conf copied in and ``apt-get update``; skips (CI: fails) when the mirror is not reached."""
    box.write_file("/etc/resolv.conf", Path("/etc/resolv.conf").read_text())
    try:
        apt(box, "update")
    except AssertionError as error:
        not_possible(f"apt-get update in the container failed (no Debian mirror?): {error}")


def copy_in(box: Container, deb: Path, directory: str = "/var/tmp/debs") -> str:
    """`deb` copied into `directory` inside; its path there."""
    (box.root / directory.lstrip("/")).mkdir(parents=True, exist_ok=True)
    (box.root / directory.lstrip("/") / deb.name).write_bytes(deb.read_bytes())
    return f"{directory}/{deb.name}"


def serves_both(box: Container) -> bool:
    """Whether /usr/bin/atopgpu is answered on both endpoints, with the simulator's two GPUs."""
    for endpoint in ENDPOINTS:
        done = box.run([ATOPGPU, *endpoint, "--json"], timeout=30)
        if done.returncode != 0 or len(json.loads(done.stdout)["gpus"]) != 2:
            return False
    return True


def show(box: Container, unit: str, *props: str) -> dict[str, str]:
    """``systemctl show -p PROPS UNIT`` as a dict."""
    out = box.systemctl("show", "-p", ",".join(props), unit).stdout
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def installed_version(box: Container) -> str:
    """The package's version and dpkg's status abbreviation (``ii`` when installed)."""
    return box.run(["dpkg-query", "-W", "-f", "${Version} ${db:Status-Abbrev}", PACKAGE], check=True).stdout.strip()


def installed_size(box: Container, venv: str) -> str:
    """dpkg's Installed-Size and ``du -sk`` of the venv after the postinst, in words."""
    size = box.run(["du", "-sk", venv], check=True).stdout.split()[0]
    declared = box.run(["dpkg-query", "-W", "-f", "${Installed-Size}", PACKAGE]).stdout
    return f"Installed-Size {declared} KiB; du -sk {venv} after the postinst: {size} KiB"


def atop_logs_gpus(box: Container, samples: int = 3) -> list[int]:
    """Debian's atop.service run with ``LOGOPTS="-k"`` until its log has `samples` samples, then stopped:
    the number of GPU lines (``atop -r LOG -P GPU``) in each sample."""
    box.write_file("/etc/default/atop", 'LOGOPTS="-k"\nLOGINTERVAL=2\nLOGGENERATIONS=28\nLOGPATH=/var/log/atop\n')
    box.systemctl("unmask", "atop.service")  # the harness masks it in every tree
    box.systemctl("restart", "atop.service")
    parsed = ["sh", "-c", "atop -r /var/log/atop/atop_$(date +%Y%m%d) -P GPU"]
    box.wait_for(lambda: len(parse_output(box.run(parsed).stdout)) >= samples, timeout=60,
                 what=f"{samples} samples in atop's log")
    out = box.run(parsed, check=True).stdout
    box.systemctl("stop", "atop.service")
    return [len(sample.gpus) for sample in parse_output(out)]


def lintian_tags(output: str) -> list[tuple[str, str]]:
    """lintian's (severity letter, tag) pairs in its `output`, as many as it gave."""
    return re.findall(r"^([EWIPXO]): \S+: (\S+)", output, re.M)


def lintian(deb: Path) -> str:
    """lintian's output (stdout and stderr) on `deb`, run here; AssertionError if lintian could not run."""
    done = subprocess.run(["lintian", "--allow-root", str(deb)], capture_output=True, text=True, timeout=600)
    # 1: it ran and found errors (the tags say which); anything else: it did not run
    assert done.returncode in (0, 1), f"lintian exited {done.returncode}:\n{done.stdout}{done.stderr}"
    return done.stdout + done.stderr


def undocumented_warnings(tags: Sequence[tuple[str, str]]) -> list[str]:
    """The warning tags not named (in backquotes) in docs/install.md."""
    install = (ROOT / "docs" / "install.md").read_text()
    return sorted({tag for severity, tag in tags if severity == "W" and f"`{tag}`" not in install})


def purge_leftovers(box: Container) -> list[str]:
    """Every path named after the daemon (or under /opt/venvs) left anywhere but /proc, /sys, /dev, the
    journal and the test's own .debs (/var/tmp/debs); sorted."""
    pruned = ["(", "-path", "/proc", "-o", "-path", "/sys", "-o", "-path", "/dev", "-o", "-path", "/var/log/journal",
              "-o", "-path", "/var/tmp/debs", ")", "-prune"]
    named = ["(", "-name", "*atopgpud*", "-o", "-path", "/opt/venvs*", ")", "-print"]
    return sorted(box.run(["find", "/", "-xdev", *pruned, "-o", *named], check=True).stdout.split())


def assert_purged(box: Container, left: Sequence[str] = ()) -> None:
    """After ``apt-get purge``: no file but `left`, no user or group, no unit systemd knows of, no package."""
    box.systemctl("daemon-reload")
    assert purge_leftovers(box) == sorted(left)
    assert box.run(["getent", "passwd", "_atopgpud"]).returncode == 2
    assert box.run(["getent", "group", "_atopgpud"]).returncode == 2
    units = box.systemctl("list-unit-files", "--no-legend", "atopgpud*", check=False).stdout
    assert units.strip() == "", units
    assert box.run(["dpkg-query", "-W", PACKAGE]).returncode != 0
