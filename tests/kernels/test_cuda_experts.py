"""The CUDA mixture of experts (pagedserve/kernels/cuda_experts.py, csrc/moe.cu) against moe_reference on the
same device, the grouping of pairs by expert it launches over, and its refusal of bad arguments.

On a CUDA device with CuPy, else in the kernels' emulator (pagedserve/kernels/emulator.py) on the CPU, with
its small tiles (cuda_experts.EMULATED_TILES); one test runs each device's tiles on the other's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
import torch

from pagedserve.kernels import cuda_experts
from pagedserve.kernels.backend import ExpertWeights, Routing
from pagedserve.kernels.cuda_experts import CUDA_TILES, EMULATED_TILES, Tiles, align
from pagedserve.kernels.cupy_backend import CupyBackend
from pagedserve.kernels.torch_ref import moe_reference
from pagedserve.kernels.tuning import Tuning
from tests.kernels.cases import DEVICE, DTYPES, PAD, assert_close, dtype_name, generator, padded_rows, randn

pytestmark = pytest.mark.cuda_kernels  # on a GPU, else in the emulator on the CPU: tests/devices.py

EXPERTS, HIDDEN, INNER = 8, 64, 48  # I a multiple of no column tile: the last one is partly outside
ROUTINGS = {
    "mixtral": Routing(2, renormalize=True),
    "qwen3-moe": Routing(3),
    "gpt-oss": Routing(2, softmax_of_top=True, swiglu_limit=1.0),  # with every bias, below
}
TOKENS = [1, 7, 40]  # a decode's one row; then rows that fill several tiles of some experts, none of others


def random_experts(gen: torch.Generator, dtype: torch.dtype, biased: bool) -> ExpertWeights:
    """Weights scaled so that the projections are about as large as their inputs, as a trained model's:
    gpt-oss's clamp at 1.0 then cuts some gates and ups, not all."""

    def weight(*shape: int, scale: float) -> torch.Tensor:
        return randn(gen, *shape, dtype=torch.float32).mul(scale).to(dtype)

    return ExpertWeights(
        router=weight(EXPERTS, HIDDEN, scale=1.0),
        gate_up=weight(EXPERTS, 2 * INNER, HIDDEN, scale=HIDDEN**-0.5),
        down=weight(EXPERTS, HIDDEN, INNER, scale=INNER**-0.5),
        router_bias=weight(EXPERTS, scale=1.0) if biased else None,
        gate_up_bias=weight(EXPERTS, 2 * INNER, scale=0.5) if biased else None,
        down_bias=weight(EXPERTS, HIDDEN, scale=0.5) if biased else None,
    )


