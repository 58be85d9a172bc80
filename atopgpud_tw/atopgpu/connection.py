"""Ask a running atopgpud for its figures, as atop does, and trust nothing it says: a blocking client
(``atopgpu`` has nothing else to do), each reply read within atop's 2-second limit and checked.  Endpoints
take the daemon's ``--listen`` forms (its listener options ignored: its value pastes) and ``tcp:HOST:PORT``."""

from __future__ import annotations

import errno
import socket
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

from atopgpud_tw import codec

DEFAULT_CONNECT = "unix:@atopgpud_nvidia"
#: what atop allows a reply (SO_RCVTIMEO), and what connecting may take
READ_TIMEOUT = 2.0
_IGNORED_OPTIONS = ("mode", "backlog", "lockfile", "wantPID")
_TCP_FORMS = "expected tcp:PORT:interface=HOST or tcp:HOST:PORT"


class ClientError(Exception):
    """The figures could not be had; the message is one line for the user."""

    #: the command's exit status for this error
    exit_status = 1


class BadReply(ClientError):
    """The daemon answered, but not with a reply atop would accept."""

    exit_status = 3


@dataclass(frozen=True)
class Address:
    """Where a daemon listens, as `socket` wants it."""

    family: int
    target: str | bytes | tuple[str, int]
    description: str


def _split(description: str) -> list[str]:
    """Split an endpoint string at colons not escaped by a backslash (Twisted's rule)."""
    parts, current, chars = [], [], iter(description)
    for char in chars:
        if char == "\\":
            current.append(next(chars, ""))
        elif char == ":":
            parts.append("".join(current))
            current = []
        else:
            current.append(char)
    parts.append("".join(current))
    return parts


def _port(text: str) -> int:
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise ValueError(f"{text!r} is not a TCP port")
    return int(text)


def parse_endpoint(description: str) -> Address:
    """The address for a ``--connect`` value; ValueError for one that makes no sense."""
    kind, _, rest = description.partition(":")
    if kind == "unix" and rest.startswith("@"):
        name = _split(rest[1:])[0]
        if not name:
            raise ValueError("an abstract socket needs a name: unix:@NAME")
        return Address(socket.AF_UNIX, b"\0" + name.encode(), description)
    positional, named = [], {}
    for part in _split(rest) if rest else []:
        key, equals, value = part.partition("=")
        if equals and key.isidentifier():
            named[key] = value
        else:
            positional.append(part)
    for key in _IGNORED_OPTIONS:
        named.pop(key, None)
    if kind == "unix":
        path = named.pop("address", None) or (positional.pop(0) if positional else "")
        if not path or positional or named:
            raise ValueError("expected unix:/path or unix:@NAME")
        return Address(socket.AF_UNIX, path, description)
    if kind in ("tcp", "tcp6"):
        host = named.pop("interface", None) or named.pop("host", None)
        port = named.pop("port", None)
        if len(positional) == 2 and host is None and port is None:
            host, port = positional
        elif len(positional) == 1 and port is None:
            port = positional[0]
        elif positional:
            raise ValueError(_TCP_FORMS)
        if port is None or named:
            raise ValueError(_TCP_FORMS)
        default = "::1" if kind == "tcp6" else "127.0.0.1"
        # a listener on every interface is reached through loopback
        if host in (None, "", "0.0.0.0", "::"):
            host = default
        return Address(socket.AF_INET6 if kind == "tcp6" else socket.AF_INET,
                       (host, _port(port)), description)
    raise ValueError("expected unix:@NAME, unix:/path, tcp:PORT:interface=HOST or tcp:HOST:PORT")


def _connect_error(address: Address, error: OSError, timeout: float) -> ClientError:
    where = address.description
    if isinstance(error, socket.timeout):
        return ClientError(f"{where}: no answer to connecting within {timeout:g} s")
    if isinstance(error, socket.gaierror):
        return ClientError(f"{where}: cannot resolve the host ({error.strerror})")
    if error.errno in (errno.ENOENT, errno.ECONNREFUSED):
        what = "no such socket" if error.errno == errno.ENOENT else "connection refused"
        return ClientError(f"{where}: {what}; is atopgpud running?")
    return ClientError(f"{where}: cannot connect ({error.strerror or error})")


