"""Boot a real systemd (Debian 12) in a container and run the installed daemon under etc/'s units.

The pieces, each usable alone:

* `cached_tree()`: a Debian 12 tree made by ``debootstrap --variant=minbase``
  with `PACKAGES`, kept under ``$ATOPGPUD_NSPAWN_CACHE`` (default
  ``/var/cache/atopgpud-tw-test/``) in a directory named after a hash of the
  suite, the package list and the recipe, so a changed list builds a new one.
  It is built in a temporary directory beside it and renamed into place; an
  fcntl lock keeps two pytest processes from building it at once.  The cached
  tree is never written to.  Debian's mirror is ``$ATOPGPUD_NSPAWN_MIRROR``
  (default http://deb.debian.org/debian).
* `Wheels` / `build_wheels()`: the project and its runtime dependencies as
  wheels, made on the host by this interpreter's pip (the container does not
  trust the host's certificate store, so it never downloads anything); pip's
  download cache is kept in the cache directory, the wheels are not.
* `booted()`: a context manager that mounts an overlay (the cached tree below, a
  fresh upper directory) and boots it with ``systemd-nspawn --register=no
  --keep-unit --private-network -b``, installs the wheels into
  ``/opt/venvs/atopgpud-tw`` (``python3 -m venv`` + ``pip install --no-index``)
  and links ``/usr/sbin/atopgpud`` and ``/usr/bin/atopgpu`` to it, where the
  Debian package puts them and etc/atopgpud.service expects them, waits for
  ``systemctl is-system-running`` and yields a `Container`.  `booted`'s
  `suite` and `packages` choose another tree (tests/test_debian_package.py
  boots one without Python and atop, for ``apt-get install`` to bring;
  tests/test_debian13_package.py boots Debian 13, ``suite="trixie"``).
  On the way out it powers the container off (SIGTERM to nspawn, which asks
  systemd for a clean halt; SIGKILL if it is stuck) and unmounts the
  overlay, on failure too.  `container_fixture()` makes a pytest
  fixture of it.

The container has only a loopback interface (``--private-network``), so its
abstract sockets and TCP 127.0.0.1:59123 never meet the host's tests.
``--keep-unit`` is what lets nspawn run on a host whose PID 1 is not systemd
(there is no systemd to ask for a scope unit); on a systemd host it keeps the
container in the caller's own unit.  ``--register=no``: no systemd-machined
needed.  Commands run inside through ``nsenter`` into the namespaces of the
container's PID 1 (`Container.run`), as root or, through ``runuser``, as
another user.

Typical use::

    box = container_fixture()          # in a test module: one boot per module

    def test_something(box):
        box.install_units(["atopgpud.service"], overrides={"atopgpud.service": exec_start_dropin()})
        box.run(["systemctl", "start", "atopgpud.service"], check=True)
        assert "Traceback" not in box.journal("atopgpud.service")

Skips and failures: `booted()` skips the test when not root, when debootstrap,
systemd-nspawn or nsenter is missing, when the kernel has no overlayfs, or
when the tree or the wheels cannot be built (no mirror reachable).  When the
environment variable ``CI`` is ``true`` all but the first are failures instead
(CI must run these tests); not being root stays a skip everywhere, since an
unprivileged run cannot be made to boot a container.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, NoReturn, Sequence

import pytest
from locks import file_lock

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the dependencies are built with the project
    tomllib = None  # type: ignore[assignment]

ROOT = Path(__file__).resolve().parents[1]
#: the shipped units (etc/atopgpud.service, ...)
UNITS = ROOT / "etc"

SUITE = "bookworm"
VARIANT = "minbase"
#: what debootstrap installs beyond minbase
PACKAGES = (
    "systemd", "systemd-sysv", "dbus", "python3", "python3-venv", "atop", "procps", "util-linux",
)
#: units of the tree masked once it is built: atop's own services (atopacct waits 90 s for
#: process accounting at boot; atop.service would be a second atop client)
MASKED = ("atop.service", "atopacct.service", "atop-rotate.timer")
#: bump when the way the tree is made changes, so caches rebuild
RECIPE = 1
DEFAULT_CACHE = Path("/var/cache/atopgpud-tw-test")
DEFAULT_MIRROR = "http://deb.debian.org/debian"
#: where the venv goes: the Debian package's (debian/rules); /usr/sbin/atopgpud, etc/atopgpud.service's
#: ExecStart, and /usr/bin/atopgpu link into it (debian/atopgpud-tw.links)
VENV = "/opt/venvs/atopgpud-tw"
#: the links the package makes, as (link, target in the venv)
LINKS = (("/usr/sbin/atopgpud", f"{VENV}/bin/atopgpud"), ("/usr/bin/atopgpu", f"{VENV}/bin/atopgpu"))
#: the environment of every command run inside
INSIDE_ENV = ("PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LANG=C.UTF-8", "HOME=/root")
TOOLS = ("debootstrap", "systemd-nspawn", "nsenter", "mount", "umount")


class Unavailable(Exception):
    """The container cannot be had here: the tree or the wheels cannot be built (no mirror, no index)."""


# -- skip or fail -------------------------------------------------------------------


def in_ci() -> bool:
    """Whether this is CI (``CI=true``): there, what would skip fails."""
    return os.environ.get("CI", "").lower() == "true"


def not_possible(reason: str) -> NoReturn:
    """Skip the test with `reason`; in CI fail it."""
    if in_ci():
        pytest.fail(f"CI=true and the systemd container cannot run: {reason}", pytrace=False)
    pytest.skip(reason)


def missing() -> str | None:
    """Why no container can be booted here though we are root (a tool, overlayfs), or None."""
    absent = [tool for tool in TOOLS if shutil.which(tool) is None]
    if absent:
        return f"{', '.join(absent)} not installed (Debian: apt-get install debootstrap systemd-container)"
    if "overlay" not in Path("/proc/filesystems").read_text():
        return "the kernel has no overlayfs"
    return None


def require() -> None:
    """Skip the calling test when not root; skip (in CI: fail) it when `missing` has a reason."""
    if os.geteuid() != 0:
        pytest.skip("booting a systemd container needs root (run pytest as root)")
    reason = missing()
    if reason:
        not_possible(reason)


# -- the cached tree ----------------------------------------------------------------


def cache_dir() -> Path:
    """``$ATOPGPUD_NSPAWN_CACHE`` or /var/cache/atopgpud-tw-test, created."""
    path = Path(os.environ.get("ATOPGPUD_NSPAWN_CACHE") or DEFAULT_CACHE)
    path.mkdir(parents=True, exist_ok=True)
    return path


def tree_key(packages: Sequence[str] = PACKAGES, suite: str = SUITE) -> str:
    """The cache key of a tree: a hash of what goes into it."""
    recipe = {"suite": suite, "variant": VARIANT, "packages": sorted(packages), "masked": MASKED, "recipe": RECIPE}
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:16]


def cached_tree(packages: Sequence[str] = PACKAGES, suite: str = SUITE, timeout: float = 1800.0) -> Path:
    """The Debian tree for `packages`, built first if the cache has none.

    Raises `Unavailable` when debootstrap fails (typically: no mirror reachable).
    """
    cache = cache_dir()
    key = tree_key(packages, suite)
    tree = cache / f"{suite}-{key}"
    if (tree / "etc" / "os-release").exists():
        return tree
    with file_lock(cache / f".{suite}-{key}.lock", timeout, poll=0.5):
        if (tree / "etc" / "os-release").exists():  # another process built it meanwhile
            return tree
        building = Path(tempfile.mkdtemp(prefix=f".{suite}-{key}-building-", dir=cache))
        log = cache / f"{suite}-{key}.debootstrap.log"
        try:
            mirror = os.environ.get("ATOPGPUD_NSPAWN_MIRROR") or DEFAULT_MIRROR
            command = [
                "debootstrap", f"--variant={VARIANT}", f"--include={','.join(packages)}",
                suite, str(building / "root"), mirror,
            ]
            with open(log, "wb") as out:
                done = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                      timeout=timeout)
            if done.returncode != 0:
                tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:])
                raise Unavailable(f"debootstrap {suite} from {mirror} failed ({done.returncode}):\n{tail}")
            _finish_tree(building / "root")
            os.rename(building / "root", tree)
        finally:
            shutil.rmtree(building, ignore_errors=True)
    return tree


def _finish_tree(root: Path) -> None:
    """Mask what slows the boot and drop apt's downloaded packages."""
    for unit in MASKED:
        link = root / "etc" / "systemd" / "system" / unit
        link.unlink(missing_ok=True)
        link.symlink_to("/dev/null")
    for deb in (root / "var" / "cache" / "apt" / "archives").glob("*.deb"):
        deb.unlink()


