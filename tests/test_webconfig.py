"""--web-config: the toolkit's file parsed strictly, the TLS context built, bcrypt bounded, reloads kept whole."""

from __future__ import annotations

import base64
import json
import os
import signal
from pathlib import Path

import pytest
from OpenSSL import SSL
from twisted.internet import task
from twisted.internet.address import IPv4Address
from twisted.internet.defer import Deferred, maybeDeferred
from twisted.internet.error import ConnectionDone
from twisted.logger import capturedLogs
from twisted.python.failure import Failure
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET
from twisted.web.test.requesthelper import DummyRequest
from webtls import Pki, hashed, web_config

from atopgpud_tw.server.system.signals import SignalService
from atopgpud_tw.server.web import websecure
from atopgpud_tw.server.web.websecure import (
    CIPHERS,
    CLIENT_AUTH_TYPES,
    Contexts,
    PasswordChecks,
    Protected,
    WebConfig,
    WebConfigError,
    WebSecurity,
    build_context,
    load,
    parse,
    subject_names,
)

HASH = "$2y$10$" + "a" * 53


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Pki:
    return Pki(tmp_path_factory.mktemp("pki"))


def tls_text(**more: str) -> str:
    lines = ["tls_server_config:", "  cert_file: server.crt", "  key_file: server.key"]
    lines += [f"  {key}: {value}" for key, value in more.items()]
    return "\n".join(lines) + "\n"


BAD = [
    ("tls_server_config: [1]\n", "tls_server_config must be a mapping of keys to values, not a list"),
    ("- a\n", "the file must be a mapping"),
    ("tls_server_confg: {}\n", "unknown key tls_server_confg (known in the file: tls_server_config, "),
    ("rate_limit: {interval: 1x, burst: 2}\n", "rate_limit.interval: '1x' is not a duration such as 1s or 250ms"),
    ("rate_limit: {interval: 5, burst: 2}\n", "rate_limit.interval must be a duration such as 1s or 250ms"),
    ("rate_limit: {interval: 1s, burst: 0}\n", "rate_limit.burst 0 would refuse every request"),
    ("rate_limit: {interval: 1s, burst: -1}\n", "rate_limit.burst must be a whole number from 0 up"),
    ("rate_limit: {interval: 1s, rate: 2}\n", "unknown key rate_limit.rate (known in rate_limit: interval, burst)"),
    (tls_text(curve_preferences="[X25519]"), "curve_preferences is not supported"),
    (tls_text(certfile="x"), "unknown key tls_server_config.certfile"),
    ("tls_server_config:\n  key_file: k\n", "tls_server_config.cert_file (or cert) is missing"),
    ("tls_server_config:\n  cert_file: c\n", "tls_server_config.key_file (or key) is missing"),
    ("tls_server_config:\n  client_auth_type: RequireAndVerifyClientCert\n", "cert_file (or cert) is missing"),
    (tls_text(cert="x"), "tls_server_config.cert and tls_server_config.cert_file are both given"),
    (tls_text(client_auth_type="Always"), "client_auth_type: 'Always' is not one of NoClientCert, "),
    (tls_text(client_ca_file="ca.crt"), "client_ca_file is given with client_auth_type NoClientCert"),
    (tls_text(client_auth_type="RequireAndVerifyClientCert"), "needs client_ca_file (or client_ca)"),
    (tls_text(client_auth_type="VerifyClientCertIfGiven"), "needs client_ca_file (or client_ca)"),
    (tls_text(client_allowed_sans="[a]"), "client_allowed_sans needs client_auth_type RequireAnyClientCert"),
    (tls_text(client_auth_type="RequestClientCert", client_allowed_sans="[a]"), "client_allowed_sans needs"),
    (tls_text(client_auth_type="RequireAnyClientCert", client_allowed_sans="a"), "must be a list of strings"),
    (tls_text(min_version="TLS14"), "min_version: 'TLS14' is not one of TLS10, TLS11, TLS12, TLS13"),
    (tls_text(max_version="1.3"), "max_version must be a string, not a number"),
    (tls_text(max_version="TLS1.3"), "max_version: 'TLS1.3' is not one of"),
    (tls_text(min_version="TLS13", max_version="TLS12"), "min_version TLS13 is above max_version TLS12"),
    (tls_text(cipher_suites="TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256"), "cipher_suites must be a list of strings"),
    (tls_text(prefer_server_cipher_suites="yes please"), "prefer_server_cipher_suites must be true or false"),
    ("tls_server_config:\n  cert_file: 5\n  key_file: k\n", "cert_file must be a string, not a number"),
    ("tls_server_config:\n  cert_file: c\n  cert_file: d\n", "line 3: cert_file is given twice"),
    ("http_server_config:\n  http2: maybe\n", "http_server_config.http2 must be true or false, not a string"),
    ("http_server_config:\n  http3: true\n", "unknown key http_server_config.http3"),
    ("http_server_config:\n  headers:\n    X-Powered-By: me\n", "X-Powered-By cannot be set"),
    ("http_server_config:\n  headers:\n    X-Frame-Options: allow\n", "'allow' is not one of deny, sameorigin"),
    ("http_server_config:\n  headers: [a]\n", "headers must be a mapping, not a list"),
    ("basic_auth_users:\n  alice: secret\n", "basic_auth_users.alice: not a bcrypt hash"),
    ("basic_auth_users:\n  alice: 5\n", "a bcrypt hash is a string, not a number"),
    (f"basic_auth_users:\n  alice: '{'$2y$03$' + 'a' * 53}'\n", "bcrypt cost 03 is not from 4 to 14"),
    (f"basic_auth_users:\n  alice: '{'$2y$15$' + 'a' * 53}'\n", "bcrypt cost 15 is not from 4 to 14"),
    (f"basic_auth_users:\n  alice: '{'$2b$31$' + 'a' * 53}'\n", "bcrypt cost 31 is not from 4 to 14"),
    (f"basic_auth_users:\n  'a:b': '{HASH}'\n", "is not a user name"),
    ("basic_auth_users: [alice]\n", "basic_auth_users must be a mapping of user names to bcrypt hashes"),
    ("basic_auth_users:\n  alice: x\n  alice: y\n", "line 3: alice is given twice"),
    ("tls_server_config: {cert_file: a\n", "not valid YAML: line 2 column 1: "),
    ("a: !!python/object:os.system x\n", "not valid YAML"),
]


