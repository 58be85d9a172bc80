"""``atopgpud``: run the daemon in the foreground, as ``twistd -n atopgpud`` does."""

from __future__ import annotations

import sys

from twisted.python import usage
from twisted.scripts import twistd

from atopgpud_tw.plugin import atopgpud


def _only_atopgpud(interface: object, package: object = None) -> list[object]:
    return [atopgpud]


def main(argv: list[str] | None = None) -> None:
    """Parse the options like twistd does, but report a bad one in one line."""
    args = sys.argv[1:] if argv is None else argv
    config = twistd.ServerOptions()
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
