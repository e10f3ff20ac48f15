"""The typed wrapper of the mixture of experts' grouped GEMMs (csrc/moe.cu), as
pagedserve/kernels/cuda_ops.py's are: shape, dtype and layout checks, then the launches on torch's current
stream, or in the emulator for CPU tensors.

Routing (pagedserve.kernels.torch_ref.route) and the grouping of the (token, slot) pairs by expert are torch
ops on the device, and every grid is sized from T, top_k, E and the weights' shapes alone: nothing reads the
routing back to the host, so a step that runs it can be captured in a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagedserve.kernels.backend import ExpertWeights, Routing
from pagedserve.kernels.cuda_ops import _dtype, _ptr, _require
from pagedserve.kernels.launch import launch
from pagedserve.kernels.torch_ref import route
from pagedserve.kernels.tuning import Tuning


@dataclass(frozen=True)
class Tiles:
    """moe.cu's compile-time tiles: a block's BLOCK_M x BLOCK_N of the product, BLOCK_K of the depth at a
    time, THREAD_M x THREAD_N of it per thread."""

    block_m: int
    block_n: int
    block_k: int
    thread_m: int
    thread_n: int

    @property
    def threads(self) -> int:
        return (self.block_m // self.thread_m) * (self.block_n // self.thread_n)

    @property
    def macros(self) -> dict[str, int]:
        return {
            "BLOCK_M": self.block_m,
            "BLOCK_N": self.block_n,
            "BLOCK_K": self.block_k,
            "THREAD_M": self.thread_m,
            "THREAD_N": self.thread_n,
        }


# Row tiles of 16 pairs: a decode step gives each expert a few tokens, and a tile's padding rows are wasted.
# A starting point, untimed; 64 threads, 16 outputs (32 in moe_gate_up) each in registers.
CUDA_TILES = Tiles(block_m=16, block_n=64, block_k=32, thread_m=4, thread_n=4)
# The emulator's: one warp a block, and small enough that the tests' few tokens fill several row tiles of
# an expert and a part of a column tile, and the down GEMM's depth (I = 48) a part of a depth tile.
EMULATED_TILES = Tiles(block_m=8, block_n=32, block_k=32, thread_m=2, thread_n=4)


def tiles_for(device: torch.device) -> Tiles:
    return CUDA_TILES if device.type == "cuda" else EMULATED_TILES


def align(chosen: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The P = T * k (token, slot) pairs of chosen [T, k] (pair = token * k + slot) in row tiles of block_m
    pairs, each tile one expert's, each expert's group in token order and padded to whole tiles.

    Returns (sorted_pairs [tiles * block_m] int64: each tile's pairs, P where padded; tile_expert [tiles]
    int64: each tile's expert, E for the tiles past the last group). tiles = min(P, ceil(P / block_m) + E),
    an upper bound whatever the routing (an expert's group pads to under block_m more, and every used tile
    holds a pair). Torch ops on chosen's device, with no host sync.
    """
    flat = chosen.flatten()
    pairs, device = flat.numel(), flat.device
    tiles = min(pairs, -(-pairs // block_m) + num_experts)
    order = flat.argsort(stable=True)  # the pairs grouped by expert, each group in token order
    grouped = flat[order]
    # Where each expert's group starts among the sorted pairs (torch.bincount would read its max back).
    starts = torch.searchsorted(grouped, torch.arange(num_experts + 1, device=device))
    padded = (starts.diff() + block_m - 1) // block_m * block_m  # each group's rows, in whole tiles
    padded_ends = padded.cumsum(0)
    padded_starts = padded_ends - padded
    rank = torch.arange(pairs, device=device) - starts[grouped]  # each pair's place in its group
    sorted_pairs = torch.full((tiles * block_m,), pairs, dtype=torch.int64, device=device)
    sorted_pairs.scatter_(0, padded_starts[grouped] + rank, order)
    tile_starts = torch.arange(tiles, device=device) * block_m
    return sorted_pairs, torch.searchsorted(padded_ends, tile_starts, right=True)


def _weights(experts: ExpertWeights, hidden: int) -> tuple[int, int]:
    """Checks the experts' shapes and layouts against x's H; returns (E, I)."""
    num_experts = experts.router.shape[0]
    _require(experts.router.shape == (num_experts, hidden), f"router must be [E, {hidden}]")
    gate_up, down = experts.gate_up, experts.down
    _require(
        gate_up.dim() == 3 and gate_up.shape[0] == num_experts and gate_up.shape[2] == hidden,
        f"gate_up must be [{num_experts}, 2 I, {hidden}]",
    )
    _require(
        gate_up.shape[1] % 2 == 0 and gate_up.shape[1] > 0, "gate_up's rows must be I gate rows, I up rows"
    )
    inner = gate_up.shape[1] // 2
    _require(down.shape == (num_experts, hidden, inner), f"down must be [{num_experts}, {hidden}, {inner}]")
    _require(gate_up.is_contiguous() and down.is_contiguous(), "gate_up and down must be contiguous")
    for name, bias, shape in (
        ("router_bias", experts.router_bias, (num_experts,)),
        ("gate_up_bias", experts.gate_up_bias, (num_experts, 2 * inner)),
        ("down_bias", experts.down_bias, (num_experts, hidden)),
    ):
        if bias is not None:
            _require(bias.is_contiguous() and bias.shape == shape, f"{name} must be contiguous {list(shape)}")
    return num_experts, inner


def moe(x: torch.Tensor, experts: ExpertWeights, routing: Routing, tuning: Tuning) -> torch.Tensor:
    """`KernelBackend.moe` over x [T, H] (rows contiguous): returns [T, H] in x's dtype.

    The tiles are this module's (tiles_for), not yet the tuning's: no GPU has timed them.
    """
    _require(x.dim() == 2 and x.stride(1) == 1, "x must be [T, H] with contiguous rows")
    tokens, hidden = x.shape
    num_experts, inner = _weights(experts, hidden)
    _require(0 < routing.top_k <= num_experts, f"top_k {routing.top_k} of {num_experts} experts")
    weights_and_biases = (
        experts.router,
        experts.gate_up,
        experts.down,
        experts.router_bias,
        experts.gate_up_bias,
        experts.down_bias,
    )
    tensors = [t for t in weights_and_biases if t is not None]
    _require(all(t.device == x.device for t in tensors), f"the experts' weights must be on {x.device}")
    dtype = _dtype(x, *tensors)
    top_k = routing.top_k
    pairs = tokens * top_k
    out = torch.empty(pairs, hidden, dtype=x.dtype, device=x.device)
    if pairs:
        weights, chosen = route(x, experts, routing)
        weights = weights.contiguous()  # [T, k] float32: pair order
        tiles = tiles_for(x.device)
        sorted_pairs, tile_expert = align(chosen, num_experts, tiles.block_m)
        act = torch.empty(pairs, inner, dtype=x.dtype, device=x.device)
        macros = {**dtype, **tiles.macros}
        block = (tiles.threads,)
        counts = (np.int32(pairs), np.int32(num_experts))
        gate_up_args = (
            _ptr(act),
            _ptr(x),
            _ptr(experts.gate_up),
            _ptr(experts.gate_up_bias),
            _ptr(sorted_pairs),
            _ptr(tile_expert),
            *counts,
            np.int32(top_k),
            np.int32(hidden),
            np.int32(inner),
            np.int64(x.stride(0)),
            np.float32(routing.swiglu_limit),
            np.float32(routing.swiglu_alpha),
        )
        row_tiles = tile_expert.shape[0]
        grid = (row_tiles, -(-inner // tiles.block_n))
        launch("moe", "moe_gate_up", macros, grid, block, gate_up_args, x.device)
        down_args = (
            _ptr(out),
            _ptr(act),
            _ptr(experts.down),
            _ptr(experts.down_bias),
            _ptr(weights),
            _ptr(sorted_pairs),
            _ptr(tile_expert),
            *counts,
            np.int32(hidden),
            np.int32(inner),
        )
        grid = (row_tiles, -(-hidden // tiles.block_n))
        launch("moe", "moe_down", macros, grid, block, down_args, x.device)
    # Each token's k weighed rows, summed in slot order: deterministic, as no atomics are.
    return out.view(tokens, top_k, hidden).sum(dim=1)
