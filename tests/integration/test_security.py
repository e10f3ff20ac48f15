"""Who may connect: the shared secret between the stack's processes, the frontend's bearer token and TLS,
loopback defaults, size limits, and no unpickling of anything."""

from __future__ import annotations

import ast
import datetime
import ipaddress
import subprocess
import sys
import urllib.request
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc

from memory_daemon.config import DaemonConfig
from memory_daemon.wire import shape_to_pb
from pagedserve.memory.v1 import memory_pb2, memory_pb2_grpc
from pagedserve.v1 import generation_pb2, generation_pb2_grpc
from pagedserve.worker.v1 import worker_pb2, worker_pb2_grpc
from services.client import Client, generate_request
from services.common.default_model import default_model_dir
from services.frontend.config import FrontendConfig
from services.worker.config import WorkerConfig
from tests.clients import internal_channel
from tests.integration.kv_agent import SHAPE
from tests.procs import REPO, SECRET, DaemonProcess, Stack, free_port, start_daemon, start_stack

UNAUTHENTICATED = grpc.StatusCode.UNAUTHENTICATED
SERVICE = "pagedserve.v1.Generation"


def test_internal_services_listen_on_loopback_by_default() -> None:
    assert DaemonConfig().address.startswith("127.0.0.1:")
    assert WorkerConfig().address.startswith("127.0.0.1:")
    assert FrontendConfig().address.startswith("127.0.0.1:")


def test_the_daemon_hands_pool_handles_only_to_callers_with_the_secret(daemon: DaemonProcess) -> None:
    attach = memory_pb2.AttachRequest(
        worker_name="intruder", model_id="m", shape=shape_to_pb(SHAPE), num_pages=16
    )
    with grpc.insecure_channel(daemon.address) as channel:
        stub = memory_pb2_grpc.MemoryDaemonStub(channel)
        for metadata in ((), (("x-pagedserve-secret", "guess"),)):
            with pytest.raises(grpc.RpcError) as caught:
                next(stub.Attach(attach, metadata=metadata))
            assert caught.value.code() == UNAUTHENTICATED
            assert "shared secret" in caught.value.details()
        with pytest.raises(grpc.RpcError) as caught:
            stub.GetStats(memory_pb2.GetStatsRequest())
        assert caught.value.code() == UNAUTHENTICATED
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
        assert health.status == health_pb2.HealthCheckResponse.SERVING  # probes need no secret
    with internal_channel(daemon.address) as channel:
        attached = next(memory_pb2_grpc.MemoryDaemonStub(channel).Attach(attach)).attached
        assert attached.pool.shm.path


def listening_on_all_interfaces(port: int) -> bool:
    """Whether a TCP socket listens on 0.0.0.0:port, from the kernel's table (state 0A is LISTEN)."""
    rows = Path("/proc/net/tcp").read_text().splitlines()[1:]
    return any(row.split()[1] == f"00000000:{port:04X}" and row.split()[3] == "0A" for row in rows)


def test_a_daemon_run_as_compose_runs_it(run_dir: Path) -> None:
    """Compose mounts the secret as a file, which wins over the environment, and opens the metrics port
    to a scraper in another container."""
    secret_file = run_dir / "secret"
    secret_file.write_text("from-the-file\n")
    port = free_port()
    daemon = start_daemon(
        run_dir, "--secret-file", str(secret_file), "--metrics-port", str(port), "--metrics-host", "0.0.0.0"
    )
    try:
        with grpc.insecure_channel(daemon.address) as channel:
            stub = memory_pb2_grpc.MemoryDaemonStub(channel)
            with pytest.raises(grpc.RpcError) as caught:
                stub.GetStats(memory_pb2.GetStatsRequest(), metadata=(("x-pagedserve-secret", SECRET),))
            assert caught.value.code() == UNAUTHENTICATED
            stub.GetStats(memory_pb2.GetStatsRequest(), metadata=(("x-pagedserve-secret", "from-the-file"),))
        assert listening_on_all_interfaces(port)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
            assert "pagedserve_kv_prefix_lookups" in reply.read().decode()
    finally:
        assert daemon.stop() == 0, daemon.log()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--secret-file", "{empty}"], "the secret file {empty} is empty"),
        (["--secret-file", "{missing}"], "No such file or directory"),
        (
            ["--metrics-port", "70000"],
            "--metrics-port must be 0 (no metrics server) or a TCP port, got 70000",
        ),
    ],
)
def test_a_bad_setting_is_a_usage_error(tmp_path: Path, flags: list[str], message: str) -> None:
    paths = {"empty": tmp_path / "empty", "missing": tmp_path / "missing"}
    paths["empty"].write_text("")
    command = [sys.executable, "-m", "memory_daemon", *(flag.format(**paths) for flag in flags)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60, cwd=REPO)
    last_line = done.stderr.splitlines()[-1]
    assert done.returncode == 2 and last_line.startswith("pagedserve daemon: error: "), done.stderr
    assert message.format(**paths) in last_line and "Traceback" not in done.stderr


