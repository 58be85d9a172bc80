"""``atopgpu doctor`` on booted hosts, and the unit's address filter opened for a remote Prometheus.

One Debian 12 container (tests/systemd_container.py) with Debian's atop 2.8.1,
made healthy and then broken in three ways.  The daemon runs the shipped unit
with a drop-in: ``--reader nvml`` over the real nvidia-ml-py on the simulated
library (``atopgpud_tw/sim/shim``), which doctor loads too; each broken host
says which of doctor's lines fail, and its exit status.  The texts doctor printed
are written to ``$ATOPGPUD_DOCTOR_RECORD`` when that is set.

Skips when not root or without debootstrap / systemd-nspawn / a Debian mirror;
with ``CI=true`` those are failures.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

import pytest
from systemd_container import UNITS, VENV, Container, container_fixture, exec_start_dropin, not_possible

pytestmark = pytest.mark.timeout(1800)  # a cold cache runs debootstrap in the first test's setup

#: cgroup v2 and the bpf() system call (nspawn's filter leaves it out) give the container systemd's IP firewall
box = container_fixture(nspawn_environment={"SYSTEMD_NSPAWN_UNIFIED_HIERARCHY": "1"},
                        nspawn_options=["--system-call-filter=bpf", "--capability=CAP_BPF,CAP_NET_ADMIN"])

SERVICE = "atopgpud.service"
UNIX, TCP = "unix:@atopgpud_nvidia", "tcp:127.0.0.1:59123"
SCENARIO = "/etc/atopgpud-doctor.json"
#: 40 GPUs: more than atop's 32
MANY = {"gpus": [{"busid": f"00000000:{16 + i:02X}:00.0"} for i in range(40)]}
DEMO = {"gpus": [{"busid": "00000000:17:00.0"}, {"busid": "00000000:65:00.0"}]}
ATOP_DEFAULTS = 'LOGOPTS="{}"\nLOGINTERVAL=600\nLOGGENERATIONS=28\nLOGPATH=/var/log/atop\n'


@pytest.fixture(scope="module")
def shim(box: Container) -> str:
    """The folder that puts the simulated pynvml first on PYTHONPATH, inside; atop.service unmasked."""
    box.systemctl("unmask", "atop.service")  # the harness masks it in the tree
    return box.run([f"{VENV}/bin/python", "-c", "import atopgpud_tw.sim as s; print(s.SHIM)"],
                   check=True).stdout.strip()


def host(box: Container, shim: str, *, gpus: dict[str, Any] = DEMO, extra: tuple[str, ...] = ("--reader", "nvml"),
         unit: str = "", logopts: str = "-k", atop_running: bool = True) -> None:
    """The daemon (re)started under the shipped unit with `extra` options and `unit` lines, over `gpus`;
    /etc/default/atop with `logopts`; atop.service running or stopped."""
    box.write_file(SCENARIO, json.dumps(gpus))
    box.write_file("/etc/default/atop", ATOP_DEFAULTS.format(logopts))
    more = f"Environment=PYTHONPATH={shim} ATOPGPUD_SCENARIO={SCENARIO}\n{unit}"
    box.systemctl("stop", "atop.service")
    box.install_units([SERVICE], overrides={SERVICE: exec_start_dropin(extra, more=more)})
    box.systemctl("restart", SERVICE)
    if atop_running:
        box.systemctl("start", "atop.service")


def doctor(box: Container, shim: str | None, name: str, user: str | None = None) -> dict[str, str]:
    """Run ``atopgpu doctor`` inside (with NVML over the simulator, unless `shim` is None), as text and as
    JSON: each check's status by name, and ``exit``; the text goes to the record as `name`."""
    env = ["env", f"PYTHONPATH={shim}", f"ATOPGPUD_SCENARIO={SCENARIO}"] if shim else []
    text = box.run([*env, "atopgpu", "doctor"], user=user, timeout=60)
    done = box.run([*env, "atopgpu", "doctor", "--json"], user=user, timeout=60)
    report = json.loads(done.stdout)
    assert text.returncode == done.returncode == (0 if report["ok"] else 1), (text, done)
    assert len(text.stdout.splitlines()) == len(report["checks"]), text.stdout
    record = os.environ.get("ATOPGPUD_DOCTOR_RECORD")
    if record:
        with open(record, "a", encoding="utf-8") as out:
            out.write(f"## {name} (exit status {text.returncode})\n\n$ atopgpu doctor\n{text.stdout}\n")
    return {"exit": str(done.returncode), **{c["name"]: c["status"] for c in report["checks"]},
            **{f"{c['name']} text": c["text"] + " / " + c["fix"] for c in report["checks"]}}


