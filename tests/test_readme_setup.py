"""The README's set-up commands, as they stand, on a fresh Debian 12 machine: as root
where there is no sudo, and as a user who may use sudo.

The machine is the booted Debian 12 container of tests/systemd_container.py, one
per test, without package lists (as a Debian image comes: the commands must fetch
them), in the host's network namespace so that it reaches the package registries,
with what the host uses to reach them copied in: its certificate store, pip's
site-wide configuration and the pip and proxy settings of the environment.  A copy
of the checkout is in the user's home.

The run command is a foreground daemon: the test starts it, waits until it answers
``atopgpu`` over the abstract socket and over TCP 127.0.0.1:59123 (the host's
too, so the test holds the lock of the atop tests' port and fails when
something else listens there), then stops it with SIGTERM.  The test command is
run as it stands, with ``-m "not e2e"`` added to its pytest: the suite's
end-to-end tests would boot containers inside the container.

Skips when not root or without debootstrap / systemd-nspawn / a Debian mirror;
with ``CI=true`` every one of those is a failure, not being root too (CI runs the
README's test command as root, so that these commands are tried).
"""

from __future__ import annotations

import configparser
import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Iterator

import pytest
from atop_helpers import port_lock, port_taken
from systemd_container import ROOT, Container, booted, in_ci, not_possible

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(2400)]

#: the user of the sudo runs, and where each runs from
USER = "debian"
HOMES = {"root": "/root", USER: f"/home/{USER}"}
#: environment variables that say how to reach the registries
PROXY_VARIABLES = ("http_proxy", "https_proxy", "no_proxy", "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY")
#: pip settings of the environment that concern reaching an index (not local wheel directories)
PIP_VARIABLES = ("PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_TRUSTED_HOST", "PIP_CERT", "PIP_CLIENT_CERT",
                 "PIP_PROXY", "PIP_DEFAULT_TIMEOUT", "PIP_RETRIES")
#: the longest the set-up may take before the daemon answers (apt-get and pip over the network)
SETUP_SECONDS = 900.0


def readme_commands() -> tuple[str, str]:
    """The README's two set-up commands: install and run the daemon; install and run the tests."""
    readme = (ROOT / "README.md").read_text()
    start = readme.index("## Set-up")
    setup = readme[start:readme.index("\n## ", start + 1)]
    commands = re.findall(r"^```sh\n(.*)\n```$", setup, re.M)
    assert len(commands) == 2, commands
    return commands[0], commands[1]


# -- the machine ----------------------------------------------------------------------


def copy_certificates(box: Container) -> None:
    """The host's /etc/ssl/certs, links followed (the container has no ca-certificates package)."""
    target = box.root / "etc" / "ssl" / "certs"
    target.mkdir(parents=True, exist_ok=True)
    for entry in Path("/etc/ssl/certs").iterdir():
        if entry.is_file():  # follows links; a dangling one is left out
            copy = target / entry.name
            if copy.is_symlink():  # an absolute link inside would lead to the host's file
                copy.unlink()
            shutil.copyfile(entry, copy)


def copy_registry_settings(box: Container) -> None:
    """pip's site-wide configuration, the environment's pip and proxy settings, apt's proxies."""
    for name in ("etc/pip.conf", "etc/xdg/pip"):
        source = Path("/") / name
        if source.is_dir():
            shutil.copytree(source, box.root / name, dirs_exist_ok=True)
        elif source.is_file():
            shutil.copyfile(source, box.root / name)
    pip = {name[4:].lower().replace("_", "-"): os.environ[name] for name in PIP_VARIABLES if os.environ.get(name)}
    proxies = {name.lower(): os.environ[name] for name in PROXY_VARIABLES if os.environ.get(name)}
    if "https_proxy" in proxies:
        pip.setdefault("proxy", proxies["https_proxy"])
    if pip:
        conf = box.root / "etc" / "pip.conf"
        settings = configparser.ConfigParser(interpolation=None)
        settings.read(conf)
        if not settings.has_section("global"):
            settings.add_section("global")
        for key, value in pip.items():
            settings.set("global", key, value)
        with open(conf, "w") as out:
            settings.write(out)
    apt = subprocess.run(["apt-config", "dump"], capture_output=True, text=True).stdout \
        if shutil.which("apt-config") else ""
    lines = [line for line in apt.splitlines() if re.match(r"Acquire::\w+::Proxy", line, re.I)]
    lines += [f'Acquire::{scheme}::Proxy "{proxies[f"{scheme}_proxy"]}";' for scheme in ("http", "https")
              if f"{scheme}_proxy" in proxies]
    if lines:
        (box.root / "etc" / "apt" / "apt.conf.d" / "00host-proxy").write_text("\n".join(lines) + "\n")
    if proxies:
        environment = box.root / "etc" / "environment"
        environment.write_text("".join(f"{name}={value}\n" for name, value in proxies.items()))


def forget_package_lists(box: Container) -> None:
    """No package lists, as a fresh Debian image comes: the commands must fetch them."""
    box.run(["sh", "-c", "rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin"], check=True)


def copy_checkout(box: Container, user: str) -> str:
    """A copy of the checkout (without its venv and build leftovers) in `user`'s home; its path inside."""
    inside = f"{HOMES[user]}/atopgpud_tw"
    shutil.copytree(ROOT, box.root / inside.lstrip("/"), symlinks=True, ignore=shutil.ignore_patterns(
        ".venv", ".git", "build", "dist", "*.egg-info", "__pycache__", ".hypothesis", "_trial_temp",
        ".pytest_cache", ".ruff_cache", ".mypy_cache"))
    box.run(["chown", "-R", f"{user}:{user}", inside], check=True)
    return inside


