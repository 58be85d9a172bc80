"""``twistd atopgpud``: the command line and the wiring of the service, nothing else."""

from __future__ import annotations

import grp
import os
import pwd
import sys
from dataclasses import replace
from typing import Any, Callable

from twisted.application.service import IService, MultiService
from twisted.logger import Logger
from twisted.python import usage

from atopgpud_tw import distribution_version
from atopgpud_tw.counters import Counters
from atopgpud_tw.readers import READERS, ReaderSettings, ReaderUnavailable, make_reader
from atopgpud_tw.server.atop.board import DEFAULT_EXITED_LIMIT, Board
from atopgpud_tw.server.atop.poller import PollerService
from atopgpud_tw.server.atop.protocol import AtopGpuFactory, Limits
from atopgpud_tw.server.system.access import AllowList, Gate, GatedFactory
from atopgpud_tw.server.system.journal import DEFAULT_LEVEL, LEVELS
from atopgpud_tw.server.system.journal import install as install_journal
from atopgpud_tw.server.system.listening import (
    PROCESS_LISTS,
    ActivationError,
    CheckedEndpoint,
    Listener,
    ListeningService,
    inherited_sockets,
    listen_all,
    listen_endpoint,
    take_inherited,
)
from atopgpud_tw.server.system.notify import Notifier, NotifyService
from atopgpud_tw.server.system.signals import SignalService
from atopgpud_tw.snapshot import DEFAULT_WORKLOAD_EXPIRY, DEFAULT_WORKLOAD_LIMIT, GROUPINGS, MIG_MODES

DEFAULT_LISTEN = "unix:@atopgpud_nvidia"

log = Logger(namespace="atopgpud_tw.tap")


def _coerce(option: str, convert: Any, check: Any, wanted: str) -> Any:
    """A coerce function whose error names the option and what it wants."""

    def coerce(value: str) -> Any:
        try:
            result = convert(value)
        except ValueError:
            result = None
        if result is None or not check(result):
            raise ValueError(f"--{option} {value!r}: {wanted}")
        return result

    coerce.coerceDoc = wanted[0].upper() + wanted[1:] + "."  # type: ignore[attr-defined]
    return coerce


#: the largest user or group id; (uid_t)-1 means "no change" to chown
MAX_ID = 2**32 - 2
#: the shortest --interval: a GPU's own sample period is some 17 ms to 1 s, and
#: every poll costs the whole process list
MIN_INTERVAL = 0.05
#: the longest --interval, --smi-timeout, --hang-warning and --idle-timeout (11.6 days)
MAX_SECONDS = 1e6  # the messages below say 1e6


def _account_id(option: str, name: str, what: str, lookup: Callable[[str], int], missing: str) -> int:
    """A user or group id from a number (within range) or a name `lookup` knows."""
    if name.isdigit():
        if int(name) > MAX_ID:
            raise usage.UsageError(f"--{option}: {name!r} is beyond the largest {what} id, {MAX_ID}")
        return int(name)
    try:
        return lookup(name)
    except KeyError:
        raise usage.UsageError(missing) from None


def _group_id(group: str, option: str = "allow-gid") -> int:
    return _account_id(option, group, "group", lambda n: grp.getgrnam(n).gr_gid, f"no group {group!r}")


def _names(option: str, value: str) -> list[str]:
    """A comma-separated list that names someone: an empty one (an unset variable in
    a unit's ExecStart) would otherwise mean everyone."""
    names = [name.strip() for name in value.split(",") if name.strip()]
    if not names:
        raise usage.UsageError(f"--{option} {value!r}: names no one (leave the option out to allow everyone)")
    return names


def _seconds(option: str, minimum: float = 0.0) -> Any:
    wanted = f"a number of seconds from {minimum:g} to 1e6" if minimum else "a number of seconds above 0, up to 1e6"
    return _coerce(option, float, lambda v: minimum <= v <= MAX_SECONDS and v > 0, wanted)


def _count(option: str) -> Any:
    return _coerce(option, int, lambda v: v >= 1, "a positive integer")


def _choice(option: str, *allowed: str) -> Any:
    return _coerce(option, str, lambda v: v in allowed, "one of " + ", ".join(allowed))


