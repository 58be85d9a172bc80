"""Text from outside (a reply, a metrics page, /proc, the driver) as it may be shown: none of it may
send commands to a terminal or to the reader of a log (docs/atopgpu.md, "Names are shown as data")."""

from __future__ import annotations


def _escape(char: str) -> str:
    code = ord(char)
    if code <= 0xFF:
        return f"\\x{code:02x}"
    if code <= 0xFFFF:
        return f"\\u{code:04x}"
    return f"\\U{code:08x}"


def printable(text: str) -> str:
    """`text` with every character a terminal would act on, or not show, as a visible escape: control
    characters as ``\\x1b`` (as ``ls --escape`` writes them), the others Python does not count as
    printable (bidirectional overrides, line separators, unassigned code points) as ``\\u202e``."""
    if text.isprintable():
        return text
    return "".join(char if char.isprintable() else _escape(char) for char in text)
