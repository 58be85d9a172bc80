"""The ``atopgpu`` command against a simulated daemon, and against replies it must refuse."""

from __future__ import annotations

import json
import os
import pwd
import socket
import subprocess
import sys
import threading
import uuid
from pathlib import Path
from typing import Iterator, Sequence

import pytest
from daemon import free_port, run_daemon
from scenarios import A10, H100

from atopgpud_tw import codec
from atopgpud_tw.atopgpu import cli
from atopgpud_tw.atopgpu import connection as client

INTERVAL = 0.2
#: above the largest pid_max Linux allows (2**22): no process can have it
ABSENT_PID = 4_194_305
MY_PID = os.getpid()
SCENARIO = {
    "gpus": [
        {
            **H100,
            "processes": [
                {"pid": MY_PID, "type": "C", "memory_mib": 1024, "sm_util": 30, "mem_util": 5},
                {"pid": ABSENT_PID, "type": "G", "memory_mib": 512, "sm_util": 20, "mem_util": 2},
            ],
        },
        A10,
    ]
}
MIB_KIB = 1024



@pytest.fixture(scope="module")
def port() -> int:
    return free_port()


@pytest.fixture(scope="module")
def daemon(tmp_path_factory, port):
    args = ["--interval", str(INTERVAL), "--listen", f"tcp:{port}:interface=127.0.0.1"]
    with run_daemon(tmp_path_factory.mktemp("cli"), args, scenario=SCENARIO) as started:
        started.wait_samples(3)
        yield started


def run(capsys, *args: str) -> tuple[int, str, str]:
    status = cli.main(list(args))
    out, err = capsys.readouterr()
    return status, out, err


def my_comm() -> str:
    return Path("/proc/self/comm").read_text().rstrip("\n")


@pytest.mark.e2e
def test_table_shows_the_scenario(daemon, capsys):
    """The table has a row per GPU with busy now, average, memory, and its processes."""
    status, out, err = run(capsys, "--connect", f"unix:@{daemon.name}")
    assert (status, err) == (0, "")
    lines = out.splitlines()
    assert "since the daemon started" in lines[0]
    gpu_a = next(line for line in lines if "00000000:17:00.0" in line).split()
    assert gpu_a[1:3] == ["00000000:17:00.0", "NVIDIA_H100_80GB_HBM3"]
    assert gpu_a[3:8] == ["40%", "40.0%", "10.0%", "2.0G", "79.6G"]
    gpu_b = next(line for line in lines if "00000000:65:00.0" in line).split()
    assert gpu_b[3:6] == ["-", "-", "-"]
    mine = next(line for line in lines if line.split()[0] == str(MY_PID)).split()
    me = pwd.getpwuid(os.getuid()).pw_name
    assert mine[1:5] == ["A", "C", me, my_comm()] and mine[6:9] == ["1.0G", "30.0%", "5.0%"]
    absent = next(line for line in lines if line.split()[0] == str(ABSENT_PID)).split()
    assert absent[1:9] == ["A", "G", "-", "-", "unknown", "512M", "20.0%", "2.0%"]


