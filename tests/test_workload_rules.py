"""etc/prometheus's workload rules: promtool checks them and runs their unit tests; they name real series."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from prometheus_server import promtool

from atopgpud_tw.counters import Counters
from atopgpud_tw.server.web.metrics import workload_families
from atopgpud_tw.workloads import WorkloadBook

ROOT = Path(__file__).resolve().parent.parent
RULES = ROOT / "etc" / "prometheus" / "atopgpud-workload-rules.yml"
RULE_TESTS = ROOT / "tests" / "prometheus" / "atopgpud-workload-rules-test.yml"


@pytest.mark.e2e
def test_workload_rules_pass_promtool_check():
    """promtool check rules accepts every workload recording rule."""
    promtool("check", "rules", str(RULES), timeout=60)


@pytest.mark.e2e
def test_workload_rules_pass_their_unit_tests():
    """promtool test rules: GPU-seconds per namespace, pod, workload and user, kube_pod_info joined on uid."""
    promtool("test", "rules", str(RULE_TESTS), timeout=120)


def test_workload_rules_name_series_the_page_has():
    """Every atopgpud series the rules read is one the workload collector writes."""
    named = set(re.findall(r"(?<![:\w])atopgpud_[a-z_]+", RULES.read_text()))
    families = {f"{family.name}_total" if family.type == "counter" else family.name
                for family in workload_families(WorkloadBook(Counters()))}
    assert named and named <= families, named - families
