"""Hostile input: any byte stream, split anywhere, is handled without harm; bad files
and option values are one line and a non-zero exit, never a traceback or a hang."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path

import pytest
from connections import connect, replies, turns
from hypothesis import example, given, settings
from hypothesis import strategies as st
from snapshots import dev, proc, snap
from twisted.internet.testing import MemoryReactorClock

from atopgpud_tw import __main__ as console
from atopgpud_tw import codec, tap
from atopgpud_tw.server.atop.board import Board
from atopgpud_tw.sim import ScenarioError, load_scenario
from atopgpud_tw.sim.replay import RecordingError, load_recording
from atopgpud_tw.snapshot import Snapshot

VALID = [b"T\x00", b"T\x01", b"T\x02", b"S\x00", b"S\x01", b"S\x02", b"S\x07"]


@functools.cache
def busy_snapshot() -> Snapshot:
    """8 GPUs of 40 processes each (a Snapshot is immutable: built once, folded into every new Board)."""
    devices = [dev(f"g{g}", processes=tuple(proc(1000 * g + p, memory=p * 999) for p in range(40))) for g in range(8)]
    return snap(*devices)


def busy_board() -> Board:
    board = Board()
    board.fold(busy_snapshot())
    return board


@functools.cache
def devices_in(body: bytes, version: int) -> int:
    """How many devices an S reply lists (parsed once per distinct reply: the parse is a pure function)."""
    return len(codec.parse_stats(body, version))


def expected_replies(stream: bytes) -> int:
    """How many requests come before the first invalid one."""
    count = 0
    for i in range(0, len(stream) - len(stream) % 2, 2):
        if stream[i] not in codec.COMMANDS:
            break
        count += 1
    return count


def chunks(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts} | {0, len(data)})
    return [data[a:b] for a, b in zip(points, points[1:])]


streams = st.one_of(
    st.binary(max_size=64),
    st.lists(st.sampled_from(VALID), max_size=20).map(b"".join),
    st.tuples(st.lists(st.sampled_from(VALID), max_size=8), st.binary(max_size=8)).map(
        lambda t: b"".join(t[0]) + t[1]
    ),
)


@settings(max_examples=300, deadline=None)
@given(stream=streams, cuts=st.lists(st.integers(min_value=0, max_value=200), max_size=10))
@example(stream=b"S\x02P\x02T\x02", cuts=[3])  # atopgpu's P among atop's requests
def test_any_stream_in_any_split_is_answered_safely(stream, cuts):
    """Never raises, never over 8192 bytes, answers exactly the valid prefix, others unaffected."""
    board = busy_board()
    protocol, transport = connect(board)
    bystander, bystander_transport = connect(board)
    for chunk in chunks(stream, cuts):
        protocol.dataReceived(chunk)
    turns(protocol)
    got = replies(transport.value())
    assert len(got) == expected_replies(stream)
    for index, (version, body) in enumerate(got):
        if stream[2 * index] != codec.COMMAND_CONTEXTS:  # atopgpu's own, beyond atop's limit
            assert 4 + len(body) <= codec.ATOP_REPLY_LIMIT
        assert version in (1, 2)
    invalid = len(got) < len(stream) // 2
    assert transport.disconnecting == invalid
    bystander.dataReceived(b"S\x02")
    ((version, body),) = replies(bystander_transport.value())
    assert devices_in(body, version) == 8 and not bystander_transport.disconnecting


@settings(max_examples=200, deadline=None)
@given(st.binary(min_size=2, max_size=2))
def test_request_parser_accepts_exactly_t_s_and_p(data):
    """parse_request raises ProtocolError for everything but T, S and atopgpu's P."""
    try:
        request = codec.parse_request(data)
    except codec.ProtocolError:
        assert data[:1] not in (b"T", b"S", b"P")
    else:
        assert data[:1] in (b"T", b"S", b"P") and request.version == data[1]


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=300), st.sampled_from([1, 2]))
def test_reply_parsers_never_raise_anything_but_protocol_error(body, version):
    """A client never trusts a reply: garbage gives ProtocolError, nothing else."""
    for parse in (codec.parse_types, lambda b: codec.parse_stats(b, version)):
        try:
            parse(body)
        except codec.ProtocolError:
            pass


