"""Who uses the GPUs: processes' contexts from /proc, their workloads from cgroups, and the sums per workload."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from atopgpud_tw.counters import Counters
from atopgpud_tw.readers.cgroups import workload_of
from atopgpud_tw.readers.procinfo import Contexts, read_context
from atopgpud_tw.snapshot import UNKNOWN_CONTEXT, DeviceSample, ProcessContext, ProcessSample, Snapshot
from atopgpud_tw.workloads import WorkloadBook

CID = "0123456789abcdef" * 4
POD = "0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0"

#: /proc/PID/cgroup texts of the layouts, and what each names: (unit, slice, container, pod, job)
LAYOUTS = {
    "v2 service": ("0::/system.slice/train.service\n", ("train.service", "system.slice", "", "", "")),
    "v2 transient scope": ("0::/system.slice/run-r1b2c.scope\n", ("run-r1b2c.scope", "system.slice", "", "", "")),
    "v2 session": ("0::/user.slice/user-1000.slice/session-3.scope\n",
                   ("session-3.scope", "user-1000.slice", "", "", "")),
    "v2 user manager unit": ("0::/user.slice/user-1000.slice/user@1000.service/app.slice/jupyter.service\n",
                             ("user@1000.service/jupyter.service", "user-1000.slice", "", "", "")),
    "hybrid name=systemd": ("12:memory:/system.slice/train.service\n1:name=systemd:/system.slice/train.service\n"
                            "0::/\n", ("train.service", "system.slice", "", "", "")),
    "hybrid 0:: used": ("1:name=systemd:/system.slice/a.service\n0::/system.slice/b.service\n",
                        ("b.service", "system.slice", "", "", "")),
    "docker systemd driver": (f"0::/system.slice/docker-{CID}.scope\n",
                              (f"docker-{CID}.scope", "system.slice", f"docker://{CID}", "", "")),
    "docker cgroupfs": (f"0::/docker/{CID}\n", ("", "", f"docker://{CID}", "", "")),
    "podman": (f"0::/machine.slice/libpod-{CID}.scope/container\n",
               (f"libpod-{CID}.scope", "machine.slice", f"podman://{CID}", "", "")),
    "crio scope": (f"0::/system.slice/crio-{CID}.scope\n",
                   (f"crio-{CID}.scope", "system.slice", f"cri-o://{CID}", "", "")),
    "kubernetes systemd driver": (
        "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod"
        f"{POD.replace('-', '_')}.slice/cri-containerd-{CID}.scope\n",
        (f"cri-containerd-{CID}.scope", f"kubepods-burstable-pod{POD.replace('-', '_')}.slice",
         f"containerd://{CID}", POD, "")),
    "kubernetes guaranteed": (
        f"0::/kubepods.slice/kubepods-pod{POD.replace('-', '_')}.slice/cri-containerd-{CID}.scope\n",
        (f"cri-containerd-{CID}.scope", f"kubepods-pod{POD.replace('-', '_')}.slice", f"containerd://{CID}", POD,
         "")),
    "kubernetes cgroupfs": (f"0::/kubepods/besteffort/pod{POD}/{CID}\n", ("", "", CID, POD, "")),
    # the kubelet's --cgroup-root (kind's nodes: /kubelet): the systemd driver's slices are named from it
    "kubernetes systemd driver, custom root": (
        "0::/kubelet.slice/kubelet-kubepods.slice/kubelet-kubepods-besteffort.slice/kubelet-kubepods-besteffort-pod"
        f"{POD.replace('-', '_')}.slice/cri-containerd-{CID}.scope\n",
        (f"cri-containerd-{CID}.scope", f"kubelet-kubepods-besteffort-pod{POD.replace('-', '_')}.slice",
         f"containerd://{CID}", POD, "")),
    "kubernetes systemd driver, custom root, guaranteed": (
        f"0::/kubelet.slice/kubelet-kubepods.slice/kubelet-kubepods-pod{POD.replace('-', '_')}.slice/"
        f"cri-containerd-{CID}.scope\n",
        (f"cri-containerd-{CID}.scope", f"kubelet-kubepods-pod{POD.replace('-', '_')}.slice",
         f"containerd://{CID}", POD, "")),
    "kubernetes cgroupfs, custom root": (f"0::/kubelet/kubepods/burstable/pod{POD}/{CID}\n", ("", "", CID, POD, "")),
    "kubernetes cgroupfs crio": (f"0::/kubepods/burstable/pod{POD}/crio-{CID}\n",
                                 ("", "", f"cri-o://{CID}", POD, "")),
    "slurm v1": ("7:freezer:/slurm/uid_1000/job_4711/step_0/task_0\n"
                 "1:name=systemd:/system.slice/slurmd.service\n",
                 ("slurmd.service", "system.slice", "", "", "4711")),
    "slurm v2": ("0::/system.slice/slurmstepd.scope/job_4712/step_batch/user/task_0\n",
                 ("slurmstepd.scope", "system.slice", "", "", "4712")),
    "seen from a pod's cgroup namespace": (
        f"0::/../../kubepods-besteffort.slice/kubepods-besteffort-pod{POD.replace('-', '_')}.slice/"
        f"cri-containerd-{CID}.scope\n",
        (f"cri-containerd-{CID}.scope", f"kubepods-besteffort-pod{POD.replace('-', '_')}.slice",
         f"containerd://{CID}", POD, "")),
    "root only": ("0::/\n", ("", "", "", "", "")),
    "garbage": ("not a cgroup file\n::\n", ("", "", "", "", "")),
}


USER_TREE = "0::/user.slice/user-1000.slice/user@1000.service"
#: paths a user (or a container, or a delegated service) makes in the subtree it owns, naming
#: someone else's pod, container or job: each is that owner's unit, and only its own slice
FORGED = {
    "pod slice in a user manager": (f"{USER_TREE}/app.slice/kubepods-besteffort-pod{POD.replace('-', '_')}.slice\n",
                                    ("user@1000.service", "user-1000.slice", "", "", "")),
    "pod slice chain in a user manager": (
        f"{USER_TREE}/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{POD.replace('-', '_')}.slice/"
        f"cri-containerd-{CID}.scope\n",
        (f"user@1000.service/cri-containerd-{CID}.scope", "user-1000.slice", "", "", "")),
    "kind's root in a user manager": (
        f"{USER_TREE}/kubelet.slice/kubelet-kubepods.slice/kubelet-kubepods-pod{POD.replace('-', '_')}.slice\n",
        ("user@1000.service", "user-1000.slice", "", "", "")),
    "cgroupfs pod in a user manager": (f"{USER_TREE}/kubepods/besteffort/pod{POD}/{CID}\n",
                                       ("user@1000.service", "user-1000.slice", "", "", "")),
    "container scope in a user manager": (f"{USER_TREE}/app.slice/docker-{CID}.scope\n",
                                          (f"user@1000.service/docker-{CID}.scope", "user-1000.slice", "", "", "")),
    "rootless podman": (f"{USER_TREE}/user.slice/libpod-{CID}.scope/container\n",
                        (f"user@1000.service/libpod-{CID}.scope", "user-1000.slice", "", "", "")),
    "job folder in a user manager": (f"{USER_TREE}/app.slice/job_4711/step_0\n",
                                     ("user@1000.service", "user-1000.slice", "", "", "")),
    "slurmstepd scope in a user manager": (f"{USER_TREE}/slurmstepd.scope/job_4711/step_0/user/task_0\n",
                                           ("user@1000.service/slurmstepd.scope", "user-1000.slice", "", "", "")),
    "v1 job folder in a user manager": ("7:freezer:/user.slice/user-1000.slice/user@1000.service/job_4711\n"
                                        "1:name=systemd:/user.slice/user-1000.slice/user@1000.service/a.service\n",
                                        ("user@1000.service/a.service", "user-1000.slice", "", "", "")),
    "pod inside a container": (
        f"0::/system.slice/docker-{CID}.scope/kubepods.slice/kubepods-pod{POD.replace('-', '_')}.slice/"
        f"cri-containerd-{CID[::-1]}.scope\n",
        (f"docker-{CID}.scope/cri-containerd-{CID[::-1]}.scope", "system.slice", f"docker://{CID}", "", "")),
    "container inside a cgroupfs container": (f"0::/docker/{CID}/docker/{CID[::-1]}\n",
                                              ("", "", f"docker://{CID}", "", "")),
    "job inside a cgroupfs container": (f"0::/docker/{CID}/slurm/uid_0/job_4711\n",
                                        ("", "", f"docker://{CID}", "", "")),
    "a delegated service's own units": ("0::/system.slice/build.service/payload/train.service\n",
                                        ("build.service/train.service", "system.slice", "", "", "")),
    "pod slice off systemd's chain": (f"0::/system.slice/kubepods-besteffort-pod{POD.replace('-', '_')}.slice\n",
                                      ("", "system.slice", "", "", "")),
    "pod slice under a plain folder": (f"0::/scratch/kubepods-pod{POD.replace('-', '_')}.slice\n",
                                       ("", "", "", "", "")),
}


@pytest.mark.parametrize("name", sorted(FORGED))
def test_only_the_managers_part_of_the_path_names_a_pod_container_or_job(name: str) -> None:
    """A pod, container or job is taken only from the part of the path no one was delegated: systemd's
    chain of slices from the root (a pod slice), folders above every unit and container (cgroupfs, Slurm
    v1), directly under slurmstepd.scope (Slurm v2). Below a unit, what a process is named by is that
    unit (``user@1000.service``), with the innermost unit its owner made after it (docs/metrics.md)."""
    text, wanted = FORGED[name]
    found = workload_of(text)
    assert (found.unit, found.slice, found.container, found.pod, found.job) == wanted
    relative = text.replace(":/", ":/../../")
    found = workload_of(relative)
    assert (found.unit, found.slice, found.container, found.pod, found.job) == wanted, relative


def test_a_forged_pod_is_the_users_unit_under_workloads_pod() -> None:
    """The attack of a delegated tree: the victim's pod uid in a slice of the user's own; with
    --workloads pod the process is counted under the user's manager, not the pod."""
    found = workload_of(FORGED["pod slice in a user manager"][0])
    context = ProcessContext(uid=1000, user="mallory", unit=found.unit, slice=found.slice,
                             container=found.container, pod=found.pod, job=found.job)
    assert context.workload("pod") == ("unit", "user@1000.service")


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_cgroup_layouts_name_their_workload(name: str) -> None:
    """Each layout (v2, hybrid, v1; systemd, containers, pods, Slurm) names its unit, slice, container, pod, job."""
    text, wanted = LAYOUTS[name]
    found = workload_of(text)
    assert (found.unit, found.slice, found.container, found.pod, found.job) == wanted


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_a_daemon_in_a_cgroup_namespace_of_its_own_names_the_same_workloads(name: str) -> None:
    """A container with a cgroup namespace of its own (podman's and Kubernetes' default on cgroup
    v2) reads other processes' paths relative to its own cgroup, ``/../../kubepods.slice/...``:
    the same unit, slice, container, pod and job (docs/install.md, "Container image")."""
    text, wanted = LAYOUTS[name]
    relative = "".join(
        f"{line.rpartition(':')[0]}:/../..{line.rpartition(':')[2]}\n" if line.rpartition(":")[2].startswith("/")
        and line.rpartition(":")[2] != "/" else f"{line}\n"
        for line in text.splitlines()
    )
    found = workload_of(relative)
    assert (found.unit, found.slice, found.container, found.pod, found.job) == wanted, relative


