"""Private folders and files, where a server may listen, and who is behind a unix socket
(pagedserve/plumbing/private.py, auth.check_serving_address)."""

from __future__ import annotations

import os
import shutil
import socket
import stat
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from pagedserve.plumbing.auth import check_serving_address
from pagedserve.plumbing.errors import PermissionDenied
from pagedserve.plumbing.private import HeldFolder, check_unix_peer, private_folder, write_private_file
from tests.second_user import (
    folder_of_second_user,
    python_as_second_user,
    remove_folder_of_second_user,
    run_as_second_user,
)
from tests.waiting import wait_until

NOBODY = 65534


@pytest.fixture
def home(tmp_path: Path) -> Path:
    """A folder of this user's that no one else can write, as pytest makes them."""
    os.chmod(tmp_path, 0o700)
    return tmp_path


def mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_a_missing_run_folder_is_made_private(home: Path) -> None:
    assert private_folder(home / "a" / "run") == home / "a" / "run"
    assert mode(home / "a" / "run") == 0o700


@pytest.mark.parametrize(
    ("make", "problem"),
    [
        (lambda p: (p.mkdir(), p.chmod(0o755)), "is open to others (mode 755); it must be 0700"),
        (lambda p: (p.mkdir(), p.chmod(0o770)), "is open to others (mode 770)"),
        (
            lambda p: (p.with_name("real").mkdir(0o700), p.symlink_to(p.with_name("real"))),
            "is a symbolic link",
        ),
        (lambda p: p.write_text(""), "is not a folder"),
    ],
    ids=["0755", "0770", "symlink", "file"],
)
def test_a_run_folder_open_to_others_is_refused(
    home: Path, make: Callable[[Path], object], problem: str
) -> None:
    make(home / "run")
    with pytest.raises(PermissionDenied, match=problem.replace("(", r"\(").replace(")", r"\)")):
        private_folder(home / "run")
    held_problem = (
        "cannot be opened as a folder" if problem in ("is a symbolic link", "is not a folder") else problem
    )
    with pytest.raises(PermissionDenied, match=held_problem.replace("(", r"\(").replace(")", r"\)")):
        HeldFolder(home / "run")  # the disk tier's: the same folder checks, through its descriptor


def test_a_held_folder_is_made_private_and_written_whole_through_its_descriptor(home: Path) -> None:
    held = HeldFolder(home / "volume" / "kv")
    assert mode(home / "volume" / "kv") == 0o700
    held.write("page", b"ours")
    (home / "volume" / "kv").rename(home / "volume" / "moved")  # the path no longer leads to it
    assert [(name, info.st_mode & 0o777) for name, info in held.names()] == [("page", 0o600)]
    fd = held.open("page", os.O_RDONLY)
    with os.fdopen(fd, "rb") as file:
        assert file.read() == b"ours"
    held.unlink("page")
    held.unlink("page")  # already gone: nothing to do
    assert not (home / "volume" / "moved" / "page").exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a folder to another user")
def test_a_run_folder_of_another_user_is_refused(home: Path) -> None:
    (home / "run").mkdir(0o700)
    os.chown(home / "run", NOBODY, NOBODY)
    with pytest.raises(PermissionDenied, match=f"belongs to uid {NOBODY}, not to this user"):
        private_folder(home / "run")


def test_a_folder_under_one_others_can_rename_is_refused(home: Path) -> None:
    (home / "open").mkdir()
    (home / "open").chmod(0o777)  # not sticky: anyone may rename what is in it
    with pytest.raises(PermissionDenied, match=r"is writable by others \(mode 777\) and not sticky"):
        private_folder(home / "open" / "run")


@pytest.fixture
def their_folder() -> Iterator[Path]:
    folder = folder_of_second_user()
    yield folder
    remove_folder_of_second_user(folder)


