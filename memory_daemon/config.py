"""The daemon's configuration: one frozen dataclass, whose fields are also its command-line flags."""

from __future__ import annotations

from dataclasses import dataclass

from memory_daemon.refill import RefillSettings
from pagedserve.plumbing.auth import secret_setting
from pagedserve.plumbing.errors import InvalidArgument
from pagedserve.plumbing.logs import log_level_setting
from pagedserve.plumbing.metrics import MetricsSettings
from pagedserve.plumbing.settings import check_settings, device, nested, positive, setting
from pagedserve.plumbing.sizes import parse_bytes


def _fraction(value: float) -> str | None:
    return None if 0.0 <= value < 1.0 else f"is a fraction of the pool in [0, 1), got {value}"


@dataclass(frozen=True)
class DaemonConfig:
    address: str = setting("127.0.0.1:50052", "host:port or unix:/path to serve on")
    device: str = setting("cpu", "where pools live: cpu, cuda or cuda:N", check=device)
    shm_dir: str = setting("/dev/shm", "the folder of CPU pools' files")
    max_memory_bytes: int = setting(
        8 * 2**30,
        "the budget for all pools together, e.g. 8GiB",
        flag="--max-memory",
        convert=parse_bytes,
        check=positive,
        shown_default="8GiB",
    )
    pool_bytes: int = setting(
        2**30,
        "a pool's size when its first worker gives none",
        flag="--pool-memory",
        convert=parse_bytes,
        check=positive,
        shown_default="1GiB",
    )
    kv_disk: str | None = setting(
        None,
        "a folder for the pages the pools evict, read back on a prefix hit and kept across restarts "
        "(a private folder: made 0700 if missing)",
        metavar="DIR",
    )
    kv_disk_bytes: int = setting(
        0,
        "the disk tier's budget, e.g. 20GiB (needed with --kv-disk)",
        flag="--kv-disk-size",
        convert=parse_bytes,
        metavar="SIZE",
    )
    kv_host_bytes: int = setting(
        0,
        "host memory for the pages the pools evict, between the pools and --kv-disk, e.g. 16GiB: pinned on "
        "CUDA, the daemon's own (outside --shm-dir) on a CPU; not kept across restarts",
        flag="--kv-host-memory",
        convert=parse_bytes,
        metavar="SIZE",
    )
    watermark: float = setting(
        0.01, "the fraction of each pool kept free by evicting idle cached pages", check=_fraction
    )
    pin_share: float = setting(
        0.1,
        "the fraction of each pool that pinned pages (cache_ttl_seconds) may hold in all, kept from any one "
        "request's reach since pins are never evicted",
        check=_fraction,
    )
    tenant_pin_share: float = setting(
        0.1,
        "the fraction of each pool that one tenant's pinned pages may hold (at most --pin-share)",
        check=_fraction,
    )
    refill: RefillSettings = nested(RefillSettings)
    shutdown_grace_s: float = 2.0
    metrics: MetricsSettings = nested(MetricsSettings)
    secret: str | None = secret_setting()
    log_level: str = log_level_setting()

    def __post_init__(self) -> None:
        check_settings(self)
        if (self.kv_disk is None) != (self.kv_disk_bytes <= 0):
            raise InvalidArgument("--kv-disk DIR and --kv-disk-size SIZE (above zero) go together")
        if self.tenant_pin_share > self.pin_share:
            raise InvalidArgument(
                f"--tenant-pin-share {self.tenant_pin_share} is more than --pin-share {self.pin_share}, "
                "which bounds all tenants' pins together"
            )

    @property
    def device_kind(self) -> str:
        return self.device.split(":")[0]
