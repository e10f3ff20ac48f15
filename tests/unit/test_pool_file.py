"""What a worker maps of the path a daemon names (memory_daemon.export.map_pool): only a pool file under its
--shm-dir that this user made for it, of exactly the pool's size, never resized."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from memory_daemon.export import PoolDescriptor, ShmHandle, ShmStorage, map_pool, remove_stale_files
from memory_daemon.shape import PoolShape
from pagedserve.plumbing.errors import PermissionDenied

SHAPE = PoolShape(num_layers=2, num_kv_heads=1, head_dim=4, dtype="float32", page_size=2)
PAGES = 3
NBYTES = PAGES * SHAPE.page_bytes


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
    assert "it is not under /dev/shm" in refused("/etc/pagedserve-kv-1-1.bin")
    assert "it is not under /dev/shm" in refused("/dev/shm/../etc/pagedserve-kv-1-1.bin")
    assert "it is not under /dev/shm" in refused("pagedserve-kv-1-1.bin")  # relative
    other = shm / "precious.bin"
    other.write_bytes(b"\0" * NBYTES)
    assert "a pool file's name is pagedserve-kv-PID-ID.bin" in refused(other)


def test_a_symlink_a_link_or_a_folder_is_refused(pool: ShmStorage, shm: Path) -> None:
    link = shm / "pagedserve-kv-1-2.bin"
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
    mine, theirs = shm / "pagedserve-kv-999999999-1.bin", shm / "pagedserve-kv-999999999-2.bin"
    mine.write_bytes(b"")
    theirs.write_bytes(b"")
    os.chown(theirs, 65534, 65534)
    (shm / "pagedserve-kv-999999999-3.bin").symlink_to(theirs)
    assert remove_stale_files(shm) == [mine]
    assert theirs.exists()
