"""The Containerfile's image, built and run with Debian's podman inside a booted Debian 12 (systemd-nspawn).

One container per module (tests/systemd_container.py) with podman in its tree.
The image is built there offline, as docs/install.md tells: its base is a
Debian 12 tree with python3 made here by debootstrap and ``podman import``-ed
(there is no registry), and the project comes from a folder of wheels built on
this host (``--build-arg WHEELS=wheels``; the booted system has no network but its
loopback).  Then:

* a second podman container runs ``sleep``; the simulator's scenario lists its
  pid (as the booted system sees it) as a GPU process;
* the image runs detached as docs/install.md says, ``--pid=host
  --network=host --cgroupns=host --read-only`` (and no tmpfs anywhere: the
  daemon writes nothing), with ``--reader sim``, that scenario and
  ``--workloads container``;
* atop 2.13 (tests/atop_source.py) run on this host in the booted system's
  network namespace shows the simulated GPUs; ``/metrics`` answers inside and
  names the sleeping container as the workload of its GPU process;
* the image runs as uid 65532 and its version label is the package's version.

What it takes to run podman (rootful) in the booted system here, each in
`booted`'s arguments or `PODMAN` / `SANDBOX` below:

* ``SYSTEMD_NSPAWN_UNIFIED_HIERARCHY=1``: the booted system gets cgroup v2 (its
  own subtree, writable), so podman makes a ``libpod-ID.scope`` per container
  (what ``--workloads container`` reads); under the host's v1 hierarchies
  nspawn mounts the controllers read-only and crun cannot make its cgroup;
* podman's storage is a folder of this host bind-mounted at
  /var/lib/containers: the booted root is an overlay, which overlay storage
  cannot be put on;
* podman runs in the cgroup namespace of the booted system's PID 1
  (``nsenter -t 1 -C``), so the cgroup paths it reads and the ones mounted
  at /sys/fs/cgroup agree;
* ``--isolation=chroot`` for the build's RUN steps, ``--privileged
  --pids-limit=-1`` for the containers run: crun cannot load its eBPF device
  filter here (it fails, and crun's retry with a raised RLIMIT_MEMLOCK needs
  CAP_SYS_RESOURCE, which this machine's bounding set lacks: "setrlimit
  (RLIM_MEMLOCK): Operation not permitted"), and a privileged container has
  none; the v2 hierarchy has no pids controller (the host binds them all to
  v1).  The daemon still runs as uid 65532 with no
  capability at all, which is checked.

Skips when not root, without debootstrap / systemd-nspawn / a Debian mirror
(CI: fails); atop 2.13's check alone skips when it cannot be built, as
tests/test_atop_gpm.py's does.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any, Iterator

import pytest
from atop_output import check_gpus, parse_output
from atop_source import LISTEN, Unavailable, built_atop
from metrics_text import samples_of, series
from systemd_container import PACKAGES, ROOT, Container, booted, build_wheels, cached_tree, not_possible
from systemd_container import Unavailable as NoTree

import atopgpud_tw

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(2400)]

#: the booted tree: the usual one and Debian's podman (crun as its runtime; netavark,
#: which podman wants to find, though every container here has no network or the host's)
PODMAN_PACKAGES = (*PACKAGES, "podman", "crun", "netavark")
#: the image's base: Debian 12 with python3 and python3-venv (what the Containerfile's
#: builder would otherwise fetch with apt)
BASE_PACKAGES = ("python3", "python3-venv")
BASE_TAG = "localhost/atopgpud-test-base:bookworm"
IMAGE = "localhost/atopgpud_tw:test"
#: the Containerfile's USER
UID = 65532
METRICS_PORT = 9445
#: podman, in the booted system's cgroup namespace
PODMAN = ("nsenter", "-t", "1", "-C", "--", "podman")
#: what every container run here needs on this machine (the module's docstring says why)
SANDBOX = ("--privileged", "--pids-limit=-1")
BASE_INSIDE = "/srv/base"
CONTEXT = "/var/tmp/context"
STORAGE = "/var/lib/containers"


def podman(box: Container, *args: str, timeout: float = 120.0, check: bool = True) -> str:
    """``podman ARGS`` inside; its standard output, stripped."""
    return box.run([*PODMAN, *args], check=check, timeout=timeout).stdout.strip()


def source_copy(dest: Path) -> None:
    """The checkout as a build context (what .containerignore leaves out is left out here too)."""
    shutil.copytree(ROOT, dest, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".hypothesis", "_trial_temp"))


def pyproject_version() -> str:
    """pyproject.toml's version (where it is written once)."""
    match = re.search(r'^version = "([^"]+)"$', (ROOT / "pyproject.toml").read_text(), re.M)
    assert match, "no version in pyproject.toml"
    return match.group(1)


