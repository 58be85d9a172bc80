"""The twistd plugin: ``twistd -n atopgpud``; behaviour lives in atopgpud_tw."""

from atopgpud_tw.plugin import atopgpud

__all__ = ["atopgpud"]