@pytest.mark.parametrize(("text", "wanted"), BAD, ids=[wanted[:40] for _, wanted in BAD])
def test_a_bad_file_is_one_line_naming_the_key(text: str, wanted: str) -> None:
    """Every error names the key and what it wants, on one line."""
    with pytest.raises(WebConfigError) as raised:
        parse(text, "/etc/atopgpud")
    message = str(raised.value)
    assert wanted in message
    assert "\n" not in message and len(message) < 300


def test_a_full_file_parses_with_paths_relative_to_its_folder() -> None:
    """Every supported key read; relative file names are the file's folder's; the toolkit's defaults hold."""
    config = parse(
        tls_text(client_auth_type="RequireAndVerifyClientCert", client_ca_file="/abs/ca.crt", min_version="TLS13",
                 cipher_suites="[TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256]", client_allowed_sans="[a.example]",
                 prefer_server_cipher_suites="false")
        + "http_server_config:\n  http2: false\n  headers:\n    X-Frame-Options: deny\n    X-XSS-Protection: ''\n"
        + f"basic_auth_users:\n  alice: '{HASH}'\n",
        "/etc/atopgpud",
    )
    assert config.tls is not None
    assert config.tls.cert_file == "/etc/atopgpud/server.crt"
    assert config.tls.client_ca_file == "/abs/ca.crt"
    assert config.tls.files() == ("/etc/atopgpud/server.crt", "/etc/atopgpud/server.key", "/abs/ca.crt")
    assert (config.tls.min_version, config.tls.max_version) == ("TLS13", "TLS13")
    assert config.tls.client_allowed_sans == ("a.example",)
    assert config.tls.prefer_server_cipher_suites is False
    assert config.headers == {"X-Frame-Options": "deny"}  # blank: unset
    assert config.users == {"alice": HASH.encode()}
    assert config.http2 is False


def test_rate_limit_is_a_go_duration_and_a_burst() -> None:
    """The toolkit's token bucket: Go durations; an interval of 0 turns it off."""
    assert parse("rate_limit: {interval: 1m30s, burst: 3}\n", "/").rate_limit == (90.0, 3)
    assert parse("rate_limit: {interval: 250ms, burst: 1}\n", "/").rate_limit == (0.25, 1)
    assert parse("rate_limit: {interval: 0, burst: 0}\n", "/").rate_limit is None


def test_an_empty_file_or_no_tls_keys_is_plain_http() -> None:
    """As the toolkit has it: nothing that turns TLS on means plain HTTP; the old RequireClientCert name is taken."""
    assert parse("", "/") == WebConfig()
    assert parse("tls_server_config: {}\n", "/").tls is None
    assert parse(tls_text(client_auth_type="RequireClientCert"), "/").tls.client_auth_type == "RequireAnyClientCert"


def test_tls_context_errors_are_one_line(pki: Pki, tmp_path: Path) -> None:
    """A missing file, a file without PEM, a key of another certificate, an unknown cipher: one line each."""
    (tmp_path / "empty.pem").write_text("nothing here\n")
    cases = [
        ({"cert_file": str(tmp_path / "missing.crt"), "key_file": str(pki.server_key)}, "cannot be read"),
        ({"cert_file": str(tmp_path / "empty.pem"), "key_file": str(pki.server_key)}, "no PEM certificate in it"),
        ({"cert_file": str(pki.server_cert), "key_file": str(tmp_path / "empty.pem")}, "no PEM private key in it"),
        ({"cert_file": str(pki.server_cert), "key_file": str(pki.client_key)}, "is not the key of"),
        ({"cert_file": str(pki.server_cert), "key_file": str(pki.server_key), "cipher_suites": ["RC4"]},
         "'RC4' is not a cipher suite"),
        ({"cert_file": str(pki.server_cert), "key_file": str(pki.server_key),
          "client_auth_type": "RequireAndVerifyClientCert", "client_ca_file": str(tmp_path / "empty.pem")},
         "client_ca_file"),
    ]
    for tls, wanted in cases:
        path = web_config(tmp_path / "web.yml", tls=tls)
        with pytest.raises(WebConfigError) as raised:
            load(str(path))
        assert wanted in str(raised.value) and "\n" not in str(raised.value), tls