# -- the project's wheels -----------------------------------------------------------

class Wheels:
    """The project's wheels being made on the host: its dependencies and itself, by two pip runs at once.

    This interpreter's pip and index make them (the container never downloads);
    pip's download cache is in the cache directory, the wheels in a temporary
    directory removed at exit.  The dependencies come first (`dependencies`),
    so the container can install them while the project's own wheel (build
    isolation: the slower one) is still being made (`project`).
    """

    def __init__(self, project: Path = ROOT) -> None:
        self.scratch = Path(tempfile.mkdtemp(prefix="atopgpud-nspawn-wheels-"))
        atexit.register(shutil.rmtree, self.scratch, True)
        # a copy of the sources: pip builds in place, and the checkout may be in use
        source = self.scratch / "source"
        shutil.copytree(project, source, ignore=shutil.ignore_patterns(
            ".venv", ".git", "build", "dist", "*.egg-info", "__pycache__", ".hypothesis", "_trial_temp"))
        if tomllib is not None:
            requirements = tomllib.loads((project / "pyproject.toml").read_text())["project"]["dependencies"]
        else:
            requirements = [str(source)]
        self._deps = self._pip(["pip", "wheel", "--wheel-dir", str(self.scratch / "deps"), *requirements])
        self._project = self._pip(["pip", "wheel", "--no-deps", "--wheel-dir", str(self.scratch / "project"),
                                   str(source)])

    def _pip(self, args: list[str]) -> subprocess.Popen[str]:
        command = [sys.executable, "-m", *args[:2], "-q", "--disable-pip-version-check",
                   "--cache-dir", str(cache_dir() / "pip"), *args[2:]]
        return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                stdin=subprocess.DEVNULL)

    def _wait(self, proc: subprocess.Popen[str], what: str, timeout: float) -> Path:
        out, _ = proc.communicate(timeout=timeout)
        if proc.returncode != 0:
            raise Unavailable(f"pip wheel of {what} failed ({proc.returncode}):\n{out[-2000:]}")
        return Path(proc.args[proc.args.index("--wheel-dir") + 1])

    def close(self) -> None:
        """Stop a pip still running and remove the wheels."""
        for proc in (self._deps, self._project):
            if proc.poll() is None:
                proc.kill()
            proc.communicate()
        shutil.rmtree(self.scratch, ignore_errors=True)

    def dependencies(self, timeout: float = 900.0) -> Path:
        """The directory of the runtime dependencies' wheels, once made; `Unavailable` if pip failed."""
        return self._wait(self._deps, "the dependencies", timeout)

    def project(self, timeout: float = 900.0) -> Path:
        """The directory of the project's own wheel, once made; `Unavailable` if pip failed."""
        return self._wait(self._project, "the project", timeout)


