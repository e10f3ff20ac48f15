"""What SMG asks a vLLM worker about itself: the model, the server, its load, and its tokenizer's files.

The model's limits come from the workers, as for pagedserve's own GetModelInfo; the rest is read from the
model folder's config.json and tokenizer files, which the frontend already has for tokenizing.
"""

from __future__ import annotations

import hashlib
import io
import json
import time
import zipfile
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path

from smg_grpc_proto.generated import common_pb2, vllm_engine_pb2
from transformers import PreTrainedTokenizerBase

from services.frontend.router import Router

TOKENIZER_CHUNK_BYTES = 64 * 1024
# The files a gateway needs to tokenize and render chats as the model does; what SMG's own servicers send.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "config.json",
    "generation_config.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.json",
    "chat_template.jinja",
)


class ModelFacts:
    """The model folder, read once at start."""

    def __init__(self, model_dir: Path, model_id: str, tokenizer: PreTrainedTokenizerBase) -> None:
        self.model_dir = model_dir
        self.model_id = model_id
        config = json.loads((model_dir / "config.json").read_text())
        self.model_type = str(config.get("model_type", ""))
        self.architectures = [str(name) for name in config.get("architectures", [])]
        self.bos_token_id = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else -1
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else -1
        self.started = time.time()
        self._tokenizer_zip: tuple[bytes, str] | None = None

    def model_info(self, router: Router) -> vllm_engine_pb2.GetModelInfoResponse:
        info = vllm_engine_pb2.GetModelInfoResponse(
            model_path=str(self.model_dir),
            tokenizer_path=str(self.model_dir),
            served_model_name=self.model_id,
            is_generation=True,
            model_type=self.model_type,
            architectures=self.architectures,
            bos_token_id=self.bos_token_id,
            pad_token_id=self.pad_token_id,
        )
        worker = router.worker_info()
        if worker is not None:
            info.max_context_length = worker.max_model_len
            info.max_req_input_len = worker.max_model_len - 1  # room for one output token
            info.vocab_size = worker.vocab_size
            info.eos_token_ids.extend(worker.eos_token_ids)
        return info

    def server_info(
        self, router: Router, active_requests: int, last_request: float, max_running: int
    ) -> vllm_engine_pb2.GetServerInfoResponse:
        info = vllm_engine_pb2.GetServerInfoResponse(
            active_requests=active_requests,
            last_receive_timestamp=last_request,
            uptime_seconds=time.time() - self.started,
            server_type="vllm-grpc",  # the protocol spoken, which is what SMG checks
            data_parallel_size=1,
            kv_cache_dtype="auto",  # until a worker says otherwise
            max_num_seqs=max_running,
        )
        worker = router.worker_info()
        if worker is not None:
            info.block_size = worker.page_size
            info.model_dtype = f"torch.{worker.dtype}"
            info.kv_cache_dtype = worker.kv_cache_dtype or "auto"  # a worker from before the field
        return info

    def tokenizer_chunks(self) -> Iterator[common_pb2.GetTokenizerChunk]:
        """The tokenizer files as one zip, in chunks; the last carries the zip's SHA-256."""
        if self._tokenizer_zip is None:
            data = _zip_files(self.model_dir, TOKENIZER_FILES)
            self._tokenizer_zip = data, hashlib.sha256(data).hexdigest()
        data, digest = self._tokenizer_zip
        for start in range(0, len(data), TOKENIZER_CHUNK_BYTES):
            end = start + TOKENIZER_CHUNK_BYTES
            yield common_pb2.GetTokenizerChunk(
                data=data[start:end], sha256=digest if end >= len(data) else ""
            )


def loads(router: Router, running: int, waiting: int, max_running: int) -> vllm_engine_pb2.GetLoadsResponse:
    """One data-parallel rank: the frontend's admission counts, and KV use over its workers' pages."""
    in_use = sum(link.load.kv_pages_in_use for link in router.links if link.up)
    total = sum(link.load.kv_pages_total for link in router.links if link.up)
    worker = router.worker_info()
    page_size = worker.page_size if worker is not None else 0
    load = vllm_engine_pb2.SchedulerLoad(
        dp_rank=0,
        num_running_reqs=running,
        num_waiting_reqs=waiting,
        num_total_reqs=running + waiting,
        num_used_tokens=in_use * page_size,
        max_total_num_tokens=total * page_size,
        token_usage=in_use / total if total else 0.0,
        max_running_requests=max_running,
    )
    return vllm_engine_pb2.GetLoadsResponse(
        timestamp=datetime.now(timezone.utc).isoformat(), version="pagedserve", dp_rank_count=1, loads=[load]
    )


def _zip_files(folder: Path, names: tuple[str, ...]) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for name in names:
            if (folder / name).is_file():
                archive.write(folder / name, name)
    return buffer.getvalue()
