"""etc/prometheus's rules: promtool checks them and runs their unit tests."""

from __future__ import annotations

from pathlib import Path

from prometheus_server import promtool

ROOT = Path(__file__).resolve().parent.parent
RULES = ROOT / "etc" / "prometheus" / "atopgpud-rules.yml"
RULE_TESTS = ROOT / "tests" / "prometheus" / "atopgpud-rules-test.yml"


def test_rules_pass_promtool_check():
    """promtool check rules accepts every recording and alerting rule."""
    promtool("check", "rules", str(RULES), timeout=60)


def test_rules_pass_their_unit_tests():
    """promtool test rules: busy rates as atop's arithmetic, and every alert firing when it should."""
    promtool("test", "rules", str(RULE_TESTS), timeout=120)
