"""--web-config end to end: Debian's Prometheus scrapes over TLS with a client certificate and basic auth;
curl is refused a wrong password, plain HTTP and a missing certificate; the file is re-read on change and on
SIGHUP, a bad reload keeps the last good; a flood of wrong passwords leaves atop's socket answering."""

from __future__ import annotations

import base64
import http.client
import os
import signal
import socket
import ssl
import subprocess
import threading
import time
from pathlib import Path

import pytest
from daemon import Daemon, free_port, run_daemon
from prometheus_server import Prometheus, needed, one_target
from test_slots import SYSTEM_PYTHON, as_others  # noqa: F401  # a fixture
from webtls import Pki, hashed, web_config

pytestmark = pytest.mark.e2e

SCENARIO = {"gpus": [{"name": "NVIDIA H100 80GB HBM3", "gpu_util": [20, 60]}]}
PASSWORD = "s3cret-scrape"


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Pki:
    return Pki(tmp_path_factory.mktemp("pki"))


def tls_of(pki: Pki, mode: str = "RequireAndVerifyClientCert") -> dict:
    tls = {"cert_file": str(pki.server_cert), "key_file": str(pki.server_key), "client_auth_type": mode}
    if mode != "NoClientCert":
        tls["client_ca_file"] = str(pki.ca)
    return tls


def curl(url: str, *args: str) -> tuple[int, str, str]:
    """curl's exit status, the HTTP status it got ('000': none) and the body."""
    binary = needed("curl", "curl")
    done = subprocess.run([binary, "-s", "-o", "-", "-w", "\n%{http_code}", "--max-time", "10", *args, url],
                          capture_output=True, text=True, timeout=30)
    body, _, code = done.stdout.rpartition("\n")
    return done.returncode, code, body


@pytest.fixture(scope="module")
def secured(tmp_path_factory, pki):
    """A daemon whose metrics need TLS, a certificate of the CA and a password (cost 10), and Prometheus
    scraping it with all three."""
    binary = needed("prometheus", "prometheus")
    tmp = tmp_path_factory.mktemp("secured")
    config = web_config(tmp / "web.yml", tls=tls_of(pki), users={"prometheus": hashed(PASSWORD, cost=10)},
                        http_server_config={"headers": {"X-Content-Type-Options": "nosniff"}})
    port = free_port()
    with run_daemon(tmp, ["--interval", "0.5", "--metrics", f"tcp:{port}:interface=127.0.0.1",
                          "--web-config", str(config)], scenario=SCENARIO) as daemon:
        scrape = one_target(
            f"127.0.0.1:{port}", scheme="https",
            tls_config={"ca_file": str(pki.ca), "cert_file": str(pki.client_cert), "key_file": str(pki.client_key)},
            basic_auth={"username": "prometheus", "password": PASSWORD},
        )
        server = Prometheus(binary, tmp, scrape)
        try:
            server.wait_for('up{job="atopgpud"} == 1')
            yield daemon, server, port
        finally:
            server.stop()


def test_prometheus_scrapes_over_tls_with_basic_auth(secured) -> None:
    """Prometheus's own TLS and basic auth client gets the page: samples grow, the target is up."""
    daemon, server, port = secured
    server.wait_for('atopgpud_gpu_samples_total > 2')
    targets = server.api("targets")["activeTargets"]
    assert targets[0]["health"] == "up" and targets[0]["scrapeUrl"].startswith("https://"), targets


def test_curl_with_everything_gets_the_page_and_headers(secured, pki, tmp_path: Path) -> None:
    """The client certificate and the right password: 200, the page, the configured header."""
    _, _, port = secured
    headers = tmp_path / "headers"
    rc, code, body = curl(f"https://127.0.0.1:{port}/metrics", "--cacert", str(pki.ca), "--cert",
                          str(pki.client_cert), "--key", str(pki.client_key), "-u", f"prometheus:{PASSWORD}",
                          "-D", str(headers))
    assert (rc, code) == (0, "200") and "atopgpud_gpu_samples_total" in body
    assert "x-content-type-options: nosniff" in headers.read_text().lower()


