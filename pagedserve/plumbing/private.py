"""What other users of this machine can reach: private folders and files, and who is behind a unix socket.

The stack's internal services talk over unix sockets, and the file system is what guards them. A socket in
a folder that no other user can write cannot be swapped for theirs, and a socket file of mode 0600 admits
only its owner (and root). So:

- `private_folder` makes or accepts a folder for the stack's sockets and files (`pagedserve up --run-dir`):
  a real folder, not a symlink, owned by this user, with no permission for group or others (0700), at the
  end of a path on which no other user controls a folder or a symlink (`check_ancestors`, which walks the
  path as given, one component at a time, and never resolves it first).
- `HeldFolder` is a private folder kept open, every file in it reached through its descriptor, so that it
  may lie below folders that others can write (a Kubernetes emptyDir's root is 0777): the disk tier's.
- `write_private_file` writes a file there whole (a fresh name, then a rename), never through a symlink.
- `check_socket_folder` is what a server checks before it listens on a unix socket, and
  `restrict_socket` makes the socket file 0600 once it is bound.
- `check_unix_peer` is what a client checks before it sends the stack's secret to a unix socket: it lies in
  a folder no other user can write, belongs to this user or root, and the process listening on it runs as
  this user or root (SO_PEERCRED). TCP carries no such check: there the secret's protection is the
  network's design (loopback on one machine, a private network such as compose's between containers).

Each check raises PermissionDenied with a message that names the path and what is wrong with it.
"""

from __future__ import annotations

import contextlib
import os
import socket
import stat
import struct
import weakref
from pathlib import Path

from pagedserve.plumbing.errors import PermissionDenied

_OTHERS = stat.S_IRWXG | stat.S_IRWXO  # 0o077
_OTHERS_WRITE = stat.S_IWGRP | stat.S_IWOTH  # 0o022
_MAX_SYMLINKS = 40  # on one path, as the kernel allows (ELOOP)


def trusted_uids() -> frozenset[int]:
    """Whose files and processes this process trusts: its own user's, and root's."""
    return frozenset((os.geteuid(), 0))


def unix_socket_path(address: str) -> str | None:
    """The file of a `unix:path` or `unix:///path` address; None for TCP (and abstract sockets)."""
    if address.startswith("unix://"):
        return address[len("unix://") :]
    if address.startswith("unix:"):
        return address[len("unix:") :]
    return None


def check_ancestors(path: Path) -> None:
    """Every folder above path, walked as given, is one that no other user controls.

    Each component is looked at with lstat, never resolved first (os.path.realpath), and refused when
    another user controls it: a folder that belongs to another user (not this one, not root), a folder
    that others can write and that is not sticky (as /tmp is), or a symbolic link that belongs to another
    user. A symlink of this user's or root's is followed and its target walked the same way, 40 at most
    (the kernel's limit). A missing folder passes only where no other user could make it. Once every
    component is this user's or root's, no other user can swap one, so what a later call reaches through
    path is what was checked here.
    """
    absolute = Path(path).absolute()
    _walk(absolute.parent, absolute)


def check_folder(path: Path, *, private: bool) -> None:
    """path is a real folder (not a symlink) of this user's, or root's unless private, that no other user
    can write in, under ancestors that pass `check_ancestors`; with private, of this user's and closed to
    everyone else (0700)."""
    absolute = Path(path).absolute()
    parent, parent_info = _walk(absolute.parent, absolute)
    info = _lstat(parent / absolute.name, parent_info)
    if stat.S_ISLNK(info.st_mode):
        raise PermissionDenied(f"{path} is a symbolic link, not a folder")
    if not stat.S_ISDIR(info.st_mode):
        raise PermissionDenied(f"{path} is not a folder")
    if private:
        _check_private(info, path)
        return
    if info.st_uid not in trusted_uids():
        raise PermissionDenied(f"{path} belongs to uid {info.st_uid}, not to this user (uid {os.geteuid()})")
    if info.st_mode & _OTHERS_WRITE:
        raise PermissionDenied(f"{path} is writable by others (mode {_mode(info)})")


def _check_private(info: os.stat_result, path: str | Path) -> None:
    """info (of a folder) is this user's, 0700."""
    if not stat.S_ISDIR(info.st_mode):
        raise PermissionDenied(f"{path} is not a folder")
    if info.st_uid != os.geteuid():
        raise PermissionDenied(f"{path} belongs to uid {info.st_uid}, not to this user (uid {os.geteuid()})")
    if info.st_mode & _OTHERS:
        raise PermissionDenied(f"{path} is open to others (mode {_mode(info)}); it must be 0700")