def test_json_matches_the_scenario(daemon, capsys):
    """--json gives the same figures: averages, memory in KiB, null for unsupported."""
    status, out, err = run(capsys, "--connect", f"unix:@{daemon.name}", "--json")
    assert (status, err) == (0, "")
    doc = json.loads(out)
    assert (doc["version"], doc["span"], doc["seconds"]) == (2, "start", None)
    a, b = doc["gpus"]
    n = a["samples"]
    assert n >= 3 and a["counters"]["samples"] == n
    assert (a["busid"], a["type"], a["task_support"]) == ("00000000:17:00.0", "NVIDIA_H100_80GB_HBM3", 3)
    assert (a["gpu_busy_now"], a["mem_busy_now"]) == (40, 10)
    assert (a["gpu_busy_avg"], a["mem_busy_avg"]) == (40.0, 10.0)
    assert a["counters"]["gpuperccum"] == 40 * n
    assert (a["memory_total_kib"], a["memory_used_kib"]) == (81559 * MIB_KIB, 2048 * MIB_KIB)
    assert a["memory_used_avg_kib"] == 2048 * MIB_KIB
    procs = {p["pid"]: p for p in a["processes"]}
    assert set(procs) == {MY_PID, ABSENT_PID}
    mine, absent = procs[MY_PID], procs[ABSENT_PID]
    assert (mine["state"], mine["type"], mine["command"]) == ("active", "C", my_comm())
    assert (mine["memory_kib"], mine["gpu_busy_avg"], mine["mem_busy_avg"]) == (1024 * MIB_KIB, 30.0, 5.0)
    assert (absent["type"], absent["command"], absent["memory_kib"]) == ("G", None, 512 * MIB_KIB)
    assert absent["gpu_busy_avg"] == 20.0
    assert (b["gpu_busy_now"], b["gpu_busy_avg"], b["mem_busy_avg"]) == (None, None, None)
    assert (b["counters"]["gpuperccum"], b["memory_used_kib"]) == (-1, 100 * MIB_KIB)


def test_version_1_averages_are_the_same(daemon, capsys):
    """Version 1 sends process averages; the figures shown agree with version 2's."""
    status, out, _ = run(capsys, "--connect", f"unix:@{daemon.name}", "--json", "--version", "1")
    doc = json.loads(out)
    assert (status, doc["version"]) == (0, 1)
    procs = {p["pid"]: p for p in doc["gpus"][0]["processes"]}
    assert (procs[MY_PID]["type"], procs[MY_PID]["gpu_busy_avg"]) == (None, 30.0)
    assert doc["gpus"][0]["gpu_busy_avg"] == 40.0


@pytest.mark.parametrize("form", ["tcp:{port}:interface=127.0.0.1", "tcp:127.0.0.1:{port}"])
def test_tcp_endpoints_reach_the_daemon(daemon, port, capsys, form):
    """Both TCP forms connect, as old atop does with version 1."""
    status, out, err = run(capsys, "--connect", form.format(port=port), "--json", "--version", "1")
    assert (status, err) == (0, "")
    assert json.loads(out)["gpus"][0]["busid"] == "00000000:17:00.0"


def test_watch_shows_deltas(daemon, capsys):
    """--watch reports figures over each interval: samples and averages from differences."""
    args = ["--connect", f"unix:@{daemon.name}", "--json", "--watch", "0.3", "--count", "3"]
    status, out, err = run(capsys, *args)
    assert (status, err) == (0, "")
    docs = [json.loads(line) for line in out.splitlines()]
    assert [d["span"] for d in docs] == ["start", "interval", "interval"]
    for before, after in zip(docs, docs[1:]):
        gpu, old = after["gpus"][0], before["gpus"][0]
        assert gpu["samples"] == gpu["counters"]["samples"] - old["counters"]["samples"]
        if gpu["samples"]:
            delta = gpu["counters"]["gpuperccum"] - old["counters"]["gpuperccum"]
            assert gpu["gpu_busy_avg"] == round(delta / gpu["samples"], 2) == 40.0
        assert after["seconds"] > 0


def test_watch_table_repeats_with_intervals(daemon, capsys):
    """The table form of --watch prints one block per report, later ones per interval."""
    status, out, _ = run(capsys, "--connect", f"unix:@{daemon.name}", "--watch", "0.2", "--count", "2")
    assert status == 0
    headers = [line for line in out.splitlines() if line.startswith("atopgpud at")]
    assert len(headers) == 2
    assert "since the daemon started" in headers[0] and "over the last" in headers[1]


