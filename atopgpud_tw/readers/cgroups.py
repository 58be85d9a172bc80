"""A process's workload, from its ``/proc/PID/cgroup``: pure text, no I/O.

The path read is the ``0::`` line's when it says anything (cgroup v2), else the
``name=systemd`` line's, else the first v1 controller's (cgroups(7)).  What it
names: a systemd unit and slice, a container id (the systemd and cgroupfs
drivers' scopes and folders), a Kubernetes pod uid, a Slurm job id, each only
from the part of the path its manager owns, above every delegated subtree
(`workload_of`).  docs/metrics.md, "Workloads", has the layouts.

Sources: cgroups(7); systemd.unit(5) and https://systemd.io/CGROUP_DELEGATION/; the kubelet's
cgroup drivers (https://kubernetes.io/docs/setup/production-environment/container-runtimes/);
Slurm's cgroup v2 plugin (https://slurm.schedmd.com/cgroup_v2.html).
"""

from __future__ import annotations

import re

from atopgpud_tw.snapshot import CgroupWorkload

#: the systemd driver's container scopes, and the runtime each names (a container id: ``RUNTIME://ID``)
_SCOPES = (("cri-containerd-", "containerd"), ("docker-", "docker"), ("crio-", "cri-o"), ("libpod-", "podman"))
_ID = re.compile(r"[0-9a-f]{32,128}")
#: the systemd driver's pod slice; a kubelet with --cgroup-root=/ROOT names its slices
#: ``ROOT-kubepods-...`` (kind's nodes: ``kubelet-kubepods-besteffort-podUID.slice``)
_POD_SLICE = re.compile(r"(?:[^/]+-)?kubepods(?:-[a-z]+)*-pod([0-9a-fA-F_]{8,64})\.slice")
_POD_FOLDER = re.compile(r"pod([0-9a-fA-F-]{8,64})")
_JOB = re.compile(r"job_([0-9]{1,20})")
_QOS = ("burstable", "besteffort", "guaranteed")
_SLURM_SCOPE = "slurmstepd.scope"


def cgroup_paths(text: str) -> tuple[str, list[str]]:
    """(the path systemd placed the process in, every hierarchy's path) of a ``/proc/PID/cgroup`` text."""
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


def _unit(part: str) -> bool:
    return part.endswith((".service", ".scope"))


def _visible(path: str) -> list[str]:
    """The path's components, less the leading ``..`` of a cgroup namespace: what follows them is
    below an ancestor of the reader's own cgroup, the top of what it can see."""
    parts = [part for part in path.split("/") if part]
    while parts and parts[0] == "..":
        parts.pop(0)
    return parts


def _job(path: str) -> str:
    """The Slurm job id of one hierarchy's path, from the manager's part of it: a ``job_N`` folder
    with no unit or container above it (v1: ``/slurm/uid_U/job_N``), or directly under a
    ``slurmstepd.scope`` that has none above it (v2)."""
    parent = ""
    for part in _visible(path):
        found = _JOB.fullmatch(part)
        if found and (parent == _SLURM_SCOPE or not _unit(parent)):
            return found.group(1)
        if _unit(parent) or _container(part, parent):
            return ""
        parent = part
    return ""


def workload_of(text: str) -> CgroupWorkload:
    """The workload a ``/proc/PID/cgroup`` text names, from the part of the path no one was delegated.

    systemd delegates a subtree only at a unit (``user@UID.service``, a container's scope,
    ``Delegate=``), and a cgroupfs container folder is the container's own, so the walk trusts:

    - a slice only on systemd's own chain (``a-b.slice`` directly in ``a.slice``, from the root, or
      from the top a cgroup namespace shows), and a pod slice only as a link of that chain;
    - a cgroupfs pod folder (``kubepods/QOS/podUID``) and a ``job_N`` folder only above every unit;
    - a container id only from the first unit or folder that names one.

    The first unit met is the process's unit; below it (its owner's own tree) only the innermost
    unit is added, as ``OWNER/NAME`` (``user@1000.service/jupyter.service``): whatever the owner
    makes there, its processes stay the owner's.
    """
    path, paths = cgroup_paths(text)
    owner = inner = slice_ = container = pod = ""
    chain = ""  # the last slice of systemd's chain so far ("" at the top)
    on_chain = True
    parent = ""
    for part in _visible(path):
        if owner:
            if _unit(part):
                inner = part
            continue
        if part.endswith(".slice") and on_chain:
            stem = part.removesuffix(".slice")
            on_chain = not chain and (stem.count("-") == 0 or path.startswith("/..")) \
                or bool(chain) and stem.rpartition("-")[0] == chain
            if on_chain:
                chain = stem
                slice_ = part
                found = _POD_SLICE.fullmatch(part)
                if found:
                    pod = found.group(1).replace("_", "-")
        elif not part.endswith(".slice"):
            on_chain = False
            if not _unit(part) and (parent.startswith("kubepods") or parent in _QOS):
                found = _POD_FOLDER.fullmatch(part)
                if found:
                    pod = found.group(1)
        container = _container(part, parent)
        if _unit(part) or container:
            owner = part if _unit(part) else ""
            if container and not owner:
                break  # a cgroupfs container: what is below it is the container's
        parent = part
    unit = f"{owner}/{inner}" if owner and inner else owner
    job = next(filter(None, (_job(each) for each in paths)), "")
    return CgroupWorkload(path, unit, slice_, container, pod, job)
