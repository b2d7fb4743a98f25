"""The Kubernetes recipe in deploy/: every manifest validates against the Kubernetes schemas
(kubernetes-validate, which bundles them: no cluster, no network), the kustomization lists
every resource file, peers name the headless Services that front the right Deployments,
every container's flags parse, and the CURVE Secret mounts back as `disagg-node keygen`'s
DIR/node layout. Nothing here builds the image or talks to a cluster."""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes_validate import utils as kv

from disagg.cli.node import build_parser
from disagg.remote.discovery import DnsName, parse_peer_spec

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S_VERSION = "1.30.0"  # the oldest minor this recipe claims (README)

KUSTOMIZATION = yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())
NAMESPACE = KUSTOMIZATION["namespace"]


def documents() -> list[tuple[str, dict[str, Any]]]:
    out = []
    for name in KUSTOMIZATION["resources"]:
        for doc in yaml.safe_load_all((DEPLOY / name).read_text()):
            if doc:
                out.append((name, doc))
    return out


DOCS = documents()
DEPLOYMENTS = {d["metadata"]["name"]: d for _, d in DOCS if d["kind"] == "Deployment"}
SERVICES = {d["metadata"]["name"]: d for _, d in DOCS if d["kind"] == "Service"}


def container(dep: dict[str, Any]) -> dict[str, Any]:
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    return c


def args(dep: dict[str, Any]) -> Any:
    return build_parser().parse_args(container(dep)["args"])


def port_number(c: dict[str, Any], port: int | str) -> int:
    if isinstance(port, int):
        return port
    (n,) = [p["containerPort"] for p in c["ports"] if p["name"] == port]
    return int(n)


def listen_port(address: str) -> int:
    return int(address.rpartition(":")[2])


def test_the_kustomization_lists_every_resource_file():
    files = {p.name for p in DEPLOY.glob("*.yaml")} - {"kustomization.yaml"}
    listed = KUSTOMIZATION["resources"]
    assert sorted(listed) == sorted(files)
    assert len(set(listed)) == len(listed)
    assert KUSTOMIZATION["kind"] == "Kustomization"
    assert [i["name"] for i in KUSTOMIZATION["images"]] == ["disagg"]
    assert {container(d)["image"] for d in DEPLOYMENTS.values()} == {"disagg"}


@pytest.mark.parametrize("name, doc", DOCS, ids=[f"{n}:{d['kind']}/{d['metadata']['name']}"
                                                 for n, d in DOCS])
def test_every_manifest_validates_against_the_kubernetes_schema(name, doc):
    kv.validate(doc, K8S_VERSION, strict=True)  # raises on any unknown or mistyped field


def test_the_validator_does_catch_mistakes():
    dep = yaml.safe_load(yaml.safe_dump(DEPLOYMENTS["disagg-decode"]))
    container(dep)["readinesProbe"] = container(dep).pop("readinessProbe")
    with pytest.raises(kv.ValidationError):
        kv.validate(dep, K8S_VERSION, strict=True)