@pytest.mark.parametrize("mode", CLIENT_AUTH_TYPES)
def test_every_client_auth_type_builds_a_context(pki: Pki, tmp_path: Path, mode: str) -> None:
    """The five client auth types map onto OpenSSL verify modes; Go's cipher names onto OpenSSL's."""
    tls = {"cert_file": str(pki.server_cert), "key_file": str(pki.server_key), "client_auth_type": mode,
           "cipher_suites": list(CIPHERS)[4:8] + ["TLS_AES_128_GCM_SHA256"]}
    if mode != "NoClientCert":
        tls["client_ca_file"] = str(pki.ca)
    context = load(str(web_config(tmp_path / "web.yml", tls=tls))).context
    assert isinstance(context, SSL.Context)
    verify = context.get_verify_mode()
    assert bool(verify & SSL.VERIFY_PEER) == (mode != "NoClientCert")
    assert bool(verify & SSL.VERIFY_FAIL_IF_NO_PEER_CERT) == (mode in ("RequireAnyClientCert",
                                                                        "RequireAndVerifyClientCert"))


def test_what_twisteds_certificate_options_cannot_do(pki: Pki) -> None:
    """Why the client certificates are set by hand on CertificateOptions' context: it cannot ask for a certificate
    without verifying it against CAs (RequestClientCert, RequireAnyClientCert: verify=True needs caCerts, and
    without verify it asks for none), nor check client_allowed_sans (no verify callback); and it always prefers
    the server's order of suites (prefer_server_cipher_suites: false has no effect)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization
    from twisted.internet.ssl import CertificateOptions

    key = serialization.load_pem_private_key(pki.server_key.read_bytes(), password=None)
    cert = x509.load_pem_x509_certificate(pki.server_cert.read_bytes())
    with pytest.raises(ValueError, match="if and only if enabling certificate verification"):
        CertificateOptions(privateKey=key, certificate=cert, verify=True)
    context = CertificateOptions(privateKey=key, certificate=cert).getContext()
    assert context.get_verify_mode() == SSL.VERIFY_NONE
    assert context.set_options(0) & SSL.OP_CIPHER_SERVER_PREFERENCE
    asking = load_context(pki, "RequestClientCert")
    assert asking.get_verify_mode() == SSL.VERIFY_PEER  # asked, accepted unverified (test_web_tls.py)


def load_context(pki: Pki, mode: str) -> SSL.Context:
    tls = {"cert_file": str(pki.server_cert), "key_file": str(pki.server_key), "client_auth_type": mode}
    return build_context(parse("tls_server_config: " + json.dumps(tls) + "\n", "/").tls)


def test_inline_pem_builds_the_same_context(pki: Pki) -> None:
    """cert, key and client_ca given inline, as the toolkit allows."""
    settings = parse(
        "tls_server_config:\n"
        f"  cert: {json.dumps(pki.server_cert.read_text())}\n  key: {json.dumps(pki.server_key.read_text())}\n"
        f"  client_ca: {json.dumps(pki.ca.read_text())}\n  client_auth_type: RequireAndVerifyClientCert\n",
        "/",
    ).tls
    assert settings is not None and settings.files() == ()
    assert isinstance(build_context(settings), SSL.Context)


def test_subject_names_are_read_as_go_matches_them(pki: Pki) -> None:
    from cryptography import x509

    server = x509.load_pem_x509_certificate(pki.server_cert.read_bytes())
    assert subject_names(server) == ["localhost", "127.0.0.1"]


# -- bcrypt, bounded ----------------------------------------------------------------------


@pytest.fixture
def held(monkeypatch):
    """A clock, and a PasswordChecks whose bcrypt runs when the test says (`run`), not in a thread."""
    clock = task.Clock()
    checks = PasswordChecks(clock, max_pending=2, now=clock.seconds)
    queued: list = []

    def defer(reactor, pool, function, *args):  # noqa: ANN001
        done: Deferred = Deferred()
        queued.append((done, function, args))
        return done

    monkeypatch.setattr(websecure, "deferToThreadPool", defer)
    monkeypatch.setattr(checks, "start", lambda: None)
    yield clock, checks, queued


def run(queued: list) -> None:
    while queued:
        done, function, args = queued.pop(0)
        done.callback(function(*args))


def test_bcrypt_runs_outside_the_reactor_bounded_and_cached(held) -> None:
    """Checks go to the pool; beyond the bound the answer is None (503) at once; a verdict is cached a while,
    right and wrong alike; the same credentials at once share one check."""
    clock, checks, queued = held
    users = {"alice": hashed("right").encode()}
    first = checks.check(b"alice", b"right", users)
    same = checks.check(b"alice", b"right", users)
    wrong = checks.check(b"alice", b"wrong", users)
    assert isinstance(first, Deferred) and isinstance(same, Deferred) and isinstance(wrong, Deferred)
    assert len(queued) == 2  # the same credentials share one run
    assert checks.check(b"alice", b"third", users) is None  # two pending: the bound
    assert checks.refused == 1
    run(queued)
    assert [first.result, same.result, wrong.result] == [True, True, False]
    assert checks.check(b"alice", b"right", users) is True  # cached: no bcrypt
    assert checks.check(b"alice", b"wrong", users) is False
    assert not queued and checks.checked == 2
    clock.advance(websecure.CACHE_SECONDS + 1)
    assert isinstance(checks.check(b"alice", b"right", users), Deferred)  # expired: checked again


def test_the_right_verdict_is_renewed_by_use_and_never_waits_behind_a_flood(held) -> None:
    """Scraped every 30 s for 5 minutes, the right password is checked once; left unused past its verdict while
    wrong passwords fill every pending place, it is still checked (in its own thread), never answered 503."""
    clock, checks, queued = held
    users = {"alice": hashed("right").encode()}
    first = checks.check(b"alice", b"right", users)
    run(queued)
    assert isinstance(first, Deferred) and first.result is True
    for _ in range(10):
        clock.advance(websecure.CACHE_SECONDS / 2)
        assert checks.check(b"alice", b"right", users) is True
    assert checks.checked == 1
    clock.advance(websecure.CACHE_SECONDS + 1)  # the scraper paused; its verdict lapsed
    flood = [checks.check(b"alice", b"guess%d" % n, users) for n in range(2)]
    assert all(isinstance(each, Deferred) for each in flood)
    assert checks.check(b"alice", b"guess-more", users) is None  # the flood is at its bound: 503
    again = checks.check(b"alice", b"right", users)
    assert isinstance(again, Deferred)  # not None: checked beside the flood
    assert checks.check(b"bob", b"right", users) is False
    run(queued)
    assert again.result is True and [each.result for each in flood] == [False, False]
    root = Protected(page_tree(), WebConfig(users=users), checks, clock)
    for n in range(3):
        checks.check(b"alice", b"guess-again%d" % n, users)
    good = request_for(b"metrics", "alice", "right")
    assert render(root.getChildWithDefault(b"metrics", good), good) == b"page"
    checks.forget()  # the users changed: nothing is known right any more
    assert checks.check(b"alice", b"right", users) is None
    root.stop()


def test_a_first_check_from_another_address_pushes_out_the_floods_newest(held) -> None:
    """Wrong passwords from one address fill every pending place; the scraper's first check (never known
    right) from another address takes the flood's newest place (that request: 503), not a 503 of its own;
    the flood's next one is 503; two addresses holding one each refuse a third as before."""
    clock, checks, queued = held
    users = {"alice": hashed("right").encode()}
    root = Protected(page_tree(), WebConfig(users=users), checks, clock)
    flood = []
    for n in range(2):
        request = request_for(b"metrics", "alice", f"guess{n}")
        request.client = IPv4Address("TCP", "10.0.0.1", 4000 + n)
        request.render = lambda resource, request=request: render(resource, request)
        root.getChildWithDefault(b"metrics", request).render(request)
        flood.append(request)
    assert checks.check(b"alice", b"guess-more", users, "10.0.0.1") is None
    scraper = request_for(b"metrics", "alice", "right")
    scraper.client = IPv4Address("TCP", "10.0.0.2", 5000)
    scraper.render = lambda resource: render(resource, scraper)
    root.getChildWithDefault(b"metrics", scraper).render(scraper)
    assert flood[1].responseCode == 503 and checks.refused == 1
    assert checks.check(b"alice", b"guess-again", users, "10.0.0.1") is None
    run(queued)
    assert b"".join(scraper.written) == b"page" and flood[0].responseCode == 401
    assert checks.checked == 3 and not checks.pending and not checks.owners
    assert checks.check(b"alice", b"right", users, "10.0.0.3") is True  # cached; the pushed-out one never ran
    for peer in ("10.0.0.1", "10.0.0.2"):
        checks.check(b"alice", b"x" + peer.encode(), users, peer)
    assert checks.check(b"alice", b"y", users, "10.0.0.3") is None
    run(queued)
    root.stop()