def test_a_wrong_or_missing_password_gets_401_on_every_page(secured, pki) -> None:
    """Wrong password, unknown user, no password, on /metrics and the health pages alike: 401."""
    _, _, port = secured
    tls = ["--cacert", str(pki.ca), "--cert", str(pki.client_cert), "--key", str(pki.client_key)]
    for path, auth in [("/metrics", ["-u", "prometheus:wrong"]), ("/metrics", ["-u", "nobody:x"]),
                       ("/metrics", []), ("/-/healthy", []), ("/", ["-u", "prometheus:nope"])]:
        rc, code, body = curl(f"https://127.0.0.1:{port}{path}", *tls, *auth)
        assert (rc, code, body) == (0, "401", "Unauthorized\n"), (path, auth)


def test_plain_http_to_the_tls_port_fails(secured) -> None:
    """A plain HTTP request is no TLS handshake: the connection is closed, no HTTP reply."""
    _, _, port = secured
    rc, code, _ = curl(f"http://127.0.0.1:{port}/metrics", "-u", f"prometheus:{PASSWORD}")
    assert rc != 0 and code == "000"


def test_without_a_client_certificate_the_handshake_is_refused(secured, pki) -> None:
    """RequireAndVerifyClientCert: no certificate, or one the CA did not sign, ends the handshake."""
    _, _, port = secured
    rc, code, _ = curl(f"https://127.0.0.1:{port}/metrics", "--cacert", str(pki.ca), "-u", f"prometheus:{PASSWORD}")
    assert rc != 0 and code == "000"
    rc, code, _ = curl(f"https://127.0.0.1:{port}/metrics", "--cacert", str(pki.ca), "--cert",
                       str(pki.stranger_cert), "--key", str(pki.stranger_key), "-u", f"prometheus:{PASSWORD}")
    assert rc != 0 and code == "000"


def get(port: int, user: str, password: str, pki: Pki | None = None, source: str = "127.0.0.1",
        timeout: float = 10.0) -> int:
    """The HTTP status of one GET /metrics with basic auth, over TLS with the client certificate when `pki` is
    given, from the local address `source` (0: no reply)."""
    if pki is None:
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout, source_address=(source, 0))
    else:
        context = ssl.create_default_context(cafile=str(pki.ca))
        context.load_cert_chain(str(pki.client_cert), str(pki.client_key))
        connection = http.client.HTTPSConnection("127.0.0.1", port, timeout=timeout, context=context,
                                                 source_address=(source, 0))
    token = base64.b64encode(f"{user}:{password}".encode()).decode()
    try:
        connection.request("GET", "/metrics", headers={"Authorization": "Basic " + token})
        response = connection.getresponse()
        response.read()
        return int(response.status)
    except (OSError, http.client.HTTPException):
        return 0
    finally:
        connection.close()


def https_get(port: int, pki: Pki, user: str, password: str) -> int:
    return get(port, user, password, pki)


