"""What a worker maps of the path a daemon names (memory_daemon.export.map_pool): only a pool file under its
--shm-dir that this user made for it, of exactly the pool's size, never resized."""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from memory_daemon import export
from memory_daemon.export import PoolDescriptor, ShmHandle, ShmStorage, map_pool, remove_stale_files
from memory_daemon.shape import PoolShape
from pagedserve.plumbing.errors import PermissionDenied

SHAPE = PoolShape(num_layers=2, num_kv_heads=1, head_dim=4, dtype="float32", page_size=2)
PAGES = 3
NBYTES = PAGES * SHAPE.page_bytes
TOKEN = "0123456789abcdef" * 2


def pool_name(pid: int, pool_id: int, token: str = TOKEN) -> str:
    return f"pagedserve-kv-{pid}-{pool_id}-{token}.bin"


@pytest.fixture
def shm() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="pagedserve-test-", dir="/dev/shm"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def pool(shm: Path) -> Iterator[ShmStorage]:
    storage = ShmStorage(shm, 1, NBYTES)
    yield storage
    storage.close()


def descriptor(path: Path | str, pages: int = PAGES, nbytes: int = NBYTES) -> PoolDescriptor:
    return PoolDescriptor(1, SHAPE, pages, nbytes, ShmHandle(str(path)))


def refused(path: Path | str, *, shm_dir: Path | str = "/dev/shm", **sizes: int) -> str:
    with pytest.raises(PermissionDenied) as caught:
        map_pool(descriptor(path, **sizes), shm_dir)
    return caught.value.message


def test_the_daemons_pool_file_maps_zero_copy(pool: ShmStorage, shm: Path) -> None:
    kv = map_pool(descriptor(pool.path), shm)
    again = map_pool(descriptor(pool.path))  # under /dev/shm, the default --shm-dir
    assert kv.shape == SHAPE.tensor_shape(PAGES) and kv.dtype == torch.float32
    kv[:, :, 2] = 7.0
    assert torch.equal(again[:, :, 2], torch.full_like(again[:, :, 2], 7.0))
    assert os.path.getsize(pool.path) == NBYTES


def test_a_path_outside_the_shm_folder_or_not_named_as_a_pool_is_refused(pool: ShmStorage, shm: Path) -> None:
    assert "it is not under /tmp (--shm-dir)" in refused(pool.path, shm_dir="/tmp")
    assert "it is not under /dev/shm" in refused(f"/etc/{pool_name(1, 1)}")
    assert "it is not under /dev/shm" in refused(f"/dev/shm/../etc/{pool_name(1, 1)}")
    assert "it is not under /dev/shm" in refused(pool_name(1, 1))  # relative
    for other in (shm / "precious.bin", shm / "pagedserve-kv-1-1.bin"):  # the old, guessable name
        other.write_bytes(b"\0" * NBYTES)
        assert "a pool file's name is pagedserve-kv-PID-ID-TOKEN.bin" in refused(other)


def test_a_symlink_a_link_or_a_folder_is_refused(pool: ShmStorage, shm: Path) -> None:
    link = shm / pool_name(1, 2)
    link.symlink_to(pool.path)
    assert "Too many levels of symbolic links" in refused(link)
    link.unlink()
    os.link(pool.path, link)
    assert "it has 2 names (hard links)" in refused(link)
    link.unlink()
    link.mkdir()
    assert "Is a directory" in refused(link) or "not a regular file" in refused(link)


def test_a_file_of_the_wrong_mode_or_size_is_refused_and_never_resized(pool: ShmStorage) -> None:
    os.chmod(pool.path, 0o644)
    assert "its mode is 644, not 600" in refused(pool.path)
    os.chmod(pool.path, 0o600)
    bigger = (PAGES + 1) * SHAPE.page_bytes
    assert f"it holds {NBYTES} bytes, not the pool's {bigger}" in refused(
        pool.path, pages=PAGES + 1, nbytes=bigger
    )
    assert os.path.getsize(pool.path) == NBYTES  # not grown
    assert f"are not {NBYTES + 1} bytes" in refused(pool.path, nbytes=NBYTES + 1)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a file to another user")
def test_a_file_of_another_user_is_refused(pool: ShmStorage) -> None:
    os.chown(pool.path, 65534, 65534)
    assert "it belongs to uid 65534; the daemon and its workers run as one user" in refused(pool.path)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a file to another user")
def test_a_daemon_removes_only_its_own_users_stale_files(shm: Path) -> None:
    mine, theirs = shm / pool_name(999999999, 1), shm / pool_name(999999999, 2)
    older = shm / "pagedserve-kv-999999999-4.bin"  # named as daemons before the token named them
    alive = shm / pool_name(os.getpid(), 5)
    for path in (mine, theirs, older, alive):
        path.write_bytes(b"")
    os.chown(theirs, 65534, 65534)
    (shm / pool_name(999999999, 3)).symlink_to(theirs)
    assert sorted(remove_stale_files(shm)) == sorted([mine, older])
    assert theirs.exists() and alive.exists()


def test_a_file_planted_under_a_guessable_name_is_left_alone(shm: Path) -> None:
    """Before: the daemon's pid and the pool's number were the whole name, and creating the pool failed
    with FileExistsError where a file of that name was planted first."""
    planted = shm / f"pagedserve-kv-{os.getpid()}-1.bin"
    planted.write_bytes(b"planted")
    storage = ShmStorage(shm, 1, NBYTES)
    try:
        assert re.fullmatch(rf"pagedserve-kv-{os.getpid()}-1-[0-9a-f]{{32}}\.bin", storage.path.name)
        assert os.path.getsize(storage.path) == NBYTES and planted.read_bytes() == b"planted"
    finally:
        storage.close()
    assert os.listdir(shm) == [planted.name]


def draws(monkeypatch: pytest.MonkeyPatch, *tokens: str) -> list[int]:
    """The pool's tokens come from tokens, the last one over and over; returns the sizes asked for."""
    asked: list[int] = []

    def token_hex(nbytes: int) -> str:
        asked.append(nbytes)
        return tokens[min(len(asked), len(tokens)) - 1]

    monkeypatch.setattr(export, "secrets", SimpleNamespace(token_hex=token_hex))
    return asked


def test_a_taken_name_is_retried_with_a_fresh_token(shm: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    taken = shm / pool_name(os.getpid(), 1)
    taken.write_bytes(b"taken")
    asked = draws(monkeypatch, TOKEN, TOKEN, "f" * 32)
    storage = ShmStorage(shm, 1, NBYTES)
    storage.close()
    assert storage.path.name == pool_name(os.getpid(), 1, "f" * 32) and asked == [16, 16, 16]
    assert taken.read_bytes() == b"taken"


def test_names_taken_every_time_give_a_clear_error(shm: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (shm / pool_name(os.getpid(), 1)).write_bytes(b"taken")
    asked = draws(monkeypatch, TOKEN)
    with pytest.raises(PermissionDenied, match=rf"cannot make a pool file in {shm}: .* were all taken"):
        ShmStorage(shm, 1, NBYTES)
    assert len(asked) > 1 and os.listdir(shm) == [pool_name(os.getpid(), 1)]
