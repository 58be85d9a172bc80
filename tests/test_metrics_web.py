"""The metrics listener's other pages: ``/``, ``/-/healthy``, ``/healthz``, ``/-/ready``,
its error pages, and the bounds and access gate applying to them."""

from __future__ import annotations

import http.client
import os
import subprocess
import time
import urllib.error
import urllib.request
import warnings

import pytest
from daemon import Daemon, free_port, run_daemon, unique_name
from metrics_text import FakePoller
from snapshots import dev, snap
from twisted.internet.defer import Deferred, fail, succeed
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.web.test.requesthelper import DummyRequest

from atopgpud_tw.server.atop.board import Board
from atopgpud_tw.server.atop.poller import PollerService
from atopgpud_tw.server.web.metrics import Healthy, Ready, make_site, not_ready
from atopgpud_tw.server.web.webbounds import WebLimits


class Reader:
    """A reader whose polls give the outcomes listed (an exception fails that poll)."""

    name = "fake"

    def __init__(self, *outcomes: object) -> None:
        self.outcomes = list(outcomes)

    def poll(self) -> Deferred:
        outcome = self.outcomes.pop(0) if self.outcomes else snap(dev())
        return fail(outcome) if isinstance(outcome, Exception) else succeed(outcome)

    def close(self) -> None:
        pass


def site_with(poller: object | None = None, **limits):
    board = Board()
    board.fold(snap(dev()))
    return make_site(board, poller or FakePoller(polls=1), 1.0, limits=WebLimits(**limits), clock=Clock(),
                     in_thread=lambda render: succeed(render()))


def ask(site, request: bytes) -> tuple[int, dict[str, str], bytes]:
    """One request on a fresh connection: the status, the headers (lower-case names), the body."""
    channel = site.buildProtocol(None)
    transport = StringTransport()
    channel.makeConnection(transport)
    channel.dataReceived(request)
    raw = transport.value()
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    if headers.get("transfer-encoding") == "chunked":
        body = _unchunk(body)
    return int(lines[0].split()[1]), headers, body


def _unchunk(body: bytes) -> bytes:
    out = b""
    while body:
        size, _, rest = body.partition(b"\r\n")
        length = int(size, 16)
        if length == 0:
            break
        out += rest[:length]
        body = rest[length + 2 :]
    return out


def get(path: str) -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode()


# -- readiness, on a fake poller --


def test_not_ready_says_why():
    """The reason names what is missing: a first poll, a working reader, the driver."""
    assert not_ready(FakePoller(polls=0)) == "waiting for the first poll"
    assert not_ready(FakePoller(polls=3, failing="PollError: NVML timed out")) == \
        "the reader is failing: PollError: NVML timed out"
    assert not_ready(FakePoller(polls=0, failing="OSError: gone")) == "the reader is failing: OSError: gone"
    waiting = "waiting for the NVIDIA driver (NVML_ERROR_DRIVER_NOT_LOADED)"
    assert not_ready(FakePoller(polls=0, waiting=waiting)) == waiting
    assert not_ready(FakePoller(polls=1)) is None


@pytest.mark.parametrize(
    ("poller", "code", "body"),
    [
        (FakePoller(polls=1), 200, b"atopgpud is ready\n"),
        (FakePoller(polls=0), 503, b"atopgpud is not ready: waiting for the first poll\n"),
        (FakePoller(polls=2, failing="ValueError: boom"), 503, b"atopgpud is not ready: the reader is failing: "
                                                          b"ValueError: boom\n"),
        (FakePoller(polls=2, waiting="waiting for the NVIDIA driver (it is not loaded)"), 503,
         b"atopgpud is not ready: waiting for the NVIDIA driver (it is not loaded)\n"),
        (FakePoller(polls=2, failing="ValueError: two\nlines"), 503,
         b"atopgpud is not ready: the reader is failing: ValueError: two lines\n"),
    ],
)
def test_ready_resource(poller, code, body):
    """/-/ready: 200 when ready, else 503 and the reason on one plain-text line."""
    request = DummyRequest([b""])
    assert Ready(poller).render(request) == body
    assert (request.responseCode or 200) == code
    assert request.responseHeaders.getRawHeaders(b"content-type") == [b"text/plain; charset=utf-8"]


def test_healthy_resource():
    request = DummyRequest([b""])
    assert Healthy().render(request) == b"atopgpud is healthy\n"
    assert request.responseCode in (None, 200)


def test_ready_follows_a_real_poller():
    """Through PollerService: not ready before its first poll, ready after, not while polls fail, ready again."""
    clock = Clock()
    poller = PollerService(Reader(snap(dev()), ValueError("boom")), Board(), 1.0, clock)
    site = site_with(poller)
    assert ask(site, get("/-/ready"))[:3:2] == (503, b"atopgpud is not ready: waiting for the first poll\n")
    poller.startService()
    try:
        assert ask(site, get("/-/ready"))[:3:2] == (200, b"atopgpud is ready\n")
        clock.advance(1.0)
        assert ask(site, get("/-/ready"))[:3:2] == (
            503, b"atopgpud is not ready: the reader is failing: ValueError: boom\n"
        )
        assert ask(site, get("/-/healthy"))[0] == 200  # alive all the same
        clock.advance(1.0)
        assert ask(site, get("/-/ready"))[0] == 200
    finally:
        poller.stopService()


