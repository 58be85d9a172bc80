"""etc/atopgpud.service under a real systemd: Debian 12 booted in systemd-nspawn (tests/systemd_container.py).

One container per module.  The shipped units run as shipped (the service and both
socket units) but for a drop-in adding ``--reader sim`` (there is no GPU in the
container; the default reader would fail), and a few more options where a test
says so.  Clients run inside: ``atopgpu`` over the abstract socket and over
TCP 127.0.0.1:59123, and Debian's atop 2.8.1 (``-k``, TCP, API 1).

Skips when not root or without debootstrap / systemd-nspawn / a Debian mirror;
with ``CI=true`` those are failures.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from importlib import resources
from typing import Any, Iterator

import pytest
from atop_output import parse_output
from metrics_text import samples_of, series
from systemd_container import UNITS, VENV, Container, container_fixture, exec_start_dropin

pytestmark = pytest.mark.timeout(1800)  # a cold cache runs debootstrap in the first test's setup

box = container_fixture()

SERVICE = "atopgpud.service"
#: the socket units, once etc/ ships them: started before the service
SOCKETS = [name for name in ("atopgpud.socket", "atopgpud-tcp.socket") if (UNITS / name).exists()]
ATOPGPU = f"{VENV}/bin/atopgpu"
ENDPOINTS = {
    "abstract": ["--connect", "unix:@atopgpud_nvidia"],
    "tcp": ["--connect", "tcp:127.0.0.1:59123", "--version", "1"],
}
#: a log line at warning level or worse (``[namespace#warn]``), or Twisted's level-less complaint
WARNING = re.compile(r"#(warn|error|critical)\]|Unable to write|error number \d+", re.I)


def demo_gpus() -> list[dict[str, Any]]:
    """The GPUs of the simulator's built-in scenario (what ``--reader sim`` serves)."""
    return json.loads(resources.files("atopgpud_tw.sim").joinpath("demo.json").read_text())["gpus"]


def query(box: Container, endpoint: str) -> dict[str, Any]:
    """``atopgpu --json`` run inside against one endpoint."""
    done = box.run([ATOPGPU, *ENDPOINTS[endpoint], "--json"], check=True, timeout=30)
    return json.loads(done.stdout)


def serving(box: Container) -> bool:
    """Whether the daemon answers on both endpoints with at least one sample of every GPU."""
    for endpoint in ENDPOINTS:
        done = box.run([ATOPGPU, *ENDPOINTS[endpoint], "--json"], timeout=30)
        if done.returncode != 0:
            return False
        gpus = json.loads(done.stdout)["gpus"]
        if not gpus or not all(gpu["samples"] >= 1 for gpu in gpus):
            return False
    return True


@pytest.fixture(scope="module")
def installed(box: Container) -> str:
    box.install_units([SERVICE, *SOCKETS], overrides={SERVICE: exec_start_dropin()})
    return SERVICE


@pytest.fixture
def stopped(box: Container, installed: str) -> Iterator[str]:
    """The service (and its sockets) stopped; the journal cursor of that moment."""
    box.systemctl("stop", installed, *SOCKETS)
    box.systemctl("reset-failed", installed, check=False)
    yield box.journal_cursor()
    box.systemctl("stop", installed, *SOCKETS, check=False)


@pytest.fixture
def started(box: Container, stopped: str) -> str:
    """The service freshly started and serving; the journal cursor from before the start."""
    if SOCKETS:
        box.systemctl("start", *SOCKETS)
    box.systemctl("start", SERVICE)
    box.wait_for(lambda: serving(box), timeout=30, what="atopgpud answering on both endpoints")
    return stopped


def test_service_is_active_and_serves_both_endpoints(box: Container, started: str) -> None:
    """Started under the shipped unit, it answers atopgpu on @atopgpud_nvidia and on TCP 59123."""
    assert box.is_active(SERVICE), box.systemctl("status", "--no-pager", SERVICE, check=False).stdout
    expected = [(gpu["busid"], gpu["name"].replace(" ", "_")) for gpu in demo_gpus()]
    for endpoint in ENDPOINTS:
        gpus = query(box, endpoint)["gpus"]
        assert [(gpu["busid"], gpu["type"]) for gpu in gpus] == expected, endpoint
    table = box.run([ATOPGPU], check=True).stdout
    assert all(busid in table for busid, _ in expected), table


