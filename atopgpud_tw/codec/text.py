"""Text from outside (a reply, a metrics page, /proc, the driver) as it may be shown.

A process names itself, a daemon names its GPUs, a metrics page labels its
series: none of them may send commands to the terminal that shows them, or
to the reader of a log.  `printable` is the one rule, used by ``atopgpu``
wherever it prints such text and by the daemon's log lines that carry names
and messages it was given (docs/atopgpu.md, "Names are shown as data").
"""

from __future__ import annotations


def _escape(char: str) -> str:
    code = ord(char)
    if code <= 0xFF:
        return f"\\x{code:02x}"
    if code <= 0xFFFF:
        return f"\\u{code:04x}"
    return f"\\U{code:08x}"


def printable(text: str) -> str:
    """`text` with every character a terminal would act on, or not show, as a visible escape.

    Control characters (C0, DEL, C1) become ``\\x1b`` and the like, as
    ``ls --escape`` writes them; so do the other characters Python does not
    count as printable (format characters such as the bidirectional overrides,
    line and paragraph separators, unassigned and private code points), as
    ``\\u202e``.  A space stays a space; printable text is returned as it is.
    """
    if text.isprintable():
        return text
    return "".join(char if char.isprintable() else _escape(char) for char in text)