def test_a_flood_of_wrong_passwords_leaves_atop_answered(secured, pki) -> None:
    """Many clients at once, each with another wrong password (bcrypt cost 10): each gets 401, or 503 at once
    beyond the bound; meanwhile atop's socket answers every request.  The slowest answer is printed."""
    daemon, _, port = secured
    statuses: list[int] = []
    stop = threading.Event()

    def flood(number: int) -> None:
        attempt = 0
        while not stop.is_set():
            attempt += 1
            statuses.append(https_get(port, pki, "prometheus", f"guess-{number}-{attempt}"))

    threads = [threading.Thread(target=flood, args=(n,)) for n in range(20)]
    for thread in threads:
        thread.start()
    slowest = 0.0
    answered = 0
    client = daemon.client()
    try:
        deadline = time.monotonic() + 6
        while time.monotonic() < deadline:
            began = time.monotonic()
            assert client.stats()  # answered (the socket's timeout is 5 s)
            slowest = max(slowest, time.monotonic() - began)
            answered += 1
            time.sleep(0.05)
    finally:
        client.close()
        stop.set()
        for thread in threads:
            thread.join(30)
    print(f"flood: {len(statuses)} requests, {statuses.count(401)} 401, {statuses.count(503)} 503, "
          f"{statuses.count(0)} cut; atop: {answered} answers, slowest {slowest * 1000:.1f} ms")
    assert statuses and set(statuses) <= {401, 503, 0}
    assert 503 in statuses  # the bound was reached, and answered at once
    # (many are cut: one peer address has at most 4 TLS handshakes in flight, and the flood's
    # 20 clients share 127.0.0.1, so a fifth closes the oldest)
    assert statuses.count(401) + statuses.count(503) >= 20
    assert https_get(port, pki, "prometheus", PASSWORD) == 200  # and the right password still works


# -- reloads ----------------------------------------------------------------------------------


def wait_until(check, what: str, daemon: Daemon, timeout: float = 15.0) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.2)
    raise AssertionError(f"{what} in {timeout} s:\n{daemon.log()}")


def served_serial(port: int, pki: Pki) -> int:
    """The serial number of the certificate the daemon shows in a handshake."""
    context = ssl.create_default_context(cafile=str(pki.ca))
    context.load_cert_chain(str(pki.client_cert), str(pki.client_key))
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
        with context.wrap_socket(raw, server_hostname="localhost") as wrapped:
            der = wrapped.getpeercert(binary_form=True)
    from cryptography import x509

    return x509.load_der_x509_certificate(der).serial_number


def test_reload_on_change_on_sighup_and_a_bad_reload_keeps_the_last_good(tmp_path: Path, pki) -> None:
    """A new password is taken when the file changes; one written without changing the file's stamp is taken
    on SIGHUP; a broken file is one line and the last good stays; a renewed certificate is served."""
    cert, key = tmp_path / "server.crt", tmp_path / "server.key"
    cert.write_bytes(pki.server_cert.read_bytes())
    key.write_bytes(pki.server_key.read_bytes())
    tls = {**tls_of(pki), "cert_file": "server.crt", "key_file": "server.key"}  # relative: the file's folder
    path = web_config(tmp_path / "web.yml", tls=tls, users={"alice": hashed("one")})
    port = free_port()
    with run_daemon(tmp_path, ["--metrics", f"tcp:{port}:interface=127.0.0.1", "--web-config", str(path)],
                    scenario=SCENARIO) as daemon:
        assert https_get(port, pki, "alice", "one") == 200
        web_config(path, tls=tls, users={"alice": hashed("two")})
        wait_until(lambda: https_get(port, pki, "alice", "two") == 200, "the changed file was not read", daemon)
        assert https_get(port, pki, "alice", "one") == 401
        # the same size and stamp: only SIGHUP says it changed
        stamp = path.stat()
        web_config(path, tls=tls, users={"alice": hashed("six")})
        assert path.stat().st_size == stamp.st_size
        os.utime(path, ns=(stamp.st_atime_ns, stamp.st_mtime_ns))
        time.sleep(2.5)
        assert https_get(port, pki, "alice", "six") == 401
        assert daemon.proc is not None
        daemon.proc.send_signal(signal.SIGHUP)
        wait_until(lambda: https_get(port, pki, "alice", "six") == 200, "SIGHUP did not reload", daemon)
        path.write_text("basic_auth_users:\n  alice: not-a-hash\n")
        wait_until(lambda: "keeping the last good configuration" in daemon.log(), "no line for the bad file", daemon)
        assert https_get(port, pki, "alice", "six") == 200
        lines = [line for line in daemon.log().splitlines() if "keeping the last good" in line]
        assert len(lines) == 1 and "basic_auth_users.alice: not a bcrypt hash" in lines[0]
        # a renewed certificate (same CA, another serial) is served from the next handshake on
        web_config(path, tls=tls, users={"alice": hashed("six")})
        before = served_serial(port, pki)
        renewed, renewed_key = pki.reissue_server("renewed")
        key.write_bytes(renewed_key.read_bytes())
        cert.write_bytes(renewed.read_bytes())
        wait_until(lambda: served_serial(port, pki) != before, "the renewed certificate was not served", daemon)
        assert daemon.proc.poll() is None


