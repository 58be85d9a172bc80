"""Every error message README.md and docs/ quote is the one the installed commands print.

`quoted()` collects the quotes: a backticked or code-block line starting
``atopgpud: `` anywhere, the ``... `` continuations of the listen failures in
docs/reliability.md, and the examples of docs/atopgpu.md's table of exit
statuses.  `CASES` says for each how to make the command print it, and in which
status; a quote the docs add without a case here fails
`test_every_quoted_error_has_a_case`.  Each case runs ``atopgpud`` or
``atopgpu`` (installed, as a user would) and compares the one line on stderr with
the quote: ``...`` in a quote stands for any text, and names the docs use for a
machine's own (``@atopgpud_nvidia``, port 59123, /run/atopgpud/...) are replaced
by ones made for the test.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import threading
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import pytest
from daemon import Daemon

from atopgpud_tw import codec

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BIN = Path(sys.executable).parent


# -- the quotes -----------------------------------------------------------------------------


def quoted() -> set[tuple[str, str]]:
    """(document, quote) for every error message the docs quote."""
    found: set[tuple[str, str]] = set()
    for path in DOCS:
        text = path.read_text()
        name = str(path.relative_to(ROOT))
        prose = re.sub(r"^```.*?^```$", "", text, flags=re.M | re.S)
        spans = [" ".join(span.split()) for span in re.findall(r"`([^`]+)`", prose)]
        lines = re.findall(r"^(atopgpud: .*)$", text, re.M)
        for quote in [*spans, *lines]:
            if quote.startswith("atopgpud: "):
                found.add((name, quote))
        if name == "docs/reliability.md":
            bullet = text[text.index("cannot listen: `atopgpud: cannot listen"):]
            bullet = bullet[:bullet.index("\n- ") if "\n- " in bullet else bullet.index("\n\n")]
            for span in re.findall(r"`(\.\.\. [^`]+)`", bullet):
                found.add((name, " ".join(span.split())))
        if name == "docs/atopgpu.md":
            table = text[text.index("## Errors and exit status"):]
            for row in re.findall(r"^\| ([123]) \| [^|]+ \| (.*) \|$", table, re.M):
                for span in re.findall(r"`([^`]+)`", row[1]):
                    found.add((name, span))
    return found


# -- making the commands say it ---------------------------------------------------------------


def unique(prefix: str = "atopgpud-test") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@dataclass
class Run:
    """What a case runs, in `tmp`, and what it replaces in the quote first."""

    command: list[str]
    status: int
    names: dict[str, str] = field(default_factory=dict)
    cwd: Path | None = None
    #: the lines the command prints on stderr, and which of them the quote is
    lines: int = 1
    line: int = 0


def held_abstract(name: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(b"\0" + name.encode())
    sock.listen()
    return sock


def held_port() -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    return sock


class FakeDaemon:
    """An abstract socket that answers each 2-byte request with the next of `replies`, then closes."""

    def __init__(self, replies: list[bytes]) -> None:
        self.name = unique()
        self.listener = held_abstract(self.name)
        self.listener.settimeout(10)
        self.replies = replies
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        try:
            conn, _ = self.listener.accept()
        except OSError:
            return
        with conn:
            conn.settimeout(10)
            for reply in self.replies:
                if len(conn.recv(2)) < 2:
                    break
                conn.sendall(reply)

    def close(self) -> None:
        self.listener.close()
        self.thread.join(10)


GOOD_T = codec.frame(2, b"1@00000000:17:00.0 NVIDIA_A10 3")
GOOD_S = b"@40 10 1000 100 2 80 20 200#A 7 C 60 10 50 100 2"


def prelude(version: int, length: int) -> bytes:
    return codec.PRELUDE.pack(version << 24 | length)


def atopgpud(*args: str) -> list[str]:
    return [str(BIN / "atopgpud"), *args]


def atopgpu(*args: str) -> list[str]:
    return [str(BIN / "atopgpu"), *args]


def scenario(tmp: Path, name: str, text: str) -> Run:
    (tmp / name).write_text(text)
    return Run(atopgpud("--reader", "sim", "--scenario", name, "--listen", f"unix:@{unique()}"), 1, cwd=tmp)


def mig_scenario(tmp: Path, held: list) -> Run:
    mig = [{"profile": "3g.40gb"}, {"profile": "3g 40gb"}]
    return scenario(tmp, "mig.json", json.dumps({"gpus": [{"name": "NVIDIA A100-SXM4-80GB", "mig": mig}]}))


def taken_abstract(tmp: Path, held: list) -> Run:
    name = unique()
    held.append(held_abstract(name))
    return Run(atopgpud("--reader", "sim", "--listen", f"unix:@{name}"), 1, {"@atopgpud_nvidia": f"@{name}"})


def taken_tcp(tmp: Path, held: list) -> Run:
    sock = held_port()
    held.append(sock)
    port = str(sock.getsockname()[1])
    return Run(atopgpud("--reader", "sim", "--listen", f"tcp:{port}:interface=127.0.0.1"), 1, {"59123": port})


def missing_directory(tmp: Path, held: list) -> Run:
    path = tmp / "missing" / "atopgpud.sock"
    return Run(atopgpud("--reader", "sim", "--listen", f"unix:{path}"), 1, {"/run/atopgpud/atopgpud.sock": str(path)})


def lock_held(tmp: Path, held: list) -> Run:
    path = tmp / "atopgpud.sock"
    held.append(Daemon(tmp, ["--reader", "sim", "--listen", f"unix:{path}"]).start())
    return Run(atopgpud("--reader", "sim", "--listen", f"unix:{path}"), 1, {"/run/atopgpud/atopgpud.sock": str(path)})


def taken_metrics(tmp: Path, held: list) -> Run:
    sock = held_port()
    held.append(sock)
    port = str(sock.getsockname()[1])
    return Run(atopgpud("--reader", "sim", "--listen", f"unix:@{unique()}", "--metrics",
                        f"tcp:{port}:interface=127.0.0.1"), 1, {"9445": port})


def hung_at_start_up(line: int) -> Callable[[Path, list], Run]:
    def start(tmp: Path, held: list) -> Run:
        hang = {"call": "nvmlDeviceGetUUID", "error": "hang", "until": 3600}
        gpus = [{"busid": "00000000:17:00.0", "faults": [hang]}]
        (tmp / "hung.json").write_text(json.dumps({"gpus": gpus}))
        return Run(atopgpud("--reader", "sim", "--scenario", "hung.json", "--hang-warning", "1", "--start-timeout", "3",
                            "--listen", f"unix:@{unique()}"), 1, cwd=tmp, lines=2, line=line)

    return start


def no_nvml(tmp: Path, held: list) -> Run:
    return Run(atopgpud("--reader", "nvml", "--listen", f"unix:@{unique()}"), 1)


def refused(tmp: Path, held: list) -> Run:
    name = unique()
    return Run(atopgpu("--connect", f"unix:@{name}"), 1, {"@atopgpud_nvidia": f"@{name}"})


def no_such_socket(tmp: Path, held: list) -> Run:
    path = tmp / "x.sock"
    return Run(atopgpu("--connect", f"unix:{path}"), 1, {"/run/x.sock": str(path)})


def fake(replies: list[bytes]) -> Callable[[Path, list], Run]:
    def start(tmp: Path, held: list) -> Run:
        server = FakeDaemon(replies)
        held.append(server)
        return Run(atopgpu("--connect", f"unix:@{server.name}"), 3)

    return start


#: (document, quote) -> how to make the command print it
def bad_web_config(tmp: Path, held: list) -> Run:
    path = tmp / "web.yml"
    path.write_text("tls_server_config:\n  cert_file: s.crt\n  key_file: s.key\n  client_auth_type: Always\n")
    return Run(atopgpud("--reader", "sim", "--listen", f"unix:@{unique()}", "--metrics",
                        f"tcp:{free_port()}:interface=127.0.0.1", "--web-config", str(path)), 2,
               {"/etc/atopgpud/web.yml": str(path)})


CASES: dict[tuple[str, str], Callable[[Path, list], Run]] = {
    ("docs/metrics.md", "atopgpud: --web-config /etc/atopgpud/web.yml: tls_server_config.client_auth_type: 'Always' "
                        "is not one of NoClientCert, RequestClientCert, RequireAnyClientCert, VerifyClientCertIfGiven, "
                        "RequireAndVerifyClientCert"): bad_web_config,
    ("README.md", "atopgpud: cannot listen on unix:@atopgpud_nvidia: address already in use"): taken_abstract,
    ("docs/reliability.md", "atopgpud: cannot listen on unix:@atopgpud_nvidia: address already in use"):
        taken_abstract,
    ("docs/reliability.md", "... on tcp:59123:interface=127.0.0.1: address already in use"): taken_tcp,
    ("docs/install.md", "atopgpud: cannot listen on unix:@atopgpud_nvidia: address already in use"): taken_abstract,
    ("docs/install.md", "atopgpud: option --bogus not recognized (try atopgpud --help)"):
        lambda tmp, held: Run(atopgpud("--reader", "sim", "--bogus"), 2),
    ("docs/reliability.md", "... on unix:/run/atopgpud/atopgpud.sock: no such file or directory"):
        missing_directory,
    ("docs/reliability.md", "... another process holds /run/atopgpud/atopgpud.sock.lock"): lock_held,
    ("docs/reliability.md", "... on tcp:9445:interface=127.0.0.1 (--metrics): ..."): taken_metrics,
    ("docs/reliability.md", "atopgpud: nvml: the NVML library (libnvidia-ml.so.1) is not installed"): no_nvml,
    ("docs/reliability.md", "atopgpud: sim: NVML call nvmlDeviceGetUUID on GPU 00000000:17:00.0 has not returned "
                            "for 1 s; start-up waits for it up to 3 s (--start-timeout)"): hung_at_start_up(0),
    ("docs/reliability.md", "atopgpud: sim: NVML call nvmlDeviceGetUUID on GPU 00000000:17:00.0 has not returned "
                            "after 3 s (--start-timeout)"): hung_at_start_up(1),
    ("docs/simulator.md", "atopgpud: sim: scenario mig.json: gpus[0].mig[1].profile must be a name such as 3g.40gb"):
        mig_scenario,
    ("docs/simulator.md", "atopgpud: sim: scenario /dev/zero: not a regular file"):
        lambda tmp, held: Run(atopgpud("--reader", "sim", "--scenario", "/dev/zero", "--listen",
                                       f"unix:@{unique()}"), 1),
    ("docs/simulator.md", "atopgpud: sim: scenario deep.json: not usable JSON (nested too deeply)"):
        lambda tmp, held: scenario(tmp, "deep.json", "[" * 200_000 + "]" * 200_000),
    ("docs/simulator.md", "atopgpud: sim: scenario nan.json: not usable JSON (NaN is not a number)"):
        lambda tmp, held: scenario(tmp, "nan.json", '{"gpus": [{"power_w": NaN}]}'),
    ("docs/atopgpu.md", "unix:@atopgpud_nvidia: connection refused; is atopgpud running?"): refused,
    ("docs/atopgpu.md", "unix:/run/x.sock: no such socket; is atopgpud running?"): no_such_socket,
    ("docs/atopgpu.md", "--connect ssl:443: expected unix:@NAME, ..."):
        lambda tmp, held: Run(atopgpu("--connect", "ssl:443"), 2),
    ("docs/atopgpu.md", "asked for API version 2, the T reply is version 1"): fake([codec.frame(1, b"1@a b 3")]),
    ("docs/atopgpu.md", "the S reply announces 100 bytes but only 10 came"):
        fake([GOOD_T, prelude(2, 100) + GOOD_S[:10]]),
    ("docs/atopgpu.md", "malformed S reply: ..."): fake([GOOD_T, codec.frame(2, GOOD_S.replace(b"@40", b"@4x"))]),
    ("docs/atopgpu.md", "malformed S reply: a field of the device record is beyond 64 bits"):
        fake([GOOD_T, codec.frame(2, GOOD_S.replace(b" 1000 ", b" " + b"9" * 40 + b" "))]),
}


def expected_line(document: str, quote: str, run: Run) -> re.Pattern[str]:
    """The line the quote stands for, as a pattern: names replaced, ``...`` any text, the prefix
    and (for a usage error) the suffix that docs/atopgpu.md's table leaves out."""
    for ours, theirs in sorted(run.names.items(), key=lambda item: -len(item[0])):
        quote = quote.replace(ours, theirs)
    pattern = ".*".join(re.escape(part) for part in quote.split("..."))
    if document == "docs/atopgpu.md":
        pattern = "atopgpu: " + pattern + (re.escape(" (try atopgpu --help)") if run.status == 2 else "")
    return re.compile(pattern)