def test_the_bcrypt_checker_is_twisted_creds_checker(held) -> None:
    """PasswordChecks is a twisted.cred credentials checker: a Portal logs in with the right password (the user
    name as avatar id), refuses a wrong one (UnauthorizedLogin) and says Busy beyond the bound."""
    from twisted.cred.checkers import ICredentialsChecker
    from twisted.cred.credentials import UsernamePassword
    from twisted.cred.error import UnauthorizedLogin
    from zope.interface.verify import verifyObject

    clock, checks, queued = held
    assert verifyObject(ICredentialsChecker, checks)
    checks.users = {"alice": hashed("right").encode()}
    right, wrong = (checks.requestAvatarId(UsernamePassword(b"alice", password)) for password in (b"right", b"no"))
    busy = checks.requestAvatarId(UsernamePassword(b"alice", b"third"))
    run(queued)
    assert right.result == b"alice"
    assert wrong.result.check(UnauthorizedLogin) and busy.result.check(websecure.Busy)
    for done in (wrong, busy):
        done.addErrback(lambda _: None)


def test_an_unknown_user_is_refused_without_bcrypt(held) -> None:
    """An unknown user is refused at once: a flood of made-up users costs no check and takes no place."""
    clock, checks, queued = held
    users = {"alice": hashed("right").encode()}
    for name in (b"mallory", b"Alice", b"alice\0", b"\xff"):
        assert checks.check(name, b"anything", users) is False
    assert not queued and checks.checked == 0 and not checks.pending


def test_a_password_beyond_bcrypts_72_bytes_is_refused_without_bcrypt(held) -> None:
    """bcrypt 5 raises on a password over 72 bytes (older ones cut it): it is wrong at once, never checked."""
    clock, checks, queued = held
    right = "r" * 72
    users = {"alice": hashed(right).encode()}
    assert checks.check(b"alice", (right + "x").encode(), users) is False
    assert not queued and checks.checked == 0
    assert isinstance(checks.check(b"alice", right.encode(), users), Deferred)  # 72 bytes: checked
    run(queued)


