"""Fixtures the unit tests share: the SmolLM2 tokenizer (as transformers loads it, for the TextStream tests,
and as the frontend loads it, under the request builder), a small page ledger, and the Kubernetes overlays
rendered."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer
from transformers import AutoTokenizer, PreTrainedTokenizerBase
from transformers.tokenization_utils_tokenizers import PreTrainedTokenizerFast

from memory_daemon.ledger import PageLedger
from services.common.default_model import default_model_dir
from services.frontend.validation import RequestBuilder
from tests.unit.k8s_rendering import Rendered, render
from tests.unit.validating import DEFAULT_MAX_TOKENS


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(default_model_dir())


@pytest.fixture(scope="module")
def backend(tokenizer: PreTrainedTokenizerBase) -> Tokenizer:
    return tokenizer.backend_tokenizer


@pytest.fixture(scope="module")
def frontend_tokenizer() -> PreTrainedTokenizerBase:
    return PreTrainedTokenizerFast.from_pretrained(default_model_dir())  # as the frontend loads it


@pytest.fixture(scope="module")
def builder(frontend_tokenizer: PreTrainedTokenizerBase) -> RequestBuilder:
    return RequestBuilder(frontend_tokenizer, default_max_tokens=DEFAULT_MAX_TOKENS)


@pytest.fixture
def ledger() -> PageLedger:
    return PageLedger(9)  # the null page and pages 1..8


@pytest.fixture(scope="module", params=["gpu", "cpu"])
def rendered(request: pytest.FixtureRequest) -> Rendered:
    """deploy/k8s through each overlay, as `kubectl kustomize` renders it."""
    return render(request.param)
