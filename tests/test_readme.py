"""The README and --help stay true to the code."""

from __future__ import annotations

import re
from pathlib import Path

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
