"""docs/operations.md: its list of problem lines is the daemon's table of them, and every
place in the code that reports a trouble names a kind of that table."""

from __future__ import annotations

import ast
import importlib.util
import re
import time
from pathlib import Path

import pytest
from daemon import run_daemon

from atopgpud_tw.problem_kinds import KINDS

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "atopgpud_tw"

#: (module, the key as the code writes it) -> the kinds of KINDS its troubles are; a
#: site the code gains fails test_every_site_has_a_kind until it is added here and,
#: for a new kind, to atopgpud_tw/problem_kinds.py
SITES: dict[tuple[str, str], tuple[str, ...]] = {
    # Attempt.note: the key every failed NVML call (and its callers' keys below) ends in
    ("readers/nvml/calls.py", "f'{self.device.key} {key or cause}'"): ("nvml-call",),
    ("readers/nvml/calls.py", "f'{self.device.key} {part[0]} {cause}'"): ("mig-slot",),
    ("readers/nvml/calls.py", "cause"): ("nvml-call",),
    ("readers/nvml/calls.py", "key"): ("nvml-call", "mig-slot"),
    ("readers/nvml/calls.py", "key or f'{error} not found'"): ("nvml-call", "mig-slot"),
    ("readers/nvml/gpm.py", "f'gpm {gpu_instance}'"): ("gpm-unsupported",),
    ("readers/nvml/health.py", "'health lost'"): ("health-lost",),
    ("readers/nvml/mig.py", "(f'mig slot {slot}', f'MIG device {slot}')"): ("mig-slot",),
    ("readers/nvml/mig.py", "'mig identity'"): ("mig-identity",),
    ("readers/nvml/mig.py", "f'{card.key} mig-empty'"): ("mig-empty",),
    ("readers/nvml/mig.py", "'lost'"): ("mig-instance-lost",),
    ("readers/nvml/reader.py", "'init'"): ("nvml-init", "nvml-reinit"),
    ("readers/nvml/reader.py", "f'{card.key} lost'"): ("gpu-lost",),
    ("readers/nvml/reader.py", "f'{key} lost'"): ("gpu-lost",),
    ("readers/nvml/reader.py", "f'index {index} unusable'"): ("index-unusable",),
    ("readers/smi/mig.py", "f'{card.key} mig-ids'"): ("smi-mig-ids",),
    ("readers/smi/mig.py", "f'{card.key} mig-unmatched'"): ("smi-mig-unmatched",),
    ("readers/smi/reader.py", "'mig-names'"): ("smi-mig-names",),
    ("readers/smi/report.py", "'preamble'"): ("smi-preamble",),
    ("readers/smi/report.py", "f'{owner} {tag} long'"): ("smi-long",),
    ("readers/smi/report.py", "f'{card.busid} mig-empty'"): ("mig-empty",),
    ("readers/smi/report.py", "f'{card.key} processes'"): ("smi-processes",),
    ("readers/smi/report.py", "f'{card.key} pid'"): ("smi-pid",),
    ("readers/smi/values.py", "f'gpu#{position} no-id'"): ("smi-no-id",),
    ("readers/smi/values.py", "f'{owner[0]} {path}'"): ("smi-value",),
    # the health ProblemLog reports the troubles the health reading above keyed
    ("server/web/metrics.py", "key"): ("health-lost", "nvml-call"),
}


def report_sites() -> set[tuple[str, str]]:
    """Each place the package reports a trouble, as (module, key expression): a call of
    ``<...>problems.add`` or ``.setdefault`` (its key), of ``.note`` (its key, its part, or its
    cause), and a ``"... unusable"`` key of a dict of troubles (nvml's devices it cannot open)."""
    found = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        module = path.relative_to(PACKAGE).as_posix()
        if module == "problems.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                receiver, name = ast.unparse(node.func.value), node.func.attr
                if name in ("add", "setdefault") and receiver.endswith("problems") and node.args:
                    found.add((module, ast.unparse(node.args[0])))
                elif name == "note":
                    given = {k.arg: k.value for k in node.keywords}
                    found.add((module, ast.unparse(given.get("key") or given.get("part") or node.args[0])))
            elif isinstance(node, (ast.Dict, ast.DictComp)):
                for key in node.keys if isinstance(node, ast.Dict) else [node.key]:
                    if isinstance(key, ast.JoinedStr) and ast.unparse(key).endswith(" unusable'"):
                        found.add((module, ast.unparse(key)))
    return found


