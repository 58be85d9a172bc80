"""Start-up through the installed daemon: an NVML call that hangs while the reader opens, and a
driver that is not loaded yet, each said on standard error or in the log and to systemd
(a NOTIFY_SOCKET of the test's own), and what follows: exit status 1, the fall-back of
``--reader auto`` to nvidia-smi, or READY=1 once the driver has come."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from daemon import Client, smi_stand_in, stop_process, unique_name

import atopgpud_tw.sim

pytestmark = pytest.mark.e2e

ATOPGPUD = str(Path(sys.executable).with_name("atopgpud"))
SHIM = str(Path(atopgpud_tw.sim.__file__).parent / "shim")
FIXTURES = Path(__file__).parent / "fixtures" / "smi"
HUNG_UUID = {"gpus": [{"busid": "00000000:17:00.0"}, {"busid": "00000000:65:00.0",
                                                     "faults": [{"call": "nvmlDeviceGetUUID", "error": "hang",
                                                                 "until": 3600}]}]}


class Listener:
    """A NOTIFY_SOCKET of the test's own: what the daemon tells systemd."""

    def __init__(self) -> None:
        self.name = unique_name("notify")
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(b"\0" + self.name.encode())

    def messages(self, timeout: float, until: str | None = None) -> list[dict[str, str]]:
        """Every message that comes within `timeout` seconds (up to the first with the field `until`)."""
        found = []
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            self.sock.settimeout(left)
            try:
                data = self.sock.recv(4096).decode()
            except TimeoutError:
                break
            found.append(dict(line.split("=", 1) for line in data.splitlines()))
            if until is not None and until in found[-1]:
                break
        return found

    def close(self) -> None:
        self.sock.close()


def start(tmp_path: Path, listener: Listener, args: list[str], env: dict[str, str] | None = None,
          scenario: Any = None) -> tuple[subprocess.Popen[bytes], Path, Path, str]:
    """The daemon with its standard error and its log (standard output) apart."""
    name = unique_name()
    if scenario is not None:
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(scenario))
        args = [*args, "--scenario", str(path)] if "--reader" in args and "sim" in args else args
        env = {**(env or {}), "ATOPGPUD_SCENARIO": str(path)}
    out, err = tmp_path / f"{name}.out", tmp_path / f"{name}.err"
    environ = {**os.environ, **(env or {}), "NOTIFY_SOCKET": "@" + listener.name}
    proc = subprocess.Popen([ATOPGPUD, "--listen", f"unix:@{name}", *args], env=environ,
                            stdout=out.open("wb"), stderr=err.open("wb"), stdin=subprocess.DEVNULL)
    return proc, out, err, name


def types_on(name: str) -> list:
    """The T reply of the daemon on the abstract socket `name`."""
    client = Client(b"\0" + name.encode())
    try:
        return client.types()
    finally:
        client.close()


def test_a_call_hung_at_start_up_is_said_and_ends_start_up(tmp_path: Path) -> None:
    """nvmlDeviceGetUUID hangs from its first call: after --hang-warning one line naming the
    call and the GPU (standard error, and systemd's status), after --start-timeout exit status 1
    with that line; never READY=1."""
    listener = Listener()
    began = time.monotonic()
    proc, out, err, _ = start(tmp_path, listener, ["--reader", "sim", "--hang-warning", "1",
                                                   "--start-timeout", "3"], scenario=HUNG_UUID)
    try:
        status = proc.wait(30)
        took = time.monotonic() - began
        messages = listener.messages(0.2)
    finally:
        stop_process(proc)
        listener.close()
    said = err.read_text().splitlines()
    call = "NVML call nvmlDeviceGetUUID on GPU 00000000:65:00.0"
    assert status == 1, (said, out.read_text())
    assert said == [
        f"atopgpud: sim: {call} has not returned for 1 s; start-up waits for it up to 3 s (--start-timeout)",
        f"atopgpud: sim: {call} has not returned after 3 s (--start-timeout)",
    ], said
    assert 3 <= took < 15, took
    assert messages == [{"STATUS": f"starting: {said[0].removeprefix('atopgpud: ')}"}], messages


