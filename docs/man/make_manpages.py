#!/usr/bin/env python3
"""Write atopgpud(8) and atopgpu(1) from the commands' own ``--help``.

The OPTIONS section of each page is the command's ``--help`` at 80 columns, option
by option, so the pages cannot say what the commands do not: tests/test_manpages.py
runs this script's `render` and compares it with the committed pages. The other
sections (what the daemon serves, files, exit status, examples) are written here.

    python3 docs/man/make_manpages.py        # rewrite docs/man/atopgpud.8 and atopgpu.1
    python3 docs/man/make_manpages.py --check   # exit 1 when a committed page differs

Run it with the interpreter of an environment where atopgpud_tw is installed.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import sys
from pathlib import Path
from typing import NamedTuple

HERE = Path(__file__).resolve().parent
WIDTH = "80"


class Option(NamedTuple):
    """One option as ``--help`` gives it: its names, its argument's name (or None), its text."""

    names: tuple[str, ...]
    argument: str | None
    text: str


def daemon_help() -> str:
    """``atopgpud --help``, as the command prints it."""
    from atopgpud_tw.__main__ import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
        main(["--help"])
    return out.getvalue()


def client_help() -> str:
    """``atopgpu --help``, as the command prints it."""
    from atopgpud_tw.atopgpu.cli import make_parser

    return make_parser().format_help()


def doctor_help() -> str:
    """``atopgpu doctor --help``, as the command prints it."""
    from atopgpud_tw.atopgpu.doctor import make_parser

    return make_parser().format_help()


def joined(text: str, line: str) -> str:
    """`text` with the wrapped `line` after it: a word broken after its hyphen is whole again."""
    line = line.strip()
    if not text:
        return line
    return text + line if re.search(r"\w-$", text) else f"{text} {line}"


_TWISTED_OPTION = re.compile(r"^ {2,}(?:-(\w), )?--([\w-]+)(=?)(?: {2,}(.*))?$")


def daemon_options(text: str) -> tuple[list[Option], str]:
    """The options of Twisted's usage text and the description after them."""
    options: list[Option] = []
    lines = text.splitlines()
    index = next(i for i, line in enumerate(lines) if line.strip() == "Options:") + 1
    while index < len(lines) and lines[index].strip():
        match = _TWISTED_OPTION.match(lines[index])
        if match:
            short, long, takes, first = match.groups()
            names = (f"-{short}", f"--{long}") if short else (f"--{long}",)
            options.append(Option(names, "VALUE" if takes else None, first or ""))
        else:  # a continuation of the last option's text
            options[-1] = options[-1]._replace(text=joined(options[-1].text, lines[index]))
        index += 1
    description = " ".join(line.strip() for line in lines[index:] if line.strip())
    return options, description


_ARGPARSE_OPTION = re.compile(r"^  (-[^ ].*?)(?: {2,}(.*))?$")


def client_options(text: str) -> tuple[list[Option], str]:
    """The options of argparse's help text and the description before them."""
    head, _, body = text.partition("\noptions:\n")
    description = " ".join(head.split("\n\n", 1)[1].split()) if "\n\n" in head else ""
    options: list[Option] = []
    for line in body.splitlines():
        match = _ARGPARSE_OPTION.match(line)
        if match:
            spec, first = match.groups()
            names, argument = [], None
            for part in spec.split(", "):
                name, _, arg = part.partition(" ")
                names.append(name)
                argument = arg or argument
            options.append(Option(tuple(names), argument, first or ""))
        elif line.strip():
            options[-1] = options[-1]._replace(text=joined(options[-1].text, line))
    return options, description


def escape(text: str) -> str:
    """Text as roff prints it: backslashes and hyphens escaped, no line starting with a dot."""
    text = text.replace("\\", "\\e").replace("-", "\\-")
    return "\\&" + text if text.startswith((".", "'")) else text


def option_items(options: list[Option]) -> list[str]:
    """Each option as a tagged paragraph."""
    out = []
    for option in options:
        names = ", ".join(f"\\fB{escape(name)}\\fR" for name in option.names)
        if option.argument:
            separator = "=" if option.argument == "VALUE" else " "
            names += f"{separator}\\fI{escape(option.argument)}\\fR"
        out += [".TP", names, escape(option.text[:1].upper() + option.text[1:])]
    return out