def test_stop_takes_under_a_second(box: Container, started: str) -> None:
    """systemctl stop (SIGTERM) returns within a second and leaves the unit inactive, not failed."""
    began = time.monotonic()
    box.systemctl("stop", SERVICE)
    took = time.monotonic() - began
    print(f"systemctl stop took {took:.3f} s")  # shown with -rA
    assert took < 1.0, f"systemctl stop took {took:.2f} s"
    shown = box.systemctl("show", "-p", "ActiveState,Result", SERVICE).stdout
    state = dict(line.split("=", 1) for line in shown.split())
    assert state == {"ActiveState": "inactive", "Result": "success"}, state


def start_log(box: Container, cursor: str) -> str:
    """The service's journal since `cursor`, once twistd's start-up lines are in it."""
    box.wait_for(lambda: "reactor class" in box.journal(SERVICE, cursor=cursor), timeout=10, what="start-up logged")
    log = box.journal(SERVICE, cursor=cursor)
    assert "Started" in log, log
    return log


def test_clean_start_logs_no_traceback(box: Container, started: str) -> None:
    """A clean start's journal has no Python traceback."""
    log = start_log(box, started)
    assert "Traceback" not in log, log


def test_clean_start_logs_no_warning(box: Container, started: str) -> None:
    """A clean start's journal has no line at warning level or worse."""
    log = start_log(box, started)
    warnings = [line for line in log.splitlines() if WARNING.search(line)]
    assert warnings == [], log


def atop_run(box: Container, samples: int) -> Any:
    """Start ``atop -k -P GPU 1 SAMPLES`` inside (Debian's 2.8.1: one TCP connect at start)."""
    return box.popen(["atop", "-k", "-P", "GPU", "1", str(samples)])


def gpu_samples(output: str) -> list[int]:
    """How many GPU lines each of atop's samples has."""
    return [len(sample.gpus) for sample in parse_output(output)]


def test_atop_started_after_the_service_shows_gpus(box: Container, started: str) -> None:
    """atop 2.8.1 inside, started once the service serves: every sample has the simulated GPUs."""
    atop = atop_run(box, 2)
    out, err = atop.communicate(timeout=30)
    assert atop.returncode == 0, err
    assert gpu_samples(out) == [len(demo_gpus())] * 2, out + err


def test_atop_started_before_the_service_shows_gpus(box: Container, stopped: str) -> None:
    """atop started before the service (its sockets listening) still gets GPU lines."""
    assert SOCKETS, "etc/ ships no socket units"
    box.systemctl("start", *SOCKETS)
    atop = atop_run(box, 3)
    try:
        time.sleep(0.3)  # atop has made its one connection attempt
        box.systemctl("start", SERVICE)
        out, err = atop.communicate(timeout=30)
    finally:
        if atop.poll() is None:
            atop.kill()
            atop.communicate()
    counts = gpu_samples(out)
    assert len(counts) == 3, out + err
    # the first sample may come before the daemon's first poll; later ones must have every GPU
    assert counts[1:] == [len(demo_gpus())] * 2, f"GPU lines per sample: {counts}\n{out}{err}"


def test_commands_run_as_another_user(box: Container) -> None:
    """The harness: a user made with add_user runs commands and reads a file written for it."""
    box.add_user("atopuser", groups=["atopgpu-readers"])
    done = box.run(["id", "-nG"], user="atopuser", check=True)
    assert done.stdout.split() == ["atopuser", "atopgpu-readers"]
    box.write_file("/etc/atopgpud-test.txt", "hello\n", mode=0o640, owner="atopuser")
    assert box.run(["cat", "/etc/atopgpud-test.txt"], user="atopuser", check=True).stdout == "hello\n"
    assert box.run(["id", "-u"], user=61234, check=True).stdout.strip() == "61234"
    assert box.run(["cat", "/etc/atopgpud-test.txt"], user=61234).returncode != 0


def test_boot_timings_are_reported(box: Container) -> None:
    """The harness says how long the tree, the boot and the install took (shown with -rA)."""
    print("systemd container timings:", {name: round(value, 2) for name, value in box.timings.items()})
    assert {"tree", "ready", "install"} <= set(box.timings)


