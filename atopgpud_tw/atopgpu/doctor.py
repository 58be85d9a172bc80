"""``atopgpu doctor``: why atop would show no GPU figures on this host: the facts gathered first (`gather`),
each check a plain function of them (`verdicts`); docs/operations.md ("Troubleshooting") explains the lines."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import pwd
import re
import shutil
import subprocess
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

from atopgpud_tw import nvml_codes
from atopgpud_tw.atopgpu import connection as client
from atopgpud_tw.codec import ATOP_MAX_GPUS

OK, FAIL, NOTE = "OK", "FAIL", "--"
#: atop's two ways in: (endpoint, the daemon's --listen for it, API version); atop 2.13 and later use the first
SOCKETS = ((client.DEFAULT_CONNECT, client.DEFAULT_CONNECT, 2),
           ("tcp:127.0.0.1:59123", "tcp:59123:interface=127.0.0.1", 1))
#: the first atop on the abstract socket (older ones: TCP)
UNIX_ATOP = (2, 13)
#: atop's options that take an argument (its getopt string): in a cluster, what follows one is its argument
_ATOP_ARGUMENT_FLAGS = "beJLPrtz"
_UNIT_FIX = "systemctl edit atopgpud: ProtectProc=default and ProcSubset=all (as the shipped unit has them)"


@dataclass
class Check:
    """One line of the report: `status` OK, FAIL or -- (nothing to do)."""

    name: str
    status: str
    text: str
    fix: str = ""


@dataclass
class Reach:
    """What one socket answered: figures (`devices`), or why not (`error`)."""

    endpoint: str
    error: str | None = None
    refused: bool = False
    uid: int | None = None
    devices: int | None = None


@dataclass
class Daemon:
    """The running atopgpud as /proc shows it: its groups, its options and its view of /proc."""

    pid: int
    groups: frozenset[int] = frozenset()
    options: dict[str, Any] | None = None
    proc_options: set[str] | None = None


@dataclass
class Host:
    """Everything the verdicts look at: what the sockets answered, the daemon, the caller's uid and groups, ..."""

    reaches: list[Reach]
    daemon: Daemon | None
    caller: tuple[int, frozenset[int]]
    atop_version: tuple[int, ...] | None = None
    atop_needs_k: bool = False
    #: atop.service's LoadState, and the atop arguments it runs (or would run) with
    atop_unit: str = "not-found"
    atop_args: list[str] | None = None
    nvml_error: str | None = None
    nvml_code: int | None = None
    driver: str = ""
    #: per GPU (by NVML index): (current, pending) MIG mode, None where MIG is not supported
    mig: list[tuple[int, int] | None] = field(default_factory=list)
    host_proc: set[str] = field(default_factory=set)
    unit_proc: dict[str, str] = field(default_factory=dict)


def _user(uid: int) -> str:
    try:
        return f"uid {uid}, {pwd.getpwuid(uid).pw_name}"
    except KeyError:
        return f"uid {uid}"


def has_k(args: Sequence[str]) -> bool:
    """Whether atop's arguments `args` (after the program) give -k."""
    for arg in args:
        if arg.startswith("-") and not arg.startswith("--"):
            for flag in arg[1:]:
                if flag == "k":
                    return True
                if flag in _ATOP_ARGUMENT_FLAGS:
                    break
    return False


def check_socket(host: Host, reach: Reach, listen: str, used: bool | None) -> Check:
    name = reach.endpoint
    if reach.error is None:
        who = "" if reach.uid is None else f" as {_user(reach.uid)}"
        return Check(name, OK, f"answers{who}: {reach.devices} devices")
    text = (f"closed the connection unanswered: you ({_user(host.caller[0])}) are refused (--allow-uid), "
            "or --max-clients is full") if reach.refused else reach.error
    if used is False:
        return Check(name, NOTE, f"{text} (the installed atop does not use it)")
    if reach.refused:
        return Check(name, FAIL, text, "see access")
    if host.daemon is None:
        return Check(name, FAIL, reach.error, "systemctl enable --now atopgpud atopgpud.socket")
    listens = " ".join((host.daemon.options or {}).get("listen", ["?"]))
    return Check(name, FAIL, f"{reach.error}; atopgpud (pid {host.daemon.pid}) listens on {listens}",
                 f"add --listen {listen} to the daemon's options (ATOPGPUD_OPTS in /etc/default/atopgpud)")


