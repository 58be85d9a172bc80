"""The scenario's fields are declared once (sim/scenario.py) and each is documented."""

from __future__ import annotations

import re
from dataclasses import fields
from pathlib import Path

import pytest

from atopgpud_tw.sim.scenario import SPECS, Fault, GpuSpec, MigSpec, ProcessSpec, Scenario, Timeline, json_keys

DOC = Path(__file__).resolve().parent.parent / "docs" / "simulator.md"
#: the section of docs/simulator.md that documents each part of a scenario
SECTIONS = {
    Scenario: "Top level",
    GpuSpec: "A GPU",
    ProcessSpec: "A process",
    MigSpec: "A MIG instance",
    Timeline: "A timeline",
    Fault: "A fault",
}


def section(title: str) -> str:
    text = DOC.read_text()
    found = re.search(rf"^### {re.escape(title)}\n(.*?)(?=^##)", text, re.S | re.M)
    assert found, f"docs/simulator.md has no section {title!r}"
    return found.group(1)


def test_every_part_of_a_scenario_has_a_section():
    """Each declared part of a scenario is one of the documented ones."""
    assert set(SPECS) == set(SECTIONS)


@pytest.mark.parametrize("spec", SPECS, ids=lambda spec: spec.__name__)
def test_every_declared_field_is_documented(spec):
    """Each JSON key a part of a scenario declares is named in its section of docs/simulator.md."""
    text = section(SECTIONS[spec])
    missing = [key for key in json_keys(spec) if f"`{key}`" not in text]
    assert not missing, f"docs/simulator.md, {SECTIONS[spec]}: {missing} not documented"


@pytest.mark.parametrize("spec", SPECS, ids=lambda spec: spec.__name__)
def test_every_field_is_declared_with_its_check_and_words(spec):
    """No field of a scenario part is checked elsewhere: each has its check (or is filled from
    others) and the words that say what it does."""
    for found in fields(spec):
        assert "check" in found.metadata and found.metadata["help"], f"{spec.__name__}.{found.name}"
