"""Standard-library modules that Twisted imports at start-up and the daemon does not use,
run when they are first used instead.

The ``atopgpud`` command calls `defer_unused` before it imports Twisted.  Each
module named in `DEFERRED` is then put in ``sys.modules`` (and on its package)
as the module object the import system would make, its body not yet run: the
``import`` statements of Twisted's modules bind it and go on.  The first
attribute looked up on it runs its body, in that same object, so every later
use sees the real module (a module that is used is loaded, a little later).
`EARLY` names the few attributes an importer takes at once (``from asyncio
import Future``): they come from the submodule that defines them, which is
imported alone, without the package's ``__init__``.

What it saves (docs/PERFORMANCE.md, "Start-up imports"): ``http.cookiejar``
brings ``urllib.request``, ``http.client``, ``email`` and ``hashlib`` and
``ssl`` with OpenSSL's libraries; ``asyncio``'s ``__init__`` brings its event
loops, transports and ``ssl`` again.  ``twistd -n atopgpud`` imports Twisted
before any of the daemon's code runs, so there nothing is deferred.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import threading
from types import ModuleType

#: module: who imports it at start-up, and what for
DEFERRED = {
    # twisted.python.compat: ``from http import cookiejar as cookielib``, a name kept for old code
    "http.cookiejar": "twisted.python.compat",
    # twisted.internet.defer: Deferred.asFuture, fromFuture and coroutines (names in EARLY)
    "asyncio": "twisted.internet.defer",
    # twisted.application.app: twistd's --debug (pdb) and a passphrase prompt (getpass)
    "pdb": "twisted.application.app",
    "getpass": "twisted.application.app",
}

#: module: {attribute taken at import: the module that defines it}
EARLY = {
    "asyncio": {"Future": "asyncio.futures", "AbstractEventLoop": "asyncio.events",
                "iscoroutine": "asyncio.coroutines"},
}


def defer_unused(names: dict[str, str] | None = None) -> list[str]:
    """Defer each of `names` (default `DEFERRED`) not imported yet; the names deferred."""
    deferred = []
    for name in DEFERRED if names is None else names:
        if name not in sys.modules and defer(name, EARLY.get(name, {})):
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


def defer(name: str, early: dict[str, str]) -> bool:
    """Put module `name` in sys.modules, its body to run at the first attribute looked up
    on it; the attributes of `early` are taken from the modules named (a package's own
    submodules, imported without its ``__init__``).
    False where it is not a Python module (not found, built in, an extension): left alone."""
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

    def importing_submodule() -> bool:
        # the import system marks a module whose body is running (``_initializing``,
        # as importlib's own _find_and_load reads it)
        return any(key.startswith(prefix) and getattr(getattr(value, "__spec__", None), "_initializing", False)
                   for key, value in list(sys.modules.items()))

    def __getattr__(attribute: str) -> object:
        with lock:
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
            if not state["ran"] and not importing_submodule():
                # a lookup from the body itself finds what it has made so far (as in a
                # module being imported); another thread's waits on the lock
                state["ran"] = True
                try:
                    run(module)
                except BaseException:
                    if sys.modules.get(name) is module:
                        del sys.modules[name]  # as a failed import: the next one starts afresh
                    raise
                finally:
                    if module.__dict__.get("__getattr__") is __getattr__:  # the body may have its own
                        del module.__dict__["__getattr__"]
        try:
            return module.__dict__[attribute]
        except KeyError:
            raise AttributeError(f"module {name!r} has no attribute {attribute!r}") from None

    module.__dict__["__getattr__"] = __getattr__
    sys.modules[name] = module
    parent, _, child = name.rpartition(".")
    if parent:
        setattr(sys.modules[parent], child, module)  # find_spec imported the parent
    return True


def is_deferred(module: ModuleType) -> bool:
    """Whether `module` is one whose body has not run yet."""
    hook = module.__dict__.get("__getattr__")
    return getattr(hook, "__qualname__", "") == "defer.<locals>.__getattr__"