def build_wheels(project: Path = ROOT, dest: Path | None = None) -> Path:
    """Every wheel the project needs (itself and its runtime dependencies) in one directory."""
    wheels = Wheels(project)
    dest = dest or wheels.scratch / "all"
    dest.mkdir(parents=True, exist_ok=True)
    for directory in (wheels.dependencies(), wheels.project()):
        for wheel in directory.glob("*.whl"):
            shutil.copy2(wheel, dest)
    return dest


# -- units ----------------------------------------------------------------------------


def shipped_exec_start(unit: str = "atopgpud.service") -> str:
    """The command line of the shipped unit's (single) ExecStart=."""
    lines = re.findall(r"^ExecStart=(.+)$", (UNITS / unit).read_text(), re.M)
    assert len(lines) == 1, f"{unit} has {len(lines)} ExecStart= lines"
    return lines[0].strip()


def exec_start_dropin(extra: Sequence[str] = ("--reader", "sim"), unit: str = "atopgpud.service",
                      more: str = "") -> str:
    """A drop-in that runs the shipped ExecStart= with `extra` arguments added.

    Without a GPU the default reader (auto) fails, so tests add ``--reader sim``.
    `more` is appended to the [Service] section (e.g. ``"Environment=X=1\\n"``).
    """
    command = " ".join([shipped_exec_start(unit), *map(shlex.quote, extra)])
    return f"[Service]\nExecStart=\nExecStart={command}\n{more}"