# -- bad files and options: one line and a non-zero exit, never a traceback or a hang --

BAD_SCENARIOS = [
    (b"\xff\xfe{}", "not UTF-8 text (byte 0)"),
    (b"[" * 100_000 + b"]" * 100_000, "not usable JSON (nested too deeply)"),
    (b'{"repeat": NaN}', "not usable JSON (NaN is not a number)"),
    (b'{"repeat": -Infinity}', "not usable JSON (-Infinity is not a number)"),
    (b'{"repeat": 1e999}', "repeat must be a number from -1e+15 to 1e+15"),
    (b'{"repeat": ' + b"9" * 5000 + b"}", "not usable JSON (Exceeds the limit (4300 digits)"),
    (b'{"call_delay_ms": 1e300}', "call_delay_ms must be a number from"),
    (b'{"gpus": [{"processes": [{"pid": 99999999999}]}]}', "gpus[0].processes[0].pid must be at most 2147483647"),
    (b'{"gpus": [{"process_list_capacity": -3}]}', "process_list_capacity must be a positive integer"),
    (b'{"gpus": [{"process_list_capacity": 1e400}]}', "process_list_capacity must be a positive integer"),
    (b'{"gpus": [{"idle_samples": -1}]}', "gpus[0].idle_samples"),
]


@pytest.mark.parametrize(("data", "words"), BAD_SCENARIOS)
def test_bad_scenario_text_is_one_line(tmp_path: Path, data: bytes, words: str) -> None:
    """Text that is no usable scenario is refused with the file and the cause."""
    path = tmp_path / "bad.json"
    path.write_bytes(data)
    with pytest.raises(ScenarioError) as raised:
        load_scenario(path)
    message = str(raised.value)
    assert message.startswith(f"{path}: ") and words in message
    assert "\n" not in message and len(message) < 300


def special_files(tmp_path: Path) -> list[tuple[Path, str]]:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    return [
        (fifo, "not a regular file"),  # reading it would wait for a writer for ever
        (Path("/dev/zero"), "not a regular file"),  # reading it would fill memory
        (tmp_path, "is a directory"),
        (tmp_path / "absent.json", "No such file or directory"),
    ]


def test_scenario_that_is_no_regular_file_is_one_line(tmp_path: Path) -> None:
    """A fifo, a device, a directory or nothing at all: one line, no hang."""
    for path, words in special_files(tmp_path):
        with pytest.raises(ScenarioError, match=f"^{path}: {words}$"):
            load_scenario(path)
        with pytest.raises(RecordingError, match=f"^{path}: {words}$"):
            load_recording(path)


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any file")
def test_unreadable_scenario_is_one_line(tmp_path: Path) -> None:
    """A file without read permission is named with the reason."""
    path = tmp_path / "secret.json"
    path.write_text("{}")
    path.chmod(0)
    with pytest.raises(ScenarioError, match="Permission denied$"):
        load_scenario(path)


def test_oversized_scenario_is_refused(tmp_path: Path, monkeypatch) -> None:
    """A file past the size limit is not read whole."""
    from atopgpud_tw.sim import jsonfile

    monkeypatch.setattr(jsonfile, "MAX_SIZE", 2**20)
    path = tmp_path / "big.json"
    path.write_bytes(b" " * (2**20 + 1) + b"{}")
    with pytest.raises(ScenarioError, match="larger than 1 MiB$"):
        load_scenario(path)


