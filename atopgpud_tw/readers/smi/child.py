"""Running one nvidia-smi child, through the reactor or (at start-up) blocking.

Every child leads a session of its own (through the reactor, by ``setsid``, which
execs it without forking: its pid is the group's id), so that a timeout kills what it
started too; when a run ends what is left of its group is killed, and what left the
group is found below the daemon (orphans.py).  A child that has exited is finished
`EXIT_GRACE` seconds later even when something it left still holds its pipes.
"""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import time
from contextlib import suppress
from typing import Any, Callable

from twisted.internet.defer import Deferred
from twisted.internet.error import ProcessDone, ProcessExitedAlready
from twisted.internet.protocol import ProcessProtocol
from twisted.python.failure import Failure

from atopgpud_tw.problems import printable
from atopgpud_tw.readers.base import PollError
from atopgpud_tw.readers.smi.values import first_line as text_line

#: more output than this is no report (eight H100s print about 200 KiB)
MAX_OUTPUT = 32 * 2**20
#: seconds a child's pipes are read after it exited, for what it wrote last
EXIT_GRACE = 0.5
#: the most of a child's standard error kept, for its first line
_ERR_KEPT = 4096


class SmiRunError(PollError):
    """One run of nvidia-smi failed, said in one line with no pid (logged again only when it changes)."""


def kill_group(pid: int) -> bool:
    """SIGKILL the process group led by `pid`; False if there is none (yet, or any more)."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        return False
    return True


class Run(ProcessProtocol):
    """One child: collects its stdout; `result` fires with it (the chunks as read) or fails."""

    #: the child's process transport, from spawnProcess on
    transport: Any

    def __init__(
        self, reactor: Any, command: str, timeout: float, on_exit: Callable[[], None], sweep: Callable[[], None]
    ) -> None:
        # cancelling the poll kills the child rather than leaving it to the timeout
        self.result: Deferred = Deferred(lambda _: self._abort("was cancelled"))
        self.command = command
        self._reactor = reactor
        self._out: list[bytes] = []
        self._size = 0
        self._err = b""
        self._on_exit = on_exit
        #: kills what the run left outside its group (orphans.py), once the child is reaped
        self._sweep = sweep
        #: why it was killed, while it has not been reaped yet
        self.killed: str | None = None
        self._timer = reactor.callLater(timeout, self._abort, f"did not finish within {timeout:g} s")
        self._grace: Any = None
        self._group: int | None = None

    def connectionMade(self) -> None:
        #: the group's id: the transport forgets the pid when the child is reaped
        self._group = self.transport.pid
        self.transport.closeStdin()  # nvidia-smi reads nothing

    def outReceived(self, data: bytes) -> None:
        if self.result.called:
            return
        self._size += len(data)
        if self._size > MAX_OUTPUT:
            self._out = []  # not kept while the child is reaped
            self._abort(f"printed more than {MAX_OUTPUT} bytes")
        else:
            self._out.append(data)

    def errReceived(self, data: bytes) -> None:
        self._err = (self._err + data)[:_ERR_KEPT]

    def kill(self) -> None:
        """SIGKILL the child's group and stop reading; `processEnded` follows once it is reaped."""
        pid = self.transport.pid
        if pid is None or not kill_group(pid):
            with suppress(ProcessExitedAlready):  # before setsid has made the group, or without setsid
                self.transport.signalProcess("KILL")
        # our ends of the pipes close too, or a grandchild holding them would keep processEnded from coming
        self.transport.loseConnection()

    def fail(self, message: str) -> None:
        if self._timer.active():
            self._timer.cancel()
        if not self.result.called:
            self.result.errback(Failure(SmiRunError(f"{self.command} {message}")))

    def _abort(self, message: str) -> None:
        self.kill()
        self.killed = f"{self.command} {message}; killed"
        self.fail(f"{message}; killed")

    def processExited(self, reason: Failure) -> None:
        if not self.transport.pipes:
            return  # processEnded follows at once
        # something it started still holds the pipes: the group's rest is killed, the pipes read a moment
        if self._group is not None:
            kill_group(self._group)
        self._sweep()
        self._grace = self._reactor.callLater(EXIT_GRACE, self.transport.loseConnection)

    def processEnded(self, reason: Failure) -> None:
        if self._grace is not None and self._grace.active():
            self._grace.cancel()
        # what is left of the group dies with the run, however it ended (the group's id stays taken
        # while any of it lives: it names no other group)
        if self._group is not None:
            kill_group(self._group)
        self._sweep()
        self._on_exit()
        if isinstance(reason.value, ProcessDone):
            if self._timer.active():
                self._timer.cancel()
            out, self._out = self._out, []
            if not self.result.called:
                self.result.callback(out)  # not joined: a copy of up to MAX_OUTPUT bytes
            return
        self.fail(exit_text(reason.value.exitCode, reason.value.signal, self._err, _head(self._out)))


