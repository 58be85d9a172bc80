"""``--web-config FILE``: the Prometheus exporter-toolkit's web configuration, parsed.

The file is the YAML every exporter built on the exporter toolkit takes
(https://github.com/prometheus/exporter-toolkit/blob/master/docs/web-configuration.md;
docs/metrics.md lists the keys).  `read` takes only a regular file of at most
`MAX_SIZE` bytes (a FIFO would hang the reactor at a reload, ``/dev/zero`` fill
memory).  `parse` checks the text as strictly as the toolkit's Go parser does (an
unknown key, a duplicate key or a value of the wrong type is an error) and reads
no other file; `websecure` loads the certificates.  What the toolkit has and this
daemon does not (``curve_preferences``) is refused by name, never ignored.
Every error is a `WebConfigError` of one line.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field, fields
from typing import Any, Mapping

import yaml

from atopgpud_tw.checks import flag, integer, kind
from atopgpud_tw.regularfile import read_regular

#: the largest web configuration, or certificate file, read (a real one is a few KiB)
MAX_SIZE = 1024 * 1024
#: client_auth_type values, as Go's crypto/tls names them (RequireClientCert: the toolkit's old name)
CLIENT_AUTH_TYPES = ("NoClientCert", "RequestClientCert", "RequireAnyClientCert", "VerifyClientCertIfGiven",
                     "RequireAndVerifyClientCert")
_AUTH_ALIASES = {"RequireClientCert": "RequireAnyClientCert", "": "NoClientCert"}
#: the client auth types that demand a certificate of every client
CERT_REQUIRED = ("RequireAnyClientCert", "RequireAndVerifyClientCert")
#: the client auth types that check a client's certificate against client_ca
CERT_VERIFIED = ("VerifyClientCertIfGiven", "RequireAndVerifyClientCert")
TLS_VERSIONS = ("TLS10", "TLS11", "TLS12", "TLS13")
#: the headers the toolkit lets a file set, and the values it allows (None: any)
HEADERS: dict[str, tuple[str, ...] | None] = {
    "Strict-Transport-Security": None,
    "X-Content-Type-Options": ("nosniff",),
    "X-Frame-Options": ("deny", "sameorigin"),
    "X-XSS-Protection": None,
    "Content-Security-Policy": None,
}
#: keys of the toolkit's format this daemon does not implement, and why
UNSUPPORTED = {
    "tls_server_config.curve_preferences": "curve_preferences is not supported (OpenSSL's default groups are used)",
}
#: a Go duration: 1s, 250ms, 1m30s
_DURATION = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)")
_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
#: a bcrypt hash in the modular crypt format: $2a$, $2b$ or $2y$ (htpasswd -B), cost, 53 characters
_BCRYPT = re.compile(r"\$2[aby]\$(\d\d)\$[./A-Za-z0-9]{53}")
#: the lowest and highest bcrypt cost taken: each step doubles a check (cost 10: some 80 ms, 14: some 1.3 s of a
#: core), and a cost of 31 would hold a checking thread for days and a stop behind it
MIN_COST = 4
MAX_COST = 14


class WebConfigError(ValueError):
    """A web configuration that cannot be used; its text is one line."""


@dataclass(frozen=True)
class TLSSettings:
    """``tls_server_config``: PEM text given inline, or a file (absolute) to read it from."""

    cert: str | None = None
    key: str | None = None
    client_ca: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    client_auth_type: str = "NoClientCert"
    client_ca_file: str | None = None
    client_allowed_sans: tuple[str, ...] | None = None
    min_version: str = "TLS12"
    max_version: str = "TLS13"
    cipher_suites: tuple[str, ...] = ()
    prefer_server_cipher_suites: bool = True

    def files(self) -> tuple[str, ...]:
        """The files the certificates are read from: a change to any is a reload."""
        return tuple(path for path in (self.cert_file, self.key_file, self.client_ca_file) if path)


@dataclass(frozen=True)
class WebConfig:
    """A parsed web configuration: TLS (None: plain HTTP), headers, users and their bcrypt hashes."""

    tls: TLSSettings | None = None
    headers: Mapping[str, str] = field(default_factory=dict)
    users: Mapping[str, bytes] = field(default_factory=dict)
    http2: bool = True
    #: (seconds per token, burst), None: no rate limit
    rate_limit: tuple[float, int] | None = None

    def describe(self) -> str:
        """What the configuration turns on, in a few words."""
        parts = []
        if self.tls is None:
            parts.append("plain HTTP")
        else:
            parts.append(f"TLS {self.tls.min_version} to {self.tls.max_version}, client certificates: "
                         f"{self.tls.client_auth_type}")
        if self.users:
            parts.append(f"basic auth for {len(self.users)} user{'s' if len(self.users) != 1 else ''}")
        else:
            parts.append("no basic auth")
        if self.rate_limit is not None:
            parts.append(f"at most {self.rate_limit[1]} requests at once, one more every {self.rate_limit[0]:g} s")
        return ", ".join(parts)


class _StrictLoader(yaml.SafeLoader):
    """YAML's safe loader, except that a key given twice is an error (as Go's UnmarshalStrict has it)."""


def _mapping(loader: _StrictLoader, node: yaml.MappingNode) -> dict[Any, Any]:
    loader.flatten_mapping(node)
    seen: dict[Any, Any] = {}
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node, deep=True)  # type: ignore[no-untyped-call]
        if isinstance(key, (list, dict)):
            raise WebConfigError(f"line {key_node.start_mark.line + 1}: a key that is not a scalar")
        if key in seen:
            raise WebConfigError(f"line {key_node.start_mark.line + 1}: {key!s} is given twice")
        seen[key] = loader.construct_object(value_node, deep=True)  # type: ignore[no-untyped-call]
    return seen


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping)


def read(path: str) -> WebConfig:
    """The configuration in the file at `path` (relative file names are its folder's)."""
    try:
        text = read_regular(path, MAX_SIZE)
    except OSError as error:
        raise WebConfigError(f"cannot be read ({error.strerror or error})") from None
    return parse(text, os.path.dirname(os.path.abspath(path)))


def parse(text: bytes | str, folder: str) -> WebConfig:
    """A configuration from its YAML text; `folder` resolves relative file names."""
    try:
        document = yaml.load(text, Loader=_StrictLoader)  # noqa: S506  # a safe loader
    except yaml.MarkedYAMLError as error:
        mark = error.problem_mark
        where = f"line {mark.line + 1} column {mark.column + 1}: " if mark is not None else ""
        raise WebConfigError(f"not valid YAML: {where}{_line(error.problem or str(error))}") from None
    except yaml.YAMLError as error:
        raise WebConfigError(f"not valid YAML: {_line(str(error))}") from None
    if document is None:
        return WebConfig()  # an empty file: plain HTTP, no users (as the toolkit has it)
    top = _table(document, "the file", ("tls_server_config", "http_server_config", "basic_auth_users", "rate_limit"))
    tls = _tls(top.get("tls_server_config"), folder)
    http = _table(top.get("http_server_config"), "http_server_config", ("http2", "headers"))
    http2 = flag(http.get("http2", True), "http_server_config.http2", WebConfigError)
    headers = _headers(http.get("headers"))
    users = _users(top.get("basic_auth_users"))
    return WebConfig(tls=tls, headers=headers, users=users, http2=http2, rate_limit=_rate(top.get("rate_limit")))


def _line(text: str) -> str:
    return " ".join(str(text).split())


def _table(value: Any, where: str, known: tuple[str, ...]) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise WebConfigError(f"{where} must be a mapping of keys to values, not {kind(value)}")
    prefix = "" if where == "the file" else where + "."
    for key in value:
        name = f"{prefix}{key}"
        if not isinstance(key, str) or key not in known:
            supported = (k for k in known if f"{prefix}{k}" not in UNSUPPORTED)
            raise WebConfigError(f"unknown key {name!s} (known in {where}: {', '.join(supported)})")
        if name in UNSUPPORTED and value[key] is not None:
            raise WebConfigError(UNSUPPORTED[name])
    return value


def _string(value: Any, where: str) -> str | None:
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise WebConfigError(f"{where} must be a string, not {kind(value)}")
    return value


def _strings(value: Any, where: str) -> tuple[str, ...] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(item, str) and item for item in value):
        raise WebConfigError(f"{where} must be a list of strings")
    return tuple(value)