@pytest.mark.e2e
def test_the_daemon_on_a_fifo_scenario_exits_with_one_line(tmp_path: Path) -> None:
    """The installed daemon given a fifo: status 1 and one line, not a hang."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    result = subprocess.run(
        [sys.executable, "-m", "atopgpud_tw", "--reader", "sim", "--scenario", str(fifo), "--listen", "unix:@never"],
        capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL,
    )
    assert result.returncode == 1
    assert result.stderr.strip() == f"atopgpud: sim: scenario {fifo}: not a regular file"
    assert "Traceback" not in result.stdout


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--interval", "0.000001"], "--interval '0.000001': a number of seconds from 0.05 to 1e6"),
        (["--interval", "nan"], "--interval 'nan': a number of seconds from 0.05 to 1e6"),
        (["--interval", "inf"], "--interval 'inf'"),
        (["--smi-timeout", "-1"], "--smi-timeout '-1': a number of seconds above 0, up to 1e6"),
        (["--max-clients", "-4"], "--max-clients '-4': a positive integer"),
        (["--socket-group", "99999999999"], "--socket-group: '99999999999' is beyond the largest group id"),
        (["--allow-gid", "4294967295"], "--allow-gid: '4294967295' is beyond the largest group id"),
        (["--allow-uid", "99999999999999999999"], "--allow-uid: '99999999999999999999' is beyond the largest"),
    ],
)
def test_bad_option_values_are_one_line(capsys, args: list[str], words: str) -> None:
    """Each is refused before anything starts, in one line, exit status 2."""
    with pytest.raises(SystemExit) as raised:
        console.main(["--reader", "sim", *args])
    assert raised.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"atopgpud: {words}"), err


def test_interval_at_its_floor_is_taken() -> None:
    """0.05 s is the shortest interval; --help says so."""
    parsed = tap.Options()
    parsed.parseOptions(["--interval", "0.05"])
    assert parsed["interval"] == 0.05
    assert "from 0.05 to 1e6" in str(tap.Options())


@pytest.mark.parametrize(
    ("endpoint", "words"),
    [
        ("ssl:443", "needs the Python module OpenSSL, which is not installed"),
        ("carrier-pigeon:1", "--listen carrier-pigeon:1:"),
    ],
)
def test_listen_on_what_cannot_be_served_is_one_line(endpoint: str, words: str) -> None:
    """An endpoint type that cannot be used here ends start-up with one line."""
    if endpoint.startswith("ssl:"):
        try:
            import OpenSSL  # noqa: F401
        except ImportError:
            pass
        else:
            pytest.skip("pyOpenSSL is installed, so ssl: is usable")
    with pytest.raises(SystemExit) as raised:
        tap.makeService(tap_options("--reader", "sim", "--listen", endpoint), reactor=MemoryReactorClock())
    assert words in str(raised.value) and "\n" not in str(raised.value)


def tap_options(*args: str) -> tap.Options:
    parsed = tap.Options()
    parsed.parseOptions(list(args))
    return parsed


@pytest.mark.parametrize("where", ["/proc/atopgpud-test.pid", "/nonexistent/atopgpud.pid"])
def test_unwritable_pid_file_is_one_line(where: str) -> None:
    """twistd --pidfile somewhere it cannot write: one line before anything starts."""
    options = tap_options("--reader", "sim", "--listen", "unix:@never")
    options.parent = {"pidfile": where}
    with pytest.raises(SystemExit) as raised:
        tap.makeService(options, reactor=MemoryReactorClock())
    assert str(raised.value) == f"atopgpud: --pidfile {where}: cannot be written (No such file or directory)"


def test_writable_pid_file_is_left_to_twistd(tmp_path: Path) -> None:
    """The check leaves no pid file behind for twistd to find."""
    options = tap_options("--reader", "sim", "--listen", "unix:@never")
    options.parent = {"pidfile": str(tmp_path / "atopgpud.pid")}
    tap.makeService(options, reactor=MemoryReactorClock())
    assert list(tmp_path.iterdir()) == []
