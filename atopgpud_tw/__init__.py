"""atopgpud_tw: a GPU statistics daemon for atop, on Twisted (docs/design.md has a line per module)."""

from __future__ import annotations

import functools

DISTRIBUTION = "atopgpud_tw"


@functools.cache
def distribution_version(name: str = DISTRIBUTION) -> str:
    """The installed version of distribution `name` (this project's by default: pyproject.toml's);
    ``0+unknown`` when it is not installed (a checkout on sys.path)."""
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