class Options(usage.Options):
    """atopgpud: cumulative NVIDIA GPU statistics for atop."""

    synopsis = "[options]"
    longdesc = (
        "Samples every NVIDIA GPU once per interval, keeps cumulative counters per GPU "
        "and per process, and answers atop's requests (atop -k). Old atop (2.4 to 2.12) "
        "connects to TCP 127.0.0.1:59123: add --listen tcp:59123:interface=127.0.0.1. "
        "An endpoint that cannot listen ends start-up with one line and exit status 1. "
        "Sockets passed by systemd (atopgpud.socket) take the place of the --listen or "
        "--metrics endpoint with the same address; under systemd it says READY=1 once "
        "it serves (Type=notify). "
        "SIGHUP reopens twistd's log file (SIGUSR1 rotates it) and re-reads --web-config; without either, "
        "SIGHUP, SIGUSR1 and SIGUSR2 are logged and ignored."
    )

    optParameters = [
        ["reader", None, "auto", "Where readings come from: auto (nvml, then nvidia-smi), "
         "nvml, nvidia-smi, or sim (the simulator).", _choice("reader", *READERS)],
        ["scenario", None, None, "The simulator's scenario, a JSON file (sim only; "
         "without it a built-in demo)."],
        ["interval", None, 1.0, "Sampling interval in seconds.", _seconds("interval", MIN_INTERVAL)],
        ["nvidia-smi", None, None, "The nvidia-smi binary (default: found on PATH)."],
        ["smi-timeout", None, 5.0, "Seconds an nvidia-smi run may take before it is "
         "killed and that poll is skipped.", _seconds("smi-timeout")],
        ["hang-warning", None, 10.0, "Seconds an NVML call may run before it is logged as hung "
         "(once, and once more when it returns).", _seconds("hang-warning")],
        ["start-timeout", None, 30.0, "Seconds an NVML call may run while the reader is opened at "
         "start-up: beyond it --reader auto falls back to nvidia-smi, and other readers end start-up "
         "with exit status 1.", _seconds("start-timeout")],
        ["driver-wait", None, 60.0, "Seconds to hold back telling systemd the daemon is ready while "
         "the NVIDIA driver is not loaded yet (at boot); it looks for the driver all the same.",
         _seconds("driver-wait")],
        ["mig", None, "instances", "How a card in MIG mode is shown: instances (each "
         "MIG instance a device) or card (one device).", _choice("mig", *MIG_MODES)],
        ["max-exited", None, DEFAULT_EXITED_LIMIT, "Exited processes kept per client "
         "until it asks again; the oldest are dropped beyond this.", _count("max-exited")],
        ["max-clients", None, 256, "Clients connected at once; more are closed at once.", _count("max-clients")],
        ["max-clients-per-uid", None, None, "Shared slots one user (the uid of a UNIX client, or of a TCP "
         "client on this host) may hold at once; more of its connections are closed at once "
         "(default: three quarters of the shared slots).", _count("max-clients-per-uid")],
        ["reserved-clients", None, 8, "Slots of --max-clients kept for root and for each --allow-uid user, "
         "which no other user can take (fewer where they would be more than half of --max-clients); "
         "the rest are shared.", _count("reserved-clients")],
        ["max-unsent", None, 1048576, "Reply bytes a client may leave unread before it is "
         "disconnected.", _count("max-unsent")],
        ["idle-timeout", None, 10800.0, "Seconds a client may stay silent between requests "
         "(atop asks every interval).", _seconds("idle-timeout")],
        ["busy-idle-timeout", None, 60.0, "Seconds a client in a shared slot may stay silent while every "
         "shared slot is taken and another user asks for one.", _seconds("busy-idle-timeout")],
        ["socket-group", None, None, "Group given to filesystem UNIX sockets of --listen and --metrics "
         "(with mode=660 in the endpoint: only that group may connect)."],
        ["metrics", None, None, "Serve Prometheus metrics at /metrics on this endpoint, e.g. "
         "tcp:9445:interface=127.0.0.1 (default: off): atop's counters and each GPU's health and "
         "power figures, read when scraped; a UNIX one is guarded by --allow-uid, "
         "--allow-gid and --socket-group as --listen's are."],
        ["web-config", None, None, "With --metrics: TLS and basic authentication for the metrics listener, "
         "from a Prometheus exporter-toolkit web configuration file (YAML); re-read when it or its "
         "certificates change, and on SIGHUP (a bad file at start-up: exit status 2)."],
        ["metrics-max-clients", None, 32, "Metrics connections open at once; more are closed at once.",
         _count("metrics-max-clients")],
        ["workloads", None, "off", "With --metrics: exact GPU time per workload, its processes' counters "
         "summed (exited ones included), the workload being each process's systemd unit, container, pod, "
         "Slurm job or user (read from /proc once per process): unit, container, pod, job, user or off.",
         _choice("workloads", *GROUPINGS)],
        ["workload-limit", None, DEFAULT_WORKLOAD_LIMIT, "Workload series (one per workload and GPU) at most; "
         "the rest are summed under workload=\"other\".", _count("workload-limit")],
        ["log-level", None, DEFAULT_LEVEL, "The least important log lines shown: debug, info, warn, error "
         "or critical. Under systemd (JOURNAL_STREAM) each line carries its syslog priority for the "
         "journal and no timestamp of its own.", _choice("log-level", *LEVELS)],
        ["workload-expiry", None, DEFAULT_WORKLOAD_EXPIRY, "Seconds a workload stays on the page once its last "
         "process has ended; then its sums go into workload=\"other\".", _seconds("workload-expiry")],
    ]

    optFlags = [
        ["metrics-processes", None, "With --metrics: also export per-process series (one per pid)."],
        ["metrics-process-context", None, "With --metrics-processes: label each process's series with "
         "its user, comm and workload."],
    ]

    def __init__(self) -> None:
        super().__init__()
        self["listen"] = []
        self["allow-uid"] = set()
        self["allow-gid"] = set()

    def opt_listen(self, description: str) -> None:
        """Where to accept clients (repeatable): endpoint string, or unix:@NAME. Default: unix:@atopgpud_nvidia."""
        self["listen"].append(description)

    def opt_allow_uid(self, users: str) -> None:
        """Only these users (names or uids, comma-separated, repeatable; root always) may use UNIX sockets."""
        self["allow-uid"] |= {_account_id("allow-uid", u, "user", lambda n: pwd.getpwnam(n).pw_uid,
                                          f"--allow-uid: no user {u!r}") for u in _names("allow-uid", users)}

    def opt_allow_gid(self, groups: str) -> None:
        """Only members of these groups (names or gids, comma-separated, repeatable) may use UNIX sockets."""
        self["allow-gid"] |= {_group_id(g) for g in _names("allow-gid", groups)}

    def getSynopsis(self) -> str:
        """``Usage: atopgpud [options]`` under the ``atopgpud`` command (its parent names it), else twistd's."""
        command = getattr(self.parent, "command", None)
        if command:
            return f"Usage: {command} {self.synopsis}"
        return super().getSynopsis()

    def opt_version(self) -> None:
        """Display the daemon's version, the NVML binding's and Twisted's, and exit."""
        print(f"atopgpud (atopgpud_tw) {distribution_version()}\nnvidia-ml-py {distribution_version('nvidia-ml-py')}"
              f"\nTwisted {distribution_version('twisted')}")
        sys.exit(0)

    def postOptions(self) -> None:
        if not self["listen"]:
            self["listen"] = [DEFAULT_LISTEN]
        if self["scenario"] and self["reader"] != "sim":
            raise usage.UsageError("--scenario is for the simulator: add --reader sim")
        if len(self["allow-uid"] | {0}) > self["max-clients"] // 2:
            raise usage.UsageError(
                f"--max-clients {self['max-clients']} leaves no room to keep a slot for root and each of "
                f"{len(self['allow-uid'] - {0})} --allow-uid users: raise it to at least "
                f"{2 * len(self['allow-uid'] | {0})}"
            )
        if self["socket-group"] is not None:
            self["socket-group"] = _group_id(self["socket-group"], "socket-group")
        for option, needed in (("metrics-processes", "metrics"), ("web-config", "metrics"),
                               ("metrics-process-context", "metrics-processes"), ("workloads", "metrics")):
            if self[option] not in ("", None, 0, "off") and not self[needed]:
                raise usage.UsageError(f"--{option} needs --{needed}" + (" ENDPOINT" if needed == "metrics" else ""))
        parent = getattr(self, "parent", None)
        if parent is not None:  # twistd's options: the log observer is chosen there
            refused = install_journal(parent, self["log-level"])
            if refused:
                raise usage.UsageError(refused)


