"""docs/design.md's "Extending" stays true: every file it lists exists and names what it says."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def extending_rows() -> list[tuple[list[str], list[str]]]:
    """Each table row of "Extending": its files, and the backticked names of its second column."""
    design = (ROOT / "docs" / "design.md").read_text()
    section = design[design.index("\n## Extending"):]
    rows = []
    for line in section.splitlines():
        cells = [cell.strip() for cell in line.strip("|").split("|")] if line.startswith("| `") else []
        if len(cells) == 2:
            rows.append((re.findall(r"`([^`]+)`", cells[0]), re.findall(r"`([A-Za-z_][\w.]*)`", cells[1])))
    return rows


def test_extending_has_its_four_changes():
    design = (ROOT / "docs" / "design.md").read_text()
    section = design[design.index("\n## Extending"):]
    assert re.findall(r"^### (.+)$", section, re.M) == [
        "A new figure", "A new driver behaviour", "A new request", "A new reader"]
    assert len(extending_rows()) >= 15


def test_every_listed_file_exists_and_names_what_it_says():
    wrong = []
    for files, names in extending_rows():
        texts = []
        for name in files:
            path = ROOT / name
            if not path.is_file():
                wrong.append(f"{name}: no such file")
            else:
                texts.append(path.read_text())
        for name in names:
            if not any(re.search(rf"\b{re.escape(name)}\b", text) for text in texts):
                wrong.append(f"{files}: no {name}")
    assert not wrong, wrong
