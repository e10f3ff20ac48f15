"""`pagedserve gateway`: the smg command line it builds, and the settings it refuses (`up --gateway` on a real
stack: tests/integration/test_control_surface.py)."""

from __future__ import annotations

import argparse
import re
import stat
import sys
from pathlib import Path

import pytest

from services import gateway
from services.gateway import GatewayConfig, smg_binary, smg_command


def flag(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


def test_every_stack_is_a_vllm_worker_and_the_gateway_keeps_its_surfaces_private() -> None:
    config = GatewayConfig(stacks=("10.0.0.1:50051", "10.0.0.2:50051"), port=30009, api_key="client-key")
    command = smg_command(config, ["--cache-threshold", "0.5"])
    assert command[1:4] == ["launch", "--backend", "vllm"]
    urls = command[command.index("--worker-urls") + 1 : command.index("--model-path")]
    assert urls == ["grpc://10.0.0.1:50051", "grpc://10.0.0.2:50051"]
    assert (flag(command, "--port"), flag(command, "--policy")) == ("30009", "cache_aware")
    assert flag(command, "--prometheus-host") == "127.0.0.1"  # smg's own default is every interface
    assert flag(command, "--api-key") == "client-key"
    admin = flag(command, "--control-plane-api-keys").split(":")
    assert admin[2] == "admin" and len(admin[3]) >= 32
    assert flag(smg_command(config), "--control-plane-api-keys") != ":".join(admin)  # a new key each start
    assert command[-2:] == ["--cache-threshold", "0.5"]  # extra flags go to smg as they are
    assert "--api-key" not in smg_command(GatewayConfig())


def test_the_gateway_says_how_to_install_smg_when_it_is_missing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))  # a folder without smg
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(ValueError, match=re.escape("pip install 'smg==1.13.0'")):
        smg_binary()


@pytest.mark.parametrize("stacks", [()])
def test_a_gateway_needs_a_stack(stacks: tuple[str, ...]) -> None:
    with pytest.raises(ValueError, match="at least one --stack"):
        GatewayConfig(stacks=stacks)


def test_the_client_key_comes_from_a_private_file(tmp_path: Path) -> None:
    key = tmp_path / "key"
    key.write_text("client-key\n")
    key.chmod(stat.S_IRUSR | stat.S_IWUSR)
    parser = argparse.ArgumentParser()
    gateway.add_arguments(parser)
    plan = gateway.configure(parser.parse_args(["--api-key-file", str(key), "--stack", "h:1", "--", "--x"]))
    assert flag(plan.command, "--api-key") == "client-key" and plan.command[-1] == "--x"
    assert "client-key" not in repr(plan.config)
