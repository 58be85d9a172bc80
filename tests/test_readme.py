"""The README and --help stay true to the code."""

from __future__ import annotations

import re
from pathlib import Path

from atopgpud_tw import tap

ROOT = Path(__file__).resolve().parents[1]


def test_readme_test_command_is_what_ci_runs():
    """.ci/run runs the README's test command word for word."""
    ci = (ROOT / ".ci" / "run").read_text()
    command = re.search(r'^TEST_COMMAND="(.*)"$', ci, re.M).group(1)
    assert command in (ROOT / "README.md").read_text()


def test_readme_installs_the_packages_ci_installs():
    """The README's apt-get line for the tests names the Debian packages .ci/run installs."""
    ci = re.search(r"apt-get install -y -qq --no-install-recommends ([^>]+)>", (ROOT / ".ci" / "run").read_text())
    readme = re.search(r"apt-get install -y ([^&]+)&& python3 -m venv \.venv && \.venv/bin/pip install -q",
                       (ROOT / "README.md").read_text())
    assert ci and readme
    assert sorted(readme.group(1).split()) == sorted(ci.group(1).split())


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