def show(box: Container, unit: str, *properties: str) -> dict[str, str]:
    """``systemctl show -p ...`` as a mapping."""
    out = box.systemctl("show", "-p", ",".join(properties), unit).stdout
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def test_ready_and_status_are_told_to_systemd(box: Container, started: str) -> None:
    """Type=notify: active once serving, with the daemon's status line."""
    state = show(box, SERVICE, "Type", "ActiveState", "SubState", "StatusText")
    assert state == {"Type": "notify", "ActiveState": "active", "SubState": "running",
                     "StatusText": "sim: 2 GPUs"}, state


def test_the_sockets_outlive_the_service_and_start_it_again(box: Container, started: str) -> None:
    """Stopping the service leaves its sockets listening (the daemon never shuts them down);
    the next connection starts it, and is answered."""
    box.systemctl("stop", SERVICE)
    for socket_unit in SOCKETS:
        assert show(box, socket_unit, "ActiveState", "SubState") == {"ActiveState": "active",
                                                                     "SubState": "listening"}, socket_unit
    gpus = query(box, "abstract")["gpus"]  # this connection starts the service
    assert len(gpus) == len(demo_gpus())
    assert box.is_active(SERVICE)
    journal = box.journal(SERVICE, cursor=started)
    assert "serving @atopgpud_nvidia (atopgpud.socket), passed by systemd" in journal, journal


def scrape_as(box: Container, user: str, name: str = "atopgpud_metrics") -> bool:
    """Whether `user` gets a metrics page over the abstract socket @NAME."""
    code = (
        "import socket,sys\n"
        "s=socket.socket(socket.AF_UNIX); s.settimeout(10)\n"
        f"s.connect(b'\\0{name}'); s.sendall(b'GET /metrics HTTP/1.0\\r\\n\\r\\n')\n"
        "sys.exit(0 if s.recv(12).startswith(b'HTTP/1.') else 3)\n"
    )
    return box.run(["python3", "-c", code], user=user, timeout=30).returncode == 0


def test_access_control_under_the_unit(box: Container, stopped: str) -> None:
    """--allow-uid and --allow-gid (a supplementary group too), on the atop socket and a UNIX
    metrics socket, admit and refuse as documented while running under the shipped unit."""
    for user, groups in (("atopuser", []), ("groupie", ["gpuview"]), ("outsider", [])):
        if box.run(["id", user]).returncode != 0:
            box.add_user(user, groups=groups)
    outsider = int(box.run(["id", "-u", "outsider"], check=True).stdout)
    dropin = exec_start_dropin(("--reader", "sim", "--allow-uid", "atopuser", "--allow-gid", "gpuview",
                                "--metrics", "unix:@atopgpud_metrics"))
    box.install_units([], overrides={SERVICE: dropin})
    try:
        box.systemctl("start", *SOCKETS, SERVICE)
        box.wait_for(lambda: box.run([ATOPGPU, "--json"]).returncode == 0, timeout=30, what="serving")
        asked = {user: box.run([ATOPGPU, "--json"], user=user, timeout=30).returncode == 0
                 for user in ("atopuser", "groupie", "outsider")}
        assert asked == {"atopuser": True, "groupie": True, "outsider": False}
        scraped = {user: scrape_as(box, user) for user in ("atopuser", "groupie", "outsider")}
        assert scraped == {"atopuser": True, "groupie": True, "outsider": False}
        log = box.journal(SERVICE, cursor=stopped)
        assert f"refusing a client with uid {outsider}: not in --allow-uid/--allow-gid" in log, log
        assert f"refusing a client with uid {outsider} on --metrics: not in" in log, log
        assert "uid 65534" not in log, log
    finally:
        box.systemctl("stop", SERVICE, *SOCKETS, check=False)
        box.install_units([], overrides={SERVICE: exec_start_dropin()})


