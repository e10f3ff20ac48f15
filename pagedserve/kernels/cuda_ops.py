"""Typed wrappers of the CUDA kernels in csrc/: each checks shapes, dtypes and strides, picks the launch
and the compile-time shape, then launches (pagedserve/kernels/launch.py) on torch's current stream.

Tensors travel as raw device pointers: CuPy has no bfloat16, and the kernels read 16-bit types as bits.
With CPU tensors, the same kernels run in the emulator (pagedserve/kernels/emulator.py), for tests with no
GPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import get_args

import numpy as np
import torch

from pagedserve.kernels.backend import AttentionMetadata, LayerAttention
from pagedserve.kernels.launch import launch, max_shared_bytes, resident_blocks
from pagedserve.kernels.nvrtc import DTYPE_MACROS
from pagedserve.kernels.page_size import PageSize
from pagedserve.kernels.tuning import (
    Tuning,
    decode_mma_shared_bytes,
    decode_mma_stages,
    decode_split,
    step_prefill_tiles,
)

PAGE_SIZES = get_args(PageSize)
HEAD_DIMS = (64, 128)
MAX_GROUP = 16  # query heads per KV head; the decode kernel keeps them all in registers


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def _dtype(*tensors: torch.Tensor) -> dict[str, int]:
    """The macro that compiles a kernel for these tensors' one dtype."""
    names = {str(t.dtype).removeprefix("torch.") for t in tensors}
    _require(len(names) == 1, f"tensors must share one dtype, got {sorted(names)}")
    (name,) = names
    _require(name in DTYPE_MACROS, f"dtype {name} is not one of {', '.join(DTYPE_MACROS)}")
    return {DTYPE_MACROS[name]: 1}


def _pack(tensors: list[torch.Tensor], *lengths: int) -> int:
    """VEC, the elements a thread moves in one access: 16 bytes' worth where every tensor starts on 16 bytes,
    its strides (but the last) keep every row there, and each length (of a row, or of the part of one a
    kernel takes as a unit) is a whole number of them; else 1."""
    size = tensors[0].element_size()
    vec = 16 // size
    aligned = all(
        t.data_ptr() % 16 == 0 and all(stride * size % 16 == 0 for stride in t.stride()[:-1]) for t in tensors
    )
    return vec if aligned and all(length % vec == 0 for length in lengths) else 1


def _index(t: torch.Tensor, name: str, dims: int) -> None:
    _require(
        t.dtype == torch.int64 and t.dim() == dims and t.is_contiguous(),
        f"{name} must be contiguous int64, {dims}-D",
    )


def _ptr(t: torch.Tensor | None) -> np.uint64:
    return np.uint64(0 if t is None else t.data_ptr())


def _kv_layer(kv_layer: torch.Tensor) -> tuple[int, int, int, int]:
    _require(
        kv_layer.dim() == 5 and kv_layer.shape[0] == 2 and kv_layer.is_contiguous(),
        "kv_layer must be a contiguous [2, P, B, Hkv, D] view of the pool",
    )
    pages, page_size, kv_heads, head_dim = kv_layer.shape[1:]
    _require(page_size in PAGE_SIZES, f"page size {page_size} is not one of {PAGE_SIZES}")
    _require(head_dim in HEAD_DIMS, f"head dim {head_dim} is not one of {HEAD_DIMS}")
    return pages, page_size, kv_heads, head_dim


def _heads(x: torch.Tensor, name: str, heads: int, head_dim: int) -> None:
    """x is [T, heads, D] with each head's D elements contiguous and heads D apart."""
    _require(x.dim() == 3 and x.shape[1:] == (heads, head_dim), f"{name} must be [T, {heads}, {head_dim}]")
    _require(x.stride(2) == 1 and x.stride(1) == head_dim, f"{name}'s heads must be contiguous rows of D")