def statuses(found: dict[str, str]) -> dict[str, str]:
    return {name: status for name, status in found.items() if not name.endswith(" text")}


def test_a_healthy_host_passes(box: Container, shim: str) -> None:
    """Both sockets answer, atop.service runs atop -k, NVML loads, 2 GPUs, /proc as shipped: exit 0."""
    host(box, shim)
    found = doctor(box, shim, "a healthy host")
    assert statuses(found) == {"exit": "0", UNIX: "OK", TCP: "OK", "access": "OK", "atop": "OK",
                               "atop.service": "OK", "NVML": "OK", "devices": "OK", "MIG": "OK", "/proc": "OK"}, found
    pid = box.systemctl("show", SERVICE, "-p", "MainPID", "--value").stdout.strip()
    uid = box.run(["stat", "-c", "%u", f"/proc/{pid}"], check=True).stdout.strip()  # the dynamic user's
    assert uid != "0" and f"answers as uid {uid}:" in found[f"{UNIX} text"], (uid, found)
    assert "atop 2.8.1" in found["atop text"] and "999.99.99-sim" in found["NVML text"]
    assert "-k" in found["atop.service text"]


def test_daemon_on_another_socket_and_atop_service_without_k(box: Container, shim: str) -> None:
    """The daemon listens on @atopgpud_elsewhere only and atop.service (stopped) has Debian's LOGOPTS="":
    atop 2.8.1's TCP port is not served, and atop.service would not ask."""
    host(box, shim, unit='Environment="ATOPGPUD_OPTS=--listen unix:@atopgpud_elsewhere"\n', logopts="",
         atop_running=False)
    found = doctor(box, shim, "broken host 1: the daemon on another socket, atop.service without -k")
    assert statuses(found) == {"exit": "1", UNIX: "--", TCP: "FAIL", "access": "OK", "atop": "OK",
                               "atop.service": "FAIL", "NVML": "OK", "devices": "OK", "MIG": "OK", "/proc": "OK"}, found
    assert "listens on unix:@atopgpud_elsewhere" in found[f"{TCP} text"]
    assert "--listen tcp:59123:interface=127.0.0.1" in found[f"{TCP} text"]
    assert "LOGOPTS" in found["atop.service text"]


def test_a_refused_user_40_gpus_and_a_hidden_proc(box: Container, shim: str) -> None:
    """--allow-uid nobody, ProtectProc=invisible and 40 GPUs, doctor run by another user: the abstract
    socket refuses them (atop 2.8.1 does not use it), atop shows 32 of 40, the daemon sees only its own
    processes."""
    box.run(["sh", "-c", "id doctoruser || useradd --system --no-create-home doctoruser"], check=True)
    host(box, shim, gpus=MANY, extra=("--reader", "nvml", "--allow-uid", "nobody"), unit="ProtectProc=invisible\n")
    found = doctor(box, shim, "broken host 2: a refused user, 40 GPUs, ProtectProc=invisible", user="doctoruser")
    assert statuses(found) == {"exit": "1", UNIX: "--", TCP: "OK", "access": "OK", "atop": "OK",
                               "atop.service": "OK", "NVML": "OK", "devices": "FAIL", "MIG": "OK",
                               "/proc": "FAIL"}, found
    assert "refused" in found[f"{UNIX} text"] and "TCP" in found["access text"]
    assert "40 devices" in found["devices text"] and "hidepid=invisible" in found["/proc text"]