def test_over_long_passwords_get_401_and_one_line(held) -> None:
    """Fifty requests with a 100-byte password: 401 each, one warning for them all, no traceback."""
    clock, checks, queued = held
    root = Protected(page_tree(), WebConfig(users={"alice": hashed("right").encode()}), checks, clock)
    with capturedLogs() as events:
        for _ in range(50):
            request = request_for(b"metrics", "alice", "p" * 100)
            assert render(root.getChildWithDefault(b"metrics", request), request) == b"Unauthorized\n"
            assert request.responseCode == 401
        run(queued)
        clock.advance(11)
    assert not queued
    lines = [e for e in events if e.get("log_level") and e["log_level"].name in ("warn", "error", "critical")]
    assert len(lines) == 2, lines  # the first, and the count when the burst is over
    assert "over bcrypt's" in lines[0]["log_format"] and (lines[0]["size"], lines[0]["most"]) == (100, 72)
    assert not [e for e in events if "log_failure" in e]
    root.stop()


def request_for(path: bytes, user: str | None = None, password: str = "") -> DummyRequest:
    request = DummyRequest([path])
    if user is not None:
        token = base64.b64encode(f"{user}:{password}".encode())
        request.requestHeaders.setRawHeaders(b"authorization", [b"Basic " + token])
    return request


def page_tree() -> Resource:
    root = Resource()
    leaf = Resource()
    leaf.isLeaf = True
    leaf.render_GET = lambda request: b"page"  # type: ignore[attr-defined]
    root.putChild(b"metrics", leaf)
    return root


def render(resource, request: DummyRequest) -> bytes:
    result = resource.render(request)
    if result is not NOT_DONE_YET:
        request.write(result)
        request.finish()
    return b"".join(request.written)


def test_protected_root_answers_401_503_or_the_page(held) -> None:
    """No password, a wrong one: 401 with WWW-Authenticate; the right one: the page (after the pool ran);
    too many pending: 503 with Retry-After; configured headers on every reply."""
    clock, checks, queued = held
    config = WebConfig(users={"alice": hashed("right").encode()}, headers={"X-Content-Type-Options": "nosniff"})
    root = Protected(page_tree(), config, checks, clock)
    bare = request_for(b"metrics")
    answer = root.getChildWithDefault(b"metrics", bare)
    assert render(answer, bare) == b"Unauthorized\n" and bare.responseCode == 401
    assert bare.responseHeaders.getRawHeaders(b"www-authenticate") == [b'Basic realm="atopgpud"']
    assert bare.responseHeaders.getRawHeaders(b"x-content-type-options") == [b"nosniff"]
    good = request_for(b"metrics", "alice", "right")
    waiting = root.getChildWithDefault(b"metrics", good)
    good.render = lambda resource: render(resource, good)  # what BoundedRequest.render does, in short
    assert waiting.render(good) is NOT_DONE_YET
    bad = request_for(b"metrics", "alice", "wrong")
    bad.render = lambda resource: render(resource, bad)
    root.getChildWithDefault(b"metrics", bad).render(bad)
    flood = request_for(b"metrics", "alice", "guess")
    assert render(root.getChildWithDefault(b"metrics", flood), flood).startswith(b"Too many")
    assert flood.responseCode == 503 and flood.responseHeaders.getRawHeaders(b"retry-after") == [b"1"]
    run(queued)
    assert b"".join(good.written) == b"page"
    assert bad.responseCode == 401
    root.stop()


def test_beyond_the_rate_limit_is_429_before_any_password_check(held) -> None:
    """Two requests at once pass (burst 2), the third is 429 with no bcrypt; a token comes back each interval."""
    clock, checks, queued = held
    root = Protected(page_tree(), WebConfig(rate_limit=(1.0, 2)), checks, clock)
    codes = []
    for _ in range(3):
        request = request_for(b"metrics", "alice", "x")
        render(root.getChildWithDefault(b"metrics", request), request)
        codes.append(request.responseCode or 200)
    assert codes == [200, 200, 429] and not queued
    clock.advance(1)
    request = request_for(b"metrics")
    assert render(root.getChildWithDefault(b"metrics", request), request) == b"page"
    root.config = WebConfig()  # a reload without it
    for _ in range(5):
        request = request_for(b"metrics")
        assert render(root.getChildWithDefault(b"metrics", request), request) == b"page"
    root.stop()


def test_no_users_passes_every_request(held) -> None:
    clock, checks, queued = held
    root = Protected(page_tree(), WebConfig(), checks, clock)
    request = request_for(b"metrics")
    assert render(root.getChildWithDefault(b"metrics", request), request) == b"page"


# -- reloads ----------------------------------------------------------------------------------


def security_for(path: Path, clock: task.Clock, held) -> WebSecurity:
    loaded = load(str(path))
    _, checks, _ = held
    root = Protected(page_tree(), loaded.config, checks, clock)
    contexts = Contexts(loaded.context) if loaded.context is not None else None
    return WebSecurity(str(path), loaded, root, contexts, clock, run=maybeDeferred)


