"""The text of a reply is the tokenizer's decode of its own token ids, even when the output ends inside a
character, through a real `pagedserve up` stack over gRPC.

The model is built so that its greedy output is known: every layer's weights are zero, so the residual stream
is the current token's embedding, a one-hot vector, and lm_head maps it to the next token with a margin
(no ties for the sampler to break). Its tokenizer is byte-level with the bytes of 世 (E4 B8 96) as tokens 0, 1
and 2, so an ASCII prompt makes the model cycle through them: 世 comes out one byte at a time and max_tokens
can cut it anywhere. After '!' it repeats the lone lead byte F0, which never completes a character.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from pagedserve.v1 import generation_pb2 as pb
from pagedserve.v1 import generation_pb2_grpc
from services.client import generate_request
from tests.models import CHAT_TEMPLATE
from tests.procs import Stack, start_stack

Reason = pb.GenerateResponse.FinishReason
REPLACEMENT = "\ufffd"

# The characters that stand for the bytes of 世 and for the lead byte F0 in tokenizers' ByteLevel alphabet.
E4, B8, X96, F0 = "\u00e4", "\u00b8", "\u0138", "\u00f0"
CYCLE = [0, 1, 2]  # E4 B8 96: 世
LEAD = 3  # F0
BANG = 4  # '!'
NEXT = {0: 1, 1: 2, 2: 0, LEAD: LEAD, BANG: LEAD}  # greedy next token; every other token is followed by 0


def make_byte_model(folder: Path) -> Path:
    """A llama model and byte-level tokenizer whose greedy outputs end inside characters (see above)."""
    chars = [E4, B8, X96, F0, "!", *(chr(c) for c in range(ord('"'), ord("~") + 1)), "Ġ"]  # Ġ: a space
    tokenizer = Tokenizer(models.BPE(vocab={char: i for i, char in enumerate(chars)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(["<pad>", "<s>", "</s>"])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(folder)
    vocab = len(fast)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        pad_token_id=fast.pad_token_id,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        tie_word_embeddings=False,
    )
    model = AutoModelForCausalLM.from_config(config)
    other = config.hidden_size - 1  # the embedding dimension of every token not in NEXT
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.fill_(1.0 if name.endswith("norm.weight") else 0.0)
        for token in range(vocab):
            dim = token if token in NEXT else other
            model.model.embed_tokens.weight[token, dim] = 1.0
            model.lm_head.weight[NEXT.get(token, 0), dim] = 1.0
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def model_dir() -> Iterator[Path]:
    folder = Path(tempfile.mkdtemp(prefix="ps-model-"))
    yield make_byte_model(folder)
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> PreTrainedTokenizerBase:
    return PreTrainedTokenizerFast.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def stack(model_dir: Path) -> Iterator[Stack]:
    run_dir = Path(tempfile.mkdtemp(prefix="ps-"))
    running = start_stack(run_dir, "--model", str(model_dir), "--kv-memory", "64MiB")
    yield running
    assert running.stop() == 0, running.log()
    assert not running.survivors(), "pagedserve up left processes behind"
    shutil.rmtree(run_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def stub(stack: Stack) -> Iterator[generation_pb2_grpc.GenerationStub]:
    with grpc.insecure_channel(stack.address) as channel:
        yield generation_pb2_grpc.GenerationStub(channel)


def greedy(prompt: list[int], n: int) -> list[int]:
    out = [NEXT.get(prompt[-1], 0)]
    while len(out) < n:
        out.append(NEXT[out[-1]])
    return out


def test_the_model_and_tokenizer_do_what_the_tests_need(
    model_dir: Path, tokenizer: PreTrainedTokenizerBase
) -> None:
    assert tokenizer.decode(CYCLE) == "世"
    assert [tokenizer.decode([token]) for token in (*CYCLE, LEAD)] == [REPLACEMENT] * 4
    hf = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    for text in ("Hi", "Hi!"):
        prompt = tokenizer(text)["input_ids"]
        out = hf.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=7, do_sample=False, eos_token_id=None, pad_token_id=tokenizer.pad_token_id,
        )[0, len(prompt) :].tolist()  # fmt: skip
        assert out == greedy(prompt, 7)


def complete_and_stream(
    stub: generation_pb2_grpc.GenerationStub, request: pb.GenerateRequest
) -> tuple[pb.GenerateResponse, list[pb.GenerateResponse]]:
    return stub.Complete(request, timeout=30), list(stub.Generate(request, timeout=30))


@pytest.mark.parametrize("stop", [[], ["zzz"], ["世世!"]], ids=["no-stop", "stop", "long-stop"])
@pytest.mark.parametrize(
    ("prompt", "max_tokens", "expected"),
    [
        ("Hi", 1, REPLACEMENT),  # E4: a lone lead byte
        ("Hi", 2, REPLACEMENT),  # E4 B8: two of three bytes
        ("Hi", 3, "世"),  # the whole character
        ("Hi", 4, "世" + REPLACEMENT),  # 世, then a lead byte
        ("Hi", 5, "世" + REPLACEMENT),  # 世, then two of three bytes
        ("Hi", 7, "世世" + REPLACEMENT),
        ("Hi!", 1, REPLACEMENT),  # F0
        ("Hi!", 3, REPLACEMENT * 3),  # F0 F0 F0: DecodeStream never yields a piece
    ],
)
def test_text_is_the_decode_of_the_token_ids_when_max_tokens_cuts_a_character(
    stub: generation_pb2_grpc.GenerationStub,
    tokenizer: PreTrainedTokenizerBase,
    prompt: str,
    max_tokens: int,
    expected: str,
    stop: list[str],
) -> None:
    request = generate_request(prompt, max_tokens=max_tokens, temperature=0.0, stop=stop)
    whole, responses = complete_and_stream(stub, request)
    assert list(whole.token_ids) == greedy(tokenizer(prompt)["input_ids"], max_tokens)
    assert whole.finish_reason == responses[-1].finish_reason == Reason.LENGTH
    assert tokenizer.decode(whole.token_ids, skip_special_tokens=True) == expected
    assert whole.text == expected
    assert "".join(r.text for r in responses) == expected
    assert [t for r in responses for t in r.token_ids] == list(whole.token_ids)


def test_text_is_the_decode_of_the_token_ids_when_a_stop_token_ends_inside_a_character(
    stub: generation_pb2_grpc.GenerationStub, tokenizer: PreTrainedTokenizerBase
) -> None:
    # E4 B8, and B8 is a stop token: the output ends inside 世 whether or not the stop token is in it.
    request = generate_request("Hi", max_tokens=10, temperature=0.0, stop_token_ids=[CYCLE[1]])
    whole, responses = complete_and_stream(stub, request)
    assert whole.finish_reason == responses[-1].finish_reason == Reason.STOP
    assert list(whole.token_ids) in ([CYCLE[0]], CYCLE[:2])
    assert whole.text == tokenizer.decode(whole.token_ids, skip_special_tokens=True) == REPLACEMENT
    assert "".join(r.text for r in responses) == REPLACEMENT
