"""A second local user for the attack tests: `runuser -u nobody`, running this checkout's Python code.

The tests run as root and play the victim; `nobody` plays another user of the same machine. That user may
not be able to run the venv's interpreter (pyenv keeps it under /root), so it runs a system Python of the
same version with the venv's site-packages and this checkout on its path. Without root, runuser or such an
interpreter the attack tests are skipped, and say why.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from tests.procs import REPO

USER = "nobody"
_VERSION = f"python{sys.version_info.major}.{sys.version_info.minor}"


def _environment() -> dict[str, str]:
    path = os.pathsep.join([str(REPO), sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]])
    return {"PATH": "/usr/bin:/bin", "PYTHONPATH": path, "HOME": "/tmp", "PYTHONDONTWRITEBYTECODE": "1"}


@functools.cache
def _python() -> tuple[list[str] | None, str]:
    """The command prefix that runs Python as the second user, or None and why not."""
    if os.geteuid() != 0:
        return None, f"needs root to act as a second local user ({USER}) with runuser"
    runuser = shutil.which("runuser")
    if runuser is None:
        return None, "needs runuser to act as a second local user"
    candidates = [sys.executable, os.path.realpath(sys.executable), shutil.which(_VERSION) or "",
                  f"/usr/bin/{_VERSION}", f"/usr/local/bin/{_VERSION}"]  # fmt: skip
    for python in dict.fromkeys(c for c in candidates if c):
        prefix = [runuser, "-u", USER, "--", "env", "-i", *(f"{k}={v}" for k, v in _environment().items())]
        probe = subprocess.run(
            [*prefix, python, "-c", "import grpc, pagedserve.memory.v1.memory_pb2"],
            capture_output=True, cwd=REPO, timeout=60,
        )  # fmt: skip
        if probe.returncode == 0:
            return [*prefix, python], ""
    return None, f"{USER} cannot run a {_VERSION} that imports grpc and this checkout"


def python_as_second_user() -> list[str]:
    """The command prefix for `python` as the second user; skips the test when there is none."""
    prefix, why = _python()
    if prefix is None:
        pytest.skip(why)
    return prefix


def run_as_second_user(*args: str, timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
    """A plain command (mkdir, ln, chmod...) as the second user."""
    python_as_second_user()  # the same skip rule
    command = ["runuser", "-u", USER, "--", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, check=True)


def start_as_second_user(module: str, *args: str, log_path: Path) -> subprocess.Popen[bytes]:
    """`python -m module args` as the second user, its output in log_path."""
    command = [*python_as_second_user(), "-m", module, *args]
    with open(log_path, "wb") as log:
        return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)


def folder_of_second_user() -> Path:
    """A fresh folder in /tmp that the second user made, open to everyone (mode 0777), as a careless or
    hostile user leaves one."""
    made = run_as_second_user("mktemp", "-d", "/tmp/ps-other-XXXXXX").stdout.strip()
    run_as_second_user("chmod", "0777", made)
    return Path(made)


def remove_folder_of_second_user(folder: Path) -> None:
    shutil.rmtree(folder, ignore_errors=True)