def test_there_is_a_router_a_prefill_and_a_decode_deployment_with_their_services():
    roles = {args(d).role: name for name, d in DEPLOYMENTS.items()}
    assert set(roles) == {"router", "prefill", "decode"}
    for role in ("prefill", "decode"):
        svc = SERVICES[roles[role]]
        assert svc["spec"]["clusterIP"] == "None", f"{role}: peers need a headless Service"
    for name, dep in DEPLOYMENTS.items():
        pod_labels = dep["spec"]["template"]["metadata"]["labels"]
        assert dep["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
        assert SERVICES[name]["spec"]["selector"].items() <= pod_labels.items()
        others = [d for n, d in DEPLOYMENTS.items() if n != name]
        for other in others:  # a Service selects its own Deployment's pods only
            labels = other["spec"]["template"]["metadata"]["labels"]
            assert not SERVICES[name]["spec"]["selector"].items() <= labels.items()


def peers_of(dep: dict[str, Any]) -> list[tuple[str, DnsName]]:
    a = args(dep)
    out = []
    for flag, specs in (("--decode-peer", a.decode_peers), ("--prefill-peer", a.prefill_peers)):
        for spec in specs:
            parsed = parse_peer_spec(spec, flag)
            assert isinstance(parsed, DnsName), f"{spec}: peers in the recipe come from DNS"
            out.append((flag, parsed))
    return out


def test_peer_addresses_name_the_services_and_ports_of_the_right_deployments():
    wanted = {"router": "--decode-peer", "decode": "--prefill-peer"}
    target_role = {"--decode-peer": "decode", "--prefill-peer": "prefill"}
    seen = set()
    for dep in DEPLOYMENTS.values():
        role = args(dep).role
        peers = peers_of(dep)
        assert [flag for flag, _ in peers] == ([wanted[role]] if role in wanted else [])
        for flag, peer in peers:
            svc_name, ns, svc_suffix = peer.host.split(".")
            assert (ns, svc_suffix) == (NAMESPACE, "svc"), peer
            svc = SERVICES[svc_name]
            target = DEPLOYMENTS[svc_name]
            assert args(target).role == target_role[flag]
            (sp,) = [p for p in svc["spec"]["ports"] if p["port"] == peer.port]
            c = container(target)
            # the Service port leads to the container port the node listens on
            assert port_number(c, sp["targetPort"]) == listen_port(args(target).listen)
            assert args(target).listen.startswith("tcp://0.0.0.0:")
            seen.add(flag)
    assert seen == {"--decode-peer", "--prefill-peer"}


def test_gpus_probes_and_prometheus_annotations():
    for name, dep in DEPLOYMENTS.items():
        a, c = args(dep), container(dep)
        res = c["resources"]
        if a.role in ("prefill", "decode"):
            assert res["requests"]["nvidia.com/gpu"] == 1 == res["limits"]["nvidia.com/gpu"]
            assert a.devices == "cuda:0"
        else:
            assert "nvidia.com/gpu" not in res.get("limits", {})
        # /metrics: --metrics-listen on nodes, the HTTP gateway on the router
        serving = a.http_listen if a.role == "router" else a.metrics_listen
        assert serving is not None, f"{name}: nothing serves /metrics"
        ann = dep["spec"]["template"]["metadata"]["annotations"]
        assert ann["prometheus.io/scrape"] == "true" and ann["prometheus.io/path"] == "/metrics"
        assert int(ann["prometheus.io/port"]) == listen_port(serving)
        assert listen_port(serving) in {p["containerPort"] for p in c["ports"]}
        for probe in ("readinessProbe", "livenessProbe"):
            p = c[probe]
            if "httpGet" in p:
                assert p["httpGet"]["path"] == "/health"
                assert port_number(c, p["httpGet"]["port"]) == listen_port(serving)
            else:
                port_number(c, p["tcpSocket"]["port"])  # a named port of the container


def test_model_and_curve_keys_are_mounted_where_the_flags_point():
    for dep in DEPLOYMENTS.values():
        a, c = args(dep), container(dep)
        mounts = {m["name"]: m for m in c["volumeMounts"]}
        assert a.curve_keys == mounts["curve-keys"]["mountPath"]
        assert a.model.startswith(mounts["model"]["mountPath"] + "/")
        assert mounts["model"]["readOnly"] and mounts["curve-keys"]["readOnly"]
        volumes = {v["name"]: v for v in dep["spec"]["template"]["spec"]["volumes"]}
        assert volumes["model"]["persistentVolumeClaim"]["claimName"] in {
            d["metadata"]["name"] for _, d in DOCS if d["kind"] == "PersistentVolumeClaim"}
        secret = volumes["curve-keys"]["secret"]
        assert secret["defaultMode"] == 0o400  # security.load_node refuses readable secrets
        assert "fsGroup" not in dep["spec"]["template"]["spec"].get("securityContext", {})


def test_the_curve_secret_mounts_back_as_the_keygen_node_layout(tmp_path):
    from disagg.serving.security import keygen, load_node

    keys = keygen(tmp_path / "keys")  # what `disagg-node keygen deploy/keys` writes
    (gen,) = KUSTOMIZATION["secretGenerator"]
    sources = dict(entry.split("=", 1) for entry in gen["files"])  # secret key -> file
    node_files = {p.relative_to(keys / "node").as_posix()
                  for p in (keys / "node").rglob("*") if p.is_file()}
    assert {Path(f).relative_to("keys/node").as_posix() for f in sources.values()} == node_files
    # the Secret kustomize would generate validates, and each Deployment mounts it back
    data = {k: "eA==" for k in sources}
    kv.validate({"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
                 "metadata": {"name": gen["name"]}, "data": data}, K8S_VERSION, strict=True)
    for dep in DEPLOYMENTS.values():
        volumes = {v["name"]: v for v in dep["spec"]["template"]["spec"]["volumes"]}
        secret = volumes["curve-keys"]["secret"]
        assert secret["secretName"] == gen["name"]
        mapped = {i["key"]: i["path"] for i in secret["items"]}
        assert mapped.keys() == sources.keys()
        assert {k: "keys/node/" + p for k, p in mapped.items()} == sources
    # rebuilt from the Secret's keys as the volume lays them out, the node loads its keys
    mounted = tmp_path / "mounted"
    for key, path in mapped.items():
        dst = mounted / path
        dst.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        dst.write_bytes((tmp_path / sources[key]).read_bytes())
        dst.chmod(0o400)
    mounted.chmod(0o700)
    load_node(mounted)


def test_the_dockerfile_builds_a_cuda_image_of_the_package():
    text = (DEPLOY / "Dockerfile").read_text()
    base = re.search(r"^ARG CUDA_IMAGE=(\S+)", text, re.M)
    assert base and base.group(1).startswith("nvidia/cuda:") and "FROM ${CUDA_IMAGE}" in text
    assert "libfabric-dev" in text and "python -m disagg.fabric.build" in text
    assert re.search(r"pip install (--no-deps )?\.", text)
    assert 'ENTRYPOINT ["disagg-node"]' in text
    ignore = (DEPLOY / "Dockerfile.dockerignore").read_text()
    assert "!disagg/**" in ignore and "!pyproject.toml" in ignore
    # the commands the README gives for the recipe name files that exist
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Deploying on Kubernetes"):]
    for line in section.splitlines():
        if line.startswith(("docker build", "kubectl apply")):
            for word in shlex.split(line):
                if word.startswith("deploy/"):
                    assert (ROOT / word).exists(), word


# ---------------------------------------------------------------- drain and autoscaling

AUTOSCALING = DEPLOY / "autoscaling"
SCALED = [d for d in yaml.safe_load_all((AUTOSCALING / "scaledobjects.yaml").read_text()) if d]
# the ScaledObjectSpec fields of KEDA v2 (keda.sh/v1alpha1) this recipe may use
SCALED_SPEC = {"scaleTargetRef", "minReplicaCount", "maxReplicaCount", "pollingInterval",
               "cooldownPeriod", "idleReplicaCount", "advanced", "fallback", "triggers"}
TRIGGER = {"type", "name", "metadata", "metricType", "authenticationRef", "useCachedMetrics"}
PROMETHEUS_METADATA = {"serverAddress", "query", "threshold", "activationThreshold",
                       "ignoreNullValues", "unsafeSsl", "namespace", "customHeaders"}


def test_decode_pods_drain_before_they_stop():
    """The decode pod's preStop hook is `disagg-node drain` of its own metrics endpoint (parsed
    by the node's parser), it waits past --drain-timeout, and the grace period covers both."""
    from disagg.cli.node import drain_parser

    dep = DEPLOYMENTS["disagg-decode"]
    a, c = args(dep), container(dep)
    cmd = c["lifecycle"]["preStop"]["exec"]["command"]
    assert cmd[:2] == ["disagg-node", "drain"]
    hook = drain_parser().parse_args(cmd[2:])
    host, _, port = hook.address.rpartition(":")
    assert host == "127.0.0.1" and int(port) == listen_port(a.metrics_listen)  # loopback only
    grace = dep["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert a.drain_timeout < hook.wait < grace


def test_the_autoscaling_overlay_scales_each_pool_on_the_advice():
    """deploy/autoscaling: the base plus a KEDA ScaledObject per pool, each aiming its
    Deployment at the router's disagg_advice_needed_nodes{pool}; their fields are KEDA's, and
    the HPA KEDA makes of each validates against the Kubernetes schema."""
    from disagg.serving.advice import Advice, Slo
    from disagg.serving.metrics import Metrics

    kust = yaml.safe_load((AUTOSCALING / "kustomization.yaml").read_text())
    assert kust["resources"] == ["..", "scaledobjects.yaml"]
    assert kust["namespace"] == NAMESPACE
    m = Metrics()  # what the router exports: the gauge each query reads
    m.watch_advice(lambda: Advice("decode-bound", 0.5, 1, 2, 1, 2, 1, 3, 0.5, 1.4, None, None,
                                  0, Slo(1.0, 0.05)))
    exported = m.render().decode()
    assert 'disagg_advice_needed_nodes{pool="decode"} 3.0' in exported
    assert {d["metadata"]["name"] for d in SCALED} == {"disagg-decode", "disagg-prefill"}
    for so in SCALED:
        assert so["apiVersion"] == "keda.sh/v1alpha1" and so["kind"] == "ScaledObject"
        spec = so["spec"]
        assert set(spec) <= SCALED_SPEC
        target = DEPLOYMENTS[spec["scaleTargetRef"]["name"]]
        assert spec["scaleTargetRef"]["kind"] == "Deployment"
        pool = args(target).role
        assert so["metadata"]["labels"]["app.kubernetes.io/component"] == pool
        assert 1 <= spec["minReplicaCount"] <= spec["maxReplicaCount"]
        (trigger,) = spec["triggers"]
        assert set(trigger) <= TRIGGER and trigger["type"] == "prometheus"
        meta = trigger["metadata"]
        assert set(meta) <= PROMETHEUS_METADATA and {"serverAddress", "query", "threshold"} <= set(meta)
        assert all(isinstance(v, str) for v in meta.values())  # KEDA's metadata: strings
        assert meta["query"] == f'max(disagg_advice_needed_nodes{{pool="{pool}"}})'
        assert trigger["metricType"] == "AverageValue" and meta["threshold"] == "1"
        behavior = spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
        hpa = {"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
               "metadata": {"name": f"keda-hpa-{so['metadata']['name']}"},
               "spec": {"scaleTargetRef": spec["scaleTargetRef"],
                        "minReplicas": spec["minReplicaCount"],
                        "maxReplicas": spec["maxReplicaCount"], "behavior": behavior,
                        "metrics": [{"type": "External", "external": {
                            "metric": {"name": "s0-prometheus"},
                            "target": {"type": "AverageValue",
                                       "averageValue": meta["threshold"]}}}]}}
        kv.validate(hpa, K8S_VERSION, strict=True)
        if pool == "decode":  # one pod drains at a time, each within its grace period
            (down,) = behavior["scaleDown"]["policies"]
            grace = target["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
            assert down == {"type": "Pods", "value": 1, "periodSeconds": down["periodSeconds"]}
            assert down["periodSeconds"] >= grace