def makeService(options: Options, reactor: Any = None) -> IService:
    """The daemon: a poller and one listener per --listen, around one Board."""
    if reactor is None:
        from twisted.internet import reactor
    use_monotonic_clock(reactor)  # before anything reads the time or schedules
    _check_pidfile(getattr(options, "parent", None))
    notifier = Notifier()
    try:
        # the options that concern the reader, typed: readers never see the Options mapping
        settings = ReaderSettings(
            kind=options["reader"], mig=options["mig"], scenario=options["scenario"], smi_path=options["nvidia-smi"],
            smi_timeout=options["smi-timeout"], hang_warning=options["hang-warning"],
            start_timeout=options["start-timeout"])
        reader, layout = make_reader(settings, reactor, _start_up_line(notifier))
    except ReaderUnavailable as error:
        raise SystemExit(f"atopgpud: {error}") from None
    workloads = options["workloads"] != "off"
    # a workload's sums are its processes' time-weighted ones
    counters = Counters(weigh_processes=options["metrics-processes"] or workloads)
    board = Board(counters, exited_limit=options["max-exited"], layout=layout)
    top = MultiService()
    signals = SignalService(reactor)
    signals.setServiceParent(top)
    poller = PollerService(reader, board, options["interval"], reactor)
    poller.setServiceParent(top)
    limits = Limits(
        max_clients=options["max-clients"], max_clients_per_uid=options["max-clients-per-uid"],
        reserved_clients=options["reserved-clients"], max_unsent=options["max-unsent"],
        idle_timeout=options["idle-timeout"], busy_idle_timeout=options["busy-idle-timeout"],
        allow=AllowList(frozenset(options["allow-uid"]), frozenset(options["allow-gid"])),
    )
    factory = AtopGpuFactory(board, limits, reactor)
    listeners = [Listener(description, _endpoint(reactor, "--listen", description), factory)
                 for description in options["listen"]]
    if options["metrics"]:
        # prometheus_client only when asked for
        from atopgpud_tw.server.web.metrics import HealthCache, make_site
        from atopgpud_tw.server.web.webbounds import WebLimits

        book = None
        if workloads:
            from atopgpud_tw.workloads import WorkloadBook  # with --workloads alone

            book = WorkloadBook(counters, options["workloads"], options["workload-limit"],
                                options["workload-expiry"], reactor.seconds)
            board.exit_watchers.append(book.exited)
        site: Any = make_site(
            board, poller, options["interval"], options["metrics-processes"], reader.watchdog,
            WebLimits(max_clients=options["metrics-max-clients"]), reactor, health=HealthCache(reader, reactor),
            workloads=book, process_context=options["metrics-process-context"],
        )
        if options["web-config"]:
            from atopgpud_tw.server.web.websecure import secure_site  # pyOpenSSL and bcrypt only when asked for

            # a bad file ends start-up here: one line, exit status 2
            site, security = secure_site(options["web-config"], site, reactor, options["metrics"])
            security.setServiceParent(top)
            signals.hangup_hooks.append(security.hangup)
        if limits.allow.restricts:
            site = GatedFactory(site, Gate(limits.allow, reactor, " on --metrics"))
        endpoint = _endpoint(reactor, "--metrics", options["metrics"])
        listeners.append(Listener(f"{options['metrics']} (--metrics)", endpoint, site))
    try:
        chosen = take_inherited(reactor, listeners, inherited_sockets())
    except ActivationError as error:
        raise SystemExit(f"atopgpud: {error}") from None
    checked = []
    for listener in chosen:
        if listener.passed is not None:
            log.info("serving {socket}, passed by systemd", socket=listener.passed.describe())
        exposed = (PROCESS_LISTS if listener.factory is factory
                   else "every GPU process (--metrics-processes)" if options["metrics-processes"] else None)
        group = options["socket-group"] if listener.passed is None else None  # systemd's: SocketGroup=
        checked.append(replace(listener, endpoint=CheckedEndpoint(listener.endpoint, group, exposed)))
    for port in listen_all(checked, reactor):  # before twistd daemonizes: a failure is the parent's exit status
        ListeningService(port).setServiceParent(top)
    NotifyService(notifier, poller.status, reactor, lambda: poller.waiting,
                  options["driver-wait"]).setServiceParent(top)
    return top