def add_sudo_user(box: Container) -> None:
    """`USER`, with a home, who may run anything through sudo without a password."""
    box.run(["sh", "-c", "apt-get update -q && apt-get install -y -q --no-install-recommends sudo"],
            check=True, timeout=600)
    box.run(["useradd", "--create-home", "--shell", "/bin/bash", USER], check=True)
    box.write_file(f"/etc/sudoers.d/{USER}", f"{USER} ALL=(ALL) NOPASSWD: ALL\n", mode=0o440)


@pytest.fixture(params=["root", USER])
def machine(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[Container, str, str]]:
    """A fresh machine; who runs the commands (root: no sudo installed; `USER`: with sudo); the checkout."""
    user = request.param
    if os.geteuid() != 0 and in_ci():
        pytest.fail("CI=true and the README's commands cannot be tried: booting a container needs root",
                    pytrace=False)
    with booted(tmp_path / "nspawn", install=False, network=True) as box:
        copy_certificates(box)
        copy_registry_settings(box)
        if user == "root":
            assert box.run(["sh", "-c", "command -v sudo"]).returncode != 0, "the tree has sudo"
        else:
            add_sudo_user(box)
        forget_package_lists(box)
        yield box, user, copy_checkout(box, user)


def as_user(user: str, checkout: str, command: str) -> list[str]:
    """`command` run by ``sh`` in the checkout, with the user's own HOME and USER."""
    return ["env", f"HOME={HOMES[user]}", f"USER={user}", f"LOGNAME={user}", "sh", "-c",
            f"cd {shlex.quote(checkout)} && {command}"]


def run_shown(box: Container, user: str, checkout: str, command: str, timeout: float) -> str:
    """Run `command` as `user` in the checkout; its output, or AssertionError with it if it failed."""
    done = subprocess.run(box.command(as_user(user, checkout, command), None if user == "root" else user),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)
    assert done.returncode == 0, f"{command}\nexited {done.returncode} as {user}:\n{done.stdout[-6000:]}"
    return done.stdout


# -- the daemon's names on the host -----------------------------------------------------


def abstract_answers(name: str) -> bool:
    """Whether something accepts connections on the abstract socket @NAME (of this network namespace)."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(b"\0" + name.encode())
        return True
    except OSError:
        return False
    finally:
        probe.close()


@contextlib.contextmanager
def the_daemons_names() -> Iterator[None]:
    """@atopgpud_nvidia and TCP 127.0.0.1:59123 of the host, free and held for the test."""
    with port_lock(timeout=900):
        taken = port_taken()
        if taken is None and abstract_answers("atopgpud_nvidia"):
            taken = "something already answers on @atopgpud_nvidia"
        if taken:
            not_possible(f"the README's run command listens where the host's daemon would: {taken}")
        yield


def stop_group(proc: subprocess.Popen[str], timeout: float = 30.0) -> str:
    """SIGTERM to the command's process group (sh and the daemon); what it printed."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate(timeout=30)
    return out or ""


def serves(box: Container, user: str, checkout: str) -> bool:
    """Whether the daemon answers atopgpu with every GPU of the built-in scenario, on both endpoints."""
    for connect in (["--connect", "unix:@atopgpud_nvidia"], ["--connect", "tcp:127.0.0.1:59123", "--version", "1"]):
        done = box.run(as_user(user, checkout, shlex.join([".venv/bin/atopgpu", *connect, "--json"])),
                       user=None if user == "root" else user, timeout=30)
        if done.returncode != 0:
            return False
        gpus = json.loads(done.stdout)["gpus"]
        if len(gpus) != 2 or not all(gpu["samples"] >= 1 for gpu in gpus):
            return False
    return True


# -- the tests ------------------------------------------------------------------------------


def test_readme_set_up_commands_as_they_stand(machine: tuple[Container, str, str]) -> None:
    """The run command installs and starts the daemon, which serves until SIGTERM; then the test
    command installs what the tests need and runs them."""
    box, user, checkout = machine
    run_command, test_command = readme_commands()
    with the_daemons_names():
        daemon = box.popen(as_user(user, checkout, run_command), user=None if user == "root" else user,
                           stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + SETUP_SECONDS
            while not serves(box, user, checkout):
                assert daemon.poll() is None, f"the run command ended ({daemon.returncode}) as {user}:\n" \
                                              f"{stop_group(daemon)[-6000:]}"
                assert time.monotonic() < deadline, f"not serving within {SETUP_SECONDS} s"
                time.sleep(1.0)
        finally:
            out = stop_group(daemon)
        assert not abstract_answers("atopgpud_nvidia"), "the daemon still answers after SIGTERM"
    assert "Traceback" not in out, out[-6000:]
    assert "sudo: command not found" not in out
    owners = box.run(["stat", "-c", "%U", f"{checkout}/.venv/bin/atopgpud"], check=True).stdout.strip()
    assert owners == user  # installed as the user, not through sudo

    out = run_shown(box, user, checkout, f'{test_command} -m "not e2e" -q -p no:cacheprovider', timeout=1800)
    print(out[-1500:])
    assert re.search(r"^\d+ passed", out.splitlines()[-1]), out[-3000:]
    assert not re.search(r"\b\d+ (failed|errors?)\b", out.splitlines()[-1]), out[-6000:]