class Started:
    """One run before the reactor starts; a hung child is killed, not waited for."""

    def __init__(self, argv: list[str]) -> None:
        self.command = " ".join(argv)
        self.error: SmiRunError | None = None
        self.child: subprocess.Popen[bytes] | None = None
        try:
            self.child = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True
            )
        except OSError as error:
            self.error = SmiRunError(f"{self.command} cannot be started: {error}")

    def output(self, timeout: float) -> bytes:
        """Its standard output; SmiRunError if it could not start, hung, printed too much or failed."""
        if self.child is None:
            assert self.error is not None
            raise self.error
        child, command = self.child, self.command
        deadline = time.monotonic() + timeout
        hung = f"{command} did not finish within {timeout:g} s; killed"
        out, err = self._read(deadline, hung)
        try:
            child.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:  # closed its output, then hung
            self.discard()
            raise SmiRunError(hung) from None
        kill_group(child.pid)  # what is left of its group, pipes let go of or not
        if child.returncode != 0:
            code, signum = (child.returncode, None) if child.returncode > 0 else (None, -child.returncode)
            raise SmiRunError(f"{command} {exit_text(code, signum, err, out)}")
        return out

    def _read(self, deadline: float, hung: str) -> tuple[bytes, bytes]:
        """Read stdout and stderr until both close, or the child exited a moment ago."""
        child = self.child
        assert child is not None and child.stdout is not None and child.stderr is not None  # both are pipes
        out: list[bytes] = []
        size, err = 0, b""
        exited_at: float | None = None
        with selectors.DefaultSelector() as selector:
            selector.register(child.stdout, selectors.EVENT_READ)
            selector.register(child.stderr, selectors.EVENT_READ)
            while selector.get_map():
                now = time.monotonic()
                if exited_at is None and child.poll() is not None:
                    exited_at = now
                    kill_group(child.pid)  # what it left holding the pipes
                if exited_at is not None and now >= exited_at + EXIT_GRACE:
                    break
                if exited_at is None and now >= deadline:
                    self.discard()
                    raise SmiRunError(hung)
                # woken at least every 0.1 s to see whether the child has exited
                for key, _ in selector.select(0.1):
                    data = os.read(key.fd, 65536)
                    if not data:
                        selector.unregister(key.fileobj)
                    elif key.fileobj is child.stderr:
                        err = (err + data)[:_ERR_KEPT]
                    elif size + len(data) > MAX_OUTPUT:
                        out.clear()
                        self.discard()
                        raise SmiRunError(f"{self.command} printed more than {MAX_OUTPUT} bytes; killed")
                    else:
                        size += len(data)
                        out.append(data)
        return b"".join(out), err

    def discard(self) -> None:
        """Kill its group (what it left behind too), and reap it unless it is stuck in the kernel."""
        child = self.child
        if child is None:
            return
        if not kill_group(child.pid) and child.poll() is None:
            child.kill()
        for stream in (child.stdout, child.stderr):
            if stream is not None:
                stream.close()
        with suppress(subprocess.TimeoutExpired):  # stuck in the kernel: it cannot be waited for
            child.wait(timeout=1.0)


def _head(chunks: list[bytes]) -> bytes:
    """The first `_ERR_KEPT` bytes of an output read in chunks (not the whole joined)."""
    head = b""
    for chunk in chunks:
        head += chunk[: _ERR_KEPT - len(head)]
        if len(head) >= _ERR_KEPT:
            break
    return head


def exit_text(code: int | None, signum: int | None, err: bytes, out: bytes) -> str:
    """How a child ended, in words, and the first line it printed (on its standard error first)."""
    said = first_line(err) or first_line(out)
    ended = f"exited with status {code}" if code is not None else f"was killed by signal {signum}"
    return ended + (f": {said}" if said else "")


def first_line(data: bytes) -> str:
    """The first non-blank line of a child's output, at most 200 characters, shown as data (it is logged)."""
    return printable(text_line(data.decode("utf-8", errors="replace")))