# -- the site's tree --


def test_every_path_of_the_site():
    """/, /-/healthy, /healthz, /-/ready answer; the index links the rest; HEAD has no body."""
    site = site_with()
    code, headers, body = ask(site, get("/"))
    assert code == 200 and headers["content-type"] == "text/html; charset=utf-8"
    for link in (b'href="metrics"', b'href="-/healthy"', b'href="-/ready"'):
        assert link in body
    for path in ("/-/healthy", "/healthz"):
        assert ask(site, get(path))[:3:2] == (200, b"atopgpud is healthy\n")
    assert ask(site, get("/-/ready"))[:3:2] == (200, b"atopgpud is ready\n")
    code, headers, body = ask(site, b"HEAD /-/healthy HTTP/1.1\r\nHost: x\r\n\r\n")
    assert (code, body) == (200, b"") and headers["content-length"] == "20"
    assert b"atopgpud_gpu_samples_total" in ask(site, get("/metrics"))[2]


@pytest.mark.parametrize("path", ["/nothing", "/-", "/-/", "/-/nothing", "/metric", "/<script>alert(1)</script>"])
def test_unknown_paths_are_escaped_404s(path):
    code, headers, body = ask(site_with(), get(path))
    assert code == 404 and headers["content-type"] == "text/html; charset=utf-8"
    assert b"<script>" not in body and b"No Such Resource" in body