def _choice(value: Any, where: str, allowed: tuple[str, ...], default: str) -> str:
    text = _string(value, where)
    if text is None:
        return default
    if text not in allowed:
        raise WebConfigError(f"{where}: {text!r} is not one of {', '.join(allowed)}")
    return text


def _tls(value: Any, folder: str) -> TLSSettings | None:
    # the keys in TLSSettings' order (the error for an unknown key lists them)
    table = _table(value, "tls_server_config", (*(f.name for f in fields(TLSSettings)), "curve_preferences"))
    where = "tls_server_config."
    given = {key: _string(table.get(key), where + key) for key in ("cert", "key", "client_ca", "cert_file",
                                                                  "key_file", "client_ca_file")}
    auth_text = _string(table.get("client_auth_type"), where + "client_auth_type") or ""
    if not any(given.values()) and not auth_text:
        return None  # as the toolkit has it: nothing that turns TLS on, plain HTTP
    for inline in ("cert", "key", "client_ca"):
        if given[inline] and given[inline + "_file"]:
            raise WebConfigError(f"{where}{inline} and {where}{inline}_file are both given: give one")
    if not (given["cert"] or given["cert_file"]):
        raise WebConfigError(f"{where}cert_file (or cert) is missing: TLS needs the server's certificate")
    if not (given["key"] or given["key_file"]):
        raise WebConfigError(f"{where}key_file (or key) is missing: TLS needs the server's private key")
    auth = _AUTH_ALIASES.get(auth_text, auth_text)
    if auth not in CLIENT_AUTH_TYPES:
        raise WebConfigError(f"{where}client_auth_type: {auth_text!r} is not one of {', '.join(CLIENT_AUTH_TYPES)}")
    has_ca = bool(given["client_ca"] or given["client_ca_file"])
    if has_ca and auth == "NoClientCert":
        raise WebConfigError(f"{where}client_ca_file is given with client_auth_type NoClientCert: "
                             "set client_auth_type (RequireAndVerifyClientCert checks the clients)")
    if auth in CERT_VERIFIED and not has_ca:
        raise WebConfigError(f"{where}client_auth_type {auth} needs client_ca_file (or client_ca) to verify against")
    sans = _strings(table.get("client_allowed_sans"), where + "client_allowed_sans")
    if sans is not None and auth not in CERT_REQUIRED:
        raise WebConfigError(f"{where}client_allowed_sans needs client_auth_type RequireAnyClientCert or "
                             "RequireAndVerifyClientCert")
    low = _choice(table.get("min_version"), where + "min_version", TLS_VERSIONS, "TLS12")
    high = _choice(table.get("max_version"), where + "max_version", TLS_VERSIONS, "TLS13")
    if TLS_VERSIONS.index(low) > TLS_VERSIONS.index(high):
        raise WebConfigError(f"{where}min_version {low} is above max_version {high}")
    ciphers = _strings(table.get("cipher_suites"), where + "cipher_suites") or ()
    prefer = table.get("prefer_server_cipher_suites", True)

    def path(name: str) -> str | None:
        file = given[name]
        return None if file is None else os.path.join(folder, file)

    return TLSSettings(
        cert=given["cert"], cert_file=path("cert_file"), key=given["key"], key_file=path("key_file"),
        client_ca=given["client_ca"], client_ca_file=path("client_ca_file"), client_auth_type=auth,
        client_allowed_sans=sans, min_version=low, max_version=high, cipher_suites=ciphers,
        prefer_server_cipher_suites=flag(prefer, where + "prefer_server_cipher_suites", WebConfigError),
    )