@pytest.fixture(scope="module")
def box(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Container]:
    tmp = tmp_path_factory.mktemp("image")
    storage = tmp / "storage"
    storage.mkdir()
    try:
        base = cached_tree(BASE_PACKAGES)
    except NoTree as error:
        not_possible(str(error))
    options = [f"--bind={storage}:{STORAGE}", f"--bind-ro={base}:{BASE_INSIDE}"]
    environment = {"SYSTEMD_NSPAWN_UNIFIED_HIERARCHY": "1"}
    with booted(tmp / "nspawn", install=False, packages=PODMAN_PACKAGES, nspawn_options=options,
                nspawn_environment=environment) as box:
        yield box
        box.run([*PODMAN, "rm", "-a", "-f", "-t", "0"], timeout=120)
    shutil.rmtree(storage, ignore_errors=True)


@pytest.fixture(scope="module")
def image(box: Container) -> dict[str, float]:
    """The image built inside, offline; how long each step took."""
    took: dict[str, float] = {}
    began = time.monotonic()
    podman(box, "info")
    box.run(["sh", "-c", f"tar -C {BASE_INSIDE} -c . | {' '.join(PODMAN)} import -q - {BASE_TAG}"], check=True,
            timeout=600)
    took["import"] = time.monotonic() - began
    began = time.monotonic()
    context = box.root / CONTEXT.lstrip("/")
    source_copy(context)
    build_wheels(dest=context / "wheels")
    took["wheels"] = time.monotonic() - began
    began = time.monotonic()
    podman(box, "build", "--isolation=chroot", "--build-arg", f"BASE={BASE_TAG}",
           "--build-arg", f"VERSION={pyproject_version()}", "--build-arg", "WHEELS=wheels",
           "-t", IMAGE, "-f", f"{CONTEXT}/Containerfile", CONTEXT, timeout=1200)
    took["build"] = time.monotonic() - began
    print(f"image: {took}; {podman(box, 'images')}")  # shown with -rA
    return took


@pytest.fixture(scope="module")
def sleeper(box: Container, image: dict[str, float]) -> tuple[str, int]:
    """A podman container beside the daemon's, running sleep: its id and its pid in the booted system."""
    ident = podman(box, "run", "-d", *SANDBOX, "--network=none", "--name", "sleeper", BASE_TAG, "sleep", "3600")
    pid = int(podman(box, "inspect", "-f", "{{.State.Pid}}", "sleeper"))
    return ident, pid


def cards(pid: int) -> list[dict[str, Any]]:
    """The simulated GPUs: two cards, the first one with `pid` as its process."""
    return [
        {"name": "NVIDIA A10", "busid": "00000000:65:00.0", "memory_total_mib": 24000, "memory_used_mib": 1000,
         "gpu_util": 60, "mem_util": 10, "processes": [{"pid": pid, "memory_mib": 300, "sm_util": 40, "mem_util": 5}]},
        {"name": "NVIDIA L4", "busid": "00000000:B3:00.0", "memory_total_mib": 23000, "memory_used_mib": 500,
         "gpu_util": 20, "mem_util": 4, "processes": []},
    ]


@pytest.fixture(scope="module")
def daemon(box: Container, sleeper: tuple[str, int]) -> Iterator[dict[str, Any]]:
    """The image running detached as docs/install.md says, on the simulator: its name and GPUs."""
    _, pid = sleeper
    gpus = cards(pid)
    box.write_file("/var/tmp/scenario.json", json.dumps({"gpus": gpus}))
    name = f"atopgpud-{uuid.uuid4().hex[:8]}"
    podman(box, "run", "-d", *SANDBOX, "--name", name, "--pid=host", "--network=host", "--cgroupns=host",
           "--read-only", "--read-only-tmpfs=false", "-v", "/var/tmp/scenario.json:/etc/atopgpud/scenario.json:ro",
           IMAGE, "--reader", "sim", "--scenario", "/etc/atopgpud/scenario.json", "--interval", "0.5",
           "--listen", LISTEN, "--metrics", f"tcp:{METRICS_PORT}:interface=127.0.0.1", "--workloads", "container")
    yield {"name": name, "gpus": gpus}
    logs = box.run([*PODMAN, "logs", name], timeout=60)
    print(logs.stdout, logs.stderr)
    podman(box, "rm", "-f", "-t", "5", name, check=False)


def scrape(box: Container) -> str | None:
    """/metrics fetched inside the booted system (the daemon's network namespace: the host's)."""
    fetch = f"import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:{METRICS_PORT}/metrics', " \
            "timeout=10).read().decode())"
    done = box.run(["python3", "-c", fetch], timeout=30)
    return done.stdout if done.returncode == 0 else None


