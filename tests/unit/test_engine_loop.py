"""The engine thread's own watch: a step that runs far longer than the steps before it counts as stuck."""

from __future__ import annotations

import threading
from pathlib import Path
from unittest import mock

import torch

from kernels import TorchBackend
from memory_daemon.shape import PoolShape
from services.common.sampling import SamplingOptions
from services.worker.core.engine import EngineConfig, EngineCore
from services.worker.core.loop import EngineLoop
from services.worker.kv.local import LocalKVCache
from services.worker.models import CausalLM
from tests.models import make_model
from tests.waiting import wait_until


def test_a_step_stuck_past_the_floor_is_reported_and_clears_when_it_ends(tmp_path: Path) -> None:
    folder = make_model("llama", tmp_path / "model")
    cpu = torch.device("cpu")
    model = CausalLM.from_pretrained(folder, dtype=torch.float32, device=cpu, backend=TorchBackend())
    spec = model.spec
    kv = LocalKVCache(PoolShape(spec.num_layers, spec.num_kv_heads, spec.head_dim, "float32", 16), 64)
    loop = EngineLoop(EngineCore(model, kv, EngineConfig()))
    release = threading.Event()
    real_step = loop.core.step

    def stuck_step() -> list:
        release.wait(30)
        return real_step()

    loop.start()
    try:
        assert loop.stalled(floor_s=0.2) is None  # idle is not stuck
        with mock.patch.object(loop.core, "step", stuck_step):
            loop.submit(
                loop.core.new_sequence("r", [5, 6, 7], SamplingOptions(max_tokens=2, temperature=0.0))
            )
            why = wait_until(lambda: loop.stalled(floor_s=0.2), 10, "the stuck step to be noticed")
            assert why.startswith("the engine has been in one step for")
            release.set()
            wait_until(lambda: loop.stalled(floor_s=0.2) is None, 10, "the step to end")
    finally:
        release.set()
        loop.stop()