def test_groupings_pick_the_field_and_fall_back() -> None:
    """A grouping names the workload by its field, else by the next one a process has."""
    pod = ProcessContext(uid=0, user="root", unit="cri-containerd-x.scope", container="containerd://x", pod=POD)
    service = ProcessContext(uid=1000, user="ann", unit="train.service", slice="system.slice")
    assert pod.workload("pod") == ("pod", POD)
    assert pod.workload("container") == ("container", "containerd://x")
    assert service.workload("pod") == ("unit", "train.service")
    assert service.workload("user") == ("user", "ann")
    assert ProcessContext(uid=1234).workload("user") == ("user", "1234")
    assert UNKNOWN_CONTEXT.workload("unit") == ("unknown", "unknown")


def _fake_proc(root: Path, pid: int, cgroup: str, uid: int = 1000, start: int = 777, comm: str = "python3") -> None:
    folder = root / str(pid)
    folder.mkdir(parents=True)
    (folder / "stat").write_text(f"{pid} ({comm} x) S 1 " + " ".join(["0"] * 17) + f" {start} 0 0\n")
    (folder / "status").write_text(f"Name:\t{comm}\nUmask:\t0022\nState:\tS\nUid:\t{uid}\t{uid}\t{uid}\t{uid}\n")
    (folder / "cgroup").write_text(cgroup)
    (folder / "cmdline").write_bytes(b"python3\0train.py\0--epochs\0" + b"x" * 1000)


