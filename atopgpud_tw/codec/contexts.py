"""The ``P`` request: who the processes are, for ``atopgpu`` (atop never sends it).

The reply's body is a line per process, ``PID UID USER KIND WORKLOAD COMM``, each
text a token (`context_token`), at most `CONTEXT_REPLY_LIMIT` bytes: docs/protocol.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from atopgpud_tw.codec.wire import ProtocolError

#: a ``P`` body's bytes at most (not atop's: atop never asks)
CONTEXT_REPLY_LIMIT = 262144
#: a token keeps its first this many characters (a container id is 64 hex digits and its runtime)
CONTEXT_TOKEN_CHARS = 160

_SAFE = bytes(c if 0x21 <= c <= 0x7E else ord("_") for c in range(256))


@dataclass(frozen=True, slots=True)
class ProcessInfo:
    """One process's line of a ``P`` reply."""

    pid: int
    uid: int
    user: str
    kind: str
    workload: str
    comm: str


def context_token(text: str) -> bytes:
    """A text as one token of a ``P`` line."""
    raw = bytes(min(ord(c), 0x80) for c in text[:CONTEXT_TOKEN_CHARS])
    return raw.translate(_SAFE) or b"-"


def render_contexts(records: Iterable[ProcessInfo]) -> bytes:
    """A ``P`` body of these records, as many as fit within `CONTEXT_REPLY_LIMIT` (the last dropped first)."""
    lines = []
    size = 0
    for record in records:
        texts = (record.user, record.kind, record.workload, record.comm)
        line = f"{record.pid} {record.uid} ".encode() + b" ".join(map(context_token, texts)) + b"\n"
        size += len(line)
        if size > CONTEXT_REPLY_LIMIT:
            break
        lines.append(line)
    return b"".join(lines)


def parse_contexts(body: bytes) -> dict[int, ProcessInfo]:
    """A ``P`` body, by pid; `ProtocolError` for a line that is not one."""
    found: dict[int, ProcessInfo] = {}
    for number, line in enumerate(body.split(b"\n")[:-1] if body else (), 1):
        fields = line.split(b" ")
        if len(fields) != 6:
            raise ProtocolError(f"P line {number}: {len(fields)} fields, not 6")
        pid, uid = fields[0], fields[1]
        if not pid.isdigit() or not (uid.isdigit() or uid == b"-1"):
            raise ProtocolError(f"P line {number}: the pid and uid must be numbers")
        texts = [field.decode("ascii", "replace") for field in fields[2:]]
        found[int(pid)] = ProcessInfo(int(pid), int(uid), *(("" if t == "-" else t) for t in texts))
    if body and not body.endswith(b"\n"):
        raise ProtocolError("a P body ends with a newline")
    return found