def kv_write(
    kv_layer: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor, tuning: Tuning
) -> None:
    """k, v [T, Hkv, D] into kv_layer [2, P, B, Hkv, D] at slot_mapping [T] (negative slots skipped)."""
    pages, page_size, kv_heads, head_dim = _kv_layer(kv_layer)
    _heads(k, "k", kv_heads, head_dim)
    _heads(v, "v", kv_heads, head_dim)
    _index(slot_mapping, "slot_mapping", 1)
    _require(
        slot_mapping.shape[0] == k.shape[0] == v.shape[0], "k, v and slot_mapping need one row per token"
    )
    dtype = _dtype(kv_layer, k, v)
    tokens, row = k.shape[0], kv_heads * head_dim
    if tokens == 0:
        return
    strides = (np.int64(k.stride(0)), np.int64(v.stride(0)))
    args = (
        _ptr(k),
        _ptr(v),
        _ptr(kv_layer),
        _ptr(slot_mapping),
        *strides,
        np.int32(row),
        np.int64(pages * page_size * row),
    )
    vec = _pack([k, v, kv_layer], row)
    block = (min(row // vec, tuning.row_threads),)
    launch("kv_write", "kv_write", {**dtype, "VEC": vec}, (tokens,), block, args, k.device)


@dataclass(frozen=True)
class _Attention:
    """What both attention kernels check and need of q, out and the pool."""

    macros: dict[str, int]  # the dtype and the compile-time shape, less NUM_WARPS
    kv_heads: int
    v_offset: int  # elements from the K half of kv_layer to its V half
    variations: tuple  # the layer's window, softcap and sinks, as the kernels' last three arguments


def _attention(
    out: torch.Tensor,
    q: torch.Tensor,
    kv_layer: torch.Tensor,
    block_tables: torch.Tensor,
    layer: LayerAttention,
) -> _Attention:
    pages, page_size, kv_heads, head_dim = _kv_layer(kv_layer)
    q_heads = q.shape[1]
    group = q_heads // kv_heads
    _require(
        q_heads % kv_heads == 0 and group <= MAX_GROUP, f"{q_heads} query heads over {kv_heads} KV heads"
    )
    _heads(q, "q", q_heads, head_dim)
    _require(out.is_contiguous() and out.shape == q.shape, "out must be contiguous and shaped like q")
    _index(block_tables, "block_tables", 2)
    _require(layer.window >= 0 and layer.softcap >= 0, "a layer's window and softcap must not be negative")
    sinks = layer.sinks
    if sinks is not None:
        _require(sinks.is_contiguous() and sinks.shape == (q_heads,), f"sinks must be contiguous [{q_heads}]")
    dtype = _dtype(kv_layer, q, out, *([sinks] if sinks is not None else []))
    macros = {**dtype, "HEAD_DIM": head_dim, "PAGE_SIZE": page_size, "GROUP": group}
    variations = (np.int32(layer.window), np.float32(layer.softcap), _ptr(sinks))
    return _Attention(macros, kv_heads, pages * page_size * kv_heads * head_dim, variations)


def paged_decode(
    out: torch.Tensor,
    q: torch.Tensor,
    kv_layer: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seq_len: int,
    layer: LayerAttention,
    tuning: Tuning,
) -> None:
    """out [S, Hq, D] = attention of q [S, Hq, D] over each sequence's seq_lens [S] cached tokens (those of
    its window, for a sliding layer), as `layer` says.

    max_seq_len bounds every seq_lens entry; with the batch's size and the device's, it sets how many
    partitions each sequence is split into (pagedserve.kernels.tuning.decode_split).
    """
    shape = _attention(out, q, kv_layer, block_tables, layer)
    _index(seq_lens, "seq_lens", 1)
    seqs, head_dim = q.shape[0], q.shape[2]
    kv_heads, group = shape.kv_heads, shape.macros["GROUP"]
    _require(
        block_tables.shape[0] == seq_lens.shape[0] == seqs, "one block table row and length per sequence"
    )
    if seqs == 0:
        return
    macros = {**shape.macros, "NUM_WARPS": tuning.decode_warps}
    name, threads, shared = "paged_decode", tuning.decode_warps * 32, 0
    stages = decode_mma_stages(head_dim, shape.macros["PAGE_SIZE"], tuning, max_shared_bytes(q.device))
    if stages and _on_tensor_cores(out, q, kv_layer):
        name = "paged_decode_mma"
        macros |= {"STAGES": stages, "MAX_PARTITION": tuning.max_partition}
        shared = decode_mma_shared_bytes(head_dim, shape.macros["PAGE_SIZE"], tuning, stages)
    resident = resident_blocks(name, name, macros, threads, q.device, shared)
    span = max_seq_len  # the most tokens a partitioned context holds: a window's, from its first page on
    if layer.window:
        span = min(span, layer.window + shape.macros["PAGE_SIZE"] - 1)
    split = decode_split(seqs, kv_heads, span, resident, tuning.min_partition, tuning.max_partition)
    partitions = split.partitions
    partial_out = partial_max = partial_sum = None
    if partitions > 1:
        partial_max = torch.empty(seqs, kv_heads, partitions, group, dtype=torch.float32, device=q.device)
        partial_sum = torch.empty_like(partial_max)
        partial_out = partial_max.new_empty(*partial_max.shape, head_dim)
    args = (
        _ptr(out),
        _ptr(partial_out),
        _ptr(partial_max),
        _ptr(partial_sum),
        _ptr(q),
        _ptr(kv_layer),
        _ptr(block_tables),
        _ptr(seq_lens),
        np.int32(kv_heads),
        np.int32(block_tables.shape[1]),
        np.int64(q.stride(0)),
        np.int64(shape.v_offset),
        np.float32(layer.scale),
        np.int32(split.partition_size),
        *shape.variations,
    )
    launch(name, name, macros, (seqs, kv_heads, partitions), (threads,), args, q.device, shared)
    if partitions > 1:
        reduce_args = (
            _ptr(out),
            _ptr(partial_out),
            _ptr(partial_max),
            _ptr(partial_sum),
            _ptr(seq_lens),
            np.int32(kv_heads),
            np.int32(partitions),
            np.int32(split.partition_size),
            shape.variations[0],
            shape.variations[2],
        )
        heads = (seqs, q.shape[1])
        merge = {**shape.macros, "NUM_WARPS": tuning.decode_warps}  # paged_decode.cu's
        launch("paged_decode", "paged_decode_reduce", merge, heads, (head_dim,), reduce_args, q.device)


def _on_tensor_cores(out: torch.Tensor, q: torch.Tensor, kv_layer: torch.Tensor) -> bool:
    """The tensor-core attention takes 16-bit types, and copies rows of q and the pool 16 bytes at a time."""
    return q.element_size() == 2 and _pack([out, q, kv_layer], q.shape[-1]) > 1


def paged_prefill(
    out: torch.Tensor,
    q: torch.Tensor,
    kv_layer: torch.Tensor,
    meta: AttentionMetadata,
    layer: LayerAttention,
    tuning: Tuning,
) -> None:
    """out [Tp, Hq, D]: the prefill rows of meta's step (q [Tp, Hq, D], its tokens past the decodes), each
    attending causally to its sequence's keys up to its own position (from its window's first), as `layer`
    says.

    16-bit types run on tensor cores, tile by tile (paged_prefill_mma.cu); float32 a warp per query token.
    """
    shape = _attention(out, q, kv_layer, meta.block_tables, layer)
    _index(meta.prefill_seq, "prefill_seq", 1)
    _index(meta.prefill_pos, "prefill_pos", 1)
    tokens, kv_heads, warps = q.shape[0], shape.kv_heads, tuning.prefill_warps
    _require(
        meta.prefill_seq.shape[0] == meta.prefill_pos.shape[0] == tokens,
        "one sequence row and position per query token",
    )
    if tokens == 0:
        return
    macros = {**shape.macros, "NUM_WARPS": warps}
    common = (
        np.int32(kv_heads),
        np.int32(meta.block_tables.shape[1]),
        np.int64(q.stride(0)),
        np.int64(shape.v_offset),
        np.float32(layer.scale),
    )
    args: tuple
    if not _on_tensor_cores(out, q, kv_layer):  # a warp per query token and KV head
        name = "paged_prefill"
        args = (
            _ptr(out),
            _ptr(q),
            _ptr(kv_layer),
            _ptr(meta.block_tables),
            _ptr(meta.prefill_seq),
            _ptr(meta.prefill_pos),
            np.int32(tokens),
            *common,
            *shape.variations,
        )
        grid: tuple[int, ...] = (-(-tokens * kv_heads // warps),)
    else:
        name = "paged_prefill_mma"
        tiles = step_prefill_tiles(meta, 16 * warps // shape.macros["GROUP"], q.device)
        args = (
            _ptr(out),
            _ptr(q),
            _ptr(kv_layer),
            _ptr(meta.block_tables),
            _ptr(tiles),
            *common,
            *shape.variations,
        )
        grid = (tiles.shape[0], kv_heads)
    launch(name, name, macros, grid, (warps * 32,), args, q.device)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None, tuning: Tuning
) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last dim of x [T, H] or [T, heads, D], after adding residual in place when given.

    Returns (normed, contiguous like x; the new residual: residual itself, updated, or x).
    """
    _require(
        x.dim() in (2, 3) and x.stride(-1) == 1, "x must be [T, H] or [T, heads, D] with contiguous rows"
    )
    hidden = x.shape[-1]
    heads = x.shape[1] if x.dim() == 3 else 1
    rows = x.shape[0] * heads
    _require(weight.is_contiguous() and weight.shape == (hidden,), f"weight must be [{hidden}]")
    if residual is not None:
        _require(
            residual.is_contiguous() and residual.shape == x.shape,
            "residual must be contiguous and shaped like x",
        )
    dtype = _dtype(x, weight, *([residual] if residual is not None else []))
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if rows:
        head_stride = x.stride(1) if x.dim() == 3 else 0
        args = (
            _ptr(out),
            _ptr(residual),
            _ptr(x),
            _ptr(residual),
            _ptr(weight),
            np.int32(hidden),
            np.int32(heads),
            np.int64(x.stride(0)),
            np.int64(head_stride),
            np.float32(eps),
        )
        vec = _pack([out, x, weight, *([residual] if residual is not None else [])], hidden)
        packs = -(-hidden // vec)
        threads = min(tuning.row_threads, max(32, -(-packs // 32) * 32))
        macros = {**dtype, "VEC": vec, "ITEMS": -(-packs // threads)}  # the row, in registers
        launch("rms_norm", "rms_norm", macros, (rows,), (threads,), args, x.device)
    return out, (residual if residual is not None else x)


def rotary(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, tuning: Tuning
) -> None:
    """Rotate q [T, Hq, D] and k [T, Hkv, D] in place by positions [T]; cos_sin is [max_positions, 2, D]."""
    head_dim = q.shape[2]
    _heads(q, "q", q.shape[1], head_dim)
    _heads(k, "k", k.shape[1], head_dim)
    _require(
        head_dim % 2 == 0 and k.shape[0] == q.shape[0], "q and k need even head dims and one row per token"
    )
    _require(
        cos_sin.is_contiguous() and cos_sin.shape[1:] == (2, head_dim), f"cos_sin must be [N, 2, {head_dim}]"
    )
    _index(positions, "positions", 1)
    dtype = _dtype(q, k, cos_sin)
    if q.shape[0] == 0:
        return
    args = (
        _ptr(q),
        _ptr(k),
        _ptr(positions),
        _ptr(cos_sin),
        np.int32(q.shape[1]),
        np.int32(k.shape[1]),
        np.int64(q.stride(0)),
        np.int64(k.stride(0)),
    )
    vec = _pack([q, k, cos_sin], head_dim // 2)
    packs = (q.shape[1] + k.shape[1]) * head_dim // 2 // vec
    macros = {**dtype, "VEC": vec, "HEAD_DIM": head_dim}
    launch("rotary", "rotary", macros, (q.shape[0],), (min(packs, tuning.row_threads),), args, q.device)


def silu_and_mul(x: torch.Tensor, tuning: Tuning) -> torch.Tensor:
    """x [T, 2 I] holds gate then up; returns silu(gate) * up, [T, I]."""
    _require(
        x.dim() == 2 and x.stride(1) == 1 and x.shape[1] % 2 == 0, "x must be [T, 2 I] with contiguous rows"
    )
    dtype = _dtype(x)
    inner = x.shape[1] // 2
    out = torch.empty(x.shape[0], inner, dtype=x.dtype, device=x.device)
    if x.shape[0]:
        args = (_ptr(out), _ptr(x), np.int32(inner), np.int64(x.stride(0)))
        vec = _pack([out, x], inner)
        block = (min(inner // vec, tuning.row_threads),)
        launch("silu_and_mul", "silu_and_mul", {**dtype, "VEC": vec}, (x.shape[0],), block, args, x.device)
    return out
