#!/usr/bin/env python3
"""Write the list of problem lines in docs/operations.md from the daemon's table of them.

The part of the page between the two markers below is written from
`atopgpud_tw.problem_kinds.KINDS`; the rest of the page is written by hand.
tests/test_operations.py compares the committed page with `render`'s.

    python3 docs/make_operations.py           # rewrite docs/operations.md's list
    python3 docs/make_operations.py --check   # exit 1 when the committed page differs

Run it with the interpreter of an environment where atopgpud_tw is installed.
"""

from __future__ import annotations

import sys
from pathlib import Path

PAGE = Path(__file__).resolve().parent / "operations.md"
BEGIN = "<!-- problem lines: written by docs/make_operations.py from atopgpud_tw/problem_kinds.py -->"
END = "<!-- end of problem lines -->"


def problem_lines() -> str:
    """The list: one section per kind, its line, cause and action."""
    from atopgpud_tw.problem_kinds import KINDS

    parts = []
    for kind in KINDS:
        parts.append(
            f"#### {kind.name}\n\n"
            f"Logged by `{kind.reader}`:\n\n"
            f"```\n{kind.line}\n```\n\n"
            f"**Cause.** {kind.cause}\n\n"
            f"**What to do.** {kind.action}\n"
        )
    return "\n".join(parts)


def render(page: str) -> str:
    """`page` with the text between its markers written anew."""
    head, rest = page.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n\n{problem_lines()}\n{END}{tail}"


def main(argv: list[str]) -> int:
    current = PAGE.read_text()
    wanted = render(current)
    if "--check" in argv:
        if wanted != current:
            print(f"{PAGE} differs from what {Path(__file__).name} writes", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(wanted)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