def test_every_quoted_error_has_a_case():
    """Each error message the docs quote is checked below, and each case still quotes the docs."""
    found = quoted()
    assert found - set(CASES) == set(), "quoted in the docs, with no case here"
    assert set(CASES) - found == set(), "a case for a quote the docs no longer have"


@pytest.fixture
def held() -> Iterator[list]:
    things: list = []
    yield things
    for thing in things:
        if isinstance(thing, Daemon):
            thing.stop()
        else:
            thing.close()


@pytest.mark.e2e
@pytest.mark.parametrize(("document", "quote"), sorted(CASES), ids=[f"{d}:{q[:40]}" for d, q in sorted(CASES)])
def test_quoted_error_is_what_the_command_prints(tmp_path: Path, held: list, document: str, quote: str) -> None:
    """The command prints the quoted message on its line of stderr (alone, for most), and exits with its status."""
    if quote.startswith("atopgpud: nvml:") and Path("/dev/nvidiactl").exists():
        pytest.skip("NVML is installed here")
    run = CASES[(document, quote)](tmp_path, held)
    env = {**os.environ, "LANG": "C.UTF-8"}
    done = subprocess.run(run.command, capture_output=True, text=True, timeout=60, cwd=run.cwd,
                          stdin=subprocess.DEVNULL, env=env)
    assert done.returncode == run.status, done
    assert done.stderr.endswith("\n") and done.stderr.count("\n") == run.lines, done.stderr
    assert done.stdout == "" or "Traceback" not in done.stdout
    line = done.stderr.splitlines()[run.line]
    assert expected_line(document, quote, run).fullmatch(line), f"the docs say {quote!r}; printed {line!r}"