def page(name: str, section: int, summary: str, synopsis: str, description: list[str],
         options: list[Option], rest: list[str]) -> str:
    """A whole man page."""
    title = "System Manager's Manual" if section == 8 else "User Commands"
    lines = [
        f'.\\" Written by docs/man/make_manpages.py from `{name} --help`: edit that script, not this file.',
        f'.TH {name.upper()} {section} "" "atopgpud_tw" "{title}"',
        ".SH NAME", f"{name} \\- {escape(summary)}",
        ".SH SYNOPSIS", f"\\fB{name}\\fR {synopsis}",
        ".SH DESCRIPTION", *description,
        ".SH OPTIONS", *option_items(options),
        *rest,
    ]
    return "\n".join(lines) + "\n"


def daemon_page() -> str:
    options, description = daemon_options(daemon_help())
    return page(
        "atopgpud", 8, "GPU statistics daemon for atop", "[\\fIoptions\\fR]",
        [escape(description), ".PP",
         "The same service runs as a twistd plugin: \\fBtwistd \\-n atopgpud\\fR [\\fIoptions\\fR].",
         "Without a GPU, \\fB\\-\\-reader sim\\fR runs it on the built\\-in simulator."],
        options,
        [".SH FILES",
         ".TP", "\\fI/etc/default/atopgpud\\fR",
         "The options the Debian package's unit passes to the daemon (ATOPGPUD_OPTS).",
         ".TP", "\\fIatopgpud.service\\fR, \\fIatopgpud.socket\\fR, \\fIatopgpud\\-tcp.socket\\fR",
         "The systemd units: the daemon, and the sockets of atop 2.13 and later",
         "(\\fB@atopgpud_nvidia\\fR) and of older atop (TCP 127.0.0.1:59123).",
         ".SH EXIT STATUS",
         "After a clean stop on SIGTERM or SIGINT it ends by that signal, as twistd does (status 143",
         "or 130 in a shell; systemd counts it a clean stop); 1 when start\\-up fails (no reader,",
         "a scenario that cannot be read, an endpoint that cannot listen); 2 for a bad option or",
         "\\fB\\-\\-web\\-config\\fR file.",
         "Each failure is one line on standard error.",
         ".SH EXAMPLES",
         ".nf",
         "atopgpud \\-\\-listen unix:@atopgpud_nvidia \\-\\-listen tcp:59123:interface=127.0.0.1",
         "atopgpud \\-\\-reader sim \\-\\-metrics tcp:9445:interface=127.0.0.1",
         ".fi",
         ".SH SEE ALSO",
         "\\fBatop\\fR(1), \\fBatopgpu\\fR(1), \\fBsystemd.socket\\fR(5), \\fBtwistd\\fR(1)"],
    )


def client_page() -> str:
    options, description = client_options(client_help())
    doctor, doctor_description = client_options(doctor_help())
    return page(
        "atopgpu", 1, "show the figures a running atopgpud serves",
        "[\\fIoptions\\fR]\n.br\n\\fBatopgpu doctor\\fR [\\fB\\-\\-json\\fR]",
        [escape(description)],
        options,
        [".SH DOCTOR", escape(doctor_description), *option_items(doctor),
         ".SH EXIT STATUS",
         "0 on success; 1 when the daemon cannot be reached or answers wrongly; 2 for a bad option.",
         "\\fBatopgpu doctor\\fR: 0 when every check passes, 1 when one fails.",
         ".SH EXAMPLES",
         ".nf",
         "atopgpu",
         "atopgpu \\-\\-watch 5 \\-\\-by workload",
         "atopgpu \\-\\-health \\-\\-metrics\\-url http://127.0.0.1:9445/metrics",
         "atopgpu doctor",
         ".fi",
         ".SH SEE ALSO",
         "\\fBatopgpud\\fR(8), \\fBatop\\fR(1)"],
    )


def render() -> dict[str, str]:
    """Each page's file name and text."""
    os.environ["COLUMNS"] = WIDTH  # both Twisted and argparse wrap --help to it
    return {"atopgpud.8": daemon_page(), "atopgpu.1": client_page()}


def main(argv: list[str]) -> int:
    pages = render()
    if argv[1:] == ["--check"]:
        stale = [name for name, text in pages.items()
                 if not (HERE / name).exists() or (HERE / name).read_text() != text]
        for name in stale:
            print(f"docs/man/{name} differs from --help: run docs/man/make_manpages.py", file=sys.stderr)
        return 1 if stale else 0
    for name, text in pages.items():
        (HERE / name).write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