def test_a_bad_file_at_start_is_one_line_and_exit_2(tmp_path: Path, pki) -> None:
    """A file that cannot be used ends start-up: exit status 2 and one line naming the file and the key."""
    path = web_config(tmp_path / "web.yml", tls={"cert_file": "missing.crt", "key_file": str(pki.server_key)})
    daemon = Daemon(tmp_path, ["--metrics", f"tcp:{free_port()}:interface=127.0.0.1", "--web-config", str(path)],
                    scenario=SCENARIO).start(wait=False)
    assert daemon.proc is not None
    assert daemon.proc.wait(30) == 2
    daemon.stop()
    lines = daemon.log().strip().splitlines()
    assert lines == [f"atopgpud: --web-config {path}: tls_server_config.cert_file {tmp_path / 'missing.crt'}: "
                     "cannot be read (No such file or directory)"]


def refused_at_start(tmp_path: Path, path: Path) -> list[str]:
    """The lines of a daemon started with `path` as its --web-config, which must end start-up (exit 2)."""
    daemon = Daemon(tmp_path, ["--metrics", f"tcp:{free_port()}:interface=127.0.0.1", "--web-config", str(path)],
                    scenario=SCENARIO).start(wait=False)
    assert daemon.proc is not None
    try:
        assert daemon.proc.wait(30) == 2
    finally:
        daemon.stop()
    return daemon.log().strip().splitlines()


def test_a_bcrypt_cost_over_the_bound_at_start_is_one_line_and_exit_2(tmp_path: Path) -> None:
    """A hash of cost 15 (some 2.6 s of a core a check, a stop behind each) ends start-up: exit 2, one line."""
    path = web_config(tmp_path / "web.yml", users={"prometheus": "$2y$15$" + "a" * 53})
    lines = refused_at_start(tmp_path, path)
    assert len(lines) == 1 and lines[0].startswith(f"atopgpud: --web-config {path}: basic_auth_users.prometheus: "
                                                   "bcrypt cost 15 is not from 4 to 14"), lines


#: for each client_auth_type: whether a client with no certificate, one the CA signed, and a self-signed one
#: gets the page (Go's meanings, https://pkg.go.dev/crypto/tls#ClientAuthType)
CLIENT_AUTH = {
    "NoClientCert": (True, True, True),
    "RequestClientCert": (True, True, True),
    "RequireAnyClientCert": (False, True, True),
    "VerifyClientCertIfGiven": (True, True, False),
    "RequireAndVerifyClientCert": (False, True, False),
}


def test_each_client_auth_type_admits_whom_go_admits(tmp_path: Path, pki) -> None:
    """One daemon, its file rewritten for each client_auth_type (a reload swaps the context): curl without a
    certificate, with the CA's, and with a self-signed one is served or refused as crypto/tls would."""
    path = web_config(tmp_path / "web.yml", tls=tls_of(pki, "NoClientCert"))
    port = free_port()
    url = f"https://127.0.0.1:{port}/-/healthy"
    clients = {"none": [], "signed": ["--cert", str(pki.client_cert), "--key", str(pki.client_key)],
               "self-signed": ["--cert", str(pki.stranger_cert), "--key", str(pki.stranger_key)]}
    with run_daemon(tmp_path, ["--metrics", f"tcp:{port}:interface=127.0.0.1", "--web-config", str(path)],
                    scenario=SCENARIO) as daemon:
        for reloads, (mode, admitted) in enumerate(CLIENT_AUTH.items()):
            if reloads:
                web_config(path, tls=tls_of(pki, mode))
                line = f"client certificates: {mode}"
                wait_until(lambda line=line: line in daemon.log(), f"{mode} not read", daemon)
            got = tuple(curl(url, "--cacert", str(pki.ca), *args)[1] == "200" for args in clients.values())
            assert got == admitted, (mode, dict(zip(clients, got)))


