"""The daemon's configuration: one frozen dataclass, checked on construction."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from memory_daemon.refill import RefillSettings
from services.common.metrics import METRICS_HOST, check_metrics_port

_DEVICE = re.compile(r"^(cpu|cuda)(?::(\d+))?$")


@dataclass(frozen=True)
class DaemonConfig:
    address: str = "127.0.0.1:50052"  # "host:port" or "unix:/path"; loopback unless told otherwise
    device: str = "cpu"  # "cpu", "cuda" or "cuda:N"
    shm_dir: str = "/dev/shm"
    max_memory_bytes: int = 8 * 2**30  # all pools together
    pool_bytes: int = 2**30  # a pool's size when its first worker gives none
    watermark: float = 0.01  # fraction of a pool kept free by evicting idle cached pages
    refill: RefillSettings = field(default_factory=RefillSettings)
    shutdown_grace_s: float = 2.0
    secret: str | None = field(default=None, repr=False)  # callers must present it (services.common.auth)
    metrics_port: int = 0  # Prometheus /metrics on metrics_host:PORT; 0 serves none
    metrics_host: str = METRICS_HOST

    def __post_init__(self) -> None:
        if not _DEVICE.match(self.device) or self.device.startswith("cpu:"):
            raise ValueError(f"device must be cpu, cuda or cuda:N, got {self.device!r}")
        if self.max_memory_bytes <= 0 or self.pool_bytes <= 0:
            raise ValueError("memory sizes must be positive")
        if not 0.0 <= self.watermark < 1.0:
            raise ValueError(f"watermark is a fraction of the pool in [0, 1), got {self.watermark}")
        check_metrics_port(self.metrics_port)

    @property
    def device_kind(self) -> str:
        return self.device.split(":")[0]

    @property
    def cuda_index(self) -> int:
        match = _DEVICE.match(self.device)
        assert match is not None
        return int(match.group(2) or 0)
