"""A second local user for the attack tests: `nobody`, running this checkout's Python code.

The tests run as root and play the victim; `nobody` plays another user of the same machine. That user
may reach neither the checkout nor the venv (CI clones into a `mktemp -d` folder, 0700; pyenv keeps the
interpreter under /root), so once a session the Python packages it needs are copied into a fresh folder
in /tmp that every user can read, and it runs a Python of the same version that it can reach with only
that folder on its path. setpriv becomes the user and then runs the command itself (runuser would stay
in between, and killing it would leave the user's process running). Only without root, setpriv, the
user or such an interpreter are the attack tests skipped, and they say why.
"""

from __future__ import annotations

import atexit
import functools
import importlib.util
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.procs import REPO

USER = "nobody"
_VERSION = f"python{sys.version_info.major}.{sys.version_info.minor}"
_CHECKOUT = ("pagedserve", "memory_daemon", "services", "tests")
# What tests/integration/other_user.py imports from site-packages (grpc needs typing_extensions), and
# protobuf's compiled implementation, which the stack's own processes use.
_SITE_PACKAGES = ("grpc", "grpc_health", "google.protobuf", "google._upb", "typing_extensions")


def _copy(source: Path, target: Path) -> None:
    if source.is_dir():
        shutil.copytree(source, target, ignore=shutil.ignore_patterns("__pycache__"))
    else:
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, target)


def _python_path() -> Path:
    """A fresh folder every user can read, holding the packages the second user's Python imports."""
    folder = Path(tempfile.mkdtemp(prefix="ps-second-user-", dir="/tmp"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    for package in _CHECKOUT:
        _copy(REPO / package, folder / package)
    for name in _SITE_PACKAGES:
        spec = importlib.util.find_spec(name)
        assert spec is not None, f"{name} is not installed"
        if spec.submodule_search_locations:
            _copy(Path(spec.submodule_search_locations[0]), folder.joinpath(*name.split(".")))
        else:
            assert spec.origin is not None
            _copy(Path(spec.origin), folder.joinpath(*name.split(".")[:-1], Path(spec.origin).name))
    for root, _, files in os.walk(folder):  # whatever the umask and the modes copied
        os.chmod(root, 0o755)
        for name in files:
            os.chmod(os.path.join(root, name), 0o644)
    return folder


@functools.cache
def _as_user() -> tuple[list[str] | None, str]:
    """The command prefix that runs a command as the second user, or None and why not."""
    if os.geteuid() != 0:
        return None, f"needs root to act as a second local user ({USER})"
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        return None, "needs setpriv (util-linux) to act as a second local user"
    try:
        user = pwd.getpwnam(USER)
    except KeyError:
        return None, f"needs a user {USER} on this machine to act as a second local user"
    become = [setpriv, f"--reuid={user.pw_uid}", f"--regid={user.pw_gid}", "--clear-groups", "--"]
    return [*become, "env", "-i", "PATH=/usr/bin:/bin", "HOME=/tmp"], ""  # none of this user's secrets


@functools.cache
def _python() -> tuple[list[str] | None, str]:
    """The command prefix that runs Python as the second user, or None and why not."""
    as_user, why = _as_user()
    if as_user is None:
        return None, why
    # Its imports come from the copy alone: PYTHONSAFEPATH keeps the working folder off sys.path.
    environment = ["PYTHONDONTWRITEBYTECODE=1", "PYTHONSAFEPATH=1", f"PYTHONPATH={_python_path()}"]
    prefix = [*as_user, *environment]
    candidates = [sys.executable, os.path.realpath(sys.executable), shutil.which(_VERSION) or "",
                  f"/usr/bin/{_VERSION}", f"/usr/local/bin/{_VERSION}"]  # fmt: skip
    for python in dict.fromkeys(c for c in candidates if c):
        probe = [*prefix, python, "-c", "import tests.integration.other_user"]
        if subprocess.run(probe, capture_output=True, cwd="/", timeout=60).returncode == 0:
            return [*prefix, python], ""
    return None, f"{USER} can run no {_VERSION} that imports tests/integration/other_user.py's packages"


def python_as_second_user() -> list[str]:
    """The command prefix for `python` as the second user; skips the test when there is none."""
    prefix, why = _python()
    if prefix is None:
        pytest.skip(why)
    return prefix


def run_as_second_user(*args: str, timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
    """A plain command (mkdir, ln, chmod...) as the second user."""
    as_user, why = _as_user()
    if as_user is None:
        pytest.skip(why)
    return subprocess.run([*as_user, *args], capture_output=True, text=True, timeout=timeout_s, check=True)


def start_as_second_user(module: str, *args: str, log_path: Path) -> subprocess.Popen[bytes]:
    """`python -m module args` as the second user, its output in log_path."""
    command = [*python_as_second_user(), "-m", module, *args]
    with open(log_path, "wb") as log:
        return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd="/")


def folder_of_second_user() -> Path:
    """A fresh folder in /tmp that the second user made, open to everyone (mode 0777), as a careless or
    hostile user leaves one."""
    made = run_as_second_user("mktemp", "-d", "/tmp/ps-other-XXXXXX").stdout.strip()
    run_as_second_user("chmod", "0777", made)
    return Path(made)


def remove_folder_of_second_user(folder: Path) -> None:
    shutil.rmtree(folder, ignore_errors=True)