def wait_page(box: Container, check: Any, timeout: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout
    page: dict = {}
    while time.monotonic() < deadline:
        text = scrape(box)
        page = samples_of(text) if text else {}
        if page and check(page):
            break
        time.sleep(0.5)
    return page


def test_metrics_name_the_gpus_and_the_sleeping_containers_workload(
        box: Container, daemon: dict[str, Any], sleeper: tuple[str, int]) -> None:
    ident, pid = sleeper
    name = "atopgpud_workload_busy_percent_seconds_total"
    workload = f"podman://{ident}"
    page = wait_page(box, lambda page: series(page, name, kind="container", workload=workload))
    assert page, podman(box, "logs", daemon["name"])
    assert series(page, name, kind="container", workload=workload)[0] > 0, sorted(k for k, _ in page if "work" in k)
    busids = {dict(labels)["busid"] for (sample, labels) in page if sample == "atopgpud_gpu_memory_total_bytes"}
    assert busids == {gpu["busid"] for gpu in daemon["gpus"]}, busids
    # atopgpu in the image, as docs/install.md runs it: the process, its command and its workload
    shown = json.loads(podman(box, "exec", daemon["name"], "atopgpu", "--json"))
    (process,) = shown["gpus"][0]["processes"]
    assert (process["pid"], process["command"], process["workload"]) == (pid, "sleep", f"container:{workload}"), \
        json.dumps(process)


def test_atop_2_13_outside_shows_the_gpus(box: Container, daemon: dict[str, Any]) -> None:
    """atop 2.13 run on this host in the booted system's network namespace, where @atopgpud_nvidia is."""
    try:
        atop = built_atop()
    except Unavailable as error:
        pytest.skip(str(error))
    assert wait_page(box, lambda page: page), "the daemon does not answer"
    done = subprocess.run(["nsenter", "-t", str(box.leader), "-n", atop, "-k", "-P", "GPU", "1", "3"],
                          capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr
    samples = parse_output(done.stdout)
    assert len(samples) == 3, done.stdout
    for number, sample in enumerate(samples):
        check_gpus(sample, daemon["gpus"], f"sample {number}\n{done.stdout}")


def test_runs_as_uid_65532_on_a_read_only_root(box: Container, daemon: dict[str, Any]) -> None:
    assert wait_page(box, lambda page: page), "the daemon does not answer"
    pid = podman(box, "inspect", "-f", "{{.State.Pid}}", daemon["name"])
    status = box.read_file(f"/proc/{pid}/status")
    fields = dict(line.split(":", 1) for line in status.splitlines())
    assert fields["Uid"].split() == [str(UID)] * 4 and fields["Gid"].split() == [str(UID)] * 4, status
    assert int(fields["CapEff"], 16) == int(fields["CapPrm"], 16) == 0, status
    assert podman(box, "inspect", "-f", "{{.HostConfig.ReadonlyRootfs}}", daemon["name"]) == "true"
    assert podman(box, "inspect", "-f", "{{.State.Running}}", daemon["name"]) == "true"
    logs = box.run([*PODMAN, "logs", daemon["name"]], timeout=60)
    assert "Traceback" not in logs.stdout + logs.stderr, logs.stdout + logs.stderr


def test_version_label_is_the_packages_version(box: Container, image: dict[str, float]) -> None:
    label = podman(box, "image", "inspect", "-f", '{{index .Labels "org.opencontainers.image.version"}}', IMAGE)
    inside = podman(box, "run", "--rm", *SANDBOX, "--read-only", "--network=none", IMAGE, "--version")
    assert label == atopgpud_tw.distribution_version() == pyproject_version(), (label, inside)
    assert label in inside, inside


def test_a_version_other_than_the_packages_fails_the_build(box: Container, image: dict[str, float]) -> None:
    """The version label cannot disagree with the package: the build checks VERSION against its metadata."""
    wrong = f"{pyproject_version()}.post999"
    done = box.run([*PODMAN, "build", "--isolation=chroot", "--build-arg", f"BASE={BASE_TAG}",
                    "--build-arg", f"VERSION={wrong}", "--build-arg", "WHEELS=wheels", "-t", f"{IMAGE}-wrong",
                    "-f", f"{CONTEXT}/Containerfile", CONTEXT], timeout=1200)
    assert done.returncode != 0, done.stdout
    assert f"VERSION={wrong} but the package installed is {pyproject_version()}" in done.stderr, done.stderr
    assert box.run([*PODMAN, "image", "exists", f"{IMAGE}-wrong"]).returncode != 0
