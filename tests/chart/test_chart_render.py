"""`helm lint`, and `helm template` with default and non-default values: every rendered
object must pass the strict Kubernetes schemas of K8S_VERSION (kubernetes-validate), and
the objects must say what the values asked for.

Kinds outside Kubernetes' own schema set are named in NON_CORE_KINDS and checked
structurally instead (ServiceMonitor against the subset of prometheus-operator's schema
the chart uses; kopf's peering objects against the CRDs the chart ships).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from pstrain_api import __version__
from pstrain_api import constants as c

from .helm import (
    CHART,
    K8S_VERSION,
    RELEASE_NAMESPACE,
    objects_of,
    one,
    render,
    require_helm,
    run_helm,
)

FULLNAME = "pstrain"  # release "pstrain" already contains the chart name
TEAM_NAMESPACES = ["team-a", "team-b"]


class Values:
    """Builder of chart values: `Values().namespaced("a").leader().build()`."""

    def __init__(self) -> None:
        self.data: dict[str, Any] = {}

    def set(self, dotted: str, value: Any) -> Values:
        node = self.data
        *parents, leaf = dotted.split(".")
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
        return self

    def namespaced(self, *namespaces: str) -> Values:
        return self.set("watchNamespaces", list(namespaces))

    def leader(self, replicas: int = 2) -> Values:
        return self.set("leaderElection.enabled", True).set("replicaCount", replicas)

    def service_monitor(self) -> Values:
        return self.set("metrics.serviceMonitor.enabled", True).set(
            "metrics.serviceMonitor.labels", {"release": "kube-prometheus-stack"}
        )

    def build(self) -> dict[str, Any]:
        return self.data


CUSTOM = (
    Values()
    .set("image.digest", "sha256:" + "a" * 64)
    .set("image.pullPolicy", "Always")
    .set("imagePullSecrets", [{"name": "regcred"}])
    .set("runtimeImage.repository", "registry.example.com/ml/pstrain-runtime")
    .set("runtimeImage.tag", "0.1.0-cu128")
    .set("logLevel", "debug")
    .set("jobPodSecurity", "none")
    .set("progressInterval", 2.5)
    .set("jobNetworkPolicy", False)
    .set("psLivenessSeconds", 0)
    .set("serviceAccount.annotations", {"iam.gke.io/gcp-service-account": "ml@p.iam"})
    .set("resources", {"requests": {"cpu": "100m", "memory": "200Mi"},
                       "limits": {"cpu": 1, "memory": "400Mi"}})
    .set("podAnnotations", {"example.com/team": "ml"})
    .set("podLabels", {"team": "ml"})
    .set("nodeSelector", {"kubernetes.io/os": "linux"})
    .set("tolerations", [{"key": "dedicated", "operator": "Equal", "value": "ml",
                          "effect": "NoSchedule"}])
    .set("affinity", {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchExpressions": [
            {"key": "kubernetes.io/arch", "operator": "In", "values": ["amd64"]}]}]}}})
    .set("priorityClassName", "system-cluster-critical")
    .set("extraEnv", [{"name": "HTTPS_PROXY", "value": "http://proxy:3128"}])
    .set("metrics.port", 9090)
    .set("metrics.service.port", 80)
    .set("metrics.service.annotations", {"prometheus.io/scrape": "true"})
    .set("health.port", 9091)
    .build()
)

# (id, values, include_crds)
CASES = [
    ("default", {}, True),
    ("crds-skipped", {}, False),
    ("namespaced", Values().namespaced(*TEAM_NAMESPACES).build(), True),
    ("leader-election", Values().leader().build(), True),
    ("leader-election-namespaced",
     Values().leader(3).namespaced(*TEAM_NAMESPACES).build(), True),
    ("service-monitor", Values().service_monitor().build(), False),
    ("custom", CUSTOM, False),
    ("no-sa-no-rbac-no-service",
     Values().set("serviceAccount.create", False).set("serviceAccount.name", "existing")
     .set("rbac.create", False).set("metrics.service.enabled", False).build(), False),
]

# ---------------------------------------------------------------------------------------
# Structural checks for kinds kubernetes-validate has no schema for.

_LABELS = {"type": "object", "additionalProperties": {"type": "string"}}
_DURATION = {"type": "string", "pattern": "^([0-9]+(\\.[0-9]+)?(ms|s|m|h))+$"}
SERVICE_MONITOR_SCHEMA = {
    # The subset of monitoring.coreos.com/v1 ServiceMonitor the chart renders, closed.
    "type": "object",
    "additionalProperties": False,
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "ServiceMonitor"},
        "metadata": {
            "type": "object", "additionalProperties": False, "required": ["name", "namespace"],
            "properties": {"name": {"type": "string"}, "namespace": {"type": "string"},
                           "labels": _LABELS},
        },
        "spec": {
            "type": "object", "additionalProperties": False,
            "required": ["selector", "endpoints"],
            "properties": {
                "selector": {
                    "type": "object", "additionalProperties": False,
                    "properties": {"matchLabels": _LABELS},
                },
                "namespaceSelector": {
                    "type": "object", "additionalProperties": False,
                    "properties": {"matchNames": {"type": "array",
                                                  "items": {"type": "string"}}},
                },
                "endpoints": {
                    "type": "array", "minItems": 1,
                    "items": {
                        "type": "object", "additionalProperties": False, "required": ["port"],
                        "properties": {"port": {"type": "string"}, "path": {"type": "string"},
                                       "interval": _DURATION, "scrapeTimeout": _DURATION},
                    },
                },
            },
        },
    },
}


def _peering_crds() -> dict[str, dict[str, Any]]:
    text = (CHART / "crds" / "kopf-peering.yaml").read_text(encoding="utf-8")
    return {d["spec"]["names"]["kind"]: d for d in yaml.safe_load_all(text) if d}


def check_peering(obj: dict[str, Any]) -> None:
    crd = _peering_crds()[obj["kind"]]
    version = crd["spec"]["versions"][0]
    assert obj["apiVersion"] == f"{crd['spec']['group']}/{version['name']}"
    namespaced = crd["spec"]["scope"] == "Namespaced"
    assert ("namespace" in obj["metadata"]) == namespaced, obj["metadata"]
    body = {k: v for k, v in obj.items() if k not in ("apiVersion", "kind", "metadata")}
    jsonschema.validate(body, version["schema"]["openAPIV3Schema"])


def check_service_monitor(obj: dict[str, Any]) -> None:
    jsonschema.validate(obj, SERVICE_MONITOR_SCHEMA)


NON_CORE_KINDS = {
    # kind: (reason it is not in kubernetes-validate's schema set, structural check)
    "ServiceMonitor": ("a prometheus-operator CRD (monitoring.coreos.com)", check_service_monitor),
    "ClusterKopfPeering": ("a kopf CRD (kopf.dev), shipped in the chart's crds/", check_peering),
    "KopfPeering": ("a kopf CRD (kopf.dev), shipped in the chart's crds/", check_peering),
}
CORE_KINDS = {
    "CustomResourceDefinition", "ServiceAccount", "ClusterRole", "ClusterRoleBinding",
    "Role", "RoleBinding", "Service", "Deployment",
}


@pytest.fixture(scope="module", autouse=True)
def _helm() -> None:
    require_helm()


# The oldest supported minor version (the one the values schema is generated from) and the
# newest whose schemas kubernetes-validate ships.
VERSIONS = sorted({K8S_VERSION, kubernetes_validate.utils.major_minor(
    kubernetes_validate.utils.latest_version())})


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize(("values", "include_crds"),
                         [pytest.param(v, crds, id=i) for i, v, crds in CASES])
def test_every_rendered_object_is_valid(values: dict[str, Any], include_crds: bool,
                                        version: str) -> None:
    objs = render(values, include_crds)
    assert objs
    for obj in objs:
        kind = obj["kind"]
        name = f"{kind} {obj['metadata'].get('name')}"
        assert kind in CORE_KINDS | set(NON_CORE_KINDS), f"{name}: unexpected kind"
        assert len(obj["metadata"]["name"]) <= 63 or kind == "CustomResourceDefinition", name
        if kind in NON_CORE_KINDS:
            NON_CORE_KINDS[kind][1](obj)
            continue
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{name} is not a valid Kubernetes {version} object: {exc}")


@pytest.mark.parametrize(("values", "include_crds"),
                         [pytest.param(v, crds, id=i) for i, v, crds in CASES])
def test_namespaced_objects_name_their_namespace(values: dict[str, Any],
                                                 include_crds: bool) -> None:
    cluster_kinds = {"CustomResourceDefinition", "ClusterRole", "ClusterRoleBinding",
                     "ClusterKopfPeering"}
    for obj in render(values, include_crds):
        has_ns = "namespace" in obj["metadata"]
        assert has_ns == (obj["kind"] not in cluster_kinds), obj["metadata"]


def test_helm_lint_passes_with_default_and_custom_values() -> None:
    for values in ({}, CUSTOM, Values().leader().namespaced("a").service_monitor().build()):
        result = run_helm("lint", "--strict", str(CHART), values=values)
        assert result.returncode == 0, result.stdout + result.stderr


def test_crds_are_rendered_only_with_include_crds() -> None:
    with_crds = {o["metadata"]["name"]
                 for o in objects_of(render({}, True), "CustomResourceDefinition")}
    assert with_crds == {c.CRD_NAME, "kopfpeerings.kopf.dev", "clusterkopfpeerings.kopf.dev"}
    assert objects_of(render({}, False), "CustomResourceDefinition") == []


# ---------------------------------------------------------------------------------------
# What the objects say


def _env(deployment: dict[str, Any]) -> list[dict[str, Any]]:
    return deployment["spec"]["template"]["spec"]["containers"][0]["env"]


POD_ID = {"name": "POD_ID", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}
OWN_NAMESPACE = {"name": "PSTRAIN_OPERATOR_NAMESPACE",
                 "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}}


def test_default_deployment_env_is_the_operator_contract() -> None:
    deployment = one(render(), "Deployment")
    assert _env(deployment) == [
        {"name": "PSTRAIN_OPERATOR_NAMESPACES", "value": ""},
        {"name": "PSTRAIN_OPERATOR_RUNTIME_IMAGE", "value": c.DEFAULT_RUNTIME_IMAGE},
        {"name": "PSTRAIN_OPERATOR_METRICS_PORT", "value": "8080"},
        {"name": "PSTRAIN_OPERATOR_HEALTH_PORT", "value": "8081"},
        {"name": "PSTRAIN_OPERATOR_LOG_LEVEL", "value": "info"},
        {"name": "PSTRAIN_OPERATOR_LEADER_ELECTION", "value": "false"},
        {"name": "PSTRAIN_OPERATOR_JOB_POD_SECURITY", "value": "restricted"},
        {"name": "PSTRAIN_OPERATOR_PROGRESS_INTERVAL", "value": "10"},
        {"name": "PSTRAIN_OPERATOR_JOB_NETWORK_POLICY", "value": "true"},
        {"name": "PSTRAIN_OPERATOR_PS_LIVENESS_SECONDS", "value": "60"},
        OWN_NAMESPACE,
        POD_ID,
    ]


def test_custom_deployment_env_follows_the_values() -> None:
    values = Values().namespaced(*TEAM_NAMESPACES).leader().build() | CUSTOM
    assert _env(one(render(values), "Deployment")) == [
        {"name": "PSTRAIN_OPERATOR_NAMESPACES", "value": "team-a,team-b"},
        {"name": "PSTRAIN_OPERATOR_RUNTIME_IMAGE",
         "value": "registry.example.com/ml/pstrain-runtime:0.1.0-cu128"},
        {"name": "PSTRAIN_OPERATOR_METRICS_PORT", "value": "9090"},
        {"name": "PSTRAIN_OPERATOR_HEALTH_PORT", "value": "9091"},
        {"name": "PSTRAIN_OPERATOR_LOG_LEVEL", "value": "debug"},
        {"name": "PSTRAIN_OPERATOR_LEADER_ELECTION", "value": "true"},
        {"name": "PSTRAIN_OPERATOR_JOB_POD_SECURITY", "value": "none"},
        {"name": "PSTRAIN_OPERATOR_PROGRESS_INTERVAL", "value": "2.5"},
        {"name": "PSTRAIN_OPERATOR_JOB_NETWORK_POLICY", "value": "false"},
        {"name": "PSTRAIN_OPERATOR_PS_LIVENESS_SECONDS", "value": "0"},
        OWN_NAMESPACE,
        POD_ID,
        {"name": "HTTPS_PROXY", "value": "http://proxy:3128"},
    ]


def test_chart_versions_match_the_package() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text(encoding="utf-8"))
    assert chart["appVersion"] == __version__
    # The runtime image default is spelled once in the chart and once as the operator's
    # fallback; they must name the same image.
    values = yaml.safe_load((CHART / "values.yaml").read_text(encoding="utf-8"))
    image = values["runtimeImage"]
    assert f"{image['repository']}:{image['tag'] or chart['appVersion']}" == \
        c.DEFAULT_RUNTIME_IMAGE


@pytest.mark.parametrize(("image", "expected"), [
    pytest.param({}, "ghcr.io/pstrain/pstrain-operator:0.1.0", id="appVersion"),
    pytest.param({"tag": "dev"}, "ghcr.io/pstrain/pstrain-operator:dev", id="tag"),
    pytest.param({"tag": "dev", "digest": "sha256:" + "b" * 64},
                 "ghcr.io/pstrain/pstrain-operator@sha256:" + "b" * 64, id="digest-wins"),
])
def test_operator_image_reference(image: dict[str, str], expected: str) -> None:
    deployment = one(render({"image": image}), "Deployment")
    assert deployment["spec"]["template"]["spec"]["containers"][0]["image"] == expected


def test_operator_pod_is_locked_down_by_default() -> None:
    pod = one(render(), "Deployment")["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert pod["securityContext"] == {
        "runAsNonRoot": True, "runAsUser": 65532, "runAsGroup": 65532,
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    assert container["securityContext"] == {
        "allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
    assert {p["name"]: p["containerPort"] for p in container["ports"]} == \
        {"metrics": 8080, "health": 8081}


def test_single_operator_is_replaced_not_rolled() -> None:
    assert one(render(), "Deployment")["spec"]["strategy"] == {"type": "Recreate"}
    assert "strategy" not in one(render(Values().leader().build()), "Deployment")["spec"]


@pytest.mark.parametrize(("values", "expected"), [
    pytest.param(Values().leader().build(),
                 [("ClusterKopfPeering", None)], id="cluster"),
    pytest.param(Values().leader().namespaced(*TEAM_NAMESPACES).build(),
                 [("KopfPeering", "team-a"), ("KopfPeering", "team-b")], id="namespaced"),
    pytest.param({}, [], id="off"),
])
def test_leader_election_creates_the_peering_objects(values: dict[str, Any],
                                                     expected: list[tuple[str, Any]]) -> None:
    peerings = [o for o in render(values) if o["kind"].endswith("KopfPeering")]
    assert [(o["kind"], o["metadata"].get("namespace")) for o in peerings] == expected
    assert all(o["metadata"]["name"] == "pstrain" for o in peerings)


def test_service_monitor_scrapes_the_metrics_service() -> None:
    objs = render(Values().service_monitor().build())
    monitor, service = one(objs, "ServiceMonitor"), one(objs, "Service")
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    selector = monitor["spec"]["selector"]["matchLabels"]
    assert selector.items() <= service["metadata"]["labels"].items()
    assert monitor["spec"]["endpoints"] == [
        {"port": "metrics", "path": "/metrics", "interval": "30s", "scrapeTimeout": "10s"}]
    assert [p["name"] for p in service["spec"]["ports"]] == ["metrics"]
    assert service["spec"]["selector"].items() <= \
        one(objs, "Deployment")["spec"]["template"]["metadata"]["labels"].items()


def test_optional_objects_can_be_switched_off() -> None:
    kinds = {o["kind"] for o in render(CASES[-1][1])}
    assert kinds == {"Deployment"}
    deployment = one(render(CASES[-1][1]), "Deployment")
    assert deployment["spec"]["template"]["spec"]["serviceAccountName"] == "existing"


@pytest.mark.parametrize(("values", "message"), [
    pytest.param({"replicaCount": 2},
                  "replicaCount is 2; it must be 1 unless leaderElection.enabled is true",
                  id="replicas-without-leader-election"),
    pytest.param({"metrics": {"serviceMonitor": {"enabled": True},
                              "service": {"enabled": False}}},
                  "metrics.serviceMonitor.enabled is true but metrics.service.enabled is false",
                  id="monitor-without-service"),
    pytest.param({"metrics": {"port": 8081}},
                  "metrics.port and health.port are both 8081", id="same-ports"),
    pytest.param({"serviceAccount": {"create": False}},
                  "serviceAccount.name is required when serviceAccount.create is false",
                  id="no-service-account-name"),
])
def test_inconsistent_values_are_refused_with_a_reason(values: dict[str, Any],
                                                       message: str) -> None:
    result = run_helm("template", "pstrain", str(CHART), "--namespace", RELEASE_NAMESPACE,
                      "--kube-version", f"{K8S_VERSION}.0", values=values)
    assert result.returncode != 0
    assert message in result.stderr


def render_notes(values: dict[str, Any], tmp_path: Path) -> str:
    """NOTES.txt as `helm install` prints it. helm 3.10's `install --dry-run` needs a
    cluster and `template` skips NOTES.txt, so a copy of the chart renders it through a
    YAML template with `tpl`."""
    chart = tmp_path / "chart"
    shutil.copytree(CHART, chart)
    (chart / "templates" / "NOTES.txt").rename(chart / "notes.txt")
    (chart / "templates" / "notes.yaml").write_text(
        'notes: |\n{{ tpl (.Files.Get "notes.txt") . | indent 2 }}\n', encoding="utf-8")
    result = run_helm("template", "pstrain", str(chart), "--namespace", RELEASE_NAMESPACE,
                      "--kube-version", f"{K8S_VERSION}.0",
                      "--show-only", "templates/notes.yaml", values=values)
    assert result.returncode == 0, result.stderr
    return yaml.safe_load(result.stdout)["notes"]


@pytest.mark.parametrize(("values", "namespace"), [
    pytest.param({}, RELEASE_NAMESPACE, id="cluster"),
    pytest.param(Values().namespaced("team-a", "team-b").build(), "team-a", id="namespaced"),
])
def test_notes_tell_how_to_submit_and_watch_the_example(
    values: dict[str, Any], namespace: str, tmp_path: Path,
) -> None:
    notes = render_notes(values, tmp_path)
    assert f"kubectl get tj -n {namespace} -w" in notes
    start = f"kubectl apply -n {namespace} -f - <<'YAML'\n"
    heredoc = notes.split(start, 1)[1].split("\nYAML\n", 1)[0]
    expected = yaml.safe_load((CHART.parents[1] / "examples" / "digits.yaml").read_text())
    assert yaml.safe_load(heredoc) == expected


def test_chart_speaks_the_operator_settings_contract() -> None:
    """The env names, the allowed choices and the peering name are the operator's own."""
    from pstrain_operator import settings

    declared = {getattr(settings, n) for n in dir(settings) if n.startswith("ENV_")}
    rendered = {e["name"] for e in _env(one(render(), "Deployment"))
                if e["name"].startswith("PSTRAIN_OPERATOR_")}
    assert rendered == declared
    schema = json.loads((CHART / "values.schema.json").read_text(encoding="utf-8"))
    assert tuple(schema["properties"]["logLevel"]["enum"]) == settings.LOG_LEVELS
    assert tuple(schema["properties"]["jobPodSecurity"]["enum"]) == settings.POD_SECURITY
    peerings = [o for o in render(Values().leader().build())
                if o["kind"].endswith("KopfPeering")]
    assert {o["metadata"]["name"] for o in peerings} == {settings.PEERING_NAME}
