"""atopgpud_tw: a GPU statistics daemon for atop, on Twisted.

A folder per role, in the order a figure flows (docs/design.md has a line per module):
``readers/`` acquire (NVML in ``readers/nvml/``, nvidia-smi in ``readers/smi/``)
and hand over one `snapshot.Snapshot` per poll; `counters` folds it into
cumulative counters; ``server/`` serves them to atop and to Prometheus; ``codec/``
is the wire format, shared with the ``atopgpu`` client (``atopgpu/``); ``sim/`` is
a driver for the readers to read where there is no GPU; `tap`, `plugin` and
``__main__`` are the wiring.
"""

from __future__ import annotations

import functools

DISTRIBUTION = "atopgpud_tw"


@functools.cache
def distribution_version(name: str = DISTRIBUTION) -> str:
    """The installed version of distribution `name` (this project's by default), from its
    package metadata: the one place a version is written is pyproject.toml. ``0+unknown``
    when it is not installed (a checkout on sys.path without ``pip install``)."""
    from importlib import metadata  # here, not at import: it brings email, zipfile and csv (1 MB)

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "0+unknown"


def __getattr__(name: str) -> str:
    # ``atopgpud_tw.__version__``, read from the metadata when first asked for
    if name == "__version__":
        return distribution_version()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