def reading(samples: int, cum: int, proc_samples: int, proc_cum: int) -> client.Reading:
    proc = codec.ProcessStats("A", 7, "C", proc_cum, 0, 100, 100 * proc_samples, proc_samples)
    dev = codec.DeviceStats(50, 0, 1000, 100, samples, cum, 0, 100 * samples, (proc,))
    return client.Reading(2, (codec.DeviceType("00000000:17:00.0", "X", 3),), (dev,), float(samples))


def test_report_over_an_interval_uses_differences():
    """An interval's average is Δsum/Δsamples, not the average since start."""
    first, second = reading(10, 100, 10, 50), reading(20, 1100, 20, 1050)
    gpu = cli.report(second, first, "x")["gpus"][0]
    assert (gpu["samples"], gpu["gpu_busy_avg"]) == (10, 100.0)
    assert cli.report(second, None, "x")["gpus"][0]["gpu_busy_avg"] == 55.0
    proc = gpu["processes"][0]
    assert (proc["samples"], proc["gpu_busy_avg"]) == (10, 100.0)


@pytest.mark.e2e
def test_console_script_is_installed(daemon):
    """The installed `atopgpu` script runs the command."""
    script = Path(sys.executable).with_name("atopgpu")
    result = subprocess.run(
        [str(script), "--connect", f"unix:@{daemon.name}", "--json"], capture_output=True, timeout=30
    )
    assert result.returncode == 0, result.stderr
    assert len(json.loads(result.stdout)["gpus"]) == 2


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("unix:@atopgpud_nvidia", (socket.AF_UNIX, b"\0atopgpud_nvidia")),
        ("unix:/run/atopgpud.sock:mode=660", (socket.AF_UNIX, "/run/atopgpud.sock")),
        ("unix:address=/run/a.sock", (socket.AF_UNIX, "/run/a.sock")),
        ("tcp:59123:interface=127.0.0.1", (socket.AF_INET, ("127.0.0.1", 59123))),
        ("tcp:localhost:59123", (socket.AF_INET, ("localhost", 59123))),
        ("tcp:59123", (socket.AF_INET, ("127.0.0.1", 59123))),
        ("tcp6:59123:interface=\\:\\:1", (socket.AF_INET6, ("::1", 59123))),
    ],
)
def test_endpoint_forms(text, expected):
    """--connect takes the daemon's --listen forms and the client form tcp:HOST:PORT."""
    address = client.parse_endpoint(text)
    assert (address.family, address.target) == expected


@pytest.mark.parametrize("text", ["unix:@", "tcp:x", "tcp:1:2:3", "tcp:70000", "ssl:443", "unix:"])
def test_bad_endpoint_is_a_usage_error(text, capsys):
    """A --connect that is no endpoint is refused before connecting (status 2)."""
    with pytest.raises(SystemExit) as raised:
        cli.main(["--connect", text])
    assert raised.value.code == 2
    assert "--connect" in capsys.readouterr().err


def test_count_needs_watch(capsys):
    """--count alone is a usage error."""
    with pytest.raises(SystemExit) as raised:
        cli.main(["--count", "2"])
    assert raised.value.code == 2


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--watch", "abc"], "argument --watch: 'abc' is not a number of seconds from 0.05 to 1e6"),
        (["--watch", "0.001"], "argument --watch: '0.001' is not a number of seconds from 0.05 to 1e6"),
        (["--watch", "nan"], "argument --watch: 'nan' is not a number of seconds from 0.05 to 1e6"),
        (["--watch", "1", "--count", "-2"], "argument --count: '-2' is not a positive integer"),
    ],
)
def test_bad_watch_and_count_say_what_they_want(capsys, args, words):
    """A bad --watch or --count is named with what it wants (status 2), not a function name."""
    with pytest.raises(SystemExit) as raised:
        cli.main(args)
    assert raised.value.code == 2
    err = capsys.readouterr().err
    assert err == f"atopgpu: {words} (try atopgpu --help)\n"
    assert "_positive" not in err and "Traceback" not in err