def test_a_change_reloads_and_a_bad_one_keeps_the_last_good(pki: Pki, tmp_path: Path, held, logged) -> None:
    """The file watched once a second: a change is read; a broken file, a broken certificate, or TLS turned off
    is one line and the last good configuration stays; a renewed certificate is a reload too."""
    clock = held[0]
    key = tmp_path / "server.key"  # a copy: the module's PKI stays whole
    key.write_bytes(pki.server_key.read_bytes())
    tls = {"cert_file": str(pki.server_cert), "key_file": str(key)}
    path = web_config(tmp_path / "web.yml", tls=tls, users={"alice": hashed("one")})
    security = security_for(path, clock, held)
    security.startService()
    first_context = security.contexts.context
    web_config(path, tls=tls, users={"alice": hashed("two"), "bob": hashed("three")})
    clock.advance(1)
    assert security.reloads == 1 and set(security.root.config.users) == {"alice", "bob"}
    assert security.contexts.context is not first_context
    path.write_text("tls_server_config: [\n")
    clock.advance(1)
    clock.advance(1)  # not tried again until it changes
    assert security.failed_reloads == 1 and set(security.root.config.users) == {"alice", "bob"}
    web_config(path, users={"alice": hashed("two")})
    clock.advance(1)
    assert security.failed_reloads == 2 and security.root.config.tls is not None
    web_config(path, tls=tls, users={"carol": hashed("four")})
    clock.advance(1)
    assert security.reloads == 2
    key.write_text(pki.client_key.read_text())  # the key of another certificate
    clock.advance(1)
    assert security.failed_reloads == 3 and set(security.loaded.config.users) == {"carol"}
    security.stopService()
    lines = [line for line in logged if "--web-config" in line]
    assert sum("keeping the last good configuration" in line for line in lines) == 3
    assert any("turns TLS off, which only a restart can do" in line for line in lines)
    assert any("reloaded (changed): TLS TLS12 to TLS13" in line for line in lines)
    assert not clock.getDelayedCalls()


@pytest.mark.parametrize("text", ["", "basic_auth_users:\n", "# cut\n", "rate_limit: {burst: 2, interval: 1s}\n"])
def test_a_reload_that_would_turn_basic_auth_off_is_refused(tmp_path: Path, held, logged, text: str) -> None:
    """An emptied file (what `> FILE` does first), one cut after basic_auth_users:, one without users:
    the users stay, one line says why; a restart is what turns basic auth off."""
    clock = held[0]
    path = web_config(tmp_path / "web.yml", users={"alice": hashed("one")})
    security = security_for(path, clock, held)
    security.startService()
    path.write_text(text)
    clock.advance(1)
    assert security.failed_reloads == 1 and security.reloads == 0
    assert set(security.root.config.users) == {"alice"}
    request = request_for(b"metrics")
    assert render(security.root.getChildWithDefault(b"metrics", request), request) == b"Unauthorized\n"
    web_config(path, users={"bob": hashed("two")})
    clock.advance(1)
    assert security.reloads == 1 and set(security.root.config.users) == {"bob"}
    security.stopService()
    assert any("turns basic auth off, which only a restart can do" in line for line in logged)


def test_a_reload_with_a_cost_over_the_bound_keeps_the_last_good(tmp_path: Path, held, logged) -> None:
    """A hash of cost 15 (some 2.6 s a check; 31 would be days) in a reload is one line; the last good users stay."""
    clock = held[0]
    path = web_config(tmp_path / "web.yml", users={"alice": hashed("one")})
    security = security_for(path, clock, held)
    security.startService()
    path.write_text(f"basic_auth_users:\n  alice: '{'$2y$15$' + 'a' * 53}'\n")
    clock.advance(1)
    assert security.failed_reloads == 1 and security.reloads == 0
    assert security.root.config.users["alice"].startswith(b"$2")
    assert not security.root.config.users["alice"].startswith(b"$2y$15$")
    security.stopService()
    lines = [line for line in logged if "keeping the last good" in line]
    assert len(lines) == 1 and "bcrypt cost 15 is not from 4 to 14" in lines[0]


STOPPING = """
import sys, threading
from twisted.internet import reactor
from atopgpud_tw.server.web import websecure

never = threading.Event()
started = []

def stuck(password, stored, *skip):
    started.append(password)
    never.wait()  # a check that would take for ever (a cost-31 hash)
    return False

websecure._bcrypt_check = stuck
checks = websecure.PasswordChecks(reactor, threads=2, max_pending=8)
users = {"alice": b"$2y$10$" + b"a" * 53}

def begin():
    for n in range(6):  # two running, four queued
        assert checks.check(b"alice", b"wrong%d" % n, users) is not None
    reactor.callLater(0.2, reactor.stop)

reactor.addSystemEventTrigger("before", "shutdown", checks.stop)
reactor.callWhenRunning(begin)
reactor.run()
print("stopped with", len(checks.pending), "pending,", len(started), "started", flush=True)
"""


@pytest.mark.e2e
def test_stopping_waits_for_no_pending_check() -> None:
    """Two checks that never end and four queued: the reactor stops, the process exits, nothing joined or run."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", STOPPING], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "stopped with 6 pending" in done.stdout


def test_the_file_is_read_only_if_regular_and_within_its_size(tmp_path: Path) -> None:
    """A FIFO (it would block), a device (/dev/zero fills memory), a file over MAX_SIZE: one line each, at once."""
    from atopgpud_tw.server.web.websecure import MAX_SIZE, read

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    big = tmp_path / "big.yml"
    big.write_bytes(b"#" * (MAX_SIZE + 1))
    for path, said in [(fifo, "not a regular file"), ("/dev/zero", "not a regular file"),
                       (big, "larger than"), (tmp_path, "is a directory")]:
        with pytest.raises(WebConfigError, match=said):
            read(str(path))


def test_certificate_files_are_read_the_same_way(tmp_path: Path) -> None:
    """cert_file naming /dev/zero or a FIFO is a one-line error, not a hang."""
    from atopgpud_tw.server.web.websecure import TLSSettings

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for name in ("/dev/zero", str(fifo)):
        with pytest.raises(WebConfigError, match="not a regular file"):
            build_context(TLSSettings(cert_file=name, key_file=name))


def test_a_certificate_named_before_it_exists_is_read_once_it_appears(pki: Pki, tmp_path: Path, held) -> None:
    """A file naming a certificate not written yet fails; the certificate's arrival is a change, no SIGHUP needed."""
    clock = held[0]
    path = web_config(tmp_path / "web.yml", tls=tls_of(pki))
    security = security_for(path, clock, held)
    security.startService()
    later = tmp_path / "later.crt"
    web_config(path, tls={**tls_of(pki), "cert_file": str(later)})
    clock.advance(1)
    assert security.failed_reloads == 1
    clock.advance(1)
    assert security.failed_reloads == 1  # not tried again while nothing changes
    later.write_bytes(pki.server_cert.read_bytes())
    clock.advance(1)
    assert security.reloads == 1 and security.loaded.config.tls.cert_file == str(later)
    security.stopService()