class Connection:
    """One connection to a daemon; `ask` sends a request and returns its checked body."""

    def __init__(self, address: Address, timeout: float | None = None) -> None:
        self.address = address
        self.timeout = timeout = READ_TIMEOUT if timeout is None else timeout
        try:
            if address.family == socket.AF_UNIX:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                try:
                    self._sock.settimeout(timeout)
                    self._sock.connect(address.target)
                except OSError:
                    self._sock.close()
                    raise
            else:
                assert isinstance(address.target, tuple)  # TCP: (host, port)
                self._sock = socket.create_connection(address.target, timeout=timeout)
        except OSError as error:
            raise _connect_error(address, error, timeout) from None

    def __enter__(self) -> Connection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the socket (the daemon then forgets this client)."""
        self._sock.close()

    def getHandle(self) -> socket.socket:  # noqa: N802 (a transport's name, for access.peer_of)
        """The socket, as a Twisted transport gives it (`access.peer_of` reads the daemon's credentials)."""
        return self._sock

    def ask(self, command: str, version: int, asked: int | None = None, limit: int = codec.ATOP_REPLY_LIMIT) -> bytes:
        """Send one request (version byte `asked`, `version` by default) for a reply of `version`;
        its body, once the prelude is checked (length within `limit`: atop's, but for ``P``)."""
        name = f"{command} request"
        try:
            self._sock.sendall(codec.encode_request(command, version if asked is None else asked))
        except OSError as error:
            raise ClientError(
                f"{self.address.description}: {name} not sent ({error.strerror or error})"
            ) from None
        deadline = time.monotonic() + self.timeout
        prelude = self._read(codec.PRELUDE.size, deadline, name)
        if len(prelude) < codec.PRELUDE.size:
            raise BadReply(f"the daemon closed the connection instead of answering the {name}")
        got, length = codec.parse_prelude(prelude)
        if got != version:
            raise BadReply(f"asked for API version {version}, the {command} reply is version {got}")
        if length > limit:
            raise BadReply(f"the {command} reply announces {length} bytes, over "
                           f"{'atop' if limit == codec.ATOP_REPLY_LIMIT else 'its'}'s limit of {limit}")
        body = self._read(length, deadline, name)
        if len(body) < length:
            raise BadReply(f"the {command} reply announces {length} bytes but only {len(body)} came")
        if self._pending():
            raise BadReply(f"the {command} reply has more bytes than its prelude announces ({length})")
        return body

    def _pending(self) -> bool:
        """Whether bytes wait that no request asked for (requests go one at a time)."""
        # non-blocking: with a timeout set, Python would first wait for data
        self._sock.settimeout(0.0)
        try:
            return bool(self._sock.recv(1, socket.MSG_PEEK))
        except OSError:
            # nothing waiting (BlockingIOError); a broken connection shows at the next request
            return False
        finally:
            self._sock.settimeout(self.timeout)

    def _read(self, size: int, deadline: float, name: str) -> bytes:
        """Up to `size` bytes before `deadline`; fewer only when the peer closed."""
        data = b""
        while len(data) < size:
            left = deadline - time.monotonic()
            try:
                if left <= 0:
                    raise TimeoutError()
                self._sock.settimeout(left)
                chunk = self._sock.recv(size - len(data))
            except TimeoutError:
                if data:
                    raise BadReply(f"the reply to the {name} stopped after {len(data)} of "
                                   f"{size} bytes (waited {self.timeout:g} s)") from None
                raise ClientError(f"{self.address.description}: no reply to the {name} within "
                                  f"{self.timeout:g} s") from None
            except OSError as error:
                raise ClientError(f"{self.address.description}: connection lost "
                                  f"({error.strerror or error})") from None
            if not chunk:
                break
            data += chunk
        return data


@dataclass(frozen=True)
class Reading:
    """One ``T`` and ``S`` answer, checked and in agreement, and when it was taken."""

    version: int
    types: tuple[codec.DeviceType, ...]
    stats: tuple[codec.DeviceStats, ...]
    #: time.monotonic() when the S reply was complete
    taken: float
    #: who the processes are, by pid (the P reply); None where not asked, or the
    #: daemon does not tell (it closed the connection: ask again on a new one)
    contexts: dict[int, codec.ProcessInfo] | None = None


@contextmanager
def _malformed(what: str) -> Iterator[None]:
    try:
        yield
    except codec.ProtocolError as error:
        raise BadReply(f"malformed {what} reply: {error}") from None


def take_reading(connection: Connection, version: int, contexts: bool = False) -> Reading:
    """Ask ``T`` and ``S`` (``T`` again once if a GPU appeared in between), then with `contexts` ``P``.
    Version 2 is asked with `codec.WIDE_REQUEST`, which atop never sends, so that a host of
    more than atop's 32 devices lists up to `codec.MAX_WIRE_DEVICES`."""
    asked = codec.WIDE_REQUEST if version == 2 else version
    with _malformed("T"):
        types = codec.parse_types(connection.ask("T", version, asked))
    with _malformed("S"):
        stats = codec.parse_stats(connection.ask("S", version, asked), version)
        codec.check_stats(stats, version)
    taken = time.monotonic()
    if len(stats) != len(types):
        with _malformed("T"):
            types = codec.parse_types(connection.ask("T", version, asked))
    if len(stats) != len(types):
        raise BadReply(f"the T reply lists {len(types)} GPUs, the S reply {len(stats)}")
    told = ask_contexts(connection) if contexts else None
    return Reading(version, tuple(types), tuple(stats), taken, told)


def ask_contexts(connection: Connection) -> dict[int, codec.ProcessInfo] | None:
    """The ``P`` reply by pid; None from a daemon that does not know ``P`` (it closes the connection)."""
    try:
        body = connection.ask("P", codec.NEWEST_VERSION, limit=codec.CONTEXT_REPLY_LIMIT)
    except BadReply as error:
        if "closed the connection" in str(error):
            return None
        raise
    except ClientError:
        return None  # not sent, or the connection lost: told nothing
    with _malformed("P"):
        return codec.parse_contexts(body)


def command_name(pid: int, proc: str = "/proc") -> str | None:
    """The process's command name, or None when it is not visible from here."""
    try:
        with open(f"{proc}/{pid}/comm", encoding="utf-8", errors="replace") as comm:
            return comm.read().rstrip("\n") or None
    except OSError:
        return None
