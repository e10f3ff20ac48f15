"""The committed stubs equal what grpcio-tools generates from protos/, and the public names hold."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from pagedserve.v1 import generation_pb2
from tests.procs import REPO

sys.path.insert(0, str(REPO / "scripts"))
from gen_protos import generated_files


def test_committed_stubs_are_fresh(tmp_path: Path) -> None:
    subprocess.run(
        [sys.executable, str(REPO / "scripts" / "gen_protos.py"), "--out", str(tmp_path)], check=True
    )
    fresh = generated_files(tmp_path)
    assert fresh, "the generator wrote nothing"
    assert generated_files(REPO) == fresh, "stub files differ; run python scripts/gen_protos.py"
    stale = [str(p) for p in fresh if (tmp_path / p).read_bytes() != (REPO / p).read_bytes()]
    assert not stale, f"stale stubs {stale}; run python scripts/gen_protos.py and commit the result"


def test_the_public_contract_keeps_its_names() -> None:
    service = generation_pb2.DESCRIPTOR.services_by_name["Generation"]
    assert service.full_name == "pagedserve.v1.Generation"
    methods = {m.name: (m.input_type.name, m.output_type.name, m.server_streaming) for m in service.methods}
    assert methods == {
        "Generate": ("GenerateRequest", "GenerateResponse", True),
        "Complete": ("GenerateRequest", "GenerateResponse", False),
        "Tokenize": ("TokenizeRequest", "TokenizeResponse", False),
        "GetModelInfo": ("GetModelInfoRequest", "ModelInfo", False),
    }
    fields = {
        name: set(message.fields_by_name)
        for name, message in generation_pb2.DESCRIPTOR.message_types_by_name.items()
    }
    assert {"request_id", "prompt", "prompt_token_ids", "messages", "sampling", "priority"} <= fields[
        "GenerateRequest"
    ]
    assert {
        "max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
        "frequency_penalty", "seed", "stop", "stop_token_ids", "ignore_eos", "logprobs",
    } <= fields["SamplingParams"]  # fmt: skip
    assert {"request_id", "text", "token_ids", "logprobs", "finish_reason", "usage"} <= fields[
        "GenerateResponse"
    ]
    assert {"prompt_tokens", "completion_tokens", "cached_prompt_tokens"} <= fields["Usage"]
    assert {"role", "content"} <= fields["ChatMessage"]
    reasons = generation_pb2.GenerateResponse.FinishReason
    assert {reasons.Name(v) for v in (1, 2, 3)} == {"STOP", "LENGTH", "ABORT"}