def test_a_listener_conflict_fails_the_unit(box: Container, stopped: str) -> None:
    """Another process on @atopgpud_nvidia (no socket units): the start fails, the unit is failed
    with the daemon's one line in the journal, and Restart= applies."""
    holder = box.popen(["python3", "-c", "import socket,time\n"
                        "s=socket.socket(socket.AF_UNIX); s.bind(b'\\0atopgpud_nvidia'); s.listen()\n"
                        "print('held', flush=True); time.sleep(120)"])
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        started = box.systemctl("start", SERVICE, check=False)
        assert started.returncode != 0
        state = show(box, SERVICE, "Result", "ExecMainStatus", "Restart")
        assert state["Result"] == "exit-code" and state["ExecMainStatus"] == "1" and state["Restart"] == "on-failure"
        assert show(box, SERVICE, "ActiveState")["ActiveState"] in ("failed", "activating"), state
        log = box.journal(SERVICE, cursor=stopped)
        assert "atopgpud: cannot listen on unix:@atopgpud_nvidia: address already in use" in log, log
        assert "Traceback" not in log, log
    finally:
        os.killpg(holder.pid, signal.SIGTERM)
        holder.communicate(timeout=30)
        box.systemctl("stop", SERVICE, check=False)
        box.systemctl("reset-failed", SERVICE, check=False)


#: a second container, for the test that reboots it (the module's box is left as it is)
boot_box = container_fixture()

#: the simulated driver's kernel module is "loaded" when this file exists (the scenario's
#: driver_loaded_file); /run starts empty at every boot
DRIVER_FILE = "/run/sim-nvidia/loaded"
DRIVER_LOAD_AFTER = 10


def test_atop_started_at_boot_shows_the_gpus_of_a_driver_loaded_10_s_later(boot_box: Container) -> None:
    """The shipped units enabled, Debian's atop.service enabled (logging every 2 s, with -k as
    docs/atop.md says), the daemon on --reader auto over the real nvidia-ml-py on the simulated
    library, whose driver is loaded by a timer 10 s after boot.  After a reboot: the daemon
    waited for the driver (one line each way), atop started only once the driver was loaded,
    and every sample atop logged has both GPUs."""
    box = boot_box
    shim = box.run([f"{VENV}/bin/python", "-c", "import atopgpud_tw.sim as s, os; "
                    "print(os.path.join(os.path.dirname(s.__file__), 'shim'))"], check=True).stdout.strip()
    gpus = demo_gpus()
    box.write_file("/etc/atopgpud-boot.json", json.dumps({"gpus": gpus, "driver_loaded_file": DRIVER_FILE}))
    box.write_file("/etc/systemd/system/sim-nvidia-driver.service",
                   "[Unit]\nDescription=the simulated NVIDIA driver's kernel module, loaded\n"
                   f"[Service]\nType=oneshot\nExecStart=/bin/sh -c 'mkdir -p /run/sim-nvidia && touch {DRIVER_FILE}'\n")
    box.write_file("/etc/systemd/system/sim-nvidia-driver.timer",
                   f"[Timer]\nOnBootSec={DRIVER_LOAD_AFTER}s\nAccuracySec=100ms\n[Install]\nWantedBy=timers.target\n")
    box.write_file("/etc/default/atop", "LOGOPTS=\"-k\"\nLOGINTERVAL=2\nLOGGENERATIONS=28\nLOGPATH=/var/log/atop\n")
    # the shipped ExecStart= (--reader auto), with the simulated library beneath the real binding
    dropin = exec_start_dropin((), more=f"Environment=PYTHONPATH={shim} ATOPGPUD_SCENARIO=/etc/atopgpud-boot.json\n")
    box.install_units([SERVICE, *SOCKETS], overrides={SERVICE: dropin})
    box.systemctl("unmask", "atop.service")  # the harness masks it in the tree
    box.systemctl("enable", SERVICE, *SOCKETS, "sim-nvidia-driver.timer", "atop.service")
    box.reboot()

    def monotonic(unit: str, prop: str) -> int:
        return int(show(box, unit, prop)[prop])

    loaded_at = monotonic("sim-nvidia-driver.service", "ExecMainStartTimestampMonotonic")
    assert loaded_at > 0, "the driver timer did not run"
    assert box.is_active(SERVICE) and box.is_active("atop.service")
    assert monotonic(SERVICE, "ExecMainStartTimestampMonotonic") < loaded_at, "the daemon started after the driver"
    assert monotonic(SERVICE, "ActiveEnterTimestampMonotonic") >= loaded_at, "ready before the driver"
    assert monotonic("atop.service", "ExecMainStartTimestampMonotonic") >= loaded_at, "atop started before the driver"
    assert show(box, SERVICE, "StatusText") == {"StatusText": "nvml: 2 GPUs"}
    log = box.journal(SERVICE)
    assert log.count("nvmlInit answered NVML_ERROR_DRIVER_NOT_LOADED: the NVIDIA driver is not loaded") == 1, log
    assert log.count("nvml: the NVIDIA driver answers after ") == 1, log
    assert "Traceback" not in log, log
    raw = "/var/log/atop/atop_$(date +%Y%m%d)"
    box.wait_for(lambda: len(parse_output(box.run(["sh", "-c", f"atop -r {raw} -P GPU"]).stdout)) >= 3,
                 timeout=30, what="3 samples in atop's log")
    out = box.run(["sh", "-c", f"atop -r {raw} -P GPU"], check=True).stdout
    counts = gpu_samples(out)
    assert len(counts) >= 3 and counts == [len(gpus)] * len(counts), f"GPU lines per sample: {counts}\n{out}"