def hidden_states(gen: torch.Generator, tokens: int, dtype: torch.dtype) -> torch.Tensor:
    """[T, H], a view of wider rows with NaN around it, which a kernel that ignored x's stride would read."""
    return padded_rows(gen, tokens, HIDDEN, dtype)[:, PAD : PAD + HIDDEN]


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("routing", ROUTINGS)
def test_experts_match_the_reference(
    backend: CupyBackend, routing: str, tokens: int, dtype: torch.dtype
) -> None:
    gen = generator(30 + tokens)
    experts = random_experts(gen, dtype, biased=routing == "gpt-oss")
    x = hidden_states(gen, tokens, dtype)

    out = cuda_experts.moe(x, experts, ROUTINGS[routing], backend.tuning)

    assert out.shape == (tokens, HIDDEN) and out.dtype == dtype
    assert_close(out, moe_reference(x, experts, ROUTINGS[routing]), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
def test_an_expert_no_token_picks_is_never_read(backend: CupyBackend, dtype: torch.dtype) -> None:
    gen = generator(34)
    experts = random_experts(gen, dtype, biased=True)
    unused = 3
    experts.router_bias[unused] = -1e4  # type: ignore[index]
    for weight in (experts.gate_up, experts.down, experts.gate_up_bias, experts.down_bias):
        weight[unused] = float("nan")  # type: ignore[index]
    x = hidden_states(gen, 40, dtype)
    routing = ROUTINGS["gpt-oss"]

    out = cuda_experts.moe(x, experts, routing, backend.tuning)

    assert_close(out, moe_reference(x, experts, routing), dtype)  # finite, so expert 3 was not read


@pytest.mark.parametrize("tiles", [CUDA_TILES, EMULATED_TILES], ids=["cuda-tiles", "emulated-tiles"])
def test_either_tiling_matches_the_reference(
    backend: CupyBackend, tiles: Tiles, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same source at each tiling moe picks, on this device: CUDA's tiles cover I = 48 with one part
    column tile, the emulator's with one and a half."""
    monkeypatch.setattr(cuda_experts, "tiles_for", lambda device: tiles)
    gen = generator(35)
    experts = random_experts(gen, torch.bfloat16, biased=True)
    x = hidden_states(gen, 40, torch.bfloat16)
    routing = ROUTINGS["gpt-oss"]

    out = cuda_experts.moe(x, experts, routing, backend.tuning)

    assert_close(out, moe_reference(x, experts, routing), torch.bfloat16)


def test_no_tokens(backend: CupyBackend) -> None:
    experts = random_experts(generator(36), torch.float32, biased=False)
    out = cuda_experts.moe(
        torch.zeros(0, HIDDEN, device=DEVICE), experts, ROUTINGS["mixtral"], backend.tuning
    )
    assert out.shape == (0, HIDDEN)


# The grouping of pairs by expert ------------------------------------------------------------------------


@pytest.mark.parametrize("skew", ["random", "one-expert"])
def test_align_groups_the_pairs_by_expert_in_whole_tiles(skew: str) -> None:
    tokens, top_k, block_m = 29, 3, 8
    gen = generator(37)
    if skew == "random":
        chosen = torch.stack([torch.randperm(EXPERTS, generator=gen)[:top_k] for _ in range(tokens)])
    else:  # every token's first slot on expert 5: its group spans many tiles
        chosen = torch.stack([torch.tensor([5, 1 + t % 4, 6 + t % 2]) for t in range(tokens)])
    pairs = tokens * top_k

    sorted_pairs, tile_expert = align(chosen.to(DEVICE), EXPERTS, block_m)

    tiles = min(pairs, -(-pairs // block_m) + EXPERTS)  # whatever the routing
    assert sorted_pairs.shape == (tiles * block_m,) and tile_expert.shape == (tiles,)
    flat, rows, experts = chosen.flatten(), sorted_pairs.cpu().view(tiles, block_m), tile_expert.cpu()
    assert sorted(rows[rows < pairs].tolist()) == list(range(pairs)), "each pair in exactly one row"
    assert experts.tolist() == sorted(experts.tolist()), "the tiles in expert order"
    for tile, expert in zip(rows, experts.tolist(), strict=True):
        real = tile[tile < pairs]
        if expert == EXPERTS:  # past the last group
            assert real.numel() == 0
            continue
        assert real.numel() > 0 and bool((flat[real] == expert).all()), "a tile holds one expert's pairs"
        assert torch.equal(tile[: real.numel()], real), "the padding at the end of a group's last tile"
        assert bool((real.diff() > 0).all()), "a group in token order"


# The wrapper's checks -----------------------------------------------------------------------------------


def zeros(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.zeros(shape, dtype=dtype, device=DEVICE)


def experts_but(dtype: torch.dtype = torch.bfloat16, **changes: torch.Tensor | None) -> ExpertWeights:
    """Valid weights of 4 experts, H = 64 and I = 48, with every bias, in dtype, but for `changes`."""
    valid = ExpertWeights(
        router=zeros(4, 64, dtype=dtype),
        gate_up=zeros(4, 96, 64, dtype=dtype),
        down=zeros(4, 64, 48, dtype=dtype),
        router_bias=zeros(4, dtype=dtype),
        gate_up_bias=zeros(4, 96, dtype=dtype),
        down_bias=zeros(4, 64, dtype=dtype),
    )
    return dataclasses.replace(valid, **changes)


TOP_2 = Routing(2)

# Each call is valid but for the one thing its name says, and must raise ValueError before any launch.
BAD_CALLS: dict[str, Callable[[Tuning], object]] = {
    "x-3-d": lambda t: cuda_experts.moe(zeros(3, 1, 64), experts_but(), TOP_2, t),
    "x-columns-strided": lambda t: cuda_experts.moe(zeros(3, 128)[:, ::2], experts_but(), TOP_2, t),
    "x-in-float16": lambda t: cuda_experts.moe(zeros(3, 64, dtype=torch.float16), experts_but(), TOP_2, t),
    "all-in-float64": lambda t: cuda_experts.moe(
        zeros(3, 64, dtype=torch.float64), experts_but(torch.float64), TOP_2, t
    ),
    "router-of-another-width": lambda t: cuda_experts.moe(
        zeros(3, 64), experts_but(router=zeros(4, 32)), TOP_2, t
    ),
    "gate-up-of-another-width": lambda t: cuda_experts.moe(
        zeros(3, 64), experts_but(gate_up=zeros(4, 96, 32)), TOP_2, t
    ),
    "gate-up-odd-rows": lambda t: cuda_experts.moe(
        zeros(3, 64), experts_but(gate_up=zeros(4, 95, 64)), TOP_2, t
    ),
    "gate-up-of-other-experts": lambda t: cuda_experts.moe(
        zeros(3, 64), experts_but(gate_up=zeros(5, 96, 64)), TOP_2, t
    ),
    "down-of-another-inner-size": lambda t: cuda_experts.moe(
        zeros(3, 64), experts_but(down=zeros(4, 64, 32)), TOP_2, t
    ),
    "down-transposed": lambda t: cuda_experts.moe(
        zeros(3, 64), experts_but(down=zeros(4, 48, 64).transpose(1, 2)), TOP_2, t
    ),
    "gate-up-bias-of-another-length": lambda t: cuda_experts.moe(
        zeros(3, 64), experts_but(gate_up_bias=zeros(4, 48)), TOP_2, t
    ),
    "down-bias-in-float32": lambda t: cuda_experts.moe(
        zeros(3, 64), experts_but(down_bias=zeros(4, 64, dtype=torch.float32)), TOP_2, t
    ),
    "router-bias-of-other-experts": lambda t: cuda_experts.moe(
        zeros(3, 64), experts_but(router_bias=zeros(5)), TOP_2, t
    ),
    "top-5-of-4-experts": lambda t: cuda_experts.moe(zeros(3, 64), experts_but(), Routing(5), t),
}


@pytest.mark.parametrize("call", list(BAD_CALLS.values()), ids=list(BAD_CALLS))
def test_moe_rejects_bad_arguments(backend: CupyBackend, call: Callable[[Tuning], object]) -> None:
    with pytest.raises(ValueError):
        call(backend.tuning)