def check_access(host: Host) -> Check:
    from atopgpud_tw.server.system.access import AllowList, Peer

    options = host.daemon.options if host.daemon is not None else None
    if options is None:
        return Check("access", NOTE, "no atopgpud process seen whose options could be read")
    allow = AllowList(frozenset(options["allow-uid"]), frozenset(options["allow-gid"]))
    if not allow.restricts:
        return Check("access", OK, "no --allow-uid/--allow-gid: every local user may connect")
    uid, gids = host.caller
    if host.atop_version is not None and host.atop_version < UNIX_ATOP:
        return Check("access", OK, "the installed atop connects over TCP, which --allow-uid/--allow-gid do not guard")
    if allow.admits(Peer(0, uid, gids)):
        return Check("access", OK, f"--allow-uid/--allow-gid admit you ({_user(uid)}); root always")
    return Check("access", FAIL, f"--allow-uid/--allow-gid refuse you ({_user(uid)}): your atop gets no GPU",
                 f"run atop as root, or add --allow-uid {uid}")


def check_atop(host: Host) -> Check:
    version = host.atop_version
    if version is None:
        return Check("atop", FAIL, "atop is not installed (or not on PATH)", "apt-get install atop")
    shown = ".".join(map(str, version))
    if version < (2, 4):
        return Check("atop", FAIL, f"atop {shown} has no GPU statistics (2.4 and later)", "upgrade atop")
    way = "@atopgpud_nvidia, API 2" if version >= UNIX_ATOP else "TCP 127.0.0.1:59123, API 1"
    when = "only when started with -k" if host.atop_needs_k else "by itself (it has no -k)"
    return Check("atop", OK, f"atop {shown} connects to {way}, {when}")


def check_atop_service(host: Host) -> Check:
    if host.atop_unit in ("not-found", "masked") or host.atop_args is None:
        return Check("atop.service", NOTE, f"{host.atop_unit}: no daily atop logs to check")
    if host.atop_needs_k and not has_k(host.atop_args):
        return Check("atop.service", FAIL, f"runs atop {' '.join(host.atop_args)} without -k: its logs have no GPU",
                     "add -k to LOGOPTS in /etc/default/atop (Debian; else to its ExecStart), "
                     "then systemctl restart atop")
    return Check("atop.service", OK, f"runs atop {' '.join(host.atop_args)}")


_NVML_FIXES = {
    nvml_codes.LIBRARY_NOT_FOUND: "install the NVIDIA driver",
    nvml_codes.DRIVER_NOT_LOADED: "modprobe nvidia (see dmesg), or install the driver",
    nvml_codes.LIB_RM_VERSION_MISMATCH: "reboot, or unload and load the nvidia modules",
    nvml_codes.NO_PERMISSION: "check the mode and group of /dev/nvidia* (the daemon is in group video)",
}


def check_nvml(host: Host) -> Check:
    if host.nvml_error is not None:
        return Check("NVML", FAIL, host.nvml_error, _NVML_FIXES.get(host.nvml_code or 0, "see docs/nvml.md"))
    return Check("NVML", OK, f"loads; driver {host.driver}")


def check_devices(host: Host) -> Check:
    counts = [r.devices for r in host.reaches if r.devices is not None and r.endpoint == client.DEFAULT_CONNECT]
    count = counts[0] if counts else (len(host.mig) if host.nvml_error is None else None)
    if count is None:
        return Check("devices", NOTE, "unknown: neither the daemon's socket nor NVML answered")
    if count > ATOP_MAX_GPUS:
        fix = "--mig card shows a card in MIG mode as one device; " if any(m and m[0] for m in host.mig) else ""
        return Check("devices", FAIL, f"{count} devices: atop keeps the first {ATOP_MAX_GPUS}",
                     fix + "see the rest with atopgpu or --metrics")
    return Check("devices", OK, f"{count} devices, within atop's {ATOP_MAX_GPUS}")


def check_mig(host: Host) -> Check:
    if host.nvml_error is not None:
        return Check("MIG", NOTE, "unknown: NVML did not load")
    changing = [str(i) for i, mode in enumerate(host.mig) if mode and mode[0] != mode[1]]
    if changing:
        return Check("MIG", FAIL, f"GPU {', '.join(changing)}: a MIG mode change waits for a GPU reset",
                     f"nvidia-smi -r -i {changing[0]} (with no process on it), or reboot")
    on = [str(i) for i, mode in enumerate(host.mig) if mode and mode[0]]
    if not on:
        return Check("MIG", OK, "no GPU in MIG mode")
    shown = (host.daemon.options or {}).get("mig", "instances") if host.daemon else "instances"
    how = "each MIG instance a device" if shown == "instances" else "the card as one device"
    return Check("MIG", OK, f"GPU {', '.join(on)} in MIG mode: atop sees {how} (--mig {shown})")


