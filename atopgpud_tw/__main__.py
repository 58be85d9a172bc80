"""``atopgpud``: run the daemon in the foreground, as ``twistd -n atopgpud`` does."""

from __future__ import annotations

import os
import sys

#: what on a command line asks for TLS: the metrics' web config, or a Twisted ``ssl:`` endpoint
TLS_WANTED = ("--web-config", "ssl:")


def without_tls_unless_asked(argv: list[str]) -> bool:
    """Keep pyOpenSSL out of a daemon whose command line asks for no TLS (whether it was), before Twisted is
    imported: ``twisted.internet.tcp`` imports its TLS mixins (pyOpenSSL, ``cryptography``: some 13 MB of RSS)
    whenever it can; marked absent (None in ``sys.modules``) Twisted takes its branch for a host without it."""
    if "OpenSSL" in sys.modules or any(word in arg for arg in argv for word in TLS_WANTED):
        return False
    sys.modules["OpenSSL"] = None  # type: ignore[assignment]
    return True


without_tls_unless_asked(sys.argv[1:])

from twisted.python import usage  # noqa: E402
from twisted.scripts import twistd  # noqa: E402

from atopgpud_tw.plugin import atopgpud  # noqa: E402


def _only_atopgpud(interface: object, package: object = None) -> list[object]:
    return [atopgpud]


def command_name() -> str:
    """The command as it was invoked: ``atopgpud``, or ``python3 -m atopgpud_tw``."""
    name = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "atopgpud"
    if name in ("__main__.py", "-m", "-c", ""):
        return f"{os.path.basename(sys.executable) or 'python3'} -m atopgpud_tw"
    return name


class CommandOptions(twistd.ServerOptions):  # type: ignore[misc]
    """twistd's options, for a command that runs the atopgpud plugin alone: its
    ``--help`` names the command (`command`) instead of ``twistd [options] atopgpud``."""

    command = "atopgpud"


def main(argv: list[str] | None = None) -> None:
    """Parse the options like twistd does, but report a bad one in one line."""
    args = sys.argv[1:] if argv is None else argv
    config = CommandOptions()
    config.command = command_name()
    config._getPlugins = _only_atopgpud  # type: ignore[assignment]  # no plugin scan, no dropin.cache to write
    try:
        config.parseOptions(["--nodaemon", "--pidfile=", "atopgpud", *args])
    except usage.UsageError as error:
        message = str(error).replace("Parameter type enforcement failed: ", "")
        sys.stderr.write(f"atopgpud: {message} (try atopgpud --help)\n")
        raise SystemExit(2) from None
    twistd.runApp(config)
    raise SystemExit(0)


if __name__ == "__main__":
    main()
