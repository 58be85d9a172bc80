"""Workloads through the installed daemon: real processes as the simulator's GPU processes.

The scenario's pids are this test's own children, so the daemon reads their
/proc as it would a real GPU process's; cgroup folders made by the test lay
them out as a container, a Kubernetes pod and a Slurm job where the machine
allows it (root, a writable hierarchy), and the test is skipped otherwise.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any, Iterator

import pytest
from cgroup_layouts import Placed, writable_hierarchy
from daemon import free_port, run_daemon
from metrics_text import samples_of, series

from atopgpud_tw import codec
from atopgpud_tw.atopgpu import cli

pytestmark = pytest.mark.e2e

INTERVAL = 0.2
MIB = 1024 * 1024
#: an absent pid (no such process): its workload is unknown
ABSENT = 4_000_000


def _scrape(port: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        return samples_of(response.read().decode())


def _card(processes: list[dict[str, Any]]) -> dict[str, Any]:
    return {"gpus": [{"name": "NVIDIA A10", "busid": "00000000:65:00.0", "memory_total_mib": 24000,
                      "memory_used_mib": 1000, "gpu_util": 60, "mem_util": 10, "processes": processes}]}


@pytest.fixture
def sleepers() -> Iterator[list[int]]:
    procs = [subprocess.Popen(["sleep", "600"], stdin=subprocess.DEVNULL) for _ in range(2)]
    yield [proc.pid for proc in procs]
    for proc in procs:
        proc.kill()
        proc.wait(timeout=10)


def _wait_for(port: int, check: Any, timeout: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        page = _scrape(port)
        if check(page) or time.monotonic() > deadline:
            return page
        time.sleep(0.1)


def test_users_workloads_and_sums_across_an_exit(tmp_path, sleepers, capsys):
    """Two real processes of this user, one ending at 1.5 s, and an absent pid: the user's series
    sum both, the ended one included, never going down; atopgpu names the user and workload."""
    me = pwd.getpwuid(os.getuid()).pw_name
    first, second = sleepers
    # memory / busy is 5 MiB per percent for both, so the workload's ratio is the scenario's exactly
    scenario = _card([
        {"pid": first, "memory_mib": 100, "sm_util": 20, "mem_util": 4},
        {"pid": second, "memory_mib": 50, "sm_util": 10, "mem_util": 2, "stop": 1.5},
        {"pid": ABSENT, "memory_mib": 10, "sm_util": 2, "mem_util": 1},
    ])
    port = free_port()
    args = ["--interval", str(INTERVAL), "--metrics", f"tcp:{port}:interface=127.0.0.1", "--workloads", "user",
            "--metrics-processes", "--metrics-process-context"]
    with run_daemon(tmp_path, args, scenario=scenario) as daemon:
        daemon.wait_samples(3)
        name = "atopgpud_workload_busy_percent_seconds_total"
        early = _wait_for(port, lambda page: series(page, name, kind="user", workload=me))
        energy = "atopgpud_workload_energy_joules_total"
        # the energy share needs two health readings, a page or more apart
        late = _wait_for(port, lambda page: series(page, "atopgpud_workload_processes_ended_total", kind="user",
                                                    workload=me) == [1.0]
                         and series(page, energy, kind="user", workload=me) > [0.0])
        assert series(late, "atopgpud_workload_processes_total", kind="user", workload=me) == [2.0]
        busy = series(late, name, kind="user", workload=me)[0]
        memory = series(late, "atopgpud_workload_memory_used_byte_seconds_total", kind="user", workload=me)[0]
        assert busy >= series(early, name, kind="user", workload=me)[0] > 0
        assert memory / busy == pytest.approx(5 * MIB)
        # the active process's own series, labelled with its user and comm, is within the workload's
        own = series(late, "atopgpud_process_busy_percent_seconds_total", pid=str(first), user=me, comm="sleep")
        assert own and 0 < own[0] < busy
        assert series(late, name, kind="unknown", workload="unknown")
        # the card's energy shared out by busy time: some to each, never more than the card used
        shares = series(late, energy)
        card = series(late, "atopgpud_gpu_energy_joules_total")
        assert series(late, energy, kind="user", workload=me)[0] > 0
        assert sum(shares) <= card[0]
        promtool = shutil.which("promtool")
        if promtool is not None:  # the page with the workload and labelled process series is well formed
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
                checked = subprocess.run([promtool, "check", "metrics"], input=response.read(), capture_output=True,
                                         timeout=30)
            assert checked.returncode == 0, checked.stdout + checked.stderr
        # atopgpu: the user and workload of each process, and --by user
        status = cli.main(["--connect", f"unix:@{daemon.name}", "--json", "--by", "user"])
        out, err = capsys.readouterr()
        assert (status, err) == (0, "")
        doc = json.loads(out)
        procs = {proc["pid"]: proc for proc in doc["gpus"][0]["processes"]}
        assert (procs[first]["user"], procs[first]["uid"], procs[first]["command"]) == (me, os.getuid(), "sleep")
        assert procs[first]["workload"] not in (None, "unknown")
        assert procs[ABSENT]["workload"] == "unknown" and procs[ABSENT]["user"] is None
        groups = {group["name"]: group for group in doc["groups"]}
        assert groups[me]["processes"] == 1 and groups[me]["gpu_busy_avg"] == pytest.approx(20, abs=0.01)
        assert groups["-"]["gpu_busy_avg"] == pytest.approx(2, abs=0.01)


def test_p_reply_lists_active_and_exited_processes(tmp_path, sleepers):
    """The P reply: one line per process, the one that ended among them; T and S answered as before."""
    first, second = sleepers
    scenario = _card([{"pid": first, "sm_util": 20}, {"pid": second, "sm_util": 10, "stop": 0.6}])
    with run_daemon(tmp_path, ["--interval", str(INTERVAL)], scenario=scenario) as daemon:
        daemon.wait_samples(6)
        client = daemon.client()
        try:
            version, body = client.ask("P")
            told = codec.parse_contexts(body)
            assert version == 2 and {first, second} <= set(told)
            assert told[first].comm == "sleep" and told[first].uid == os.getuid()
            assert client.types()  # the connection still serves atop's requests
        finally:
            client.close()


#: the uid that owns a delegated subtree (user@UID.service) in the forging test
MALLORY = 1000


def _layouts(prefix: str) -> dict[str, tuple[str, str, str]]:
    """Folder under a top slice ``PREFIX.slice``, and the (kind, workload) it must be shown under with
    --workloads pod. The systemd driver's pod is under a kubelet --cgroup-root of PREFIX (as kind's
    nodes are under /kubelet); the rest may sit anywhere no unit is above them."""
    pod = str(uuid.uuid4())
    container = uuid.uuid4().hex * 2
    job = str(uuid.uuid4().int % 100000)
    kube = f"{prefix}-kubepods"
    return {
        "docker": (f"{prefix}-system.slice/docker-{container}.scope", "container", f"docker://{container}"),
        "pod": (f"{kube}.slice/{kube}-burstable.slice/{kube}-burstable-pod{pod.replace('-', '_')}.slice/"
                f"cri-containerd-{container[::-1]}.scope", "pod", pod),
        "pod cgroupfs": (f"kubepods/besteffort/pod{pod[::-1]}/{container}", "pod", pod[::-1]),
        "slurm": (f"{prefix}-system.slice/slurmstepd.scope/job_{job}/step_0/user/task_0", "job", job),
        "service": (f"{prefix}-system.slice/gpu-train.service", "unit", "gpu-train.service"),
    }


def test_container_pod_and_job_layouts_under_the_daemon(tmp_path):
    """Processes moved into cgroup folders laid out as a container, pods (systemd and cgroupfs drivers),
    a Slurm job and a service: each shown under its workload, with its own figures. And a user who
    owns a delegated subtree (user@UID.service, handed over as systemd does) makes the pod's slice in
    it and moves its own process there: it is shown as its user manager, the pod keeps its own figures."""
    root, why = writable_hierarchy()
    if root is None:
        pytest.skip(why)
    if shutil.which("setpriv") is None:
        pytest.skip("setpriv (util-linux) not installed")
    placed = Placed(root, slice_top=True)
    try:
        layouts = _layouts(placed.prefix)
        pids = {name: placed.start(folder) for name, (folder, _, _) in layouts.items()}
        manager = f"{placed.prefix}-user.slice/{placed.prefix}-user-{MALLORY}.slice/user@{MALLORY}.service"
        placed.delegate(manager, MALLORY)
        victim = layouts["pod"][2]
        pids["forged"] = placed.start_as(MALLORY, manager, f"app.slice/kubepods-besteffort-pod"
                                         f"{victim.replace('-', '_')}.slice")
        layouts["forged"] = (manager, "unit", f"user@{MALLORY}.service")
        assert f"kubepods-besteffort-pod{victim.replace('-', '_')}.slice" in Path(
            f"/proc/{pids['forged']}/cgroup").read_text()
        busy = {name: 10 + 5 * position for position, name in enumerate(layouts)}
        scenario = _card([{"pid": pids[name], "memory_mib": 2 * busy[name], "sm_util": busy[name], "mem_util": 1}
                          for name in layouts])
        port = free_port()
        args = ["--interval", str(INTERVAL), "--metrics", f"tcp:{port}:interface=127.0.0.1", "--workloads", "pod",
                "--metrics-processes"]
        with run_daemon(tmp_path, args, scenario=scenario) as daemon:
            daemon.wait_samples(3)
            name = "atopgpud_workload_busy_percent_seconds_total"
            page = _wait_for(port, lambda page: all(series(page, name, kind=kind, workload=workload)
                                                    for _, kind, workload in layouts.values()))
            for layout, (_, kind, workload) in layouts.items():
                shown = series(page, name, kind=kind, workload=workload)
                own = series(page, "atopgpud_process_busy_percent_seconds_total", pid=str(pids[layout]))
                assert shown == own and own[0] > 0, (layout, shown, own)
                memory = series(page, "atopgpud_workload_memory_used_byte_seconds_total", kind=kind,
                                workload=workload)
                assert memory[0] / shown[0] == pytest.approx(2 * MIB), layout
            assert len(series(page, name, kind="pod", workload=victim)) == 1
    finally:
        placed.close()
