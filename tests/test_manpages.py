"""docs/man/atopgpud.8 and atopgpu.1 say what the commands' --help says.

The pages are written by docs/man/make_manpages.py from ``--help``; these tests
fail when an option, its text or a default changes without the pages being
written again (``python3 docs/man/make_manpages.py``).
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

MAN = Path(__file__).resolve().parents[1] / "docs" / "man"


def _script():
    spec = importlib.util.spec_from_file_location("make_manpages", MAN / "make_manpages.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


make_manpages = _script()


@pytest.mark.parametrize("name", ["atopgpud.8", "atopgpu.1"])
def test_committed_page_is_the_one_help_makes(name: str) -> None:
    assert (MAN / name).read_text() == make_manpages.render()[name], \
        f"docs/man/{name} is stale: run python3 docs/man/make_manpages.py"


def test_every_option_of_the_daemon_is_on_its_page() -> None:
    page = (MAN / "atopgpud.8").read_text()
    named = set(re.findall(r"--([a-z][\w-]+)=?", make_manpages.daemon_help()))
    assert {"listen", "reader", "metrics", "web-config", "version"} <= named
    for option in named:
        assert f"\\fB\\-\\-{option.replace('-', chr(92) + '-')}\\fR" in page, option


def test_every_option_of_the_client_is_on_its_page() -> None:
    page = (MAN / "atopgpu.1").read_text()
    options, _ = make_manpages.client_options(make_manpages.client_help())
    assert {"--connect", "--json", "--watch", "--health"} <= {name for o in options for name in o.names}
    for option in options:
        for name in option.names:
            assert f"\\fB{make_manpages.escape(name)}\\fR" in page, name


def test_a_word_wrapped_at_its_hyphen_is_whole_again() -> None:
    options, _ = make_manpages.daemon_options(make_manpages.daemon_help())
    texts = {o.names[-1]: o.text for o in options}
    assert "comma-separated" in texts["--allow-uid"]
    assert "  " not in "".join(texts.values())
