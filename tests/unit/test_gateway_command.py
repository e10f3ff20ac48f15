"""`pagedserve gateway`: the smg command line it builds, the settings it refuses, and how it runs smg (in
front of a fake smg: SIGTERM is passed on, smg's status is the gateway's, smg dies with it); `up --gateway`
on a real stack: tests/integration/test_control_surface.py."""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import stat
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from services import gateway
from services.gateway import GatewayConfig, smg_binary, smg_command
from services.launcher import free_port
from tests.procs import REPO
from tests.waiting import wait_until


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


def test_every_setting_reaches_smg(tmp_path: Path) -> None:
    # None of these is smg's default or ours: a setting that never reached the command line would show.
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    parser = argparse.ArgumentParser()
    gateway.add_arguments(parser)
    args = ["--stack", "h:1", "--host", "0.0.0.0", "--port", "30011", "--model", str(model)]
    args += ["--policy", "round_robin", "--health-check-interval", "7", "--log-level", "debug"]
    command = gateway.configure(parser.parse_args([*args, "--metrics-port", "30012"])).command
    assert (flag(command, "--host"), flag(command, "--port")) == ("0.0.0.0", "30011")
    assert flag(command, "--model-path") == str(model)  # the tokenizer SMG loads
    assert flag(command, "--policy") == "round_robin"
    assert flag(command, "--health-check-interval-secs") == "7"
    assert flag(command, "--log-level") == "debug"
    assert flag(command, "--prometheus-port") == "30012"


def test_the_smg_beside_this_python_wins_over_one_on_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The virtual environment's smg is the pinned one; another on PATH may be any version.
    beside, on_path = tmp_path / "venv", tmp_path / "path"
    for folder in (beside, on_path):
        folder.mkdir()
        (folder / "smg").write_text("#!/bin/sh\n")
        (folder / "smg").chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(beside / "python"))
    monkeypatch.setenv("PATH", str(on_path))
    assert smg_binary() == str(beside / "smg")


# A stand-in for smg: it answers the readiness probe on the port it is given, writes its pid, and exits 7
# on SIGTERM, so that its status tells a forwarded SIGTERM from any other end.
FAKE_SMG = """
    import http.server, os, signal, sys
    signal.signal(signal.SIGTERM, lambda *_: os._exit(7))
    class Ready(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()
        def log_message(self, *args):
            pass
    open(sys.argv[1], "w").write(str(os.getpid()))
    http.server.HTTPServer(("127.0.0.1", int(sys.argv[2])), Ready).serve_forever()
"""
# The gateway's own run(), in a process of its own (it installs signal handlers), with a fake smg command.
RUN_GATEWAY = """
import sys
from services.gateway import GatewayConfig, Plan, run
sys.exit(run(Plan(GatewayConfig(port=int(sys.argv[1])), sys.argv[2:])))
"""


@pytest.fixture
def fake_smg(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[str], int]]:
    """The gateway, up in front of a fake smg; and the fake smg's pid (killed afterwards if still there)."""
    fake, pid_file, port = tmp_path / "fake_smg.py", tmp_path / "smg.pid", free_port("127.0.0.1")
    fake.write_text(textwrap.dedent(FAKE_SMG))
    smg = [sys.executable, str(fake), str(pid_file), str(port)]
    command = [sys.executable, "-c", RUN_GATEWAY, str(port), *smg]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, cwd=REPO)
    assert proc.stdout is not None
    assert "the OpenAI API is up" in proc.stdout.readline()  # said once its signal handlers are set
    smg_pid = int(pid_file.read_text())
    yield proc, smg_pid
    proc.kill()
    proc.wait()
    with contextlib.suppress(ProcessLookupError):
        os.kill(smg_pid, signal.SIGKILL)


def test_sigterm_stops_smg_and_the_gateway_exits_with_its_status(
    fake_smg: tuple[subprocess.Popen[str], int],
) -> None:
    proc, _ = fake_smg
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 7  # smg got the SIGTERM, and its status is the gateway's


def test_smg_dies_with_the_gateway(fake_smg: tuple[subprocess.Popen[str], int]) -> None:
    proc, smg_pid = fake_smg
    proc.kill()  # no handler runs: the kernel tells smg (PR_SET_PDEATHSIG)
    proc.wait(timeout=30)

    def smg_gone() -> bool:
        # An exited child of a dead parent is reaped by init; until then it is a zombie.
        try:
            return Path(f"/proc/{smg_pid}/stat").read_text().split(") ")[1].startswith("Z")
        except FileNotFoundError:
            return True

    wait_until(smg_gone, 30, "smg to exit with the gateway")


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