@pytest.fixture
def their_link_in_tmp(home: Path) -> Iterator[Path]:
    """A symlink the other user put straight in /tmp (sticky, root's), to a folder of this user's."""
    link = Path(f"/tmp/ps-link-{os.urandom(6).hex()}")
    run_as_second_user("ln", "-s", str(home), str(link))
    yield link
    link.unlink()


def test_a_run_folder_reached_through_another_users_symlink_is_refused(
    home: Path, their_folder: Path, their_link_in_tmp: Path
) -> None:
    """Before: the folder passed, its ancestors checked only once the symlinks were resolved, and the other
    user could point their link elsewhere at any time after the check."""
    run_as_second_user("ln", "-s", str(home), str(their_folder / "link"))
    with pytest.raises(
        PermissionDenied, match=rf"^{their_folder}, above .*/link/run, belongs to uid {NOBODY}$"
    ):
        private_folder(their_folder / "link" / "run")
    pattern = rf"^{their_link_in_tmp}, above .*, is a symbolic link that belongs to uid {NOBODY}$"
    with pytest.raises(PermissionDenied, match=pattern):
        private_folder(their_link_in_tmp / "run")
    assert not (home / "run").exists(), "made a folder through another user's symlink"


def test_a_symlink_of_this_user_is_followed_and_its_target_checked(home: Path) -> None:
    (home / "real").mkdir(0o700)
    (home / "link").symlink_to("real")
    assert private_folder(home / "link" / "run") == home / "link" / "run"
    assert mode(home / "real" / "run") == 0o700
    (home / "open").mkdir()
    (home / "open").chmod(0o777)
    (home / "to-open").symlink_to(home / "open")
    with pytest.raises(PermissionDenied, match=r"/open, above .*/to-open/run, is writable by others"):
        private_folder(home / "to-open" / "run")
    (home / "loop-a").symlink_to("loop-b")
    (home / "loop-b").symlink_to("loop-a")
    with pytest.raises(PermissionDenied, match="more than 40 symbolic links"):
        private_folder(home / "loop-a" / "run")


def test_files_are_written_whole_and_never_through_a_symlink(home: Path) -> None:
    target = home / "precious"
    target.write_text("mine\n")
    (home / "endpoints.json").symlink_to(target)
    (home / "endpoints.json.partial").symlink_to(target)  # the old fixed name, planted
    write_private_file(home / "endpoints.json", "{}\n")
    assert target.read_text() == "mine\n"
    assert (home / "endpoints.json").read_text() == "{}\n" and not (home / "endpoints.json").is_symlink()
    assert mode(home / "endpoints.json") == 0o600
    assert sorted(p.name for p in home.iterdir()) == ["endpoints.json", "endpoints.json.partial", "precious"]


@pytest.fixture
def listener(home: Path) -> Iterator[Path]:
    path = home / "s.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server:
        server.bind(str(path))
        server.listen()
        yield path


def test_a_socket_of_this_user_in_a_private_folder_passes(home: Path, listener: Path) -> None:
    check_unix_peer(f"unix:{listener}")
    check_unix_peer(f"unix://{listener}")
    check_unix_peer(f"unix:{home}/missing.sock")  # nothing there: the call fails, no secret leaves
    check_unix_peer("127.0.0.1:50052")  # TCP: the network's design guards it


def test_a_socket_in_a_folder_others_can_write_is_refused(home: Path, listener: Path) -> None:
    home.chmod(0o1777)  # sticky, as /tmp: still, another user could put a socket of theirs in it
    with pytest.raises(
        PermissionDenied, match=r"refusing to send the stack's secret to .* is writable by others"
    ):
        check_unix_peer(f"unix:{listener}")