def test_read_context_from_proc(tmp_path: Path) -> None:
    """User, comm, a bounded command line, start time and workload come from /proc/PID."""
    _fake_proc(tmp_path, 42, "0::/system.slice/train.service\n", uid=0)
    context = read_context(42, str(tmp_path))
    assert (context.uid, context.user, context.comm, context.started) == (0, "root", "python3", 777)
    assert context.unit == "train.service"
    assert context.cmdline.startswith("python3 train.py --epochs x") and len(context.cmdline) == 256


def test_a_process_gone_is_unknown(tmp_path: Path) -> None:
    """A pid that /proc does not show is unknown, and nothing breaks."""
    assert read_context(99, str(tmp_path)) is UNKNOWN_CONTEXT
    (tmp_path / "98").mkdir()
    (tmp_path / "98" / "stat").write_text("98 (x) S")
    assert read_context(98, str(tmp_path)) is UNKNOWN_CONTEXT


def test_read_context_of_this_process() -> None:
    """This test's own process, through the real /proc."""
    context = read_context(os.getpid())
    assert context.known and context.uid == os.getuid() and context.comm


def _snapshot(*pids: int, started: int | None = None) -> Snapshot:
    processes = tuple(ProcessSample(pid, started=started) for pid in pids)
    return Snapshot((DeviceSample("GPU-a", "0000:01:00.0", "A10", processes=processes),))