def test_no_atop_no_nvml_and_proc_subset_pid(box: Container, shim: str) -> None:
    """atop removed (its unit masked, as removing the package leaves it), the daemon on the simulator with
    ProcSubset=pid, doctor without the simulated library: no atop, no NVML, no /proc/driver."""
    host(box, shim, extra=("--reader", "sim"), unit="ProcSubset=pid\n", atop_running=False)
    box.run(["mv", "/usr/bin/atop", "/usr/bin/atop.away"], check=True)
    box.systemctl("mask", "atop.service")
    try:
        found = doctor(box, None, "broken host 3: no atop, no NVML, ProcSubset=pid")
    finally:
        box.run(["mv", "/usr/bin/atop.away", "/usr/bin/atop"], check=True)
        box.systemctl("unmask", "atop.service")
    assert statuses(found) == {"exit": "1", UNIX: "OK", TCP: "OK", "access": "OK", "atop": "FAIL",
                               "atop.service": "--", "NVML": "FAIL", "devices": "OK", "MIG": "--",
                               "/proc": "FAIL"}, found
    assert "libnvidia-ml.so.1) is not installed" in found["NVML text"] and "subset=pid" in found["/proc text"]


def documented_dropin() -> str:
    """The [Service] lines of the drop-in docs/metrics.md gives for a Prometheus on another host."""
    page = (UNITS / ".." / "docs" / "metrics.md").read_text()
    scraping = page.split("## Scraping", 1)[1].split("\n## ", 1)[0]
    return re.search(r"```ini\n\[Service\]\n(.*?)```", scraping, re.S)[1]  # type: ignore[index]


#: an old-style alias (SIOCSIFADDR on lo:N, as ifconfig does) gives the container's loopback an address
#: outside localhost, for the listener and for a scraper of an allowed and of another address
ADD_ADDRESS = ("import fcntl, socket, struct, sys; fcntl.ioctl(socket.socket(), 0x8916, struct.pack('16sH2s4s8s', "
               "sys.argv[1].encode(), socket.AF_INET, bytes(2), socket.inet_aton(sys.argv[2]), bytes(8)))")
#: a scrape of --metrics at 192.0.2.10 from the source address argv[1]: exit 0 once the page's status line came
SCRAPE = ("import socket, sys; s = socket.create_connection(('192.0.2.10', 9445), timeout=float(sys.argv[2]), "
          "source_address=(sys.argv[1], 0)); s.sendall(b'GET /metrics HTTP/1.0\\r\\n\\r\\n'); "
          "sys.exit(0 if s.recv(12) == b'HTTP/1.0 200' else 3)")


def test_the_documented_dropin_lets_a_remote_prometheus_scrape(box: Container, shim: str) -> None:
    """The container boots with a BPF firewall (cgroup v2, bpf() allowed); its loopback gets 192.0.2.10
    (the listener and the Prometheus of docs/metrics.md's drop-in) and 192.0.2.99 (someone else).  With
    the documented drop-in installed, systemctl show lists its addresses besides localhost's, the scrape
    from 192.0.2.10 gets the page, and one from 192.0.2.99 is dropped; the shipped unit alone drops the
    one from 192.0.2.10 too."""
    for label, address in (("lo:1", "192.0.2.10"), ("lo:2", "192.0.2.99")):
        box.run(["python3", "-c", ADD_ADDRESS, label, address], check=True)

    def scraped(source: str, wait: float) -> bool:
        done = box.run(["python3", "-c", SCRAPE, source, str(wait)], timeout=wait + 30)
        assert done.returncode in (0, 1), done  # 1: no connection (a dropped SYN times out)
        return done.returncode == 0

    metrics = ("--reader", "sim", "--metrics", "tcp:9445:interface=0.0.0.0")
    host(box, shim, extra=metrics, unit=documented_dropin(), atop_running=False)
    allowed = box.systemctl("show", SERVICE, "-p", "IPAddressAllow", "--value").stdout.split()
    assert {"192.0.2.10/32", "198.51.100.0/24", "127.0.0.0/8", "::1/128"} <= set(allowed), allowed
    assert scraped("192.0.2.10", 60)
    if scraped("192.0.2.99", 5):
        not_possible("no BPF firewall in the container (cgroup v1 only, or no bpf()): every address gets through")
    host(box, shim, extra=metrics, atop_running=False)  # the shipped unit alone
    assert not scraped("192.0.2.10", 5)