def write_certificate(folder: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 and localhost, and its key, as PEM files."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "pagedserve test")])
    now = datetime.datetime.now(datetime.timezone.utc)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = folder / "cert.pem", folder / "key.pem"
    cert_path.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    return cert_path, key_path


def test_tls_and_a_bearer_token_on_the_frontend_and_the_secret_between_processes(tmp_path: Path) -> None:
    default_model_dir()
    cert, key = write_certificate(tmp_path)
    token_file = tmp_path / "token"
    token_file.write_text("open-sesame\n")
    # On every interface, as in a container: the certificate names 127.0.0.1 and localhost, not 0.0.0.0.
    stack: Stack = start_stack(
        tmp_path, "--kv-memory", "128MiB", "--tls-cert", str(cert), "--tls-key", str(key),
        "--api-token-file", str(token_file), tls_ca=cert, host="0.0.0.0",
    )  # fmt: skip
    try:
        health = [sys.executable, "-m", "services.cli", "health", stack.address, "--service", SERVICE]
        checked = subprocess.run([*health, "--tls-ca", str(cert)], capture_output=True, text=True, cwd=REPO)
        assert checked.returncode == 0, checked.stderr
        plain = subprocess.run(health, capture_output=True, text=True, cwd=REPO)
        assert plain.returncode == 1 and "not healthy" in plain.stderr, plain.stderr
        with Client(stack.address, token="open-sesame", tls_ca=str(cert)) as client:
            assert client.complete("Hello", max_tokens=3).usage.completion_tokens == 3
        for token in (None, "wrong"):
            with (
                Client(stack.address, token=token, tls_ca=str(cert)) as client,
                pytest.raises(grpc.RpcError) as caught,
            ):
                client.complete("Hello", max_tokens=3)
            assert caught.value.code() == UNAUTHENTICATED and "bearer token" in caught.value.details()
        with grpc.insecure_channel(stack.address) as plaintext, pytest.raises(grpc.RpcError) as caught:
            generation_pb2_grpc.GenerationStub(plaintext).Complete(generate_request("Hello"), timeout=5)
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE  # no TLS, no conversation

        # The worker behind it refuses anyone without the run's secret, which `up` made for itself.
        with grpc.insecure_channel(stack.worker_address()) as channel, pytest.raises(grpc.RpcError) as caught:
            worker_pb2_grpc.WorkerStub(channel).GetInfo(worker_pb2.GetInfoRequest())
        assert caught.value.code() == UNAUTHENTICATED
        assert stack.daemon_address.startswith("unix:") and stack.worker_address().startswith("unix:")
    finally:
        assert stack.stop() == 0


def test_oversized_messages_are_refused_and_the_server_keeps_serving(tmp_path: Path) -> None:
    default_model_dir()
    stack = start_stack(tmp_path, "--kv-memory", "128MiB")
    try:
        with grpc.insecure_channel(stack.address) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            with pytest.raises(grpc.RpcError) as caught:
                stub.Complete(generation_pb2.GenerateRequest(prompt="x" * (20 * 2**20)))
            assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            with pytest.raises(grpc.RpcError) as caught:
                stub.Complete(generate_request("Hello", max_tokens=2**21))
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert stub.Complete(generate_request("Hello", max_tokens=2)).usage.completion_tokens == 2
    finally:
        assert stack.stop() == 0


# Modules that unpickle, and calls that do (torch.load unpickles unless told weights_only).
UNPICKLING_MODULES = {"pickle", "_pickle", "cPickle", "cloudpickle", "dill", "joblib", "marshal", "shelve"}
UNPICKLING_CALLS = {"torch.load", "torch.jit.load", "torch.serialization.load", "pandas.read_pickle"}


def unpickling_uses(source: str) -> list[str]:
    """Where source could unpickle: an unpickling module imported, an unpickling function named (called or
    not, by any import name), or allow_pickle / weights_only=False passed."""
    tree = ast.parse(source)
    aliases: dict[str, str] = {}  # import name -> full module or attribute name
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                top = alias.name.split(".")[0]  # `import a.b` names a; `import a.b as c` names a.b
                aliases[alias.asname or top] = alias.name if alias.asname else top
                if top in UNPICKLING_MODULES:
                    found.append(f"line {node.lineno}: import {alias.name}")
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.module.split(".")[0] in UNPICKLING_MODULES:
                found.append(f"line {node.lineno}: from {node.module} import")
            for alias in node.names:
                aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute | ast.Name):
            name = _dotted(node, aliases)
            if name in UNPICKLING_CALLS or (name and name.split(".")[0] in UNPICKLING_MODULES):
                found.append(f"line {node.lineno}: {name}")
        elif isinstance(node, ast.keyword) and node.arg in ("allow_pickle", "weights_only"):
            safe = isinstance(node.value, ast.Constant) and node.value.value is (node.arg == "weights_only")
            if not safe:
                found.append(f"line {node.value.lineno}: {node.arg}={ast.unparse(node.value)}")
    return found


def _dotted(node: ast.expr, aliases: dict[str, str]) -> str | None:
    """node's full dotted name (np.load -> numpy.load), through the module's import names."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([aliases.get(node.id, node.id), *reversed(parts)])


def test_the_unpickling_scan_finds_each_spelling() -> None:
    spellings = [
        "import pickle as p",
        "from dill import loads",
        "import torch\nloader = torch.load",
        "from torch import load as fetch\nfetch('w.pt')",
        "import torch as t\nt.jit.load('m.pt')",
        "import numpy as np\nnp.load('a.npy', allow_pickle=True)",
        "import torch\ntorch.load('w.pt', weights_only=False)",
    ]
    assert all(unpickling_uses(source) for source in spellings), [
        s for s in spellings if not unpickling_uses(s)
    ]
    safe = "import numpy as np\nimport torch\nnp.load('a.npy', allow_pickle=False)\ntorch.save({}, 'w.pt')"
    assert unpickling_uses(safe) == []


def test_nothing_is_unpickled() -> None:
    """Weights come from safetensors and messages from protobuf: no pickle-based loader anywhere."""
    sources = [
        p
        for folder in ("services", "memory_daemon", "pagedserve", "scripts")
        for p in (REPO / folder).rglob("*.py")
    ]
    offenders = {str(p): uses for p in sources if (uses := unpickling_uses(p.read_text()))}
    assert sources and not offenders, offenders