#: the scenario of the workloads test, written inside (its pids filled in by the test)
WORKLOAD_SCENARIO = "/etc/atopgpud-workloads.json"
WORKLOAD_METRICS = "tcp:9446:interface=127.0.0.1"


def scrape_inside(box: Container, port: int = 9446) -> str:
    """The metrics page, fetched inside."""
    code = f"import urllib.request;print(urllib.request.urlopen('http://127.0.0.1:{port}/metrics').read().decode())"
    return box.run(["python3", "-c", code], check=True, timeout=30).stdout


def test_gpu_processes_under_their_units_and_users(box: Container, stopped: str) -> None:
    """A service started with systemd-run --unit= (root) and a scope with systemd-run --uid= --scope
    (another user) are the simulator's GPU processes: under the shipped unit (ProtectProc=default)
    the page shows each under its unit and its user, with the scenario's figures, and atopgpu names them."""
    if box.run(["id", "gpuuser"]).returncode != 0:
        box.add_user("gpuuser")
    box.run(["systemd-run", "--unit=gpu-train", "--property=Type=exec", "sleep", "600"], check=True)
    scope = box.popen(["systemd-run", "--scope", "--unit=gpu-user-job", "--uid=gpuuser", "sleep", "600"])
    try:
        box.wait_for(lambda: box.run(["pgrep", "-u", "gpuuser", "-x", "sleep"]).returncode == 0, timeout=30,
                     what="the scope's process")
        service_pid = int(show(box, "gpu-train.service", "MainPID")["MainPID"])
        scope_pid = int(box.run(["pgrep", "-u", "gpuuser", "-x", "sleep"], check=True).stdout.split()[0])
        assert service_pid > 0 and scope_pid > 0
        # 10 MiB of memory per busy percent for both: each workload's memory / busy is exactly that
        gpu = dict(demo_gpus()[0], processes=[
            {"pid": service_pid, "memory_mib": 300, "sm_util": 30, "mem_util": 3},
            {"pid": scope_pid, "memory_mib": 100, "sm_util": 10, "mem_util": 1},
        ])
        box.write_file(WORKLOAD_SCENARIO, json.dumps({"gpus": [gpu]}))
        dropin = exec_start_dropin(("--reader", "sim", "--scenario", WORKLOAD_SCENARIO, "--interval", "0.5",
                                    "--metrics", WORKLOAD_METRICS, "--workloads", "unit", "--metrics-processes",
                                    "--metrics-process-context"))
        box.install_units([], overrides={SERVICE: dropin})
        box.systemctl("start", *SOCKETS, SERVICE)
        name = "atopgpud_workload_busy_percent_seconds_total"
        wanted = {"gpu-train.service": ("root", service_pid), "gpu-user-job.scope": ("gpuuser", scope_pid)}

        def shown() -> bool:
            done = box.run(["python3", "-c", "import urllib.request;urllib.request.urlopen("
                            "'http://127.0.0.1:9446/metrics')"], timeout=30)
            if done.returncode != 0:
                return False
            page = samples_of(scrape_inside(box))
            return all(series(page, name, kind="unit", workload=unit) for unit in wanted)

        box.wait_for(shown, timeout=30, what="both units on the page")
        page = samples_of(scrape_inside(box))
        for unit, (user, pid) in wanted.items():
            busy = series(page, name, kind="unit", workload=unit)
            own = series(page, "atopgpud_process_busy_percent_seconds_total", pid=str(pid), user=user,
                         comm="sleep", workload=f"unit:{unit}")
            assert busy == own and busy[0] > 0, (unit, busy, own)
            memory = series(page, "atopgpud_workload_memory_used_byte_seconds_total", kind="unit", workload=unit)
            assert abs(memory[0] / busy[0] - 10 * 1024 * 1024) < 1e-3, unit
        doc = json.loads(box.run([ATOPGPU, "--json", "--by", "user"], check=True, timeout=30).stdout)
        procs = {proc["pid"]: proc for proc in doc["gpus"][0]["processes"]}
        assert (procs[service_pid]["user"], procs[service_pid]["workload"]) == ("root", "unit:gpu-train.service")
        assert (procs[scope_pid]["user"], procs[scope_pid]["workload"]) == ("gpuuser", "unit:gpu-user-job.scope")
        assert {group["name"] for group in doc["groups"]} == {"root", "gpuuser"}
        log = box.journal(SERVICE, cursor=stopped)
        assert "Traceback" not in log, log
    finally:
        box.systemctl("stop", SERVICE, *SOCKETS, "gpu-train.service", "gpu-user-job.scope", check=False)
        os.killpg(scope.pid, signal.SIGTERM)
        scope.communicate(timeout=30)
        box.install_units([], overrides={SERVICE: exec_start_dropin()})