def test_tls_and_basic_auth_on_a_unix_socket_behind_the_access_gate(tmp_path: Path, pki) -> None:
    """--metrics on a filesystem UNIX socket with --allow-uid: the gate, then TLS, then the password."""
    socket_path = tmp_path / "metrics.sock"
    path = web_config(tmp_path / "web.yml", tls=tls_of(pki, "NoClientCert"), users={"alice": hashed("one")})
    with run_daemon(tmp_path, ["--metrics", f"unix:{socket_path}", "--allow-uid", "root", "--web-config",
                               str(path)], scenario=SCENARIO):
        tls = ["--unix-socket", str(socket_path), "--cacert", str(pki.ca)]
        assert curl("https://localhost/metrics", *tls, "-u", "alice:one")[1] == "200"
        assert curl("https://localhost/metrics", *tls, "-u", "alice:two")[1] == "401"
        rc, code, _ = curl("http://localhost/metrics", "--unix-socket", str(socket_path), "-u", "alice:one")
        assert rc != 0 and code == "000"


def http_status(port: int, user: str, password: str) -> int:
    return get(port, user, password)


def test_over_long_passwords_and_unknown_users_are_refused_cheaply(tmp_path: Path) -> None:
    """200 requests with a 100-byte password: 401 each and a line or two, no traceback; 16 clients at once
    naming unknown users: 401 each, never 503 (no bcrypt check is spent on them); the right one: 200."""
    config = web_config(tmp_path / "web.yml", users={"prometheus": hashed(PASSWORD, cost=10)})
    port = free_port()
    with run_daemon(tmp_path, ["--metrics", f"tcp:{port}:interface=127.0.0.1", "--web-config", str(config)],
                    scenario=SCENARIO) as daemon:
        assert {http_status(port, "prometheus", "x" * 100) for _ in range(200)} == {401}
        codes: list[int] = []

        def stranger(n: int) -> None:
            codes.extend(http_status(port, f"stranger{n}-{i}", "guess") for i in range(10))

        threads = [threading.Thread(target=stranger, args=(n,)) for n in range(16)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert codes.count(401) == 160, sorted(set(codes))
        assert http_status(port, "prometheus", PASSWORD) == 200
        log = daemon.log()
    assert "Traceback" not in log and "bcrypt check failed" not in log
    assert 1 <= log.count("over bcrypt's 72") <= 2, log


@pytest.mark.parametrize("kind", ["device", "fifo"])
def test_a_device_or_fifo_as_the_file_at_start_is_one_line_and_exit_2(tmp_path: Path, kind: str) -> None:
    """--web-config /dev/zero (memory filled) or a FIFO (start-up hung): exit status 2 and one line."""
    path = Path("/dev/zero")
    if kind == "fifo":
        path = tmp_path / "web.yml"
        os.mkfifo(path)
    assert refused_at_start(tmp_path, path) == [f"atopgpud: --web-config {path}: cannot be read (not a regular file)"]


def test_a_reload_of_an_emptied_file_or_of_dev_zero_keeps_basic_auth_and_atop(tmp_path: Path) -> None:
    """The file emptied (`> FILE`), then swapped for a symlink to /dev/zero and SIGHUP sent: each is one line,
    requests without a password still get 401, atop is answered, the daemon stays small."""
    path = web_config(tmp_path / "web.yml", users={"prometheus": hashed(PASSWORD, cost=4)})
    port = free_port()
    with run_daemon(tmp_path, ["--metrics", f"tcp:{port}:interface=127.0.0.1", "--web-config", str(path)],
                    scenario=SCENARIO) as daemon:
        assert http_status(port, "prometheus", PASSWORD) == 200
        path.write_text("")
        wait_until(lambda: "turns basic auth off" in daemon.log(), "the emptied file was not refused", daemon)
        assert http_status(port, "nobody", "x") == 401 and http_status(port, "prometheus", PASSWORD) == 200
        path.unlink()
        path.symlink_to("/dev/zero")
        assert daemon.proc is not None
        daemon.proc.send_signal(signal.SIGHUP)
        wait_until(lambda: "not a regular file" in daemon.log(), "/dev/zero was read", daemon)
        client = daemon.client()
        try:
            assert client.types()
        finally:
            client.close()
        assert http_status(port, "prometheus", PASSWORD) == 200
        rss_kib = int(Path(f"/proc/{daemon.proc.pid}/status").read_text().split("VmRSS:")[1].split()[0])
        print(f"/dev/zero as the file at a reload: daemon RSS {rss_kib} KiB")
        assert rss_kib < 512 * 1024, rss_kib
        lines = [line for line in daemon.log().splitlines() if "keeping the last good" in line]
        assert len(lines) == 2, lines


# -- issue 37's attacks, measured (figures in docs/reliability.md) ---------------------------------


#: 20 threads sending ever new wrong passwords for USER to 127.0.0.1:PORT until standard input closes; then it
#: prints how many requests got 401 and how many 503
FLOOD = """
import base64, http.client, itertools, sys, threading
port, user, stop, codes, numbers = int(sys.argv[1]), sys.argv[2], threading.Event(), [], itertools.count()

def flood():
    while not stop.is_set():
        token = base64.b64encode(f"{user}:guess-{next(numbers)}".encode()).decode()
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        try:
            connection.request("GET", "/metrics", headers={"Authorization": "Basic " + token})
            codes.append(connection.getresponse().status)
        except (OSError, http.client.HTTPException):
            pass
        finally:
            connection.close()

for _ in range(20):
    threading.Thread(target=flood, daemon=True).start()
sys.stdin.read()
stop.set()
print(codes.count(401), codes.count(503), flush=True)
"""


@pytest.mark.usefixtures("as_others")
@pytest.mark.parametrize("flooder", ["another address", "another local uid"])
def test_first_checks_get_through_a_wrong_password_flood(tmp_path: Path, flooder: str) -> None:
    """20 threads send ever-new wrong passwords (cost 10) and fill every pending check: root on 127.0.0.1 while
    the scraper is on 127.0.0.2, or uid 1000 on the scraper's own 127.0.0.1.  16 scrapes, each the first check
    of its user's right password, each get 200 (each took a flood's place, where they got 503 on 16 of 16)."""
    users = {f"scraper{n}": hashed(f"{PASSWORD}-{n}", cost=10) for n in range(16)}
    config = web_config(tmp_path / "web.yml", users=users)
    port = free_port()
    source = "127.0.0.2" if flooder == "another address" else "127.0.0.1"
    uid = 0 if flooder == "another address" else 1000
    with run_daemon(tmp_path, ["--metrics", f"tcp:{port}:interface=127.0.0.1", "--web-config", str(config)],
                    scenario=SCENARIO) as daemon:
        attacker = subprocess.Popen(["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--",
                                     SYSTEM_PYTHON, "-c", FLOOD, str(port), "scraper0"],
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            wait_until(lambda: "password checks already pending" in daemon.log(), "the flood filled no check", daemon)
            scrapes = [get(port, f"scraper{n}", f"{PASSWORD}-{n}", source=source) for n in range(16)]
        finally:
            refused, busy = attacker.communicate("", timeout=60)[0].split()
    print(f"first checks during a flood from {flooder}: {scrapes.count(200)} of 16 got 200; the flood got "
          f"{refused} 401 and {busy} 503")
    assert scrapes == [200] * 16, scrapes


#: 32 threads, each holding a connection that sent 5 bytes of a TLS record header and no more, reopened when
#: the daemon cuts it, until standard input closes; then it prints how many were cut
HALF_OPEN = """
import socket, sys, threading
port, cut, stop = int(sys.argv[1]), [], threading.Event()

def hold():
    while not stop.is_set():
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=30) as raw:
                raw.sendall(b"\\x16\\x03\\x01\\x02\\x00")
                raw.recv(1)
        except OSError:
            pass
        cut.append(1)

for _ in range(32):
    threading.Thread(target=hold, daemon=True).start()
sys.stdin.read()
stop.set()
print(len(cut), flush=True)
"""


@pytest.mark.usefixtures("as_others")
def test_half_open_handshakes_of_a_local_user_leave_the_scraper_its_scrapes(tmp_path: Path, pki) -> None:
    """uid 1000 keeps 32 connections that send 5 bytes of a record header, each reopened when cut, from the
    scraper's own address: the scraper (root here; client certificate and password) gets 200 on 20 of 20
    scrapes (0 of 20 before), as its handshakes are counted apart from another uid's."""
    config = web_config(tmp_path / "web.yml", tls=tls_of(pki), users={"prometheus": hashed(PASSWORD, cost=10)})
    port = free_port()
    with run_daemon(tmp_path, ["--metrics", f"tcp:{port}:interface=127.0.0.1", "--web-config", str(config)],
                    scenario=SCENARIO) as daemon:
        attacker = subprocess.Popen(["setpriv", "--reuid=1000", "--regid=1000", "--clear-groups", "--",
                                     SYSTEM_PYTHON, "-c", HALF_OPEN, str(port)],
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            wait_until(lambda: "over 4 TLS handshakes in flight" in daemon.log(), "no handshake was cut", daemon)
            scrapes = [get(port, "prometheus", PASSWORD, pki) for _ in range(20)]
        finally:
            cut = attacker.communicate("", timeout=60)[0].strip()
        log = daemon.log()
    print(f"half-open handshakes of uid 1000: {cut} cut; the scraper: {scrapes.count(200)} of 20 got 200; "
          f"{log.count('over 4 TLS handshakes')} lines of handshakes cut for their number, "
          f"{log.count('no TLS handshake within')} for their time")
    assert "from 127.0.0.1 (uid 1000)" in log
    assert scrapes == [200] * 20, scrapes


def test_a_burst_of_sighups_is_a_few_reloads_and_atop_is_answered(tmp_path: Path, pki) -> None:
    """SIGHUP 50 times a second for 3 s (TLS, a client CA, users): at most one reload built a second, atop
    answered throughout; its slowest reply is printed (50 a second once gave one of 4.4 s and a timeout)."""
    config = web_config(tmp_path / "web.yml", tls=tls_of(pki), users={"prometheus": hashed(PASSWORD, cost=10)})
    with run_daemon(tmp_path, ["--metrics", f"tcp:{free_port()}:interface=127.0.0.1", "--web-config",
                               str(config)], scenario=SCENARIO) as daemon:
        assert daemon.proc is not None
        client = daemon.client()
        slowest, answered = 0.0, 0
        began = time.monotonic()
        try:
            for n in range(150):
                daemon.proc.send_signal(signal.SIGHUP)
                if n % 2 == 0:
                    asked = time.monotonic()
                    assert client.stats()
                    slowest = max(slowest, time.monotonic() - asked)
                    answered += 1
                time.sleep(0.02)
        finally:
            client.close()
        seconds = time.monotonic() - began
        time.sleep(2.5)
        reloads = daemon.log().count("reloaded (SIGHUP)")
    print(f"150 SIGHUPs in {seconds:.1f} s: {reloads} reloads; atop {answered} answers, slowest "
          f"{slowest * 1000:.1f} ms")
    assert 1 <= reloads <= seconds + 3
