"""docs/alerts.md has a section for every alert of etc/prometheus/, each alert's runbook
annotation names it, and the XID classes the page gives are the rules' own lists."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
RULES = yaml.safe_load((ROOT / "etc" / "prometheus" / "atopgpud-rules.yml").read_text())
ALERTS = {rule["alert"]: rule for group in RULES["groups"] for rule in group["rules"] if "alert" in rule}
PAGE = (ROOT / "docs" / "alerts.md").read_text()


def test_every_alert_has_its_section_and_runbook() -> None:
    sections = set(re.findall(r"^## (Atopgpud\w+)$", PAGE, re.M))
    assert sections == set(ALERTS)
    for name, rule in ALERTS.items():
        annotations = rule["annotations"]
        assert annotations["runbook"] == f"docs/alerts.md#{name.lower()}", name
        assert annotations["summary"] and annotations["description"], name
        assert rule["labels"]["severity"] in ("critical", "warning", "info"), name
        assert f"| [{name}](#{name.lower()}) | {rule['labels']['severity']} |" in PAGE, name


def _codes(alert: str) -> set[str]:
    match = re.search(r'xid=~"([\d|]+)"', ALERTS[alert]["expr"])
    assert match, alert
    return set(match.group(1).split("|"))


def test_the_xid_classes_on_the_page_are_the_rules() -> None:
    listed = {row.split("|")[1].strip(): set(re.findall(r"\d+", row.split("|")[2]))
              for row in PAGE.splitlines() if row.startswith(("| user application |", "| critical |"))}
    assert listed["user application"] == _codes("AtopgpudGpuXidApplication")
    assert listed["critical"] == _codes("AtopgpudGpuXidCritical")
    warning = re.search(r'xid!~"([\d|]+)"', ALERTS["AtopgpudGpuXidWarning"]["expr"]).group(1).split("|")
    assert set(warning) == _codes("AtopgpudGpuXidApplication") | _codes("AtopgpudGpuXidCritical")
    assert "31" in _codes("AtopgpudGpuXidApplication") and "79" in _codes("AtopgpudGpuXidCritical")