#: a simulated GPU whose samples call fails for a while: one warning, and its recovery (info)
FAULTING = {"gpus": [{"name": "NVIDIA A10", "busid": "00000000:65:00.0", "gpu_util": 40, "mem_util": 10,
                      "faults": [{"call": "nvmlDeviceGetSamples", "error": "NVML_ERROR_UNKNOWN",
                                  "from": 2, "until": 4}]}]}


def test_the_journal_has_each_lines_priority(box: Container, stopped: str) -> None:
    """Under the unit, each line carries its syslog priority: ``journalctl -p warning`` shows
    the warnings and nothing else, and no line has a second timestamp."""
    box.write_file("/etc/atopgpud-faulting.json", json.dumps(FAULTING))
    box.install_units([], overrides={SERVICE: exec_start_dropin(
        ("--reader", "sim", "--scenario", "/etc/atopgpud-faulting.json"))})
    try:
        box.systemctl("start", SERVICE)
        box.wait_for(lambda: "NVML_ERROR_UNKNOWN" in box.journal(SERVICE, cursor=stopped), timeout=30,
                     what="the samples call's failure logged")
        box.run(["journalctl", "--sync"], timeout=30)
        # the whole boot's (journalctl 252 with -p and --after-cursor shows nothing at all)
        shown = box.run(["journalctl", "-b", "--no-pager", "-o", "cat", "-u", SERVICE, "-p", "warning"],
                        check=True).stdout.splitlines()
        ours = [line for line in shown if line.startswith("[")]
        assert any("nvmlDeviceGetSamples: NVML_ERROR_UNKNOWN" in line for line in ours), shown
        assert all(WARNING.search(line) for line in ours), shown
        everything = box.journal(SERVICE, cursor=stopped, output="json")
        priorities = {}
        for line in everything.splitlines():
            entry = json.loads(line)
            if str(entry.get("MESSAGE", "")).startswith("["):
                priorities[entry["MESSAGE"]] = int(entry["PRIORITY"])
        assert any(p == 6 and "#info]" in m for m, p in priorities.items()), priorities
        assert all((p <= 4) == bool(WARNING.search(m)) for m, p in priorities.items()), priorities
        assert not any(re.match(r"\[?\d{4}-\d\d-\d\dT", m) for m in priorities), priorities
    finally:
        box.systemctl("stop", SERVICE, check=False)
        box.install_units([], overrides={SERVICE: exec_start_dropin()})
