"""The disk tier: pages the pools evict, kept in files under `--kv-disk DIR` up to `--kv-disk-size`.

A file holds one page, whole: a header that names what it is (the model's fingerprint: its id and pool
shape, so that no other model or geometry reads it; the page's chain key, its parent's key and its tokens,
for the prefix index's events) and the payload's CRC-32, then the payload, the page's bytes in the
pool's own layout. The file's name is a digest of fingerprint and key, so a lookup opens one name and a
file renamed from another page's is refused.

Nothing here is trusted because it is on disk. The folder is private to this user (0700), held open and
reached only through its descriptor (`HeldFolder`, so it may lie in a volume whose root others can write); a
file is read only if it is a regular file (never through a symlink) with one link, of this user's, mode
0600, of the size its header says; its header must match its name and its payload its CRC. A file that
fails any check is deleted and counted (`rejected`), never served. At start the folder's files are indexed
from their headers alone (a restarted daemon serves them: warm restarts); payloads are checked when read.

Files are written whole (a fresh name, then a rename), by a thread of the tier's own, so that an eviction
costs the daemon's event loop a copy of the page and no disk write; the tier holds the least recently used
out when a page would take it past its budget. The tier is inclusive: a page promoted back into a pool
keeps its file, so that evicting it again costs nothing.
"""

from __future__ import annotations

import hashlib
import logging
import os
import queue
import stat
import struct
import threading
import time
import zlib
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from memory_daemon.prefix import MAX_KEY_BYTES
from memory_daemon.prefix_events import DISK, Removed, Stored
from pagedserve.plumbing.private import HeldFolder

log = logging.getLogger(__name__)

MAGIC = b"pagedserve-kv-page-2\n"
SUFFIX = ".kvpage"
DIGEST_BYTES = 32
# After MAGIC: fingerprint, the payload's CRC-32 and bytes, key, parent and token counts. A CRC, not a
# cryptographic digest: it finds damage (at 6 GB/s here, against BLAKE2b's 1.1, on every promotion), and the
# folder's and files' ownership checks are what keep other users' files out.
_FIXED = struct.Struct(f"<{DIGEST_BYTES}sIQHHH")
_MAX_TOKENS = 1024  # a page's tokens (PoolShape's page_size limit)
# Pages put and not yet written, at most: past it a demotion is dropped rather than queued.
PENDING_BYTES = 256 * 2**20


def fingerprint(model_id: str, shape: object) -> bytes:
    """What a page on disk must have been made by: the model's id and the pool's geometry (its str)."""
    return hashlib.blake2b(f"{model_id}\0{shape}".encode(), digest_size=DIGEST_BYTES).digest()


class StoredPage(NamedTuple):
    key: bytes
    parent: bytes
    token_ids: tuple[int, ...]
    payload: bytes | memoryview  # a memoryview of pinned host memory, for a CUDA pool's (tiers.py)


class Kept(NamedTuple):
    """A page the tier keeps, as the index's events name it."""

    owner: bytes
    key: bytes
    parent: bytes
    token_ids: tuple[int, ...]


@dataclass(frozen=True)
class TierCounts:
    """A tier's size and traffic since the daemon started (the disk's, or host memory's): pages and bytes
    kept, pages written (demotions) and installed back in a pool (promotions), the bytes written and read (a
    read whose page the pool had by then included) and the seconds reads (or copies) took, and files
    refused."""

    capacity_bytes: int = 0
    pages: int = 0
    bytes: int = 0
    demotions: int = 0
    promotions: int = 0
    bytes_written: int = 0
    bytes_read: int = 0
    promote_seconds: float = 0.0
    dropped: int = 0  # held out for room
    rejected: int = 0  # truncated, corrupt, foreign or planted files, deleted unread