def check_proc(host: Host) -> Check:
    # the daemon's /proc mount options: its own mount's where it runs, else the host's and its unit's
    view = host.daemon.proc_options if host.daemon is not None else None
    if view is None:
        view = host.host_proc | {f"hidepid={host.unit_proc.get('ProtectProc', 'default')}", "subset=" +
                                 host.unit_proc.get("ProcSubset", "all")} - {"hidepid=default"}
    named = dict(option.partition("=")[::2] for option in view)
    hidepid, gid = named.get("hidepid", "0"), named.get("gid", "")
    wrong = []
    if hidepid not in ("0", "off") and not (gid.isdigit() and host.daemon and int(gid) in host.daemon.groups):
        wrong.append(f"hidepid={hidepid}: the daemon sees only its own user's processes (no user, workload)")
    if "subset=pid" in view:
        wrong.append("subset=pid: NVML cannot read /proc/driver/nvidia")
    if not wrong:
        return Check("/proc", OK, "the daemon sees every process and /proc/driver")
    on_host = any(o.startswith("hidepid=") and o != "hidepid=0" for o in host.host_proc)
    fix = ("mount /proc with gid= a group of the daemon's (video), in /etc/fstab" if on_host and hidepid != "0"
           else _UNIT_FIX)
    return Check("/proc", FAIL, "; ".join(wrong), fix)


def verdicts(host: Host) -> list[Check]:
    api = None if host.atop_version is None else 2 if host.atop_version >= UNIX_ATOP else 1
    checks = [check_socket(host, reach, listen, None if api is None else api == version)
              for reach, (_, listen, version) in zip(host.reaches, SOCKETS)]
    return checks + [check(host) for check in (check_access, check_atop, check_atop_service, check_nvml,
                                                check_devices, check_mig, check_proc)]


def reach(endpoint: str, version: int) -> Reach:
    """Ask the daemon at `endpoint` for its devices, as atop of API `version` does (version 2: all of them)."""
    from atopgpud_tw.server.system.access import peer_of

    try:
        with client.Connection(client.parse_endpoint(endpoint)) as link:
            peer = peer_of(link)
            uid = peer.uid if peer is not None else None
            try:
                return Reach(endpoint, uid=uid, devices=len(client.take_reading(link, version).types))
            except client.ClientError as error:  # closed (or reset) unanswered: refused
                shut = any(words in str(error) for words in ("closed the connection", "connection lost", "not sent"))
                return Reach(endpoint, str(error).removeprefix(f"{endpoint}: "), shut, uid)
    except client.ClientError as error:
        return Reach(endpoint, str(error).removeprefix(f"{endpoint}: "))


def proc_mount_options(mountinfo: str) -> set[str] | None:
    """The options (mount's and the filesystem's) of the last proc filesystem on /proc in `mountinfo`."""
    found = None
    for line in mountinfo.splitlines():
        fields, _, tail = line.partition(" - ")
        parts = fields.split()
        if parts[4:5] == ["/proc"] and tail.startswith("proc "):
            found = set(parts[5].split(",")) | set(tail.split()[2].split(","))
    return found


def _read(path: str | Path) -> str:
    try:
        return Path(path).read_text(errors="replace")
    except OSError:
        return ""


def find_daemon(proc: Path = Path("/proc")) -> Daemon | None:
    """The first process that runs atopgpud (``atopgpud ...`` or ``twistd ... atopgpud ...``)."""
    from twisted.python import usage

    from atopgpud_tw.tap import Options

    for entry in sorted(proc.glob("[0-9]*"), key=lambda p: int(p.name)):
        argv = _read(entry / "cmdline").split("\0")[:-1]
        names = [os.path.basename(arg) for arg in argv]
        if not ("atopgpud" in names[:2] or ("twistd" in names[:2] and "atopgpud" in names)):
            continue
        status = dict(line.split(":", 1) for line in _read(entry / "status").splitlines() if ":" in line)
        if "Gid" not in status:
            continue
        options = Options()
        try:
            options.parseOptions(argv[names.index("atopgpud") + 1:])
            parsed: dict[str, Any] | None = dict(options)
        except (usage.UsageError, SystemExit):
            parsed = None
        groups = frozenset(map(int, status.get("Groups", "").split() + status["Gid"].split()[:1]))
        return Daemon(int(entry.name), groups, parsed, proc_mount_options(_read(entry / "mountinfo")))
    return None


def unit_show(unit: str, *properties: str) -> dict[str, str]:
    """``systemctl show UNIT -p ...`` as a dict; empty without systemd."""
    if shutil.which("systemctl") is None:
        return {}
    done = subprocess.run(["systemctl", "show", unit, *(f"-p{p}" for p in properties)],
                          capture_output=True, text=True, timeout=10, check=False)
    return dict(line.split("=", 1) for line in done.stdout.splitlines() if "=" in line)


