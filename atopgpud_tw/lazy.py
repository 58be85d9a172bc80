"""Modules that Twisted imports at start-up and the daemon does not use (of the standard
library, and two of Twisted's own), run when they are first used instead.

The ``atopgpud`` command calls `defer_unused` before it imports Twisted.  Each
module named in `DEFERRED` is then put in ``sys.modules`` (and on its package)
as the module object the import system would make, its body not yet run: the
``import`` statements of Twisted's modules bind it and go on.  The first
attribute looked up on it runs its body, in that same object, so every later
use sees the real module (a module that is used is loaded, a little later).
`EARLY` names the few attributes an importer takes at once (``from asyncio
import Future``): they come from the submodule that defines them, which is
imported alone, without the package's ``__init__``.  `LATER` names the functions an
importer binds at import and calls only later (``from html import escape``): it is
given a stand-in that runs the body at its first call and calls the module's own.

What it saves (docs/PERFORMANCE.md, "Start-up imports" and "Footprint and start-up"): ``http.cookiejar``
brings ``urllib.request``, ``http.client``, ``email`` and ``hashlib`` and
``ssl`` with OpenSSL's libraries; ``asyncio``'s ``__init__`` brings its event
loops, transports and ``ssl`` again; ``html`` brings ``html.entities``,
``twisted.python.modules`` ``zipfile``, ``twisted.logger._json`` ``uuid``.
``twistd -n atopgpud`` imports Twisted before any of the daemon's code runs, so
there nothing is deferred.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import sys
import threading
from types import ModuleType

#: module: who imports it at start-up, and what for (in this order: a module is
#: deferred only if nothing before it has imported it)
DEFERRED = {
    # http.cookiejar's package: its body is the HTTPStatus and HTTPMethod enums
    "http": "twisted.python.compat",
    # twisted.python.compat: ``from http import cookiejar as cookielib``, a name kept for old code
    "http.cookiejar": "twisted.python.compat",
    # twisted.python.compat: ``from html import escape`` (for twisted.web); the package's
    # body imports html.entities, the table of 2231 named references, for ``unescape``
    "html": "twisted.python.compat",
    # getopt (twisted.python.usage): ``from gettext import gettext as _``, for its error messages
    "gettext": "getopt",
    # twisted.internet.defer: Deferred.asFuture, fromFuture and coroutines (names in EARLY)
    "asyncio": "twisted.internet.defer",
    # twisted.application.app: twistd's --debug (pdb) and a passphrase prompt (getpass)
    "pdb": "twisted.application.app",
    "getpass": "twisted.application.app",
    # twisted.python.filepath: ``armor = base64.urlsafe_b64encode``, for temporary names
    "base64": "twisted.python.filepath",
    # twisted.python.logfile: listing rotated log files
    "glob": "twisted.python.logfile",
    # twisted.internet.process: processes on a pseudo-terminal (it brings tty and termios)
    "pty": "twisted.internet.process",
    # twisted.plugin: ``from twisted.python.modules import getModule``, for the plugin scan
    # that the command replaces; it brings twisted.python.zippath and zipfile
    "twisted.python.modules": "twisted.plugin",
    # twisted.logger: its JSON log format's four functions (the daemon writes text); it
    # brings uuid, with libuuid
    "twisted.logger._json": "twisted.logger",
}

#: module: {attribute taken at import: the module that defines it}
EARLY = {
    "asyncio": {"Future": "asyncio.futures", "AbstractEventLoop": "asyncio.events",
                "iscoroutine": "asyncio.coroutines"},
}

#: module: the functions an importer takes at import (``from html import escape``) and
#: calls only later: it is given a function that runs the body at its first call and then
#: calls the module's own (the body is not run to bind the name)
LATER = {
    "html": ("escape",),
    "gettext": ("gettext",),
    "base64": ("urlsafe_b64encode",),
    "twisted.python.modules": ("getModule",),
    "twisted.logger._json": ("eventAsJSON", "eventFromJSON", "jsonFileLogObserver", "eventsFromJSONLogFile"),
}

#: packages whose own body runs when a submodule asks for one of its names (http.client
#: takes HTTPStatus from http); other packages import their submodules from their body
#: (asyncio), which a submodule's import must not start
BODY_FOR_SUBMODULES = frozenset({"http"})


def defer_unused(names: dict[str, str] | None = None) -> list[str]:
    """Defer each of `names` (default `DEFERRED`) not imported yet; the names deferred."""
    deferred = []
    for name in DEFERRED if names is None else names:
        if name not in sys.modules and defer(
            name, EARLY.get(name, {}), LATER.get(name, ()), name in BODY_FOR_SUBMODULES
        ):
            deferred.append(name)
    return deferred


#: what makes the daemon serve TLS: the metrics listener's web configuration, or a
#: Twisted ``ssl:`` endpoint string
TLS_WANTED = ("--web-config", "ssl:")


def without_tls_unless_asked(argv: list[str]) -> bool:
    """Keep pyOpenSSL out of a daemon whose command line asks for no TLS; whether it was.

    Twisted's ``tcp`` module imports its TLS mixins (``twisted.internet._newtls``,
    pyOpenSSL, ``cryptography``: some 8 MB) whenever pyOpenSSL is installed, by
    name at its import, so they cannot be deferred.  With ``OpenSSL`` marked absent
    (None in ``sys.modules``) Twisted takes the branch it has for a host without
    pyOpenSSL.  A command line with ``--web-config`` or an ``ssl:`` endpoint keeps it.
    """
    if "OpenSSL" in sys.modules or any(word in arg for arg in argv for word in TLS_WANTED):
        return False
    sys.modules["OpenSSL"] = None  # type: ignore[assignment]
    return True


def defer(name: str, early: dict[str, str], later: tuple[str, ...] = (), body_for_submodules: bool = False) -> bool:
    """Put module `name` in sys.modules, its body to run at the first attribute looked up
    on it; the attributes of `early` are taken from the modules named (a package's own
    submodules, imported without its ``__init__``); the functions named in `later` are
    looked up as stand-ins that run the body at their first call.  While one of the
    package's submodules is imported, a lookup does not run the body unless
    `body_for_submodules`.
    False where it is not a Python module (not found, built in, an extension): left alone."""
    parent, _, child = name.rpartition(".")
    if parent and parent not in sys.modules:
        # found without importing its package, whose body may import it (twisted.logger
        # imports twisted.logger._json): the import system finds it in sys.modules then
        found = importlib.util.find_spec(parent)
        within = found.submodule_search_locations if found is not None else None
        spec = importlib.machinery.PathFinder.find_spec(name, within) if within else None
    else:
        spec = importlib.util.find_spec(name)
    loader = spec.loader if spec is not None else None
    origin = spec.origin if spec is not None and spec.has_location else None
    if spec is None or loader is None or not (origin or "").endswith((".py", ".pyc")):
        return False  # an extension module's body runs as its module object is made
    run = loader.exec_module
    module = importlib.util.module_from_spec(spec)
    lock = threading.RLock()
    state = {"ran": False}
    prefix = name + "."
    package = spec.submodule_search_locations is not None

    def importing_submodule() -> bool:
        # the import system marks a module whose body is running (``_initializing``,
        # as importlib's own _find_and_load reads it)
        return any(key.startswith(prefix) and getattr(getattr(value, "__spec__", None), "_initializing", False)
                   for key, value in list(sys.modules.items()))

    def run_body() -> None:
        # under the lock; a lookup from the body itself finds what it has made so far
        # (as in a module being imported); another thread's waits on the lock
        state["ran"] = True
        try:
            run(module)
        except BaseException:
            if sys.modules.get(name) is module:
                del sys.modules[name]  # as a failed import: the next one starts afresh
            raise
        else:
            if parent in sys.modules:
                setattr(sys.modules[parent], child, module)  # as the import system does
        finally:
            if module.__dict__.get("__getattr__") is __getattr__:  # the body may have its own
                del module.__dict__["__getattr__"]

    stand_ins: dict[str, object] = {}

    def stand_in(attribute: str) -> object:
        def call(*args: object, **kwargs: object) -> object:
            with lock:
                if not state["ran"]:
                    run_body()
            return module.__dict__[attribute](*args, **kwargs)

        call.__name__ = call.__qualname__ = attribute
        call.__module__ = name
        return stand_ins.setdefault(attribute, call)

    def __getattr__(attribute: str) -> object:
        if attribute == "__path__" and not package:
            # what ``from module import name`` asks first, to tell a package: a module's
            # answer is no, with or without its body
            raise AttributeError(f"module {name!r} has no attribute '__path__'")
        with lock:
            if not state["ran"] and attribute in later:
                return stand_ins.get(attribute) or stand_in(attribute)
            if not state["ran"] and attribute in early:
                try:
                    value = getattr(importlib.import_module(early[attribute]), attribute)
                except (ImportError, AttributeError):
                    pass  # another Python's layout: the body runs, as below
                else:
                    module.__dict__[attribute] = value  # the body binds the same object again
                    return value
            # while one of its submodules is imported, the package is as one being
            # initialised: what the submodule asks of it (its siblings, ``from . import
            # events``) is imported as a submodule, or missing, and does not run the body
            if not state["ran"] and (body_for_submodules or not importing_submodule()):
                run_body()
        try:
            return module.__dict__[attribute]
        except KeyError:
            raise AttributeError(f"module {name!r} has no attribute {attribute!r}") from None

    module.__dict__["__getattr__"] = __getattr__
    sys.modules[name] = module
    if parent in sys.modules:
        setattr(sys.modules[parent], child, module)
    return True


def is_deferred(module: ModuleType) -> bool:
    """Whether `module` is one whose body has not run yet."""
    hook = module.__dict__.get("__getattr__")
    return getattr(hook, "__qualname__", "") == "defer.<locals>.__getattr__"