class DiskTier:
    """Thread-safe: the daemon's event loop puts and looks up, a writer thread writes (`background`), and
    promotions read files on threads of their own (`read_page`). A page put is served from memory until
    its file is written; a page removed meanwhile is never left on disk."""

    def __init__(self, folder: str | Path, capacity_bytes: int, *, background: bool = True) -> None:
        self.folder = HeldFolder(folder)
        self.capacity_bytes = capacity_bytes
        self._lock = threading.Lock()
        self._size_of: OrderedDict[str, int] = OrderedDict()  # file name -> bytes, least recently used first
        self._bytes = 0
        self._pending: dict[str, tuple[bytes, StoredPage]] = {}  # put, not yet written: name -> (owner, page)
        self._pending_bytes = 0
        self._identity: dict[str, Kept] = {}  # file name -> whose page it is, for events
        # owner -> its pages stored and let go since its last `take_changes`, kept only for owners that ask
        self._changes: dict[bytes, list[Stored | Removed]] = {}
        self._counts = dict.fromkeys(
            ("demotions", "promotions", "bytes_written", "bytes_read", "dropped", "rejected"), 0
        )
        self._promote_seconds = 0.0
        self._index_folder()
        self._queue: queue.SimpleQueue[str | None] = queue.SimpleQueue()
        self._writer = None
        if background:
            self._writer = threading.Thread(target=self._write_loop, name="kv-disk-writer", daemon=True)
            self._writer.start()

    def close(self) -> None:
        """Write what is still pending (a SIGTERM's restart finds it), then stop the writer: a put after
        this writes its file before it returns."""
        if self._writer is not None:
            self._queue.put(None)
            self._writer.join()
            self._writer = None

    def counts(self) -> TierCounts:
        with self._lock:
            return TierCounts(
                capacity_bytes=self.capacity_bytes,
                pages=len(self._size_of),
                bytes=self._bytes,
                promote_seconds=self._promote_seconds,
                **self._counts,
            )

    def has(self, owner: bytes, key: bytes) -> bool:
        with self._lock:
            return file_name(owner, key) in self._size_of

    def put(self, owner: bytes, page: StoredPage) -> bool:
        """Keep page for owner (a fingerprint); False if it is there already, cannot fit the budget, or
        more than PENDING_BYTES wait to be written (then it is counted as dropped)."""
        name, size = file_name(owner, page.key), _encoded_size(page)
        with self._lock:
            if name in self._size_of:
                self._size_of.move_to_end(name)
                return False
            if size > self.capacity_bytes:
                return False
            if self._pending_bytes + size > PENDING_BYTES:  # the disk is behind: keep up, not queue up
                self._counts["dropped"] += 1
                return False
            while self._bytes + size > self.capacity_bytes:
                self._remove(next(iter(self._size_of)))
                self._counts["dropped"] += 1
            self._size_of[name] = size
            self._bytes += size
            self._identity[name] = Kept(owner, page.key, page.parent, page.token_ids)
            if owner in self._changes:
                self._changes[owner].append(Stored(page.key, page.parent, page.token_ids, DISK))
            self._pending[name] = (owner, page)
            self._pending_bytes += size
        if self._writer is None:
            self._write(name)
        else:
            self._queue.put(name)
        return True

    def get(self, owner: bytes, key: bytes) -> StoredPage | None:
        """The page owner keeps under key, checked whole; None if it is not here or fails a check (then it
        is deleted and counted)."""
        found = self.locate(owner, key)
        if found is None or isinstance(found, StoredPage):
            return found
        return self.settle(read_page(self.folder, found, owner, key))

    def locate(self, owner: bytes, key: bytes) -> Located | StoredPage | None:
        """Where owner's page under key is, for `read_page` on any thread, then `settle`; or the page
        itself while it waits to be written."""
        name = file_name(owner, key)
        with self._lock:
            if name in self._pending:
                return self._pending[name][1]
            return Located(name, self._size_of[name]) if name in self._size_of else None

    def settle(self, read: Read) -> StoredPage | None:
        """Account for a read_page: a file refused (deleted and counted), one gone since, or a page read."""
        with self._lock:
            if read.page is None:
                if read.problem is not None:
                    self._reject(read.name, read.problem)
                elif read.name in self._size_of and read.name not in self._pending:
                    self._bytes -= self._size_of.pop(read.name)
                    self._forget_identity(read.name)
                return None
            if read.name in self._size_of:
                self._size_of.move_to_end(read.name)
            self._counts["bytes_read"] += read.nbytes
            self._promote_seconds += read.seconds
            return read.page

    def promoted(self) -> None:
        """Count a page read from here and installed in a pool (a read may find the pool has it by then)."""
        with self._lock:
            self._counts["promotions"] += 1

    def discard(self, owner: bytes, key: bytes) -> None:
        name = file_name(owner, key)
        with self._lock:
            if name in self._size_of:
                self._remove(name)

    def kept(self, owner: bytes) -> list[Kept]:
        """Every page owner keeps here, least recently used first."""
        with self._lock:
            return [kept for name in self._size_of if (kept := self._identity[name]).owner == owner]

    def take_changes(self, owner: bytes) -> list[Stored | Removed]:
        """owner's pages stored here and let go (for room, refused, discarded) since the last call."""
        with self._lock:
            taken = self._changes.get(owner, [])
            self._changes[owner] = []
            return taken

    def discard_owner(self, owner: bytes) -> int:
        """Delete every page of owner's; returns how many."""
        with self._lock:
            names = [name for name in self._size_of if self._identity[name].owner == owner]
            for name in names:
                self._remove(name)
            return len(names)

    # Internals (those that touch the books run under the lock) -------------------------------------

    def _write_loop(self) -> None:
        while (name := self._queue.get()) is not None:
            try:
                self._write(name)
            except OSError as exc:  # a full disk, say: the page is dropped, the daemon goes on
                log.warning("disk tier: could not write %s: %s", self.folder.path / name, exc)
                with self._lock:
                    if self._pending.pop(name, None) is not None:
                        self._pending_bytes -= self._size_of.get(name, 0)
                        self._bytes -= self._size_of.pop(name, 0)
                        self._forget_identity(name)
                        self._counts["dropped"] += 1

    def _write(self, name: str) -> None:
        with self._lock:
            item = self._pending.get(name)
        if item is None:  # removed before its turn
            return
        data = _encode(*item)
        self.folder.write(name, data)
        with self._lock:
            if self._pending.pop(name, None) is None:  # removed while it was written: so is its file
                self.folder.unlink(name)
                return
            self._pending_bytes -= len(data)
            self._counts["demotions"] += 1
            self._counts["bytes_written"] += len(data)

    def _index_folder(self) -> None:
        """Index the files a daemon before this one left, oldest first, from their headers."""
        found = []
        for name, info in self.folder.names():
            if name.endswith(".partial"):  # a write that a crash cut short
                self.folder.unlink(name)
            elif name.endswith(SUFFIX):
                found.append((info.st_mtime_ns, name, info.st_size))
        for _, name, size in sorted(found):
            header = self._header(name, size)
            if header is None:
                continue
            fields = _fields(header)
            if fields is None or file_name(fields[0], fields[3]) != name:
                self._reject(name, "it is not a page file this daemon wrote")
                continue
            owner, _, _, key, parent, token_ids, _ = fields
            self._identity[name] = Kept(owner, key, parent, token_ids)
            self._size_of[name] = size
            self._bytes += size
        while self._bytes > self.capacity_bytes:  # the budget may have shrunk since
            self._remove(next(iter(self._size_of)))
        if self._size_of:
            log.info(
                "disk tier %s: %d pages from before (%d bytes)",
                self.folder.path,
                len(self._size_of),
                self._bytes,
            )

    def _header(self, name: str, size: int) -> bytes | None:
        """The file's first bytes, a header's worth; None if it fails the file checks (then it is deleted
        and counted)."""
        data = _read_file(self.folder, name, size, _header_limit())
        if isinstance(data, str):
            self._reject(name, data)
            return None
        return data

    def _reject(self, name: str, why: str) -> None:
        log.warning("disk tier: deleting %s unread: %s", self.folder.path / name, why)
        self._counts["rejected"] += 1
        if name in self._size_of:
            self._bytes -= self._size_of.pop(name)
        self._forget_identity(name)
        self.folder.unlink(name)

    def _remove(self, name: str) -> None:
        size = self._size_of.pop(name)
        self._bytes -= size
        self._forget_identity(name)
        if self._pending.pop(name, None) is not None:
            self._pending_bytes -= size  # the writer finds it gone, and writes nothing
        self.folder.unlink(name)

    def _forget_identity(self, name: str) -> None:
        identity = self._identity.pop(name, None)
        if identity is not None and identity.owner in self._changes:
            self._changes[identity.owner].append(Removed(identity.key, DISK))