def test_contexts_read_a_bounded_number_per_poll(tmp_path: Path) -> None:
    """At most reads_per_poll new processes are read per poll; the rest in the next, each once."""
    for pid in range(10, 15):
        _fake_proc(tmp_path, pid, "0::/system.slice/a.service\n")
    contexts = Contexts(str(tmp_path), reads_per_poll=2)
    seen = [len(contexts.attach(_snapshot(*range(10, 15))).contexts) for _ in range(4)]
    assert seen == [2, 4, 5, 5]
    assert contexts.reads == 5


def test_contexts_read_a_reused_pid_again(tmp_path: Path) -> None:
    """A pid listed with another start time is another process: read again."""
    _fake_proc(tmp_path, 10, "0::/system.slice/a.service\n")
    contexts = Contexts(str(tmp_path))
    assert contexts.attach(_snapshot(10, started=1)).contexts[10].unit == "a.service"
    (tmp_path / "10" / "cgroup").write_text("0::/system.slice/b.service\n")
    assert contexts.attach(_snapshot(10, started=1)).contexts[10].unit == "a.service"
    assert contexts.attach(_snapshot(10, started=2)).contexts[10].unit == "b.service"


def test_contexts_of_the_same_processes_as_the_last_poll_are_the_same(tmp_path: Path) -> None:
    """Every process as at the last poll, every one read: its contexts again, nothing read; a new
    process, or one gone, makes them be worked out again."""
    for pid in (10, 11, 12):
        _fake_proc(tmp_path, pid, "0::/system.slice/a.service\n")
    contexts = Contexts(str(tmp_path))
    first = contexts.attach(_snapshot(10, 11)).contexts
    again = contexts.attach(_snapshot(10, 11))
    assert again.contexts is first and contexts.reads == 2 and len(again.devices) == 1
    more = contexts.attach(_snapshot(10, 11, 12)).contexts
    assert sorted(more) == [10, 11, 12] and contexts.reads == 3
    assert sorted(contexts.attach(_snapshot(10)).contexts) == [10] and contexts.reads == 3
    assert sorted(contexts.attach(_snapshot(10, 12)).contexts) == [10, 12] and contexts.reads == 4