# -- the container --------------------------------------------------------------------


class Container:
    """A booted container: commands run in it through nsenter into its PID 1's namespaces."""

    def __init__(self, nspawn: subprocess.Popen[bytes], leader: int, root: Path, console: Path) -> None:
        self.nspawn = nspawn
        #: the host pid of the container's PID 1 (systemd)
        self.leader = leader
        #: the merged overlay on the host (its /run and /tmp are the container's own, not seen here)
        self.root = root
        #: what the container printed on its console
        self.console = console
        #: boots the tree again (`reboot`): sets `nspawn`; given by `booted`
        self._boot: Callable[[], None] | None = None
        #: seconds `booted` took: to get the tree, to be ready (all in), and within that, to install:
        #: the dependencies' wheels copied in, the project's, the dependencies installed, all installed
        self.timings: dict[str, float] = {}

    def command(self, argv: Sequence[str], user: str | int | None = None, host_network: bool = False) -> list[str]:
        """The host command line that runs `argv` inside, as root or as `user`.

        `user` is a user name (``runuser -u``: its groups too) or a bare uid that
        needs no passwd entry (``setpriv``: gid the same, no supplementary groups).
        `host_network`: in the container's files and processes but the host's
        network (``apt-get`` reaching the mirror from a container whose own
        services stay on its private loopback).
        """
        namespaces = ["-m", "-u", "-i", *([] if host_network else ["-n"]), "-p", "-r", "-w"]
        enter = ["nsenter", "-t", str(self.leader), *namespaces, "--", "env", "-i", *INSIDE_ENV]
        if isinstance(user, int):
            enter += ["setpriv", f"--reuid={user}", f"--regid={user}", "--clear-groups", "--"]
        elif user is not None:
            enter += ["runuser", "-u", user, "--"]
        return enter + [str(arg) for arg in argv]

    def run(self, argv: Sequence[str], *, user: str | int | None = None, check: bool = False, timeout: float = 60.0,
            input: str | None = None, host_network: bool = False) -> subprocess.CompletedProcess[str]:
        """Run `argv` inside and wait; stdout and stderr captured as text.

        With `check`, a non-zero exit raises AssertionError with both outputs.
        `host_network`: see `command`.
        """
        done = subprocess.run(
            self.command(argv, user, host_network), capture_output=True, text=True, timeout=timeout, input=input,
            stdin=None if input is not None else subprocess.DEVNULL,
        )
        if check and done.returncode != 0:
            raise AssertionError(
                f"{shlex.join(map(str, argv))} exited {done.returncode} in the container\n"
                f"--- stdout\n{done.stdout}--- stderr\n{done.stderr}"
            )
        return done

    def popen(self, argv: Sequence[str], *, user: str | int | None = None, **kwargs: Any) -> subprocess.Popen[str]:
        """Start `argv` inside without waiting (text pipes for stdout and stderr unless given).

        It runs in its own process group: `os.killpg(proc.pid, ...)` reaches it through nsenter.
        """
        kwargs.setdefault("stdout", subprocess.PIPE)
        kwargs.setdefault("stderr", subprocess.PIPE)
        kwargs.setdefault("stdin", subprocess.DEVNULL)
        return subprocess.Popen(self.command(argv, user), text=True, start_new_session=True, **kwargs)

    def systemctl(self, *args: str, check: bool = True, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
        """``systemctl ARGS`` inside."""
        return self.run(["systemctl", *args], check=check, timeout=timeout)

    def write_file(self, path: str, text: str, mode: int = 0o644, owner: str | None = None) -> None:
        """Write `text` to `path` inside (parent directories made), with `mode` and `owner`."""
        script = 'mkdir -p "$(dirname "$1")" && cat > "$1" && chmod "$2" "$1"'
        if owner is not None:
            script += ' && chown "$3" "$1"'
        self.run(["sh", "-c", script, "-", path, f"{mode:o}", owner or ""], input=text, check=True)

    def read_file(self, path: str) -> str:
        """The text of `path` inside."""
        return self.run(["cat", path], check=True).stdout

    def add_user(self, name: str, groups: Sequence[str] = (), uid: int | None = None) -> None:
        """A system user without home or shell, in `groups` (made when missing)."""
        for group in groups:
            self.run(["groupadd", "-f", group], check=True)
        command = ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin"]
        if groups:
            command += ["--groups", ",".join(groups)]
        if uid is not None:
            command += ["--uid", str(uid)]
        self.run([*command, name], check=True)

    def install_units(self, names: Sequence[str], overrides: Mapping[str, str] | None = None,
                      source: Path = UNITS) -> None:
        """Copy `names` from etc/ into /etc/systemd/system and daemon-reload.

        `overrides` maps a unit name to the text of its drop-in
        ``/etc/systemd/system/UNIT.d/test.conf`` (see `exec_start_dropin`); a
        unit may be overridden without being in `names`.
        """
        for name in names:
            self.write_file(f"/etc/systemd/system/{name}", (source / name).read_text())
        for name, text in (overrides or {}).items():
            self.write_file(f"/etc/systemd/system/{name}.d/test.conf", text)
        self.systemctl("daemon-reload")

    def remove_override(self, name: str) -> None:
        """Drop a unit's test.conf drop-in and daemon-reload."""
        self.run(["rm", "-f", f"/etc/systemd/system/{name}.d/test.conf"], check=True)
        self.systemctl("daemon-reload")

    def journal_cursor(self) -> str:
        """The journal's current end: pass it to `journal` to see only what comes after."""
        self.run(["journalctl", "--sync"], timeout=30)
        out = self.run(["journalctl", "-n", "0", "--show-cursor", "--no-pager"], check=True).stdout
        match = re.search(r"^-- cursor: (.+)$", out, re.M)
        assert match, out
        return match.group(1).strip()

    def journal(self, unit: str | None = None, cursor: str | None = None, output: str = "cat") -> str:
        """``journalctl [-u UNIT] [--after-cursor CURSOR] -o OUTPUT --no-pager`` (this boot)."""
        self.run(["journalctl", "--sync"], timeout=30)
        command = ["journalctl", "-b", "--no-pager", "-o", output]
        if unit is not None:
            command += ["-u", unit]
        if cursor is not None:
            command += ["--after-cursor", cursor]
        return self.run(command, check=True).stdout

    def is_active(self, unit: str) -> bool:
        """Whether ``systemctl is-active UNIT`` says active."""
        return self.systemctl("is-active", "--quiet", unit, check=False).returncode == 0

    def reboot(self, timeout: float = 90.0) -> None:
        """Power the container off cleanly and boot the same tree again (what was written to it
        stays, /run starts empty); `nspawn` and `leader` become the new boot's.

        Not ``systemctl reboot``: nspawn's own reboot fails where the host's /run is no
        tmpfs (it will not remove its propagation directory there)."""
        if self._boot is None:
            raise RuntimeError("this container cannot be booted again")
        _stop(self.nspawn, self.leader, 20.0)
        self._boot()
        deadline = time.monotonic() + timeout
        self.leader = _container_leader(self.nspawn, self.console, timeout)
        _wait_running(self, max(1.0, deadline - time.monotonic()))

    def wait_for(self, predicate: Callable[[], bool], timeout: float = 30.0, what: str = "condition") -> None:
        """Poll `predicate` every 50 ms until true; AssertionError after `timeout`."""
        deadline = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() > deadline:
                raise AssertionError(f"{what}: not within {timeout} s")
            time.sleep(0.05)


def _container_leader(nspawn: subprocess.Popen[bytes], console: Path, timeout: float) -> int:
    """The host pid of the container's PID 1: nspawn's child that is pid 1 in its own namespace."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if nspawn.poll() is not None:
            text = console.read_text(errors="replace")
            raise RuntimeError(f"systemd-nspawn exited with {nspawn.returncode}:\n{text}")
        try:
            children = " ".join(
                path.read_text() for path in Path(f"/proc/{nspawn.pid}/task").glob("*/children")
            ).split()
        except OSError:
            children = []
        for child in children:
            try:
                status = Path(f"/proc/{child}/status").read_text()
            except OSError:
                continue
            nspid = re.search(r"^NSpid:\s+(.+)$", status, re.M)
            # pid 1 of a namespace of its own, and systemd already (nspawn has set the container up)
            if nspid and len(nspid.group(1).split()) > 1 and nspid.group(1).split()[-1] == "1" \
                    and re.search(r"^Name:\s+systemd$", status, re.M):
                return int(child)
        time.sleep(0.02)
    raise RuntimeError(f"no container PID 1 under systemd-nspawn within {timeout} s")


def _install_venv(box: Container, wheels: Wheels) -> None:
    """Make the venv `VENV`: the dependencies, the project (wheels copied into /var/tmp), and `LINKS`.

    Debian's own pip wheel (from python3-venv) installs, byte-compiling is done
    afterwards by all cores (not the dependencies' test packages: nothing
    imports them, and under ProtectSystem=strict the daemon could not write
    the .pyc files itself), and the dependencies go in while the project's
    wheel is still being built.
    """
    inside = f"/var/tmp/atopgpud-wheels-{uuid.uuid4().hex[:8]}"
    began = time.monotonic()
    shutil.copytree(wheels.dependencies(), box.root / inside.lstrip("/"))
    box.timings["deps-wheels"] = time.monotonic() - began
    pip = f"{VENV}/bin/python $(ls /usr/share/python-wheels/pip-*.whl | tail -n 1)/pip install -q " \
          f"--disable-pip-version-check --no-index --find-links {inside}"
    deps = box.popen(["sh", "-c", f"python3 -m venv --without-pip {VENV} && {pip} --no-compile {inside}/*.whl "
                      f"&& {VENV}/bin/python -m compileall -q -j0 -x '/tests?/' {VENV}/lib"], stderr=subprocess.STDOUT)
    shutil.copytree(wheels.project(), box.root / inside.lstrip("/") / "project")
    box.timings["project-wheel"] = time.monotonic() - began
    out, _ = deps.communicate(timeout=600)
    box.timings["deps-installed"] = time.monotonic() - began
    if deps.returncode != 0:
        raise RuntimeError(f"installing the dependencies into {VENV} failed ({deps.returncode}):\n{out}")
    links = " && ".join(f"ln -sf {target} {link}" for link, target in LINKS)
    box.run(["sh", "-c", f"{pip} --no-deps {inside}/project/*.whl && rm -rf {inside} && {links}"],
            check=True, timeout=600)
    box.timings["install"] = time.monotonic() - began


def _wait_running(box: Container, timeout: float) -> str:
    """Wait for ``systemctl is-system-running`` to say running or degraded; what it said."""
    deadline = time.monotonic() + timeout
    state = ""
    while time.monotonic() < deadline:
        left = max(1.0, deadline - time.monotonic())
        try:
            done = box.run(["systemctl", "is-system-running", "--wait"], timeout=left)
        except subprocess.TimeoutExpired:
            break
        state = done.stdout.strip()
        if state in ("running", "degraded"):
            return state
        if box.nspawn.poll() is not None:
            break
        time.sleep(0.1)  # the bus may not be there yet
    raise RuntimeError(
        f"the container's systemd is {state or 'not answering'} after {timeout} s:\n"
        f"{box.run(['systemctl', '--failed', '--no-pager'], timeout=10).stdout if box.nspawn.poll() is None else ''}"
        f"{box.console.read_text(errors='replace')[-4000:]}"
    )


def _stop(nspawn: subprocess.Popen[bytes], leader: int | None, timeout: float) -> None:
    """Power the container off: SIGTERM to nspawn (a clean halt), SIGKILL to its PID 1 if stuck."""
    if nspawn.poll() is not None:
        return
    nspawn.send_signal(signal.SIGTERM)
    try:
        nspawn.wait(timeout)
        return
    except subprocess.TimeoutExpired:
        pass
    if leader is not None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(leader, signal.SIGKILL)  # takes the container's whole pid namespace with it
    try:
        nspawn.wait(10)
    except subprocess.TimeoutExpired:
        nspawn.kill()
        nspawn.wait(10)


def _unmount(path: Path) -> None:
    if subprocess.run(["umount", str(path)], capture_output=True).returncode != 0:
        subprocess.run(["umount", "--lazy", str(path)], capture_output=True)


@contextlib.contextmanager
def booted(tmp: Path, *, install: bool = True, boot_timeout: float = 90.0,
           stop_timeout: float = 20.0, network: bool = False, suite: str = SUITE,
           packages: Sequence[str] = PACKAGES, nspawn_options: Sequence[str] = (),
           nspawn_environment: Mapping[str, str] | None = None) -> Iterator[Container]:
    """A booted Debian container on an overlay in `tmp`, with `VENV` installed.

    `suite` and `packages` choose the tree (`cached_tree`; Debian 12 with
    `PACKAGES` by default).  `install=False` skips the venv.  `network=True` boots it in the host's
    network namespace instead of a private one (it reaches what the host
    reaches, and its sockets, abstract ones too, are the host's).  `nspawn_options` are added to systemd-nspawn's
    command line (``--bind=...``, ``--capability=...``), `nspawn_environment`
    to its environment (``SYSTEMD_NSPAWN_UNIFIED_HIERARCHY=1``: the container's
    cgroups are version 2 whatever the host's are).  Skips (CI: fails)
    when `missing` says so or the tree or the wheels cannot be had.
    """
    require()
    began = time.monotonic()
    try:
        tree = cached_tree(packages, suite)
    except Unavailable as error:
        not_possible(str(error))
    tree_seconds = time.monotonic() - began
    began = time.monotonic()
    tmp.mkdir(parents=True, exist_ok=True)
    upper, work, merged = tmp / "upper", tmp / "work", tmp / "merged"
    for path in (upper, work, merged):
        path.mkdir()
    subprocess.run(
        ["mount", "-t", "overlay", "overlay", "-o", f"lowerdir={tree},upperdir={upper},workdir={work}", str(merged)],
        check=True, capture_output=True,
    )
    wheels = Wheels() if install else None
    machine = f"atopgpud-test-{uuid.uuid4().hex[:10]}"
    console = tmp / "console.log"
    nspawn: subprocess.Popen[bytes] | None = None
    leader: int | None = None
    box: Container | None = None

    def start() -> subprocess.Popen[bytes]:
        # nspawn leaves its propagation directory behind when the host's /run is no tmpfs
        with contextlib.suppress(OSError):
            shutil.rmtree(f"/run/systemd/nspawn/propagate/{machine}")
        with open(console, "ab") as out:
            return subprocess.Popen(
                ["systemd-nspawn", "--register=no", "--keep-unit", *([] if network else ["--private-network"]),
                 "--console=read-only", "--setenv=SYSTEMD_COLORS=0",
                 f"--machine={machine}", *nspawn_options, "-q", "-b", "-D", str(merged), "systemd.show_status=1"],
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env={**os.environ, **(nspawn_environment or {})},
            )

    def boot_again() -> None:
        assert box is not None
        box.nspawn = start()

    try:
        nspawn = start()
        leader = _container_leader(nspawn, console, boot_timeout)
        box = Container(nspawn, leader, merged, console)
        box._boot = boot_again
        box.timings["tree"] = tree_seconds
        if wheels is not None:
            # the wheels are made, and installed, while the container boots
            try:
                _install_venv(box, wheels)
            except Unavailable as error:
                not_possible(str(error))
        _wait_running(box, boot_timeout)
        box.timings["ready"] = time.monotonic() - began
        yield box
    finally:
        if wheels is not None:
            wheels.close()
        if box is not None:
            nspawn, leader = box.nspawn, box.leader
        if nspawn is not None:
            _stop(nspawn, leader, stop_timeout)
        _unmount(merged)
        # nspawn leaves its propagation directory behind when the host's /run is no tmpfs
        with contextlib.suppress(OSError):
            shutil.rmtree(f"/run/systemd/nspawn/propagate/{machine}")
        shutil.rmtree(upper, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)


def container_fixture(scope: str = "module", **options: Any) -> Any:
    """A pytest fixture (default: one container per module) yielding a booted `Container`.

    In a test module: ``box = container_fixture()``; `options` go to `booted`.
    """

    @pytest.fixture(scope=scope)  # type: ignore[call-overload]
    def fixture(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Container]:
        with booted(tmp_path_factory.mktemp("nspawn"), **options) as box:
            yield box

    return fixture