def duration(text: Any, where: str) -> float:
    """Seconds of a Go duration string (``1s``, ``250ms``, ``1m30s``, ``0``)."""
    if isinstance(text, int) and not isinstance(text, bool) and text == 0:
        return 0.0
    if not isinstance(text, str):
        raise WebConfigError(f"{where} must be a duration such as 1s or 250ms, not {kind(text)}")
    if text == "0":
        return 0.0
    parts = list(_DURATION.finditer(text))
    if not parts or "".join(part.group(0) for part in parts) != text:
        raise WebConfigError(f"{where}: {text!r} is not a duration such as 1s or 250ms")
    return sum(float(part.group(1)) * _UNITS[part.group(2)] for part in parts)


def _rate(value: Any) -> tuple[float, int] | None:
    table = _table(value, "rate_limit", ("interval", "burst"))
    if not table:
        return None
    interval = duration(table.get("interval", 0), "rate_limit.interval")
    burst = integer(table.get("burst", 0), "rate_limit.burst", WebConfigError, words="a whole number from 0 up",
                    high=None)
    if interval == 0:
        return None  # as the toolkit has it: 0 turns the limiter off
    if burst == 0:
        raise WebConfigError("rate_limit.burst 0 would refuse every request: give 1 or more")
    return interval, burst


def _headers(value: Any) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise WebConfigError(f"http_server_config.headers must be a mapping, not {kind(value)}")
    headers = {}
    for name, text in value.items():
        if name not in HEADERS:
            raise WebConfigError(f"http_server_config.headers: {name!s} cannot be set "
                                 f"(only {', '.join(HEADERS)})")
        text = _string(text, f"http_server_config.headers.{name}")
        if text is None:
            continue  # blank: unset, as the toolkit has it
        allowed = HEADERS[name]
        if allowed is not None and text not in allowed:
            raise WebConfigError(f"http_server_config.headers.{name}: {text!r} is not one of {', '.join(allowed)}")
        if "\n" in text or "\r" in text:
            raise WebConfigError(f"http_server_config.headers.{name}: a value on one line, please")
        headers[name] = text
    return headers


def _users(value: Any) -> dict[str, bytes]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise WebConfigError(f"basic_auth_users must be a mapping of user names to bcrypt hashes, not {kind(value)}")
    users = {}
    for name, hashed in value.items():
        if not isinstance(name, str) or not name or ":" in name:
            raise WebConfigError(f"basic_auth_users: {name!r} is not a user name (a string without ':')")
        if not isinstance(hashed, str):
            raise WebConfigError(f"basic_auth_users.{name}: a bcrypt hash is a string, not {kind(hashed)}")
        match = _BCRYPT.fullmatch(hashed.strip())
        if match is None:
            raise WebConfigError(f"basic_auth_users.{name}: not a bcrypt hash ($2y$10$ and 53 characters, "
                                 "as htpasswd -nBC 10 makes)")
        if not MIN_COST <= int(match.group(1)) <= MAX_COST:
            raise WebConfigError(f"basic_auth_users.{name}: bcrypt cost {match.group(1)} is not from {MIN_COST} "
                                 f"to {MAX_COST} (each step doubles the time of a check; htpasswd -nBC 10 is usual)")
        users[name] = hashed.strip().encode("ascii")
    return users