# -- the sums per workload ---------------------------------------------------------------


def _context(unit: str) -> ProcessContext:
    return ProcessContext(uid=1000, user="ann", unit=unit)


class _Host:
    """Counters and a WorkloadBook folded as the daemon folds them, one poll a second."""

    def __init__(self, limit: int = 500, expiry: float = 3600.0) -> None:
        self.counters = Counters(weigh_processes=True)
        self.now = 0.0
        self.book = WorkloadBook(self.counters, "unit", limit, expiry, lambda: self.now)
        #: every process's final (busy, memory busy, memory KiB) seconds, by unit
        self.finished: dict[str, list[float]] = {}

    def poll(self, running: dict[int, tuple[str, int]]) -> None:
        """One poll with these processes: pid -> (unit, busy percentage)."""
        processes = tuple(ProcessSample(pid, memory_kib=1024, gpu_busy=busy, mem_busy=busy // 2)
                          for pid, (_, busy) in running.items())
        contexts = {pid: _context(unit) for pid, (unit, _) in running.items()}
        snapshot = Snapshot((DeviceSample("GPU-a", "0000:01:00.0", "A10", processes=processes),), contexts)
        since, self.now = self.now, self.now + 1.0
        self.book.exited(self.counters.fold(snapshot, self.now, since))

    def sums(self) -> dict[tuple[str, str], tuple[float, float, float, int, int]]:
        return {(row.sums.kind, row.sums.name): (row.busy, row.mem_busy, row.memory_kib, row.sums.seen,
                                                 row.sums.ended) for row in self.book.rows()}


def test_a_workload_sums_its_processes_exited_ones_included() -> None:
    """A unit's sums are its processes' figures, and do not go down when one ends."""
    host = _Host()
    host.poll({1: ("a.service", 40), 2: ("a.service", 20), 3: ("b.service", 10)})
    host.poll({1: ("a.service", 40), 2: ("a.service", 20), 3: ("b.service", 10)})
    before = host.sums()
    assert before[("unit", "a.service")][:3] == (120.0, 60.0, 4096.0)
    host.poll({1: ("a.service", 40), 3: ("b.service", 10)})  # 2 ended
    after = host.sums()
    assert after[("unit", "a.service")] == (160.0, 80.0, 5120.0, 2, 1)
    assert after[("unit", "b.service")][:3] == (30.0, 15.0, 3072.0)


def test_a_process_without_context_yet_is_counted_once_it_has_one() -> None:
    """A process the reader has not read yet is left out, then counted whole under its workload."""
    host = _Host()
    snapshot = Snapshot((DeviceSample("GPU-a", "b", "A10", processes=(ProcessSample(1, gpu_busy=50),)),))
    host.counters.fold(snapshot, 1.0, 0.0)
    assert host.sums() == {}
    host.now = 1.0
    host.poll({1: ("a.service", 50)})
    assert host.sums()[("unit", "a.service")][0] == 100.0


def test_a_process_gone_before_it_was_read_is_unknown() -> None:
    """A process that ends without a context counts under unknown."""
    host = _Host()
    snapshot = Snapshot((DeviceSample("GPU-a", "b", "A10", processes=(ProcessSample(1, gpu_busy=50),)),))
    host.book.exited(host.counters.fold(snapshot, 1.0, 0.0))
    host.now = 1.0
    host.poll({})
    assert host.sums()[("unknown", "unknown")][3:] == (1, 1)


def test_the_cap_sums_the_rest_under_other(logged) -> None:
    """Beyond --workload-limit series, workloads are summed under other, said once in the log."""
    host = _Host(limit=2)
    host.poll({pid: (f"u{pid}.service", 10) for pid in range(5)})
    sums = host.sums()
    assert set(sums) == {("unit", "u0.service"), ("unit", "u1.service"), ("other", "other")}
    assert sums[("other", "other")][0] == 30.0
    host.poll({pid: (f"u{pid}.service", 10) for pid in range(10)})
    host.sums()
    said = [line for line in logged if "--workload-limit" in line]
    assert said == ['more than 2 workload series (--workload-limit): the rest are summed under workload="other"']


def test_an_idle_workload_expires_into_other() -> None:
    """A workload without processes for --workload-expiry leaves the page; other keeps its sums."""
    host = _Host(expiry=5.0)
    host.poll({1: ("a.service", 10)})
    host.poll({})
    host.sums()
    for _ in range(6):
        host.poll({2: ("b.service", 10)})
    sums = host.sums()
    assert ("unit", "a.service") not in sums
    assert sums[("other", "other")][:1] == (10.0,)
    assert host.book.expired == 1


def test_energy_is_shared_by_busy_time() -> None:
    """A card's energy between two readings goes to the workloads by their busy time added."""
    host = _Host()
    host.poll({1: ("a.service", 30), 2: ("b.service", 10)})
    host.book.share_energy({0: 1000.0}, host.book.rows())
    host.poll({1: ("a.service", 30), 2: ("b.service", 10)})
    host.book.share_energy({0: 1400.0}, host.book.rows())
    energy = {(s.kind, s.name): s.energy_joules for s in host.book}
    assert energy == {("unit", "a.service"): 300.0, ("unit", "b.service"): 100.0}


_churn = st.lists(
    st.dictionaries(st.integers(1, 40), st.tuples(st.sampled_from(["a", "b", "c", "d", "e", "f"]),
                                                   st.integers(0, 100)), max_size=12),
    min_size=1, max_size=60,
)


@settings(max_examples=60, deadline=None)
@given(_churn, st.integers(1, 4), st.floats(1.0, 10.0))
def test_churn_keeps_sums_monotonic_and_exact(polls: list[dict[int, tuple[str, int]]], limit: int,
                                              expiry: float) -> None:
    """Processes coming and going: every series only grows, the page stays within the cap, and the
    sums over all workloads are the sums of every process's own figures (a differential test)."""
    host = _Host(limit=limit, expiry=expiry)
    previous: dict[tuple[str, str], tuple[float, ...]] = {}
    units: dict[int, str] = {}
    for running in polls:
        # a pid keeps its unit while it runs (one process, one context); a new life may move
        running = {pid: (units.setdefault(pid, unit), busy) for pid, (unit, busy) in running.items()}
        for pid in list(units):
            if pid not in running:
                del units[pid]
        host.poll(running)
        sums = host.sums()
        assert len([key for key in sums if key != ("other", "other")]) <= limit
        for key, figures in sums.items():
            if key in previous:
                assert all(now >= before - 1e-9 for now, before in zip(figures, previous[key])), key
        for key in previous:
            if key not in sums:
                assert ("other", "other") in sums  # expired into other
        previous = sums
    # every process's own figures, active and exited, against the workloads' totals
    own = sum(t.gpu_busy_seconds for d in host.counters.devices for t in d.processes.values())
    ended = sum(s.busy for s in host.book)
    total = sum(row.busy for row in host.book.rows())
    assert total == pytest.approx(ended + own)
    expected = 0.0
    for running in polls:
        expected += sum(busy for _, busy in running.values())
    assert total == pytest.approx(expected)


# -- the P reply and atopgpu's groups ------------------------------------------------------


def test_p_lines_round_trip_as_tokens() -> None:
    """A P body gives back each process; texts with spaces or controls come back as tokens."""
    from atopgpud_tw import codec

    records = [codec.ProcessInfo(7, 1000, "ann", "unit", "train.service", "python3"),
               codec.ProcessInfo(8, -1, "", "unknown", "unknown", "bad name\x1b[2J")]
    told = codec.parse_contexts(codec.render_contexts(records))
    assert told[7] == records[0]
    assert (told[8].uid, told[8].user, told[8].comm) == (-1, "", "bad_name_[2J")


@pytest.mark.parametrize("body", [b"1 2 3\n", b"x 0 a b c d\n", b"1 0 a b c d", b"1 0 a b c d e\n"])
def test_a_bad_p_body_is_a_protocol_error(body: bytes) -> None:
    """atopgpu trusts no P line: a wrong count of fields, a non-number, no last newline."""
    from atopgpud_tw import codec

    with pytest.raises(codec.ProtocolError):
        codec.parse_contexts(body)


def test_the_p_body_keeps_within_its_limit() -> None:
    """However many processes, the body stays within CONTEXT_REPLY_LIMIT."""
    from atopgpud_tw import codec

    records = [codec.ProcessInfo(pid, 1, "u" * 200, "unit", "w" * 200, "c" * 200) for pid in range(10000)]
    body = codec.render_contexts(records)
    assert len(body) <= codec.CONTEXT_REPLY_LIMIT and codec.parse_contexts(body)


def test_groups_are_atops_arithmetic_over_the_gpus_samples() -> None:
    """--by: a group's busy figure is its processes' busy sums changed, over the GPU's samples."""
    from atopgpud_tw.atopgpu.cli import group_report, render_table

    def proc(pid: int, user: str, sums: list[int | None]) -> dict:
        return {"pid": pid, "state": "active", "type": "C", "user": user, "command": "x", "workload": None,
                "memory_kib": 1, "samples": 10, "gpu_busy_avg": 1.0, "mem_busy_avg": 1.0, "sums": sums}

    doc = {"endpoint": "e", "version": 2, "span": "start", "seconds": None, "gpus": [{
        "index": 0, "busid": "b", "type": "t", "gpu_busy_now": 50, "gpu_busy_avg": 50.0, "mem_busy_avg": 5.0,
        "memory_used_kib": 0, "memory_total_kib": 0, "samples": 10,
        "processes": [proc(1, "ann", [10, 200, 20, 1000]), proc(2, "ann", [5, 100, 10, 500]),
                      proc(3, "bob", [10, 50, None, 100])]}]}
    groups = {group["name"]: group for group in group_report(doc, "user")}
    assert (groups["ann"]["processes"], groups["ann"]["gpu_busy_avg"], groups["ann"]["memory_avg_kib"]) == (2, 30, 150)
    assert (groups["bob"]["gpu_busy_avg"], groups["bob"]["mem_busy_avg"]) == (5, None)
    for gpu in doc["gpus"]:
        for each in gpu["processes"]:
            del each["sums"]
    doc["by"], doc["groups"] = "user", list(groups.values())
    table = render_table(doc)
    assert "by user:" in table and any(line.split()[:4] == ["0", "ann", "2", "30.0%"] for line in table.splitlines())


def test_the_series_gauge_counts_what_is_on_the_page() -> None:
    """atopgpud_workload_series is the number of workload series the page shows, ``other`` included
    (two named workloads and ``other`` are three)."""
    from atopgpud_tw.server.web.metrics import workload_families

    host = _Host(limit=2)
    host.poll({pid: (f"u{pid}.service", 10) for pid in range(5)})
    families = {family.name: family for family in workload_families(host.book)}
    shown = {tuple(sorted(sample.labels.items())) for sample in families["atopgpud_workload_busy_percent_seconds"]
             .samples}
    assert len(shown) == 3
    assert [sample.value for sample in families["atopgpud_workload_series"].samples] == [3]