def assert_one_line_error(status: int, out: str, err: str, expected_status: int, words: str) -> None:
    assert status == expected_status
    assert out == ""
    assert err.startswith("atopgpu: ") and err.endswith("\n") and err.count("\n") == 1, err
    assert words in err


def test_no_daemon_on_abstract_socket(capsys):
    """Nobody listening: one line, status 1."""
    status, out, err = run(capsys, "--connect", f"unix:@atopgpud-test-{uuid.uuid4().hex}")
    assert_one_line_error(status, out, err, 1, "is atopgpud running?")


def test_no_such_socket_file(tmp_path, capsys):
    """A socket path that does not exist: one line, status 1."""
    status, out, err = run(capsys, "--connect", f"unix:{tmp_path / 'none.sock'}")
    assert_one_line_error(status, out, err, 1, "no such socket")


def test_tcp_connection_refused(capsys):
    """A TCP port nobody listens on: one line, status 1."""
    status, out, err = run(capsys, "--connect", f"tcp:127.0.0.1:{free_port()}")
    assert_one_line_error(status, out, err, 1, "connection refused")


class FakeDaemon:
    """Answers the requests of each connection with scripted raw bytes, then closes.

    With `hold`, the connection stays open after the last reply, silent.
    """

    def __init__(self, replies: Sequence[bytes], hold: bool = False) -> None:
        self.name = f"atopgpud-test-{uuid.uuid4().hex[:12]}"
        self.replies = list(replies)
        self.hold = hold
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(b"\0" + self.name.encode())
        self.listener.listen(4)
        self.listener.settimeout(0.05)
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.stopping.is_set():
            try:
                conn, _ = self.listener.accept()
            except (TimeoutError, OSError):
                continue
            with conn:
                conn.settimeout(5)
                for reply in self.replies:
                    if len(conn.recv(2)) < 2:
                        break
                    if reply:
                        conn.sendall(reply)
                if self.hold:
                    self.stopping.wait(10)

    def stop(self) -> None:
        self.stopping.set()
        # a connection wakes the accept at once, not at its next 0.05 s timeout
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as wake:
            try:
                wake.connect(b"\0" + self.name.encode())
            except OSError:
                pass
        self.thread.join(5)
        self.listener.close()


@pytest.fixture
def fake() -> Iterator:
    started: list[FakeDaemon] = []

    def start(*replies: bytes, hold: bool = False) -> FakeDaemon:
        started.append(FakeDaemon(replies, hold))
        return started[-1]

    yield start
    for server in started:
        server.stop()


GOOD_T = codec.frame(2, b"1@00000000:17:00.0 NVIDIA_A10 3")
GOOD_S = b"@40 10 1000 100 2 80 20 200#A 7 C 60 10 50 100 2"


def raw(version: int, length: int, body: bytes) -> bytes:
    return codec.PRELUDE.pack(version << 24 | length) + body


