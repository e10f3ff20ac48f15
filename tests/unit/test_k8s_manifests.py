"""deploy/k8s: each overlay rendered by `kubectl kustomize` (tests/unit/k8s_rendering.py) and every object
validated by kubernetes-validate's strict schemas (no unknown field) for the newest Kubernetes it knows and
for 1.34, the first with DRA's resource.k8s.io/v1. No cluster runs here, so what the API server, the kubelet
and SMG would find out only at run time is asserted below: names that refer to each other, ports, selectors,
probes, and each process's flags as its own parser reads them.
"""

from __future__ import annotations

import argparse
import re
import types
from pathlib import Path

import pytest
from smg.launch_router import parse_router_args

from memory_daemon.config import DaemonConfig
from pagedserve.plumbing import settings
from pagedserve.plumbing.sizes import parse_bytes
from pagedserve.v1 import generation_pb2
from pagedserve.worker.v1 import worker_pb2
from services.frontend.config import FrontendConfig
from services.worker.config import WorkerConfig
from tests.unit.k8s_rendering import Rendered

try:
    import kubernetes_validate
except ImportError:  # a failure below, not a skip: the manifests must be validated
    kubernetes_validate = None

PROCESSES = {"daemon": DaemonConfig, "worker": WorkerConfig, "frontend": FrontendConfig}
SOCKETS = "/run/pagedserve/sockets/"
GENERATION = generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name
WORKER = worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name
OLDEST = "1.34.0"  # resource.k8s.io/v1
PORT_NAME = re.compile(r"^(?=.*[a-z])(?!.*--)[a-z0-9]([a-z0-9-]{0,13}[a-z0-9])?$")  # IANA_SVC_NAME
KINDS = ["ConfigMap", "Deployment", "NetworkPolicy", "Role", "RoleBinding", "Service", "ServiceAccount"]
RESTRICTED = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}


def validator() -> types.ModuleType:
    if kubernetes_validate is None:
        pytest.fail("the manifests are validated by kubernetes-validate: pip install kubernetes-validate")
    return kubernetes_validate


def validate(obj: dict, version: str) -> None:
    try:
        validator().validate(obj, version, strict=True)
    except validator().SchemaNotFoundError as missing:  # the command line only warns
        pytest.fail(missing.message)


def test_every_object_passes_the_strict_schemas_of_the_newest_and_of_1_34(rendered: Rendered) -> None:
    newest = validator().latest_version()
    assert tuple(map(int, newest.split("."))) >= (1, 37), "a current kubernetes-validate, please"
    for obj in rendered.objects:
        for version in (newest, OLDEST):
            validate(obj, version)
    extra = ["ResourceClaimTemplate"] if rendered.overlay == "gpu" else []
    assert sorted({o["kind"] for o in rendered.objects}) == sorted([*KINDS, *extra])


def test_strict_validation_refuses_a_misspelt_field() -> None:
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"}, "spec": {"containers": []}}
    pod["spec"]["shareProcesNamespace"] = True
    with pytest.raises(validator().ValidationError, match="shareProcesNamespace"):
        validate(pod, OLDEST)


def test_one_pod_runs_the_daemon_then_the_workers_as_sidecars_then_the_frontend(rendered: Rendered) -> None:
    spec = rendered.pod("node")["spec"]
    assert spec["shareProcessNamespace"] is True  # with the Pod's IPC namespace, what CUDA IPC needs
    assert not spec.get("hostIPC") and not spec.get("hostPID")
    assert list(rendered.node) == ["socket-folder", "daemon", "worker-0", "worker-1", "frontend"]
    sidecars = [c["name"] for c in spec["initContainers"] if c.get("restartPolicy") == "Always"]
    assert sidecars == ["daemon", "worker-0", "worker-1"]  # started in turn, stopped after the frontend
    assert [c["command"] for c in rendered.processes.values()] == [
        ["pagedserve", name] for name in ("daemon", "worker", "worker", "frontend")
    ]