def use_monotonic_clock(reactor: Any) -> bool:
    """Make `reactor` tell the time on CLOCK_MONOTONIC, whether it was changed (docs/design.md, "Time"):
    calls already scheduled keep their delay; a `task.Clock` (not a `ReactorBase`) keeps its test's time."""
    import time

    from twisted.internet.base import ReactorBase

    if not isinstance(reactor, ReactorBase) or reactor.seconds is time.monotonic:
        return False
    shift = time.monotonic() - reactor.seconds()
    for call in [*reactor._pendingTimedCalls, *reactor._newTimedCalls]:
        # the same delay from now, on the new clock (the heap's order is unchanged)
        call.time += shift
        call.seconds = time.monotonic
    reactor.seconds = time.monotonic  # an instance attribute: ReactorBase reads self.seconds
    return True


def _start_up_line(notifier: Notifier) -> Callable[[str], None]:
    """What start-up waits for, said at once: on standard error (the log is written
    nowhere until the service is built) and as systemd's status line."""

    def say(text: str) -> None:
        sys.stderr.write(f"atopgpud: {text}\n")
        sys.stderr.flush()
        notifier.send(STATUS=f"starting: {text}")

    return say


def _check_pidfile(server: Any) -> None:
    """Refuse at once, in one line, the pid file twistd could not write (it writes it only after
    daemonizing, and reports a failure as a traceback)."""
    path = server.get("pidfile") if server is not None else None
    if not path:
        return
    try:
        existed = os.path.exists(path)
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o644))
    except OSError as error:
        raise SystemExit(f"atopgpud: --pidfile {path}: cannot be written ({error.strerror or error})") from None
    if not existed:
        os.unlink(path)  # twistd makes it; left behind, it would outlive a failed start


def _endpoint(reactor: Any, option: str, description: str) -> Any:
    try:
        return listen_endpoint(reactor, description)
    except ValueError as error:
        raise SystemExit(f"atopgpud: {option} {description}: {error}") from None