def test_unsupported_methods_get_the_escaping_error_page_and_no_deprecation():
    """POST is 405 with Allow; an unknown method is 501; neither uses twisted's deprecated page."""
    site = site_with()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for path in ("/metrics", "/-/ready", "/-/healthy", "/"):
            code, headers, body = ask(site, f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n".encode())
            assert code == 405 and "GET" in headers["allow"] and b"POST is not allowed here" in body
        code, _, body = ask(site, b"BR&EW /-/ready HTTP/1.1\r\nHost: x\r\n\r\n")
        assert code == 501 and b"No BR&amp;EW request" in body
        ask(site, get("/nothing"))
    assert not [w for w in caught if issubclass(w.category, DeprecationWarning)]


# -- the bounds apply --


def test_the_connection_cap_applies_to_the_health_endpoints():
    """Beyond --metrics-max-clients a health probe's connection is refused like a scrape's."""
    site = site_with(max_clients=1)
    held = site.buildProtocol(None)
    held.makeConnection(StringTransport())
    assert site.buildProtocol(None) is None
    held.connectionLost(None)
    assert ask(site, get("/-/healthy"))[0] == 200


def test_request_bounds_apply_to_the_health_endpoints():
    """A body over the bound is 413, a head over it 400, for /-/ready as for /metrics."""
    site = site_with(max_body=16, max_head=512)
    body = b"x" * 17
    request = b"POST /-/ready HTTP/1.1\r\nHost: x\r\nContent-Length: 17\r\n\r\n" + body
    assert ask(site, request)[0] == 413
    assert ask(site, b"GET /-/healthy HTTP/1.1\r\nHost: x\r\nX-Big: " + b"y" * 600 + b"\r\n\r\n")[0] == 400


def test_the_head_deadline_applies_to_the_health_endpoints():
    """A probe that trickles its head is cut at the deadline."""
    clock = Clock()
    site = make_site(Board(), FakePoller(), 1.0, limits=WebLimits(head_timeout=2.0), clock=clock)
    channel = site.buildProtocol(None)
    transport = StringTransport()
    channel.makeConnection(transport)
    channel.dataReceived(b"GET /-/heal")
    clock.advance(2.1)
    assert transport.disconnected or transport.disconnecting


# -- through the installed daemon --


@pytest.mark.e2e
def test_daemon_serves_the_health_endpoints(tmp_path):
    """The installed daemon with --metrics on loopback: every page, 404, 405."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    args = ["--reader", "sim", "--interval", "0.2", "--metrics", f"tcp:{port}:interface=127.0.0.1"]
    with run_daemon(tmp_path, args) as daemon:
        daemon.wait_samples(1)
        with urllib.request.urlopen(f"{base}/-/healthy", timeout=10) as response:
            assert (response.status, response.read()) == (200, b"atopgpud is healthy\n")
        with urllib.request.urlopen(f"{base}/healthz", timeout=10) as response:
            assert response.status == 200
        with urllib.request.urlopen(f"{base}/-/ready", timeout=10) as response:
            assert (response.status, response.read()) == (200, b"atopgpud is ready\n")
        with urllib.request.urlopen(f"{base}/", timeout=10) as response:
            assert b'href="-/ready"' in response.read()
        with pytest.raises(urllib.error.HTTPError) as missing:
            urllib.request.urlopen(f"{base}/nothing", timeout=10)
        assert missing.value.code == 404
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        connection.request("POST", "/-/ready", body=b"")
        reply = connection.getresponse()
        assert reply.status == 405 and "GET" in reply.getheader("allow")
        connection.close()
        log = daemon.log()
    assert "DeprecationWarning" not in log and "_UnsafeErrorPage" not in log


SYSTEM_PYTHON = "/usr/bin/python3"


@pytest.mark.e2e
@pytest.mark.skipif(
    os.geteuid() != 0 or not os.access(SYSTEM_PYTHON, os.X_OK),
    reason="needs root to act as another user, and /usr/bin/python3 for that user",
)
def test_the_access_gate_applies_to_the_health_endpoints(tmp_path):
    """--allow-uid guards /-/healthy and /-/ready on a UNIX --metrics socket as it guards /metrics."""
    metrics = unique_name("metrics")
    address = b"\0" + metrics.encode()
    code = (
        "import socket,sys\n"
        "s=socket.socket(socket.AF_UNIX); s.settimeout(5)\n"
        "try:\n"
        f"    s.connect({address!r}); s.sendall(b'GET /-/healthy HTTP/1.0\\r\\n\\r\\n'); reply=s.recv(15)\n"
        "except OSError: sys.exit(3)\n"
        "sys.exit(0 if reply.startswith(b'HTTP/1.0 200') else 3)\n"
    )
    for allowed, expected in (("root", 3), ("nobody", 0)):
        daemon = Daemon(tmp_path, ["--reader", "sim", "--allow-uid", allowed, "--metrics", f"unix:@{metrics}"]).start()
        try:
            result = subprocess.run([SYSTEM_PYTHON, "-c", code], user="nobody", group="nogroup",
                                    capture_output=True, timeout=30)
            assert result.returncode == expected, result.stderr
        finally:
            daemon.stop()


def _ready(port: int) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/-/ready", timeout=10) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


@pytest.mark.e2e
def test_daemon_readiness_follows_its_polls(tmp_path):
    """Through nvidia-smi: ready while reports parse, 503 with the cause while they do not, ready again."""
    from smi_doubles import FakeSmi

    smi = FakeSmi(tmp_path)
    smi.report("plain-v11.xml")
    port = free_port()
    args = ["--reader", "nvidia-smi", "--nvidia-smi", str(smi.binary), "--interval", "0.2", "--smi-timeout", "2",
            "--metrics", f"tcp:{port}:interface=127.0.0.1"]

    def wait_for(code: int, text: bytes) -> None:
        deadline = time.monotonic() + 15
        while (answer := _ready(port)) != (code, text) and not (code == 503 and answer[0] == 503 and text in answer[1]):
            assert time.monotonic() < deadline, f"{answer} while waiting for {code} {text!r}:\n{daemon.log()}"
            time.sleep(0.05)

    with run_daemon(tmp_path, args) as daemon:
        wait_for(200, b"atopgpud is ready\n")
        smi.mode("garbage")
        wait_for(503, b"atopgpud is not ready: the reader is failing: ")
        status, body = _ready(port)
        assert body.count(b"\n") == 1 and b"not XML" in body, body
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/-/healthy", timeout=10) as response:
            assert response.status == 200  # alive while its polls fail
        smi.mode("report")
        wait_for(200, b"atopgpud is ready\n")


@pytest.mark.parametrize(("faults", "gpus", "reason"), [
    ([{"call": "*", "error": "NVML_ERROR_UNKNOWN", "from": 3, "until": 8}], 1, "could not read the GPU"),
    ([{"call": "*", "error": "NVML_ERROR_GPU_IS_LOST", "from": 3, "until": 8}], 1, "could not read the GPU"),
    ([], 0, "no GPU found"),
], ids=["every call failing", "the GPU lost", "no GPU"])
def test_not_ready_while_no_gpu_is_read(faults, gpus, reason):
    """The NVML reader over the simulator: /-/ready turns 503 once three polls in a row read no GPU
    (every call failing, the GPU lost, none there), and 200 again once one is read."""
    from clocked import ClockedReader
    from scenarios import a10_card

    from atopgpud_tw.server.atop.board import Board
    from atopgpud_tw.server.atop.poller import UNREAD_POLLS

    clock = Clock()
    clock.advance(0.5)
    scenario = {"gpus": [a10_card(faults=faults)] if gpus else []}
    poller = PollerService(ClockedReader(scenario, clock), Board(), 1.0, clock)
    poller.startService()
    said = {}
    while clock.seconds() < 14:
        said[round(clock.seconds(), 1)] = not_ready(poller)
        clock.advance(1.0)
    poller.stopService()
    if gpus:
        assert said[2.5] is None and said[4.5] is None  # a failing poll or two: still ready
        assert said[6.5] == f"{reason} in the last 4 polls"
        assert said[13.5] is None  # read again
    else:
        assert said[UNREAD_POLLS - 0.5] == f"{reason} in the last {UNREAD_POLLS} polls"
        assert said[13.5] == f"{reason} in the last 14 polls"