def test_every_container_runs_as_one_unprivileged_user(rendered: Rendered) -> None:
    for name in ("node", "gateway"):
        spec = rendered.pod(name)["spec"]
        context = spec["securityContext"]
        assert (context["runAsNonRoot"], context["runAsUser"], context["runAsGroup"]) == (True, 10001, 10001)
        assert context["seccompProfile"] == {"type": "RuntimeDefault"}
        for container in [*spec.get("initContainers", []), *spec["containers"]]:
            assert container["securityContext"] == RESTRICTED, container["name"]
    assert rendered.pod("node")["spec"]["securityContext"]["fsGroup"] == 10001  # the Secret, the volumes


def mounts(container: dict) -> dict[str, str]:
    return {m["mountPath"]: m["name"] for m in container.get("volumeMounts", [])}


def test_the_processes_talk_over_unix_sockets_in_a_shared_memory_backed_folder(rendered: Rendered) -> None:
    volumes = {v["name"]: v for v in rendered.pod("node")["spec"]["volumes"]}
    # tmpfs: a root that is sticky (1777), below which the processes accept a socket folder
    assert volumes["sockets"]["emptyDir"]["medium"] == "Memory"
    assert all(mounts(c)["/run/pagedserve"] == "sockets" for c in rendered.node.values())
    assert rendered.argv(rendered.node["socket-folder"]) == ["mkdir", "-p", "-m", "0700", SOCKETS.rstrip("/")]
    flags = {name: rendered.flags(c) for name, c in rendered.processes.items()}
    daemon, frontend = flags.pop("daemon"), flags.pop("frontend")
    for name, worker in flags.items():
        assert worker["--address"] == [f"unix:{SOCKETS}{name}.sock"] and worker["--name"] == [name]
        assert worker["--daemon"] == daemon["--address"] == [f"unix:{SOCKETS}daemon.sock"]
    assert frontend["--worker"] == [worker["--address"][0] for worker in flags.values()]
    assert frontend["--daemon"] == daemon["--address"]  # the node's KV events, for SMG's routing
    # the CPU pool: a file in the daemon's /dev/shm that every worker maps
    assert volumes["shm"]["emptyDir"]["medium"] == "Memory"
    for name in ("daemon", *flags):
        assert mounts(rendered.node[name])["/dev/shm"] == "shm"
        assert rendered.flags(rendered.node[name])["--shm-dir"] == ["/dev/shm"]


def test_the_cpu_daemon_keeps_its_disk_tier_in_a_volume_that_outlives_its_container(
    rendered: Rendered,
) -> None:
    """--kv-disk in an emptyDir on disk (a container's restart keeps it: a warm restart) that only the daemon
    mounts, large enough for the tier's budget. The GPU overlay keeps pages in pinned host memory instead,
    which the daemon's memory request covers."""
    daemon = rendered.node["daemon"]
    flags = rendered.flags(daemon)
    if rendered.overlay == "gpu":
        assert "--kv-disk" not in flags
        (host,) = flags["--kv-host-memory"]
        assert parse_bytes(daemon["resources"]["requests"]["memory"]) > parse_bytes(host)
        return
    assert "--kv-host-memory" not in flags
    (folder,) = flags["--kv-disk"]
    ((path, name),) = [(p, n) for p, n in mounts(daemon).items() if folder.startswith(p.rstrip("/") + "/")]
    assert folder != path.rstrip("/"), "the tier's folder lies inside the volume: its root is not private"
    volume = {v["name"]: v for v in rendered.pod("node")["spec"]["volumes"]}[name]
    assert "medium" not in volume["emptyDir"], "on disk, not in memory"
    assert parse_bytes(volume["emptyDir"]["sizeLimit"]) > parse_bytes(flags["--kv-disk-size"][0])
    assert parse_bytes(daemon["resources"]["requests"]["ephemeral-storage"]) >= parse_bytes(
        volume["emptyDir"]["sizeLimit"]
    )
    assert [n for n, c in rendered.node.items() if name in mounts(c).values()] == ["daemon"]


