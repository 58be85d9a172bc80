"""The README and --help stay true to the code."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from twisted.python import usage

from atopgpud_tw import tap

ROOT = Path(__file__).resolve().parents[1]


def ci_test_command() -> str:
    """The command .ci/run runs: the text of its TEST_COMMAND here-document."""
    ci = (ROOT / ".ci" / "run").read_text()
    match = re.search(r"^TEST_COMMAND=\$\(cat <<'README'\n(.*)\nREADME\n\)$", ci, re.M)
    assert match, "no TEST_COMMAND here-document in .ci/run"
    return match.group(1)


def readme_commands() -> list[str]:
    """The one-line commands of the README's ``sh`` blocks under Set-up."""
    readme = (ROOT / "README.md").read_text()
    setup = readme[readme.index("## Set-up"):readme.index("\n## ", readme.index("## Set-up") + 1)]
    return re.findall(r"^```sh\n(.*)\n```$", setup, re.M)


def test_readme_test_command_is_what_ci_runs():
    """.ci/run runs the README's test command word for word, and installs nothing of its own."""
    commands = readme_commands()
    assert len(commands) == 2 and commands[1].endswith("&& .venv/bin/pytest")
    assert ci_test_command() == commands[1]
    ci = (ROOT / ".ci" / "run").read_text()
    assert ci.count("apt-get install") == 1 and ci.count("pip install") == 1


def test_readme_commands_use_sudo_only_when_not_root():
    """Both set-up commands work as root where there is no sudo, and as a user with sudo."""
    for command in readme_commands():
        assert command.startswith('$([ "$(id -u)" = 0 ] || echo sudo) sh -c \'apt-get update -q && apt-get install -y ')
        assert command.count("sudo") == 1


def test_readme_lists_every_option():
    """Every option of the daemon has a row in the README's table."""
    readme = (ROOT / "README.md").read_text()
    names = [name for name in tap.Options().docs if name not in ("help", "version")]
    assert "listen" in names and "allow-uid" in names
    missing = [name for name in names if f"`--{name}" not in readme]
    assert missing == []


def test_readme_links_exist():
    """Every docs/ link in the README points to a file."""
    readme = (ROOT / "README.md").read_text()
    for link in re.findall(r"\]\((docs/[^)]+)\)", readme):
        assert (ROOT / link).exists(), link



def anchor_of(heading: str) -> str:
    """A Markdown heading's anchor, as GitHub makes it."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


DOCUMENTS = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda path: path.name)
def test_docs_stand_alone(document: Path) -> None:
    """No doc points outside the repository, and every relative link (and its anchor) exists."""
    text = document.read_text()
    assert not re.search(r"NVML-FACTS|\.\./shared|shared/(clients|fixtures|seeds)|PROTOCOL\.md|STYLE\.md", text)
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        linked = (document.parent / path).resolve() if path else document
        assert linked.exists(), f"{document.name}: {target}"
        if anchor and linked.suffix == ".md":
            anchors = {anchor_of(h) for h in re.findall(r"^#+ (.+)$", linked.read_text(), re.M)}
            assert anchor in anchors, f"{document.name}: {target}"


# -- the options table and --help ----------------------------------------------------------

#: a row of the README's options table: name, default cell, meaning
ROW = re.compile(r"^\| `--([a-z-]+)(?: [A-Z]+)?` \| ([^|]+) \| (.+) \|$", re.M)
#: where --help states a range of seconds, and where the README does
HELP_RANGE = re.compile(r"A number of seconds (from (\S+) to (\S+?)|above 0, up to (\S+?))\.")
README_RANGE = re.compile(r"(?:(\S+) to (\S+)|above 0, up to (\S+)) seconds")


def readme_options() -> dict[str, tuple[str, str]]:
    """The README's options table: option name -> (default cell, meaning)."""
    readme = (ROOT / "README.md").read_text()
    start = readme.index("## Options")
    table = readme[start:readme.index("\n## ", start + 1)]
    return {name: (default.strip(), meaning) for name, default, meaning in ROW.findall(table)}


def help_options() -> dict[str, str]:
    """``atopgpud --help``: option name -> its help text, on one line."""
    text = tap.Options().getUsage(width=10_000)
    found = re.findall(r"^\s+(?:-\w, )?--([a-z-]+)=?\s+(.*)$", text, re.M)
    return {name: " ".join(doc.split()) for name, doc in found}


def as_number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def test_readme_options_are_the_help_options():
    """The table has a row for each option --help lists, and none other."""
    assert set(readme_options()) == set(help_options()) - {"help", "version"}


def test_readme_defaults_are_the_help_defaults():
    """A default the README gives as a value is the one --help gives (and the parser uses);
    one it gives in words (off, everyone, found on PATH) is no value in --help either."""
    helps = help_options()
    parsed = tap.Options()
    parsed.parseOptions([])
    for name, (default, _) in readme_options().items():
        shown = re.search(r"\[default: ([^\]]+)\]|Default: (\S+?)\.(?: |$)", helps[name])
        value = re.fullmatch(r"`([^`]+)`", default)
        if value is None:
            assert shown is None, (name, default, helps[name])
            assert not parsed[name], (name, parsed[name])
            continue
        assert shown is not None, (name, helps[name])
        words, help_default = value.group(1), shown.group(1) or shown.group(2)
        if as_number(words) is not None:
            assert as_number(words) == as_number(help_default) == float(parsed[name]), name
        else:
            assert words == help_default, name
            assert parsed[name] in (words, [words]), name


def test_readme_ranges_are_the_help_ranges_and_the_parsers():
    """Every range of seconds the README states is the one --help states, and the parser
    takes both ends and refuses what lies beyond them; each option with a range has one in both."""
    helps = help_options()
    readme = readme_options()
    ranged = {name for name, doc in helps.items() if HELP_RANGE.search(doc)}
    assert {"interval", "smi-timeout", "hang-warning", "idle-timeout"} <= ranged
    for name in ranged:
        said = README_RANGE.search(readme[name][1])
        assert said, f"README: --{name} does not say its range"
        low, high = (said.group(1), said.group(2)) if said.group(1) else ("0", said.group(3))
        told = HELP_RANGE.search(helps[name])
        assert (told.group(2) or "0", told.group(3) or told.group(4)) == (low, high), name
        lowest = float(low) if said.group(1) else float(low) + 1e-9
        for value, good in ((lowest, True), (float(high), True), (float(high) * 1.000001, False),
                            (float(low) * 0.999 if said.group(1) else 0.0, False)):
            options = tap.Options()
            if good:
                options.parseOptions([f"--{name}", repr(value)])
                assert options[name] == value
            else:
                wanted = re.escape(told.group(0)[0].lower() + told.group(0)[1:-1])
                with pytest.raises(usage.UsageError, match=f"--{name} '[^']*': {wanted}$"):
                    options.parseOptions([f"--{name}", repr(value)])


def test_readme_choices_are_the_help_choices():
    """An option that takes one of some words: the README names each of them, as --help does."""
    readme = readme_options()
    for name, doc in help_options().items():
        choices = re.search(r"One of ([a-z, -]+)\.", doc)
        if choices:
            words = choices.group(1).split(", ")
            assert all(f"`{word}`" in readme[name][1] for word in words), (name, words)