class Located(NamedTuple):
    name: str
    size: int


class Read(NamedTuple):
    """What read_page found: the page, or why the file was refused, or neither (it is gone)."""

    name: str
    page: StoredPage | None
    problem: str | None = None
    nbytes: int = 0
    seconds: float = 0.0


def read_page(folder: HeldFolder, found: Located, owner: bytes, key: bytes) -> Read:
    """Read and check one page file; it touches no tier's state, so it runs on any thread (promotions read
    off the daemon's event loop), and its result goes to the tier's `settle`."""
    started = time.perf_counter()
    data = _read_file(folder, found.name, found.size, found.size)
    if data is None:
        return Read(found.name, None)
    if isinstance(data, str):
        return Read(found.name, None, data)
    page = _decode(data, owner, key)
    if page is None:
        return Read(found.name, None, "its contents do not match its name, or its payload its CRC")
    return Read(found.name, page, None, len(data), time.perf_counter() - started)


def _read_file(folder: HeldFolder, name: str, size: int, limit: int) -> bytes | str | None:
    """Up to limit bytes of the file if it passes the file checks (size: what the tier indexed), else why
    not; None if it is gone."""
    try:
        fd = folder.open(name, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError as exc:  # a symlink (ELOOP), a fifo...
        return f"it cannot be opened as a plain file ({exc.strerror})"
    try:  # checked before it is read as a file: a folder under a page's name is no file to read
        problem = _file_problem(os.fstat(fd), size)
        if problem is not None:
            return problem
        with os.fdopen(fd, "rb", closefd=False) as file:
            return file.read(limit)
    finally:
        os.close(fd)


def _file_problem(info: os.stat_result, size: int) -> str | None:
    if not stat.S_ISREG(info.st_mode):
        return "it is not a regular file"
    if info.st_uid != os.geteuid():
        return f"it belongs to uid {info.st_uid}, not to this user (uid {os.geteuid()})"
    if info.st_mode & 0o077:
        return f"it is open to others (mode {stat.S_IMODE(info.st_mode):04o}); it must be 0600"
    if info.st_nlink != 1:
        return f"it has {info.st_nlink} links, not one"
    if info.st_size != size:
        return f"it holds {info.st_size} bytes, not the {size} indexed"
    return None


def file_name(owner: bytes, key: bytes) -> str:
    """The name of the file that holds owner's page under key."""
    return hashlib.blake2b(owner + key, digest_size=20).hexdigest() + SUFFIX


def _encoded_size(page: StoredPage) -> int:
    return (
        len(MAGIC)
        + _FIXED.size
        + len(page.key)
        + len(page.parent)
        + 4 * len(page.token_ids)
        + len(page.payload)
    )


def _encode(owner: bytes, page: StoredPage) -> bytes:
    digest = zlib.crc32(page.payload)
    fixed = _FIXED.pack(
        owner, digest, len(page.payload), len(page.key), len(page.parent), len(page.token_ids)
    )
    tokens = struct.pack(f"<{len(page.token_ids)}I", *page.token_ids)
    return b"".join((MAGIC, fixed, page.key, page.parent, tokens, page.payload))


def _header_limit() -> int:
    return len(MAGIC) + _FIXED.size + 2 * MAX_KEY_BYTES + 4 * _MAX_TOKENS


def _fields(data: bytes) -> tuple[bytes, int, int, bytes, bytes, tuple[int, ...], int] | None:
    """(fingerprint, payload CRC, payload size, key, parent, tokens, where the payload starts)."""
    if not data.startswith(MAGIC) or len(data) < len(MAGIC) + _FIXED.size:
        return None
    owner, digest, size, key_len, parent_len, tokens = _FIXED.unpack_from(data, len(MAGIC))
    if key_len > MAX_KEY_BYTES or parent_len > MAX_KEY_BYTES or tokens > _MAX_TOKENS:
        return None
    at = len(MAGIC) + _FIXED.size
    key, parent = data[at : at + key_len], data[at + key_len : at + key_len + parent_len]
    at += key_len + parent_len
    if len(data) < at + 4 * tokens:
        return None
    token_ids = struct.unpack_from(f"<{tokens}I", data, at)
    return owner, digest, size, key, parent, token_ids, at + 4 * tokens


def _decode(data: bytes, owner: bytes, key: bytes) -> StoredPage | None:
    fields = _fields(data)
    if fields is None:
        return None
    found_owner, digest, size, found_key, parent, token_ids, start = fields
    payload = data[start:]
    if (found_owner, found_key) != (owner, key) or len(payload) != size:
        return None
    if zlib.crc32(payload) != digest:
        return None
    return StoredPage(found_key, parent, token_ids, payload)
