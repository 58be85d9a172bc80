"""A process's workload, from its ``/proc/PID/cgroup``: pure text, no I/O.

``/proc/PID/cgroup`` has a line per hierarchy, ``ID:CONTROLLERS:PATH``
(cgroups(7)).  On a cgroup v2 host the one line is ``0::PATH``; a hybrid host
adds v1 hierarchies (``1:name=systemd:PATH``, ``4:memory:PATH``...) and keeps
``0::``, which is ``/`` or empty when nothing uses v2 there; a v1-only host has
no ``0::`` line.  The path systemd placed the process in is the ``0::`` one
when it says anything, else the ``name=systemd`` one, else the first v1
controller's.  What is found in it:

- the innermost systemd unit (``NAME.service``, ``NAME.scope``; within a
  user's manager, ``user@UID.service/NAME``) and the innermost slice
  (``user-1000.slice``, ``system.slice``);
- a container id, from the systemd cgroup driver's scopes
  (``docker-ID.scope``, ``cri-containerd-ID.scope``, ``crio-ID.scope``,
  ``libpod-ID.scope``) or the cgroupfs driver's folders (``/docker/ID``,
  ``crio-ID``, ``libpod-ID``, a bare 64-hex id in a pod's folder);
- a Kubernetes pod uid, from ``kubepods-...-podUID.slice`` (the uid's dashes
  written as ``_``; ``ROOT-kubepods-...`` under a kubelet's ``--cgroup-root``) or
  the cgroupfs ``/kubepods/.../podUID/`` (``/ROOT/kubepods/...``);
- a Slurm job id, from a ``job_N`` folder on any hierarchy (v1:
  ``/slurm/uid_U/job_N/step_S``; v2: ``/system.slice/slurmstepd.scope/job_N/...``).

Sources: cgroups(7); systemd.unit(5) and the systemd "Control Group APIs and
Delegation" page (https://systemd.io/CGROUP_DELEGATION/); the kubelet's cgroup
drivers (https://kubernetes.io/docs/setup/production-environment/container-runtimes/);
Slurm's cgroup v2 plugin (https://slurm.schedmd.com/cgroup_v2.html).
"""

from __future__ import annotations

import re

from atopgpud_tw.snapshot import CgroupWorkload

#: the systemd driver's container scopes, and the runtime each names (as Kubernetes
#: writes a container id: ``RUNTIME://ID``)
_SCOPES = (
    ("cri-containerd-", "containerd"),
    ("docker-", "docker"),
    ("crio-", "cri-o"),
    ("libpod-", "podman"),
)
_ID = re.compile(r"[0-9a-f]{32,128}")
#: the systemd driver's pod slice; a kubelet with --cgroup-root=/ROOT names its slices
#: ``ROOT-kubepods-...`` (kind's nodes: ``kubelet-kubepods-besteffort-podUID.slice``)
_POD_SLICE = re.compile(r"(?:[^/]+-)?kubepods(?:-[a-z]+)*-pod([0-9a-fA-F_]{8,64})\.slice")
_POD_FOLDER = re.compile(r"pod([0-9a-fA-F-]{8,64})")
_JOB = re.compile(r"job_([0-9]{1,20})")
_USER_MANAGER = re.compile(r"user@[0-9]+\.service")


def cgroup_paths(text: str) -> tuple[str, list[str]]:
    """(the path systemd placed the process in, every hierarchy's path) of a
    ``/proc/PID/cgroup`` text."""
    unified = named = first = ""
    paths = []
    for line in text.splitlines():
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if not path:
            continue
        paths.append(path)
        if hierarchy == "0" and not controllers:
            unified = path if path != "/" else ""
        elif controllers == "name=systemd":
            named = path if path != "/" else ""
        elif not first and path != "/":
            first = path
    return unified or named or first, paths


def _container(part: str, parent: str) -> str:
    """The container id a path component names, as ``RUNTIME://ID`` (or a bare id)."""
    name = part.removesuffix(".scope")
    for prefix, runtime in _SCOPES:
        if name.startswith(prefix) and _ID.fullmatch(name[len(prefix):]):
            return f"{runtime}://{name[len(prefix):]}"
    if _ID.fullmatch(name):
        return f"docker://{name}" if parent == "docker" else name
    return ""


def workload_of(text: str) -> CgroupWorkload:
    """The workload a ``/proc/PID/cgroup`` text names."""
    path, paths = cgroup_paths(text)
    unit = slice_ = container = pod = job = ""
    parts = [part for part in path.split("/") if part]
    manager = ""
    parent = ""
    for part in parts:
        if part.endswith(".slice"):
            slice_ = part
            found = _POD_SLICE.fullmatch(part)
            if found:
                pod = found.group(1).replace("_", "-")
        elif part.endswith((".service", ".scope")):
            if _USER_MANAGER.fullmatch(part):
                manager = part
                unit = part
            else:
                unit = f"{manager}/{part}" if manager else part
        elif parent.startswith("kubepods") or parent in ("burstable", "besteffort", "guaranteed"):
            found = _POD_FOLDER.fullmatch(part)
            if found:
                pod = found.group(1)
        container = _container(part, parent) or container
        parent = part
    for each in paths:
        for part in each.split("/"):
            found = _JOB.fullmatch(part)
            if found:
                job = found.group(1)
                break
        if job:
            break
    return CgroupWorkload(path, unit, slice_, container, pod, job)