def atop_unit_args(show: dict[str, str]) -> list[str] | None:
    """The atop arguments atop.service runs with: its main process's, else its ExecStart= expanded."""
    pid = show.get("MainPID", "0")
    if pid != "0" and (argv := _read(f"/proc/{pid}/cmdline").split("\0")[:-1]):
        words = argv
    else:
        match = re.search(r"argv\[\]=(.*?) ;", show.get("ExecStart", ""))
        if match is None:
            return None
        env = dict(word.split("=", 1) for word in show.get("Environment", "").split() if "=" in word)
        for name in re.findall(r"(\S+) \(ignore_errors", show.get("EnvironmentFiles", "")):
            for line in _read(name).splitlines():
                key, equals, value = line.partition("=")
                if equals and re.fullmatch(r"\s*\w+", key):
                    env[key.strip()] = value.strip().strip("'\"")
        text = re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: env.get(m[1] or m[2], ""), match[1])
        words = text.replace('"', " ").replace("'", " ").split()
    at = next((i for i, word in enumerate(words) if os.path.basename(word) == "atop"), None)
    return None if at is None else words[at + 1:]


def _atop_facts(host: Host) -> None:
    show = unit_show("atop.service", "LoadState", "MainPID", "ExecStart", "Environment", "EnvironmentFiles")
    host.atop_unit = show.get("LoadState", "not-found")
    host.atop_args = atop_unit_args(show)
    if shutil.which("atop") is None:
        return
    version = subprocess.run(["atop", "-V"], capture_output=True, text=True, timeout=10, check=False)
    found = re.search(r"Version:?\s*(\d+)\.(\d+)(?:\.(\d+))?", version.stdout + version.stderr)
    host.atop_version = tuple(int(n) for n in found.groups() if n is not None) if found else (0,)
    usage = subprocess.run(["atop", "-h"], capture_output=True, text=True, timeout=10, check=False)
    host.atop_needs_k = bool(re.search(r"^\s*-k\s.*atopgpud", usage.stdout + usage.stderr, re.M))


def nvml_facts(host: Host, nvml: Any = None) -> None:
    """NVML's driver version and each GPU's MIG mode, as this process loads it (`nvml`: pynvml by default)."""
    try:
        nvml = nvml or importlib.import_module("pynvml")
        nvml.nvmlInit()
        try:
            version = nvml.nvmlSystemGetDriverVersion()
            host.driver = version.decode() if isinstance(version, bytes) else str(version)
            for index in range(nvml.nvmlDeviceGetCount()):
                try:
                    mode = nvml.nvmlDeviceGetMigMode(nvml.nvmlDeviceGetHandleByIndex(index))
                    host.mig.append((int(mode[0]), int(mode[1])))
                except nvml.NVMLError:
                    host.mig.append(None)
        finally:
            nvml.nvmlShutdown()
    except Exception as error:  # ImportError, NVMLError
        from atopgpud_tw.readers.nvml.reader import describe_init_failure

        host.nvml_error, host.nvml_code = describe_init_failure(error), getattr(error, "value", None)


def gather() -> Host:
    host = Host([reach(endpoint, version) for endpoint, _, version in SOCKETS], find_daemon(),
                (os.getuid(), frozenset({os.getgid(), *os.getgroups()})))
    _atop_facts(host)
    nvml_facts(host)
    host.host_proc = proc_mount_options(_read("/proc/self/mountinfo")) or set()
    host.unit_proc = unit_show("atopgpud.service", "ProtectProc", "ProcSubset")
    return host


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="atopgpu doctor",
        description="Check, in order, what lies between atop and its GPU figures on this host: the daemon on "
        "each socket, --allow-uid and you, atop and atop.service (-k), NVML and the driver, the device count, "
        "MIG mode, what /proc hides from the daemon. One line per check: OK, or what is wrong and the fix. "
        "Exit status 1 when something is wrong.")
    parser.add_argument("--json", action="store_true", help="print the checks as JSON")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """``atopgpu doctor``: 0 when every check passes, 1 when one fails."""
    args = make_parser().parse_args(argv)
    checks = verdicts(gather())
    failed = any(check.status == FAIL for check in checks)
    if args.json:
        print(json.dumps({"ok": not failed, "checks": [asdict(check) for check in checks]}, indent=2))
    else:
        for check in checks:
            print(f"{check.status:<4} {check.name}: {check.text}" + (f" -- fix: {check.fix}" if check.fix else ""))
    return 1 if failed else 0