def test_a_socket_reached_through_another_users_symlink_is_refused(home: Path, their_folder: Path) -> None:
    """This user's own socket, but the way to it is theirs: they could swap it for theirs at any time
    between the check and the connection. Before: it passed."""
    (home / "run").mkdir(0o700)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server:
        server.bind(str(home / "run" / "s.sock"))
        server.listen()
        run_as_second_user("ln", "-s", str(home), str(their_folder / "link"))
        address = f"unix:{their_folder}/link/run/s.sock"
        with pytest.raises(PermissionDenied, match=rf"to {address}: {their_folder}, above .*belongs to uid"):
            check_unix_peer(address)


def test_a_socket_whose_folder_others_may_still_make_is_refused() -> None:
    """Nothing at /tmp/NAME yet, so the call that follows would fail: unless another user makes the
    folder and a socket in it meanwhile, since /tmp is open to all. Before: it passed."""
    address = f"unix:/tmp/ps-missing-{os.urandom(6).hex()}/s.sock"
    with pytest.raises(PermissionDenied, match=r"is missing, and others may make it in /tmp \(mode 1777\)"):
        check_unix_peer(address)


def test_a_file_that_is_not_a_socket_is_refused(home: Path) -> None:
    (home / "s.sock").write_text("")
    with pytest.raises(PermissionDenied, match="it is not a socket"):
        check_unix_peer(f"unix:{home}/s.sock")


LISTEN = (
    "import socket, sys, time; s = socket.socket(socket.AF_UNIX); s.bind(sys.argv[1]); s.listen(); "
    "time.sleep(60)"
)


def test_a_socket_another_user_listens_on_is_refused(home: Path) -> None:
    """Their socket, moved into our folder and given to us: SO_PEERCRED still names its listener."""
    python = python_as_second_user()  # skips without root or setpriv
    theirs = Path(run_as_second_user("mktemp", "-d", "/tmp/ps-other-XXXXXX").stdout.strip())
    proc = subprocess.Popen([*python, "-c", LISTEN, f"{theirs}/s"])
    try:
        wait_until(lambda: (theirs / "s").exists() or proc.poll() is not None, 30, "their socket")
        os.rename(theirs / "s", home / "s.sock")
        os.chown(home / "s.sock", 0, 0, follow_symlinks=False)
        with pytest.raises(
            PermissionDenied, match=r"the process listening there \(pid \d+\) runs as uid 65534"
        ):
            check_unix_peer(f"unix:{home}/s.sock")
    finally:
        proc.kill()
        proc.wait()
        shutil.rmtree(theirs, ignore_errors=True)


def refusal(capsys: pytest.CaptureFixture[str], secret: str | None, address: str) -> str:
    with pytest.raises(SystemExit) as caught:
        check_serving_address("pagedserve daemon", secret, address)
    assert caught.value.code == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("pagedserve daemon: error: --address ")
    return line


def test_without_a_secret_only_a_private_unix_socket(home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert "no shared secret: set $PAGEDSERVE_SECRET" in refusal(capsys, None, "127.0.0.1:50052")
    assert "no shared secret" in refusal(capsys, None, "unix-abstract:pagedserve")
    check_serving_address("pagedserve daemon", "s3cret", "0.0.0.0:50052")  # compose: a secret, TCP
    check_serving_address("pagedserve daemon", None, f"unix:{home}/run/d.sock")
    assert mode(home / "run") == 0o700
    (home / "open").mkdir(0o755)
    (home / "open").chmod(0o755)
    assert "mode 755" in refusal(capsys, None, f"unix:{home}/open/d.sock")
    check_serving_address("pagedserve daemon", "s3cret", f"unix:{home}/open/d.sock")  # no one can swap it
    (home / "open").chmod(0o777)
    assert "is writable by others" in refusal(capsys, "s3cret", f"unix:{home}/open/d.sock")


def test_a_daemon_refuses_tcp_without_a_secret_before_anything_else(home: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "PAGEDSERVE_SECRET"}
    command = [sys.executable, "-m", "memory_daemon", "--shm-dir", str(home)]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.splitlines()[-1].startswith(
        "pagedserve daemon: error: --address 127.0.0.1:50052 is open"
    )