def test_sighup_reloads_through_the_signal_service(tmp_path: Path, held) -> None:
    """SIGHUP calls the hooks (the web configuration re-read, changed or not); without a log file
    and with a hook it says nothing of being ignored."""
    clock = held[0]
    path = web_config(tmp_path / "web.yml", users={"alice": hashed("one")})
    security = security_for(path, clock, held)
    signals = SignalService(clock)
    signals.hangup_hooks.append(security.hangup)
    signals.hangup(None)
    assert security.reloads == 1
    assert signal.SIGHUP  # the handler itself is exercised end to end in test_web_tls.py


def test_reloads_are_coalesced_while_one_is_built(tmp_path: Path, held, logged) -> None:
    """50 SIGHUPs while a reload is built: that one build, then one more at the next look (reading the file
    as the burst left it), then none; a build finished after the stop is not applied."""
    clock = held[0]
    path = web_config(tmp_path / "web.yml", users={"alice": hashed("one")})
    built: list[Deferred] = []

    def run(work, *args):
        done: Deferred = Deferred()
        built.append(done)
        done.addCallback(lambda _: work(*args))
        return done

    security = security_for(path, clock, held)
    security.run = run
    security.startService()
    for _ in range(50):
        security.hangup()
    web_config(path, users={"bob": hashed("two")})
    assert len(built) == 1
    built[0].callback(None)
    assert security.reloads == 1
    clock.advance(1)
    assert len(built) == 2 and security.builds == 2
    built[1].callback(None)
    assert set(security.root.config.users) == {"bob"}
    for _ in range(3):
        clock.advance(1)
    assert len(built) == 2
    security.hangup()
    security.stopService()
    built[2].callback(None)
    assert security.reloads == 2 and sum("reloaded (SIGHUP)" in line for line in logged) == 2


RELOADS_IN_A_THREAD = """
import os, signal, sys, threading
from twisted.internet import reactor
from atopgpud_tw.server.system.signals import SignalService
from atopgpud_tw.server.web import websecure

threads = []
real = websecure.attempt

def attempt(*args):
    threads.append(threading.current_thread() is threading.main_thread())
    return real(*args)

site = type("Site", (), {"resource": None})()
_, security = websecure.secure_site(sys.argv[1], site, reactor)
websecure.attempt = attempt  # the reloads' builds, not start-up's
signals = SignalService(reactor)
signals.hangup_hooks.append(security.hangup)

def burst():
    signals.install()
    for _ in range(50):
        os.kill(os.getpid(), signal.SIGHUP)
    reactor.callLater(2.5, reactor.stop)

security.startService()
reactor.callWhenRunning(burst)
reactor.run()
print("builds", security.builds, "reloads", security.reloads, "on the reactor", sum(threads), flush=True)
"""


