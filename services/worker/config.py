"""The worker's configuration: one frozen dataclass, whose fields are also its command-line flags."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from memory_daemon.shape import DType
from pagedserve.kernels.page_size import PageSize
from pagedserve.plumbing.auth import secret_setting
from pagedserve.plumbing.logs import log_level_setting
from pagedserve.plumbing.metrics import MetricsSettings
from pagedserve.plumbing.settings import (
    between,
    check_settings,
    device,
    nested,
    positive,
    setting,
)
from pagedserve.plumbing.sizes import parse_bytes
from services.worker.core.engine_config import EngineConfig
from services.worker.quantization import Quantization


@dataclass(frozen=True)
class WorkerConfig:
    model: str | None = setting(None, "a Hugging Face model folder (default: SmolLM2-135M-Instruct)")
    draft_model: str | None = setting(
        None, "with --speculative draft: the draft model's folder, a smaller model of the same tokenizer"
    )
    model_id: str | None = setting(
        None,
        "the model's name: its cached pages' (give no two models one) and the one clients see (default: the "
        "folder's name and a digest of its config and weights)",
    )
    name: str = setting("worker", "this worker's name in logs and statistics")
    address: str = setting("127.0.0.1:50053", "host:port or unix:/path to serve on")
    kv: Literal["daemon", "local"] = setting(
        "daemon", "lease the KV pool from the daemon, or keep one in this process"
    )
    daemon: str = setting("127.0.0.1:50052", "the memory daemon's address")
    shm_dir: str = setting(
        "/dev/shm", "where CPU pool files live: a worker maps none that the daemon names elsewhere"
    )
    device: str = setting("cpu", "cpu, cuda or cuda:N", check=device)
    dtype: Literal["auto"] | DType = setting(
        "auto",
        "the model's dtype, and the KV pool's unless --kv-cache-dtype: auto is bfloat16 on CUDA, and on the "
        "CPU bfloat16 where it runs in hardware (AMX or AVX512-BF16, each tried at start), else float32",
    )
    kv_cache_dtype: Literal["auto", "float32", "bfloat16"] = setting(
        "auto",
        "the KV pool's dtype: auto is the model's; bfloat16 under a float32 model halves the bytes each "
        "attention reads, and rounds K and V to bfloat16 (CPU only: on CUDA the pool is the model's dtype)",
    )
    quantization: Quantization = setting(
        "none",
        "int8: the linear layers' weights in int8, one scale an output channel, quantized at load (a "
        "checkpoint already in int8 or FP8, in compressed-tensors' format, loads as it is without it)",
    )
    kv_memory_bytes: int = setting(
        2**30,
        "the KV pool's size, if this worker creates it",
        flag="--kv-memory",
        convert=parse_bytes,
        shown_default="1GiB",
    )
    page_size: PageSize = setting(16, "tokens a KV page holds")
    max_model_len: int | None = setting(
        None,
        "the most tokens a sequence holds, prompt and output (default: the model's max_position_embeddings, "
        "which it may not exceed); the rotary table is sized by it",
        check=positive,
    )
    threads: int = setting(0, "torch threads; 0 keeps torch's choice", check=between(0, 1024))
    kernels: Literal["auto", "torch", "cpu", "cupy"] = setting(
        "auto",
        "attention and fused kernels: auto takes CuPy's on CUDA, and on the CPU the C++ decode attention "
        "(torch's where it cannot be built); torch is the reference everywhere",
    )
    cuda_graphs: bool = setting(True, "replay decode steps as CUDA graphs (CUDA only)")
    stall_timeout_s: float = setting(
        5.0,
        "seconds one engine step may take (or three times the slowest recent step, if longer) before the "
        "worker reports NOT_SERVING and frontends route around it",
        flag="--stall-timeout",
        check=positive,
    )
    engine: EngineConfig = nested(EngineConfig)
    metrics: MetricsSettings = nested(MetricsSettings)
    secret: str | None = secret_setting()
    log_level: str = log_level_setting()

    def __post_init__(self) -> None:
        check_settings(self)
        if self.kernels == "cupy" and self.device == "cpu":
            raise ValueError("the CuPy kernels need --device cuda")
        if self.kernels == "cpu" and self.device != "cpu":
            raise ValueError("the C++ CPU kernels need --device cpu")
        cuda_dtype = "bfloat16" if self.dtype == "auto" else self.dtype  # what auto picks there
        if self.device != "cpu" and self.kv_cache_dtype not in ("auto", cuda_dtype):
            raise ValueError(
                f"--kv-cache-dtype {self.kv_cache_dtype} differs from the model's dtype ({cuda_dtype}), "
                "which only the CPU kernels take: on CUDA leave it auto"
            )
        if (self.engine.speculative == "draft") != (self.draft_model is not None):
            raise ValueError("--speculative draft and --draft-model DIR go together")

    @property
    def daemon_address(self) -> str | None:
        """The daemon to lease from; None for an in-process pool."""
        return self.daemon if self.kv == "daemon" else None

    @property
    def kernel_backend(self) -> Literal["torch", "cpu", "cupy"]:
        if self.kernels == "auto":
            return "cpu" if self.device == "cpu" else "cupy"
        return self.kernels