def private_folder(path: str | Path) -> Path:
    """The folder at path, made with mode 0700 if it is missing; PermissionDenied if it is not private."""
    folder = Path(path).absolute()
    parent, _ = _walk(folder.parent, folder, make=True)  # checked before anything is made on the way
    with contextlib.suppress(FileExistsError):
        os.mkdir(parent / folder.name, 0o700)
    check_folder(folder, private=True)
    return folder


def write_private_file(path: Path, data: str | bytes, *, dir_fd: int | None = None) -> None:
    """Write path whole or not at all: a fresh file (O_EXCL, O_NOFOLLOW, mode 0600) renamed over it.

    A reader never sees half a file, and a symlink planted at either name is replaced, never followed. A
    crash can leave the fresh file behind, named .NAME.PID.RANDOM.partial. dir_fd: path is a name in the
    folder open there (`HeldFolder`).
    """
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    partial = path.with_name(f".{path.name}.{os.getpid()}.{os.urandom(4).hex()}.partial")
    fd = os.open(partial, flags, 0o600, dir_fd=dir_fd)
    try:
        with os.fdopen(fd, "wb" if isinstance(data, bytes) else "w") as file:
            file.write(data)
        os.replace(partial, path, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(partial, dir_fd=dir_fd)
        raise


class HeldFolder:
    """A folder of this user's, closed to everyone else (0700), made if missing, opened once and held:
    every file in it is reached through its descriptor (`open`, `unlink`, `names`, `write`), never again
    through the path.

    So, unlike `private_folder`, it may lie below folders that others can write, without the sticky bit: a
    Kubernetes emptyDir's root is 0777, and the Pod's user can change neither it nor its owner. Whoever
    swaps or renames the path afterwards changes nothing for this process, and what it opened is checked
    through the descriptor, not the path (a symlink, another user's folder, one open to others are
    refused). Nothing above it needs trusting for that: no other user can write in a folder of this user's
    that is 0700. What such a user can do is take the name away, so that the next start finds no folder
    (and makes a new one) or theirs (and refuses it).
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path).absolute()
        self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        with contextlib.suppress(FileExistsError):
            os.mkdir(self.path, 0o700)
        flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            fd = os.open(self.path, flags)
        except OSError as exc:  # ELOOP: a symlink; ENOTDIR: a file
            raise PermissionDenied(f"{path} cannot be opened as a folder: {exc.strerror}") from None
        try:
            _check_private(os.fstat(fd), path)
        except PermissionDenied:
            os.close(fd)
            raise
        self.fd = fd
        weakref.finalize(self, os.close, fd)

    def open(self, name: str, flags: int) -> int:
        return os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=self.fd)

    def unlink(self, name: str) -> None:
        """Remove name, if it is there; a folder under that name only if it is empty (its contents are not
        ours to delete: it stays, and is refused again where it is found)."""
        try:
            os.unlink(name, dir_fd=self.fd)
        except FileNotFoundError:
            pass
        except IsADirectoryError:
            with contextlib.suppress(OSError):
                os.rmdir(name, dir_fd=self.fd)

    def names(self) -> list[tuple[str, os.stat_result]]:
        """Each entry's name and lstat."""
        with os.scandir(self.fd) as entries:
            return [(entry.name, entry.stat(follow_symlinks=False)) for entry in entries]

    def write(self, name: str, data: bytes) -> None:
        """As `write_private_file`, in this folder."""
        write_private_file(Path(name), data, dir_fd=self.fd)


def check_socket_folder(address: str, *, private: bool) -> None:
    """Before listening on a unix socket: its folder is the user's and no other user can swap the socket.

    private (a server without a secret): the folder, made 0700 if missing, admits no one else at all.
    """
    path = unix_socket_path(address)
    if path is None:
        return
    folder = Path(path).absolute().parent
    if private:
        private_folder(folder)
    else:
        check_folder(folder, private=False)


def restrict_socket(address: str) -> None:
    """Make a bound unix socket's file 0600: only its user (and root) may connect."""
    path = unix_socket_path(address)
    if path is not None:
        os.chmod(path, 0o600)


def check_unix_peer(address: str, timeout_s: float = 2.0) -> None:
    """Before sending the stack's secret to a unix socket: check that no other user can be listening there.

    Nothing to check for TCP. A socket that does not exist, or where nothing listens, passes: the call that
    follows fails, and only this user (or root) could put a socket in such a folder meanwhile. The probe
    here (SO_PEERCRED) and the caller's own connection happen at different times, and both go by the
    path; since every folder and symlink on it is this user's or root's (`check_ancestors`), no other user
    can swap one in between, so both reach the socket checked here.
    """
    path = unix_socket_path(address)
    if path is None:
        return
    why = f"refusing to send the stack's secret to {address}"
    try:
        check_folder(Path(path).absolute().parent, private=False)
        info = os.lstat(path)
    except FileNotFoundError:
        return
    except (PermissionDenied, OSError) as exc:  # OSError: an ancestor this user cannot look into
        raise PermissionDenied(
            f"{why}: {exc}; keep the stack's sockets in a folder only its user can write"
        ) from None
    if not stat.S_ISSOCK(info.st_mode):
        raise PermissionDenied(f"{why}: it is not a socket")
    if info.st_uid not in trusted_uids():
        raise PermissionDenied(f"{why}: the socket belongs to uid {info.st_uid}, not to this user")
    try:
        uid, pid = _listener(path, timeout_s)
    except OSError as exc:
        raise PermissionDenied(f"{why}: cannot tell who listens there: {exc}") from None
    if uid is not None and uid not in trusted_uids():
        raise PermissionDenied(f"{why}: the process listening there (pid {pid}) runs as uid {uid}")


def _walk(folder: Path, shown: Path, *, make: bool = False) -> tuple[Path, os.stat_result]:
    """The real path of the absolute folder and its lstat, once every component on the way passed
    (`check_ancestors`; shown is the path the messages name); make: make missing folders, as mkdir -p."""
    real, info = Path("/"), os.lstat("/")
    _check_walked(real, info, shown)
    todo, links = list(reversed(folder.parts[1:])), 0
    while todo:
        name = todo.pop()
        if name == "..":
            real = real.parent  # real holds no symlink: this is the kernel's ".."
            info = os.lstat(real)
            continue
        here = real / name
        found = _lstat(here, info, make=make)
        if not stat.S_ISLNK(found.st_mode):
            _check_walked(here, found, shown)
            real, info = here, found
            continue
        if found.st_uid not in trusted_uids():
            raise PermissionDenied(
                f"{here}, above {shown}, is a symbolic link that belongs to uid {found.st_uid}"
            )
        links += 1
        if links > _MAX_SYMLINKS:
            raise PermissionDenied(f"{shown}: more than {_MAX_SYMLINKS} symbolic links on the way")
        target = Path(os.readlink(here))
        if target.is_absolute():
            real, info = Path("/"), os.lstat("/")
            target = target.relative_to("/")
        todo.extend(reversed(target.parts))
    return real, info


def _lstat(here: Path, parent: os.stat_result, *, make: bool = False) -> os.stat_result:
    """here's lstat; when it is missing, made first with make, else FileNotFoundError, or PermissionDenied
    where its folder (parent) is open to others: another user could make it theirs after the check."""
    try:
        return os.lstat(here)
    except FileNotFoundError:
        if make:
            with contextlib.suppress(FileExistsError):  # made meanwhile, by whoever: checked as any
                os.mkdir(here)
            return os.lstat(here)
        if parent.st_mode & _OTHERS_WRITE:
            raise PermissionDenied(
                f"{here} is missing, and others may make it in {here.parent} (mode {_mode(parent)})"
            ) from None
        raise


def _check_walked(folder: Path, info: os.stat_result, shown: Path) -> None:
    if not stat.S_ISDIR(info.st_mode):
        raise PermissionDenied(f"{folder}, above {shown}, is not a folder")
    if info.st_uid not in trusted_uids():
        raise PermissionDenied(f"{folder}, above {shown}, belongs to uid {info.st_uid}")
    if info.st_mode & _OTHERS_WRITE and not info.st_mode & stat.S_ISVTX:
        raise PermissionDenied(
            f"{folder}, above {shown}, is writable by others (mode {_mode(info)}) and not sticky"
        )


def _listener(path: str, timeout_s: float) -> tuple[int | None, int | None]:
    """The uid and pid of the process listening on a unix socket (SO_PEERCRED); None when none listens."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(timeout_s)
        try:
            probe.connect(path)
        except (ConnectionRefusedError, FileNotFoundError):
            return None, None
        creds = probe.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, _gid = struct.unpack("3i", creds)
    return uid, pid


def _mode(info: os.stat_result) -> str:
    return f"{stat.S_IMODE(info.st_mode):o}"
