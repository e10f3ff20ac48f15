"""The worker's configuration: one frozen dataclass, checked on construction."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal

import torch

from services.common.metrics import METRICS_HOST, check_metrics_port
from services.worker.engine import EngineConfig

_DEVICE = re.compile(r"^(cpu|cuda(:\d+)?)$")


@dataclass(frozen=True)
class WorkerConfig:
    model: str | None = None  # a Hugging Face folder; None means the default model
    model_id: str | None = None  # the prefix cache's name for the model; derived from the folder when None
    name: str = "worker"
    address: str = "127.0.0.1:50053"
    daemon: str | None = "127.0.0.1:50052"  # None runs an in-process pool instead of the daemon's
    device: str = "cpu"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    kv_memory_bytes: int = 2**30  # the pool's size, when this worker creates it
    page_size: int = 16
    threads: int = 0  # torch threads; 0 keeps torch's default
    kernels: Literal["auto", "torch", "cupy"] = "auto"  # auto: the CuPy kernels on CUDA, torch on the CPU
    cuda_graphs: bool = True  # capture decode steps as CUDA graphs (CUDA only)
    engine: EngineConfig = field(default_factory=EngineConfig)
    secret: str | None = field(default=None, repr=False)  # the stack's shared secret (services.common.auth)
    metrics_port: int = 0  # Prometheus /metrics on metrics_host:PORT; 0 serves none
    metrics_host: str = METRICS_HOST

    def __post_init__(self) -> None:
        if not _DEVICE.match(self.device):
            raise ValueError(f"device must be cpu, cuda or cuda:N, got {self.device!r}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        if self.page_size not in (8, 16, 32):
            raise ValueError(f"page_size must be 8, 16 or 32, got {self.page_size}")
        if self.kernels == "cupy" and self.device == "cpu":
            raise ValueError("the CuPy kernels need --device cuda")
        check_metrics_port(self.metrics_port)

    @property
    def kernel_backend(self) -> Literal["torch", "cupy"]:
        if self.kernels == "auto":
            return "torch" if self.device == "cpu" else "cupy"
        return self.kernels

    @property
    def torch_dtype(self) -> torch.dtype:
        """fp32 on the CPU and bf16 on CUDA, unless told otherwise."""
        if self.dtype == "auto":
            return torch.float32 if self.device == "cpu" else torch.bfloat16
        return getattr(torch, self.dtype)