def test_every_flag_is_one_its_process_parses(rendered: Rendered, tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_text("s3cret")
    for name, container in rendered.processes.items():
        argv = rendered.argv(container)
        assert "$(" not in " ".join(argv), f"{name}: a variable the ConfigMap does not set"
        argv = [f"--secret-file={secret}" if a.startswith("--secret-file=") else a for a in argv]
        parser = argparse.ArgumentParser()
        settings.add_arguments(parser, PROCESSES[argv[1]])
        args, unknown = parser.parse_known_args(argv[2:])
        assert not unknown, f"{name}: no such flags: {unknown}"
        config = settings.from_args(PROCESSES[argv[1]], args)
        assert config.secret == "s3cret"
        if argv[1] != "frontend":
            assert config.device == ("cuda" if rendered.overlay == "gpu" else "cpu")


def test_the_gpu_overlay_shares_one_claimed_gpu_and_the_cpu_one_claims_none(rendered: Rendered) -> None:
    spec = rendered.pod("node")["spec"]
    resources = {name: c.get("resources", {}) for name, c in rendered.node.items()}
    claims = {name: [c["name"] for c in r.get("claims", [])] for name, r in resources.items()}
    assert not any("nvidia.com/gpu" in r.get("limits", {}) for r in resources.values())  # one container's
    if rendered.overlay == "cpu":
        assert "resourceClaims" not in spec and not any(claims.values())
        return
    (claim,) = spec["resourceClaims"]
    template = rendered.one("ResourceClaimTemplate", claim["resourceClaimTemplateName"])
    (request,) = template["spec"]["spec"]["devices"]["requests"]
    assert request["exactly"]["deviceClassName"] == "gpu.nvidia.com" and request["exactly"]["count"] == 1
    # one claim for the daemon and every worker: the same GPU; the frontend never loads torch
    shared = [n for n, c in rendered.processes.items() if c["command"][1] in ("daemon", "worker")]
    assert claims == {n: [claim["name"]] if n in shared else [] for n in rendered.node}


def test_the_shared_secret_comes_from_a_secret_as_a_file(rendered: Rendered) -> None:
    volumes = {v["name"]: v for v in rendered.pod("node")["spec"]["volumes"]}
    source = volumes["secret"]["secret"]
    assert source["secretName"] == "pagedserve" and source["items"] == [{"key": "secret", "path": "secret"}]
    for name, container in rendered.processes.items():
        (path,) = rendered.flags(container)["--secret-file"]
        (mount,) = (m for m in container["volumeMounts"] if m["name"] == "secret")
        assert path == f"{mount['mountPath']}/secret" and mount["readOnly"] is True, name
    for container in [*rendered.node.values(), *rendered.pod("gateway")["spec"]["containers"]]:
        assert all(not e["name"].endswith("SECRET") for e in container.get("env", []))  # a file only
    gateway_volumes = rendered.pod("gateway")["spec"].get("volumes", [])
    assert all(v.get("secret", {}).get("secretName") != "pagedserve" for v in gateway_volumes)  # not SMG's


def test_probes_ask_grpc_health_on_tcp_natively_and_on_sockets_by_exec(rendered: Rendered) -> None:
    frontend = rendered.node["frontend"]
    assert rendered.flags(frontend)["--address"] == ["0.0.0.0:50051"]
    assert frontend["readinessProbe"]["grpc"] == {"port": 50051, "service": GENERATION}  # a worker is up
    assert frontend["livenessProbe"]["grpc"] == frontend["startupProbe"]["grpc"] == {"port": 50051}
    for name in ("daemon", "worker-0", "worker-1"):
        container = rendered.node[name]
        health = ["pagedserve", "health", rendered.flags(container)["--address"][0]]
        assert container["livenessProbe"]["exec"]["command"] == health, name
        ready = [f"--service={WORKER}"] if name.startswith("worker") else []
        assert container["startupProbe"]["exec"]["command"] == health + ready, name
        assert "readinessProbe" not in container  # the Pod is ready when its frontend is
    smg = rendered.pod("gateway")["spec"]["containers"][0]
    assert smg["readinessProbe"]["httpGet"] == {"path": "/readiness", "port": 30000}
    assert smg["livenessProbe"]["httpGet"] == {"path": "/liveness", "port": 30000}


def test_metrics_are_served_on_distinct_ports_for_a_prometheus_scrape(rendered: Rendered) -> None:
    served = []
    for name, container in rendered.processes.items():
        flags = rendered.flags(container)
        assert flags["--metrics-host"] == ["0.0.0.0"], name
        (port,) = (p["containerPort"] for p in container["ports"] if p["name"].startswith("metrics"))
        assert [str(port)] == flags["--metrics-port"], name
        served.append(port)
    metrics = rendered.one("Service", "pagedserve-metrics")
    assert metrics["metadata"]["annotations"]["prometheus.io/scrape"] == "true"
    assert metrics["spec"]["clusterIP"] == "None" and metrics["spec"]["publishNotReadyAddresses"] is True
    assert metrics["spec"]["selector"].items() <= rendered.pod("node")["metadata"]["labels"].items()
    assert sorted(p["targetPort"] for p in metrics["spec"]["ports"]) == sorted(served)
    names = [p["name"] for c in rendered.node.values() for p in c.get("ports", [])]
    assert len(set(names)) == len(names) and all(PORT_NAME.match(n) for n in names), names
    smg = rendered.pod("gateway")
    argv = rendered.argv(smg["spec"]["containers"][0])
    assert argv[argv.index("--prometheus-host") + 1] == "0.0.0.0"
    assert argv[argv.index("--prometheus-port") + 1] == smg["metadata"]["annotations"]["prometheus.io/port"]


def test_the_frontend_drains_within_the_grace_period(rendered: Rendered) -> None:
    pre_stop = rendered.node["frontend"]["lifecycle"]["preStop"]["sleep"]["seconds"]  # SMG lets go meanwhile
    drain = FrontendConfig.__dataclass_fields__["shutdown_grace_s"].default
    grace = rendered.pod("node")["spec"]["terminationGracePeriodSeconds"]
    assert pre_stop + drain + 10 <= grace  # then the sidecars stop, in reverse order
    gateway, (smg,) = rendered.pod("gateway")["spec"], rendered.pod("gateway")["spec"]["containers"]
    drain = int(rendered.argv(smg)[rendered.argv(smg).index("--shutdown-grace-period-secs") + 1])
    assert smg["lifecycle"]["preStop"]["sleep"]["seconds"] + drain <= gateway["terminationGracePeriodSeconds"]


def test_smg_discovers_the_node_pods_by_label_with_the_rbac_it_needs(rendered: Rendered) -> None:
    for deployment in (o["spec"] for o in rendered.objects if o["kind"] == "Deployment"):
        assert deployment["selector"]["matchLabels"] == deployment["template"]["metadata"]["labels"]
    gateway = rendered.pod("gateway")
    smg = gateway["spec"]["containers"][0]
    argv = rendered.argv(smg)
    assert argv[:2] == ["sh", "-c"] and argv[2].startswith('exec smg launch "$@" --control-plane-api-keys')
    args = parse_router_args([*argv[4:], "--control-plane-api-keys", "pagedserve:pagedserve:admin:key"])
    args._validate_router_args()
    assert (args.backend, args.service_discovery, args.model_path) == ("vllm", True, None)
    assert args.selector.items() <= rendered.pod("node")["metadata"]["labels"].items()
    assert not args.selector.items() <= gateway["metadata"]["labels"].items()
    frontend = rendered.node["frontend"]
    (listener,) = rendered.flags(frontend)["--gateway-address"]
    gateway_port = next(p["containerPort"] for p in frontend["ports"] if p["name"] == "gateway")
    assert args.service_discovery_port == gateway_port == int(listener.rsplit(":", 1)[1]) == 50052
    namespace = next(e for e in smg["env"] if e.get("valueFrom", {}).get("fieldRef"))
    assert namespace["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    assert args.service_discovery_namespace == f"$({namespace['name']})"  # expanded by the kubelet
    role = rendered.one("Role", "pagedserve-gateway")
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]
    binding = rendered.one("RoleBinding", "pagedserve-gateway")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    (subject,) = binding["subjects"]
    assert subject["name"] == gateway["spec"]["serviceAccountName"]
    assert {o["metadata"]["namespace"] for o in rendered.objects} == {subject["namespace"]}  # SMG's own
    service = rendered.one("Service", "pagedserve-gateway")
    assert service["spec"]["selector"].items() <= gateway["metadata"]["labels"].items()
    assert [(p["port"], p["targetPort"]) for p in service["spec"]["ports"]] == [(30000, args.port)]