@pytest.mark.parametrize(
    ("replies", "words"),
    [
        ([codec.frame(1, b"1@a b 3")], "asked for API version 2, the T reply is version 1"),
        ([GOOD_T, raw(2, 100, GOOD_S[:10])], "announces 100 bytes but only 10 came"),
        ([raw(2, 9000, b"")], "over atop's limit of 8192"),
        ([codec.frame(2, b"2@a b 3")], "malformed T reply"),
        ([GOOD_T, codec.frame(2, GOOD_S.replace(b"@40", b"@4x"))], "malformed S reply: non-numeric"),
        ([GOOD_T, codec.frame(2, GOOD_S.replace(b"#A 7 C", b"#A 7 C 1"))], "malformed S reply"),
        ([GOOD_T, codec.frame(2, GOOD_S.replace(b"@40", b"@+40"))], "non-numeric"),
        ([GOOD_T, codec.frame(2, GOOD_S.replace(b"@40", b"@101"))], "gpupercnow 101 is outside -1..100"),
        ([GOOD_T, codec.frame(2, GOOD_S.replace(b" 80 ", b" 201 "))], "gpuperccum 201"),
        ([GOOD_T, codec.frame(2, GOOD_S + b"@" + GOOD_S[1:]), GOOD_T], "lists 1 GPUs, the S reply 2"),
        ([GOOD_T, codec.frame(2, GOOD_S.replace(b" 1000 ", b" " + b"9" * 4000 + b" "))], "beyond 64 bits"),
        ([GOOD_T, codec.frame(2, GOOD_S.replace(b" 200#", b" 9223372036854775808#"))], "beyond 64 bits"),
        ([GOOD_T, codec.frame(2, GOOD_S.replace(b" 50 100", b" 50 -" + b"9" * 30))], "beyond 64 bits"),
        ([codec.frame(2, b"9" * 4000 + b"@a b 3")], "malformed T reply: a field of the T count is beyond 64 bits"),
        ([GOOD_T + b"xx"], "more bytes than its prelude announces"),
        ([b""], "closed the connection instead of answering"),
    ],
)
def test_bad_replies_are_one_line_errors(fake, capsys, replies, words):
    """Each kind of bad reply is named in one line on stderr, status 3."""
    server = fake(*replies)
    status, out, err = run(capsys, "--connect", f"unix:@{server.name}")
    assert_one_line_error(status, out, err, 3, words)


def test_silent_daemon_times_out(fake, capsys, monkeypatch):
    """No reply within the read timeout (2 s, like atop; shortened here): status 1."""
    monkeypatch.setattr(client, "READ_TIMEOUT", 0.1)
    server = fake(b"", hold=True)
    status, out, err = run(capsys, "--connect", f"unix:@{server.name}")
    assert_one_line_error(status, out, err, 1, "no reply to the T request within 0.1 s")


def test_reply_that_stops_short_times_out(fake, capsys, monkeypatch):
    """A prelude announcing more than ever arrives, connection left open: status 3."""
    monkeypatch.setattr(client, "READ_TIMEOUT", 0.1)
    server = fake(raw(2, 100, b"1@a b 3"), hold=True)
    status, out, err = run(capsys, "--connect", f"unix:@{server.name}")
    assert_one_line_error(status, out, err, 3, "stopped after 7 of 100 bytes")


def test_good_fake_reply_is_shown(fake, capsys):
    """The checks pass a well-formed reply through: figures from its counters."""
    server = fake(GOOD_T, codec.frame(2, GOOD_S))
    status, out, err = run(capsys, "--connect", f"unix:@{server.name}", "--json")
    assert (status, err) == (0, "")
    gpu = json.loads(out)["gpus"][0]
    assert (gpu["gpu_busy_avg"], gpu["memory_used_avg_kib"], gpu["processes"][0]["gpu_busy_avg"]) == (
        40.0,
        100.0,
        30.0,
    )


#: what a hostile name sends a terminal: clear the screen, set the window title
HOSTILE = "\x1b[2J\x1b]0;PWN\x07"
#: the same name as atopgpu shows it
SHOWN = "\\x1b[2J\\x1b]0;PWN\\x07"


def controls(text: str) -> list[str]:
    """The characters of `text` a terminal would act on (a newline ends a line: allowed)."""
    return [c for c in text if (ord(c) < 0x20 and c != "\n") or 0x7F <= ord(c) <= 0x9F]


