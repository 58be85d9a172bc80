"""``atopgpu doctor``'s verdicts, each from the facts a broken (or healthy) host gives.

Quick: no process is started; NVML is the simulator's.  tests/test_doctor_boot.py
runs the command itself on booted hosts.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from scenarios import A10, H100

from atopgpud_tw import nvml_codes
from atopgpud_tw.atopgpu import cli, doctor
from atopgpud_tw.atopgpu.doctor import FAIL, NOTE, OK, Daemon, Host, Reach
from atopgpud_tw.sim import SimulatedNvml, binding_over, fresh_pynvml, parse_scenario

UNIX, TCP = (endpoint for endpoint, _, _ in doctor.SOCKETS)
#: /proc/self/mountinfo's /proc lines (the second, later mount, is the one in force)
MOUNTINFO = (
    "22 1 0:5 / /proc rw,nosuid,nodev,noexec,relatime shared:12 - proc proc rw\n"
    "25 22 0:22 / /proc/sys/fs/binfmt_misc rw,relatime shared:13 - autofs systemd-1 rw\n"
    "40 1 0:41 / /proc rw,nosuid,nodev,noexec,relatime - proc proc rw,hidepid=invisible,subset=pid\n"
)
#: Debian 12's atop.service as ``systemctl show`` gives it (its ExecStart= runs atop through sh -c)
ATOP_SHOW = {
    "LoadState": "loaded", "MainPID": "0",
    "ExecStart": "{ path=/bin/sh ; argv[]=/bin/sh -c exec /usr/bin/atop ${LOGOPTS} -w \"${LOGPATH}/atop_$(date "
                 "+%%Y%%m%%d)\" ${LOGINTERVAL} ; ignore_errors=no ; start_time=[n/a] ; pid=0 ; code=(null) }",
    "Environment": "LOGOPTS= LOGINTERVAL=600 LOGGENERATIONS=28 LOGPATH=/var/log/atop",
}


def healthy(**changes: object) -> Host:
    """A host where atop 2.8.1 (-k) gets its figures; `changes` break it."""
    options = {"listen": ["unix:@atopgpud_nvidia", "tcp:59123:interface=127.0.0.1"], "allow-uid": set(),
               "allow-gid": set(), "mig": "instances"}
    host = Host([Reach(UNIX, uid=998, devices=2), Reach(TCP, devices=2)], Daemon(40, frozenset({44}), options),
                (0, frozenset({0})), atop_version=(2, 8, 1), atop_needs_k=True, atop_unit="loaded",
                atop_args=["-k", "-w", "/var/log/atop/atop_20261204", "600"], driver="550.54.15",
                mig=[(0, 0), None], host_proc={"rw"}, unit_proc={"ProtectProc": "default", "ProcSubset": "all"})
    for name, value in changes.items():
        setattr(host, name, value)
    return host


def verdict(host: Host, name: str) -> doctor.Check:
    return next(check for check in doctor.verdicts(host) if check.name == name)


def test_a_healthy_host_passes_every_check() -> None:
    checks = doctor.verdicts(healthy())
    assert [c.name for c in checks] == [UNIX, TCP, "access", "atop", "atop.service", "NVML", "devices", "MIG", "/proc"]
    assert {c.status for c in checks} == {OK}, checks
    assert "uid 998" in checks[0].text and "2 devices" in checks[0].text


def test_the_socket_atop_uses_must_answer_the_other_need_not() -> None:
    gone = Reach(TCP, "connection refused; is atopgpud running?")
    daemon = Daemon(40, options={"listen": ["unix:@elsewhere"], "allow-uid": set(), "allow-gid": set()})
    check = verdict(healthy(reaches=[Reach(UNIX, "connection refused"), gone], daemon=daemon), TCP)
    assert check.status == FAIL and "listens on unix:@elsewhere" in check.text
    assert "--listen tcp:59123:interface=127.0.0.1" in check.fix
    assert verdict(healthy(reaches=[Reach(UNIX, "no such socket"), Reach(TCP, devices=2)]), UNIX).status == NOTE
    newer = healthy(atop_version=(2, 13, 0), reaches=[Reach(UNIX, "refused"), Reach(TCP, "refused")])
    assert verdict(newer, UNIX).status == FAIL and verdict(newer, TCP).status == NOTE
    assert "systemctl enable" in verdict(healthy(reaches=[Reach(UNIX, "x"), gone], daemon=None), TCP).fix


def test_a_refused_caller_fails_both_its_socket_and_access() -> None:
    options = {"listen": [], "allow-uid": {1001}, "allow-gid": set()}
    closed = Reach(UNIX, "the daemon closed the connection", refused=True, uid=998)
    host = healthy(reaches=[closed, Reach(TCP, devices=2)], daemon=Daemon(40, options=options),
                   caller=(4242, frozenset({4242})), atop_version=(2, 13, 0))
    assert verdict(host, UNIX).status == FAIL and "refused" in verdict(host, UNIX).text
    access = verdict(host, "access")
    assert access.status == FAIL and "uid 4242" in access.text and "--allow-uid 4242" in access.fix
    # atop 2.8.1 connects over TCP, which the allow-list does not guard
    old = healthy(reaches=host.reaches, daemon=host.daemon, caller=host.caller)
    assert verdict(old, UNIX).status == NOTE and "refused" in verdict(old, UNIX).text
    assert verdict(old, "access").status == OK and "TCP" in verdict(old, "access").text
    newer = {"atop_version": (2, 13, 0)}
    assert verdict(healthy(daemon=Daemon(40, options=options), **newer), "access").status == OK  # root
    by_group = {**options, "allow-gid": {4242}}
    assert verdict(healthy(daemon=Daemon(40, options=by_group), caller=(4242, frozenset({4242})), **newer),
                   "access").status == OK
    assert verdict(healthy(daemon=None), "access").status == NOTE


@pytest.mark.parametrize(("version", "status"), [(None, FAIL), ((2, 3, 2), FAIL), ((2, 8, 1), OK), ((2, 13, 0), OK)])
def test_atop_is_installed_and_new_enough(version: tuple[int, ...] | None, status: str) -> None:
    assert verdict(healthy(atop_version=version), "atop").status == status


def test_atop_service_without_k_fails_where_atop_needs_it() -> None:
    bare = ["-w", "/var/log/atop/atop_20261204", "600"]
    check = verdict(healthy(atop_args=bare), "atop.service")
    assert check.status == FAIL and "LOGOPTS" in check.fix
    assert verdict(healthy(atop_args=bare, atop_needs_k=False), "atop.service").status == OK
    assert verdict(healthy(atop_unit="masked", atop_args=None), "atop.service").status == NOTE


@pytest.mark.parametrize(("args", "given"), [
    (["-k"], True), (["-wk"], True), (["-kw", "f"], True), (["-P", "GPU", "-k"], True), (["-Pk"], False),
    (["--k"], False), (["-a", "1"], False),
])
def test_k_is_found_as_atops_getopt_finds_it(args: list[str], given: bool) -> None:
    assert doctor.has_k(args) is given


def test_atop_service_arguments_are_its_exec_start_expanded(tmp_path: Path) -> None:
    assert doctor.atop_unit_args(ATOP_SHOW) == ["-w", "/var/log/atop/atop_$(date", "+%%Y%%m%%d)", "600"]
    defaults = tmp_path / "atop"
    defaults.write_text('# /etc/default/atop\nLOGOPTS="-k"\nLOGINTERVAL=60\n')
    show = {**ATOP_SHOW, "EnvironmentFiles": f"{defaults} (ignore_errors=no)"}
    assert doctor.atop_unit_args(show) == ["-k", "-w", "/var/log/atop/atop_$(date", "+%%Y%%m%%d)", "60"]
    assert doctor.atop_unit_args({"LoadState": "masked"}) is None


def nvml_of(scenario: dict[str, object]) -> Host:
    host = healthy(driver="", mig=[])
    doctor.nvml_facts(host, binding_over(SimulatedNvml(parse_scenario(scenario))))
    return host


def test_nvml_gives_the_driver_and_each_cards_mig_mode() -> None:
    host = nvml_of({"gpus": [{**H100, "mig": []}, A10], "driver": "470"})
    assert verdict(host, "NVML").text == "loads; driver 470.256.02"
    assert host.mig[0] == (1, 1) and verdict(host, "MIG").status == OK and "GPU 0 in MIG" in verdict(host, "MIG").text


def test_nvml_that_cannot_start_fails_with_the_fix_for_its_error(tmp_path: Path) -> None:
    host = nvml_of({"gpus": [H100], "driver_loaded_file": str(tmp_path / "never")})
    assert verdict(host, "NVML").status == FAIL and "modprobe nvidia" in verdict(host, "NVML").fix
    assert verdict(host, "MIG").status == NOTE
    pynvml = fresh_pynvml()

    class NoLibrary:
        NVMLError = pynvml.NVMLError

        def nvmlInit(self) -> None:  # noqa: N802 (pynvml's name)
            raise pynvml.NVMLError(nvml_codes.LIBRARY_NOT_FOUND)

    host = healthy()
    doctor.nvml_facts(host, NoLibrary())
    check = verdict(host, "NVML")
    assert host.nvml_code == nvml_codes.LIBRARY_NOT_FOUND and "libnvidia-ml.so.1" in check.text
    assert check.fix == "install the NVIDIA driver"


def test_more_devices_than_atops_32_fail() -> None:
    assert verdict(healthy(reaches=[Reach(UNIX, devices=32), Reach(TCP, devices=32)]), "devices").status == OK
    check = verdict(healthy(reaches=[Reach(UNIX, devices=40), Reach(TCP, devices=32)], mig=[(1, 1)]), "devices")
    assert check.status == FAIL and "40 devices" in check.text and "--mig card" in check.fix
    # the daemon not reached: NVML's count
    unreached = [Reach(UNIX, "x"), Reach(TCP, "x")]
    assert verdict(healthy(reaches=unreached, mig=[None] * 33), "devices").status == FAIL
    assert verdict(healthy(reaches=unreached, nvml_error="x"), "devices").status == NOTE


def test_a_mig_mode_change_waiting_for_a_reset_fails() -> None:
    check = verdict(healthy(mig=[None, (0, 1)]), "MIG")
    assert check.status == FAIL and "GPU 1" in check.text and "nvidia-smi -r -i 1" in check.fix


def test_proc_options_are_those_of_the_last_proc_mount() -> None:
    assert {"hidepid=invisible", "subset=pid", "nosuid"} <= (doctor.proc_mount_options(MOUNTINFO) or set())
    assert doctor.proc_mount_options("") is None


def test_what_proc_hides_from_the_daemon_fails() -> None:
    hidden = Daemon(40, frozenset({44}), None, doctor.proc_mount_options(MOUNTINFO))
    check = verdict(healthy(daemon=hidden), "/proc")
    assert check.status == FAIL and "hidepid=invisible" in check.text and "subset=pid" in check.text
    assert "ProtectProc=default" in check.fix
    # not running: its unit's settings count
    assert verdict(healthy(daemon=None, unit_proc={"ProtectProc": "invisible"}), "/proc").status == FAIL
    # the host's own hidepid, with gid= a group of the daemon's: it sees everything
    on_host = healthy(host_proc={"hidepid=2", "gid=44"}, daemon=Daemon(40, frozenset({44})))
    assert verdict(on_host, "/proc").status == OK
    check = verdict(healthy(host_proc={"hidepid=2"}, daemon=Daemon(40, frozenset({44}))), "/proc")
    assert check.status == FAIL and "fstab" in check.fix


def test_the_command_prints_a_line_per_check_and_fails_when_one_fails(monkeypatch: pytest.MonkeyPatch,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(doctor, "gather", lambda: healthy())
    assert cli.main(["doctor"]) == 0  # the atopgpu command's subcommand
    assert len(capsys.readouterr().out.splitlines()) == 9
    monkeypatch.setattr(doctor, "gather", lambda: healthy(atop_version=None))
    assert doctor.main(["--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is False and report["checks"][3] == {
        "name": "atop", "status": FAIL, "text": "atop is not installed (or not on PATH)", "fix": "apt-get install atop"}