@pytest.mark.e2e
def test_fifty_sighups_build_a_few_reloads_none_on_the_reactor(tmp_path: Path) -> None:
    """Real SIGHUPs on a real reactor: the reload is built in a thread (never the reactor's), and 50 of them
    at once are one or two builds, not 50."""
    import subprocess
    import sys

    path = web_config(tmp_path / "web.yml", users={"alice": hashed("one")})
    done = subprocess.run([sys.executable, "-c", RELOADS_IN_A_THREAD, str(path)], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    words = done.stdout.split()
    builds, reloads, on_reactor = int(words[1]), int(words[3]), int(words[7])
    assert 1 <= builds <= 2 and reloads == builds and on_reactor == 0, done.stdout


# -- TLS on the site's bounds -------------------------------------------------------------------


def tls_site(pki: Pki, tmp_path: Path, clock: task.Clock, max_clients: int = 1):
    from atopgpud_tw.server.web.metrics import MetricsSite
    from atopgpud_tw.server.web.webbounds import WebLimits
    from atopgpud_tw.server.web.websecure import TLSChannel, TLSSiteFactory

    context = load(str(web_config(tmp_path / "web.yml", tls=tls_of(pki)))).context
    site = MetricsSite(page_tree(), WebLimits(max_clients=max_clients), clock)
    site.protocol = TLSChannel
    return site, TLSSiteFactory(Contexts(context), False, site, clock)


def tls_of(pki: Pki) -> dict:
    return {"cert_file": str(pki.server_cert), "key_file": str(pki.server_key)}


def connect(factory):
    from twisted.internet.address import IPv4Address
    from twisted.internet.testing import StringTransport

    protocol = factory.buildProtocol(IPv4Address("TCP", "127.0.0.1", 40000))
    if protocol is None:
        return None, None
    class TCPTransport(StringTransport):
        def setTcpNoDelay(self, enabled: bool) -> None:
            pass

    transport = TCPTransport(peerAddress=IPv4Address("TCP", "127.0.0.1", 40000))
    protocol.makeConnection(transport)
    return protocol, transport


def test_tls_keeps_the_connection_bound_and_a_handshake_deadline(pki: Pki, tmp_path: Path, logged) -> None:
    """Under TLS the site still refuses connections beyond --metrics-max-clients before any handshake, and a
    client that does not finish its handshake within the head deadline is cut."""
    clock = task.Clock()
    site, factory = tls_site(pki, tmp_path, clock)
    first, transport = connect(factory)
    assert first is not None and len(site.guard.channels) == 1
    assert connect(factory) == (None, None)  # full: closed before a handshake
    clock.advance(5)
    assert transport.disconnecting or getattr(transport, "aborted", False)
    # no longer one of its address's handshakes in flight, before its connection is seen lost (a turn later)
    assert not site.guard.handshakes
    first.connectionLost(Failure(ConnectionDone()))
    assert not site.guard.channels and not site.guard.handshakes
    assert any("no TLS handshake within 5.0 s" in line for line in logged)
    site.guard.stop()
    assert not clock.getDelayedCalls()


def test_stalled_handshakes_from_one_address_hold_at_most_four_places(pki: Pki, tmp_path: Path, logged) -> None:
    """Ten connections from one address that never finish their handshake: each newer one beyond 4 closes that
    address's oldest, so at most 4 places are held, and the next connection (the scraper) is still let in."""
    clock = task.Clock()
    site, factory = tls_site(pki, tmp_path, clock, max_clients=8)
    opened, closed = [], []
    for _ in range(10):
        protocol, transport = connect(factory)
        assert protocol is not None  # never refused: the oldest stalled one made room
        opened.append((protocol, transport))
        for old, gone in opened:
            if (getattr(gone, "aborted", False) or gone.disconnecting) and old not in closed:
                closed.append(old)
                old.connectionLost(Failure(ConnectionDone()))
    assert len(closed) == 6
    assert len(site.guard.channels) == 4 and len(site.guard.handshakes["127.0.0.1"]) == 4
    assert sum("over 4 TLS handshakes in flight from 127.0.0.1" in line for line in logged) == 1
    scraper, transport = connect(factory)
    assert scraper is not None and len(site.guard.channels) == 5
    for protocol, _ in [*opened, (scraper, transport)]:
        if protocol not in closed:
            protocol.connectionLost(Failure(ConnectionDone()))
    assert not site.guard.channels and not site.guard.handshakes
    site.guard.stop()
    assert not clock.getDelayedCalls()


def test_plain_http_to_the_tls_site_is_refused_and_said_once(pki: Pki, tmp_path: Path, logged) -> None:
    """A plain HTTP request to the TLS site ends the connection; the failed handshake is logged with its cause."""
    clock = task.Clock()
    site, factory = tls_site(pki, tmp_path, clock, max_clients=4)
    protocol, transport = connect(factory)
    protocol.dataReceived(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
    assert b"HTTP/1.1 200" not in transport.value()
    assert transport.disconnecting or not site.guard.channels
    protocol.connectionLost(Failure(ConnectionDone()))
    assert any("TLS handshake failed" in line for line in logged), list(logged)
    site.guard.stop()


# -- wiring ------------------------------------------------------------------------------------


def wired(*args: str):
    from twisted.internet.testing import MemoryReactorClock

    from atopgpud_tw import tap

    parsed = tap.Options()
    parsed.parseOptions(["--reader", "sim", "--listen", "unix:@test-webconfig", *args])
    reactor = MemoryReactorClock()
    return tap.makeService(parsed, reactor=reactor), reactor


def test_makeservice_wraps_the_metrics_site_in_tls_and_reloads_on_sighup(pki: Pki, tmp_path: Path) -> None:
    """With --web-config the --metrics port serves Twisted's TLS around the site, a WebSecurity service
    watches the file, and the signal service's SIGHUP calls it."""
    from atopgpud_tw.server.web.websecure import TLSSiteFactory

    path = web_config(tmp_path / "web.yml", tls=tls_of(pki), users={"alice": hashed("one")})
    service, reactor = wired("--metrics", "tcp:9445:interface=127.0.0.1", "--web-config", str(path))
    children = list(service)
    security = [c for c in children if isinstance(c, WebSecurity)]
    signals = [c for c in children if isinstance(c, SignalService)]
    assert len(security) == 1 and signals[0].hangup_hooks == [security[0].hangup]
    (port, factory) = [(p[0], p[1]) for p in reactor.tcpServers][0]
    assert port == 9445
    assert isinstance(factory, TLSSiteFactory)
    assert isinstance(factory.wrappedFactory.resource, Protected)


def test_web_config_without_metrics_or_beside_an_ssl_endpoint_is_refused(pki: Pki, tmp_path: Path, capsys) -> None:
    """--web-config needs --metrics; TLS in the file and an ssl: --metrics endpoint at once is one line, exit 2."""
    from twisted.python import usage

    with pytest.raises(usage.UsageError, match="--web-config needs --metrics ENDPOINT"):
        wired("--web-config", "x.yml")
    path = web_config(tmp_path / "web.yml", tls=tls_of(pki))
    with pytest.raises(SystemExit) as raised:
        wired("--metrics", f"ssl:9445:privateKey={pki.server_key}:certKey={pki.server_cert}", "--web-config",
              str(path))
    assert raised.value.code == 2
    assert "give one of them" in capsys.readouterr().err