@pytest.fixture
def renamed() -> Iterator[int]:
    """A process that named itself HOSTILE with prctl(PR_SET_NAME), as any local user can."""
    code = (
        "import ctypes, sys, time\n"
        f"ctypes.CDLL(None).prctl(15, {HOSTILE.encode()!r})\n"
        "print('named', flush=True)\n"
        "time.sleep(60)\n"
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline() == "named\n"
        assert Path(f"/proc/{child.pid}/comm").read_text() == HOSTILE + "\n"
        yield child.pid
    finally:
        child.kill()
        child.wait()


def hostile_replies(pid: int) -> tuple[bytes, bytes]:
    """A daemon's T naming its GPU and bus id with escapes, and an S listing `pid`."""
    types = codec.frame(2, f"1@{HOSTILE}:17:00.0 NVIDIA_{HOSTILE} 3".encode())
    return types, codec.frame(2, GOOD_S.replace(b"#A 7 C", f"#A {pid} C".encode()))


@pytest.mark.e2e
def test_names_from_outside_are_shown_as_data_in_the_table(fake, capsys, renamed):
    """A process's comm, a daemon's T name and bus id: escapes shown as \\x1b, never sent to the terminal."""
    server = fake(*hostile_replies(renamed))
    status, out, err = run(capsys, "--connect", f"unix:@{server.name}")
    assert (status, err) == (0, "")
    assert controls(out) == []
    gpu = next(line for line in out.splitlines() if line.startswith("  0"))
    assert gpu.split()[1:3] == [f"{SHOWN}:17:00.0", f"NVIDIA_{SHOWN}"]
    proc = next(line for line in out.splitlines() if line.split()[0] == str(renamed))
    assert proc.split()[4] == SHOWN


@pytest.mark.e2e
def test_json_keeps_the_names_exact_and_escaped(fake, capsys, renamed):
    """--json: the names as they are once parsed, escaped by JSON in the text (no raw control character)."""
    server = fake(*hostile_replies(renamed))
    status, out, err = run(capsys, "--connect", f"unix:@{server.name}", "--json")
    assert (status, err) == (0, "")
    assert controls(out) == []
    gpu = json.loads(out)["gpus"][0]
    assert (gpu["busid"], gpu["type"], gpu["processes"][0]["command"]) == (
        f"{HOSTILE}:17:00.0", f"NVIDIA_{HOSTILE}", HOSTILE,
    )


def test_an_error_quoting_outside_text_is_one_line_of_data(capsys, monkeypatch):
    """An error message is written as data too: its escapes and newlines cannot reach the terminal."""

    def failing(args: object) -> None:
        raise client.BadReply(f"{HOSTILE}\nsecond line\x9b31m")

    monkeypatch.setattr(cli, "run", failing)
    status, out, err = run(capsys, "--connect", "unix:@x")
    assert_one_line_error(status, out, err, 3, f"{SHOWN}\\x0asecond line\\x9b31m")
    assert controls(err) == []


def test_printable_escapes_what_a_terminal_acts_on():
    """C0, DEL, C1 and the invisible format characters become visible escapes; the rest is left as it is."""
    assert codec.printable("NVIDIA H100 80GB HBM3") == "NVIDIA H100 80GB HBM3"
    assert codec.printable("café™ ü") == "café™ ü"
    assert codec.printable(HOSTILE) == SHOWN
    assert codec.printable("a\tb\nc\rd\x00\x7f\x85\x9b") == "a\\x09b\\x0ac\\x0dd\\x00\\x7f\\x85\\x9b"
    assert codec.printable("abc\u202etxt.exe\u2028") == "abc\\u202etxt.exe\\u2028"
    assert codec.printable("\U000e0041") == "\\U000e0041"
    assert codec.printable("") == ""


def test_a_daemon_without_p_is_read_without_users(fake, capsys):
    """A daemon that does not know P closes the connection: atopgpu shows no user or workload, and
    with --watch goes on over a new connection without asking P again."""
    server = fake(GOOD_T, codec.frame(2, GOOD_S))
    status, out, err = run(capsys, "--connect", f"unix:@{server.name}", "--json", "--watch", "0.05", "--count", "2")
    assert (status, err) == (0, "")
    docs = [json.loads(line) for line in out.splitlines()]
    processes = [proc for doc in docs for gpu in doc["gpus"] for proc in gpu["processes"]]
    assert len(docs) == 2 and processes and all(p["workload"] is None and p["user"] is None for p in processes)