def test_every_site_has_a_kind() -> None:
    """A trouble reported anywhere in the code is one of the table's kinds, and the list knows no site gone."""
    found = report_sites()
    assert found - set(SITES) == set(), "reported in the code, with no kind in SITES (and problem_kinds.py)"
    assert set(SITES) - found == set(), "a site in SITES the code no longer has"


def test_every_kind_is_reported_and_has_a_cause_and_an_action() -> None:
    names = [kind.name for kind in KINDS]
    assert len(names) == len(set(names))
    used = {name for kinds in SITES.values() for name in kinds}
    assert set(names) == used, "a kind no site reports, or a site's kind not in the table"
    for kind in KINDS:
        assert re.fullmatch(r"[a-z][a-z0-9-]*", kind.name)
        assert kind.line and kind.cause.strip() and kind.action.strip(), kind.name


def test_committed_page_is_what_the_generator_writes() -> None:
    spec = importlib.util.spec_from_file_location("make_operations", ROOT / "docs" / "make_operations.py")
    assert spec is not None and spec.loader is not None
    generator = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generator)
    page = (ROOT / "docs" / "operations.md").read_text()
    assert generator.render(page) == page, "run: python3 docs/make_operations.py"
    for kind in KINDS:
        assert f"#### {kind.name}\n" in page


def test_operations_page_stands_alone() -> None:
    """Its links lead to pages of this repository, none outside it."""
    page = (ROOT / "docs" / "operations.md").read_text()
    for target in re.findall(r"\]\(([^)#]+)", page):
        assert not target.startswith(("../", "/")), target
        assert (ROOT / "docs" / target).exists(), target


def line_pattern(line: str) -> re.Pattern[str]:
    """A kind's `line` as a pattern: ``<...>`` any text, ``[...]`` what may be left out."""
    pattern = ""
    for part in re.split(r"(<[^<>]*>|\[[^\]]*\])", line):
        if part.startswith("<") and part.endswith(">"):
            pattern += ".+"
        elif part.startswith("[") and part.endswith("]") and len(part) > 2:
            pattern += f"(?:{line_pattern(part[1:-1]).pattern})?"
        else:
            pattern += re.escape(part)
    return re.compile(pattern)


@pytest.mark.e2e
def test_the_daemons_problem_lines_are_the_tables(tmp_path: Path) -> None:
    """A simulated host with a failing call, a lost GPU and a MIG card with no instances: each
    trouble line the daemon logs (and its recovery) has the words of a kind of the table, and these
    three kinds are among them."""
    scenario = {"gpus": [
        {"busid": "00000000:17:00.0",
         "faults": [{"call": "nvmlDeviceGetMemoryInfo", "error": "NVML_ERROR_UNKNOWN", "from": 0}]},
        {"busid": "00000000:65:00.0",
         "faults": [{"call": "nvmlDeviceGetMemoryInfo", "error": "NVML_ERROR_GPU_IS_LOST", "from": 0}]},
        {"busid": "00000000:B3:00.0", "mig": []},
    ]}
    with run_daemon(tmp_path, ["--interval", "0.1"], scenario) as daemon:
        deadline = time.monotonic() + 60  # a bound on waiting, not on how fast: the three come at the first poll
        while daemon.log().count("[atopgpud_tw.problems.ProblemLog#warn]") < 3 and time.monotonic() < deadline:
            time.sleep(0.1)
    lines = re.findall(r"\[atopgpud_tw\.problems\.ProblemLog#\w+\] (nvml): (.*)", daemon.log())
    assert lines, daemon.log()
    patterns = {kind.name: line_pattern(kind.line) for kind in KINDS if "nvml" in kind.reader.split()}
    seen = set()
    for _, text in lines:
        text = re.sub(r"^recovered \((.*)\)$", r"\1", text)
        matched = {name for name, pattern in patterns.items() if pattern.fullmatch(text)}
        assert matched, f"a problem line of no kind in atopgpud_tw/problem_kinds.py: {text!r}"
        seen |= matched
    assert {"nvml-call", "gpu-lost", "mig-empty"} <= seen, lines