@pytest.mark.parametrize("hang", [True, False])
def test_reader_auto_falls_back_to_nvidia_smi_after_a_start_up_hang(tmp_path: Path, hang: bool) -> None:
    """--reader auto over the real nvidia-ml-py on the simulated library (the shim): a hung
    nvmlDeviceGetUUID makes it say so and read through nvidia-smi after --start-timeout; without
    the hang it reads through NVML, and says nothing on standard error."""
    smi = smi_stand_in(tmp_path, FIXTURES / "agree-mixed-host.xml", FIXTURES / "agree-mixed-host-list.txt")
    listener = Listener()
    scenario = HUNG_UUID if hang else {"gpus": HUNG_UUID["gpus"][:1]}
    proc, out, err, name = start(tmp_path, listener, ["--reader", "auto", "--nvidia-smi", str(smi),
                                                      "--hang-warning", "1", "--start-timeout", "2"],
                                 env={"PYTHONPATH": SHIM}, scenario=scenario)
    try:
        ready = [m for m in listener.messages(20, until="READY") if "READY" in m]
        assert ready, (err.read_text(), out.read_text())
        types = types_on(name)
    finally:
        stop_process(proc)
        listener.close()
    said = err.read_text().splitlines()
    if hang:
        assert said[-1] == ("atopgpud: nvml: NVML call nvmlDeviceGetUUID on GPU 00000000:65:00.0 has not "
                            "returned after 2 s (--start-timeout); trying nvidia-smi"), said
        assert ready[0]["STATUS"].startswith("nvidia-smi: "), ready
        assert "reading GPUs through nvidia-smi" in out.read_text()
        assert len(types) >= 1
    else:
        assert said == [], said
        assert ready[0]["STATUS"] == "nvml: 1 GPU", ready
        assert len(types) == 1


def test_a_driver_loaded_after_start_up_is_waited_for_before_ready(tmp_path: Path) -> None:
    """The simulated driver is loaded (its file made) 3 s after start: the daemon starts, says
    what it waits for (log, status line) without READY=1, then READY=1 with both GPUs, and T
    lists them."""
    loaded = tmp_path / "driver-loaded"
    scenario = {"gpus": [{"busid": "00000000:17:00.0"}, {"busid": "00000000:65:00.0"}],
                "driver_loaded_file": str(loaded)}
    listener = Listener()
    proc, out, err, name = start(tmp_path, listener, ["--reader", "sim", "--interval", "0.5"], scenario=scenario)
    try:
        waiting = listener.messages(3)
        loaded.touch()
        after = listener.messages(5, until="READY")
        types = types_on(name)
    finally:
        stop_process(proc)
        listener.close()
    log = out.read_text()
    assert waiting and all("READY" not in m for m in waiting), (waiting, log)
    assert waiting[0] == {"STATUS": "sim: 0 GPUs; waiting for the NVIDIA driver (DRIVER_NOT_LOADED)"}, waiting
    assert after[0] == {"READY": "1", "STATUS": "sim: 2 GPUs"}, after
    assert len(types) == 2
    assert log.count("the NVIDIA driver is not loaded (at boot") == 1, log
    assert log.count("nvml: the NVIDIA driver answers after ") == 1, log
    assert err.read_text() == ""


def test_a_driver_upgraded_beneath_the_daemon_is_said_once_each_way(tmp_path: Path) -> None:
    """LIB_RM_VERSION_MISMATCH from every call for 2 s while serving: one warning with the cause
    and what to do, the status line says what it waits for, one line when NVML works again."""
    scenario = {"gpus": [{"busid": "00000000:17:00.0"}, {"busid": "00000000:65:00.0"}],
                "faults": [{"call": "*", "error": "NVML_ERROR_LIB_RM_VERSION_MISMATCH", "from": 1, "until": 3}]}
    listener = Listener()
    proc, out, err, _ = start(tmp_path, listener, ["--reader", "sim", "--interval", "0.5"], scenario=scenario)
    try:
        deadline = time.monotonic() + 20
        while "NVML works again" not in out.read_text() and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(1.5)
    finally:
        stop_process(proc)
        listener.close()
    log = out.read_text()
    assert log.count("NVML_ERROR_LIB_RM_VERSION_MISMATCH") == 2, log  # the warning, and the recovery naming it
    assert log.count("usually because the driver was upgraded and its module not yet reloaded (reboot, or unload "
                     "and load the nvidia modules)") == 1, log
    assert log.count("nvml: NVML works again after ") == 1, log
    assert "recovered" not in log and "#error" not in log, log
