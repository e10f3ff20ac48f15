"""The torch reference backend: plain torch ops, on any device.

It follows Hugging Face's Llama code operation for operation (RMSNorm in fp32, half-split rotary, SiLU
gate), so that the engine can match `generate` token for token. Decode attention gathers each decoding
sequence's pages, padded to the longest in its group, and makes one batched call a group; each prefill chunk
is one call with a causal mask offset by its cached prefix.

On the CPU the gather and the attention over it cost more than the GEMMs once contexts reach a few hundred
tokens, and their cost is the padded length: so decodes of very different lengths go in separate groups.
Grouping also keeps each gather small: one padded gather over many long contexts is tens of MiB, which
glibc maps afresh for every layer (it serves allocations over 32 MiB straight from mmap), and faulting that
in costs more than the copy. scripts/bench_decode_groups.py compares the two ways.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from pagedserve.kernels.backend import (
    AttentionMetadata,
    ExpertWeights,
    LayerAttention,
    QuantizedWeight,
    Routing,
    Weight,
    plain_weight,
)

# What one more decode group costs a layer (its gather, mask and attention calls), in padded token slots
# that it saves from being gathered and attended to: about 5 ms a step against 14 us a slot on this CPU.
GROUP_COST_SLOTS = 384


def moe_reference(x: torch.Tensor, experts: ExpertWeights, routing: Routing) -> torch.Tensor:
    """`KernelBackend.moe` as transformers computes it (routing in fp32), one GEMM pair per expert over
    the tokens routed to it, so that each chosen expert's weights are read once a step. The tokens' counts
    per expert go to the host: it does not run inside a CUDA graph."""
    weights, chosen = route(x, experts, routing)
    flat = chosen.flatten()
    order = flat.argsort(stable=True)  # (token, slot) pairs grouped by expert, each group in token order
    counts = torch.bincount(flat, minlength=experts.router.shape[0]).tolist()
    out = torch.zeros_like(x)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        pairs = order[start : start + count]
        start += count
        tokens = pairs // routing.top_k
        gate_up = F.linear(x[tokens], experts.gate_up[expert], _row(experts.gate_up_bias, expert))
        y = F.linear(gated(gate_up, routing), experts.down[expert], _row(experts.down_bias, expert))
        out.index_add_(0, tokens, (y * weights.flatten()[pairs, None]).to(out.dtype))
    return out


def quantized_linear(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """x W^T (+ bias) of a quantized weight, in float32 and rounded to x's dtype once."""
    wide = None if bias is None else bias.float()
    return F.linear(x.float(), weight.dequantize(), wide).to(x.dtype)


def route(x: torch.Tensor, experts: ExpertWeights, routing: Routing) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's top_k experts as routing says, from the router's logits in fp32: (their weights [T, k]
    float32, the experts [T, k] int64). Torch ops on x's device, with no host sync."""
    logits = F.linear(x, experts.router, experts.router_bias).float()
    if routing.softmax_of_top:
        top, chosen = torch.topk(logits, routing.top_k, dim=-1)  # [T, k] each
        return top.softmax(dim=-1), chosen
    weights, chosen = torch.topk(logits.softmax(dim=-1), routing.top_k, dim=-1)
    if routing.renormalize:
        weights /= weights.sum(dim=-1, keepdim=True)
    return weights, chosen


def gated(gate_up: torch.Tensor, routing: Routing) -> torch.Tensor:
    """An expert's gated activation of its [n, 2 I] gate and up projections."""
    gate, up = gate_up.chunk(2, dim=-1)
    if not routing.swiglu_limit:
        return F.silu(gate) * up
    gate = gate.clamp(max=routing.swiglu_limit)
    up = up.clamp(min=-routing.swiglu_limit, max=routing.swiglu_limit)
    return gate * torch.sigmoid(gate * routing.swiglu_alpha) * (up + 1)


def _row(bias: torch.Tensor | None, expert: int) -> torch.Tensor | None:
    return None if bias is None else bias[expert]


class TorchBackend:
    name = "torch"

    def __init__(self, group_cost: int = GROUP_COST_SLOTS) -> None:
        self.group_cost = group_cost  # scripts/bench_decode_groups.py compares a huge one: a single group
        # The decode groups of the step being run, worked out at its first layer: (its metadata, groups).
        self._groups: tuple[AttentionMetadata | None, list[tuple[torch.Tensor, int]]] = (None, [])

    def write_kv(
        self, kv_layer: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        slots = kv_layer.view(2, -1, *kv_layer.shape[3:])  # [2, P * B, Hkv, D]
        # Rounded to the pool's dtype, where it is narrower than the model's (--kv-cache-dtype).
        k, v = k.to(kv_layer.dtype), v.to(kv_layer.dtype)
        if not kv_layer.is_cuda and not bool((slot_mapping < 0).any()):  # a free check on the CPU
            slots[0].index_copy_(0, slot_mapping, k)
            slots[1].index_copy_(0, slot_mapping, v)
            return
        # Padding rows (slot -1, from CUDA graphs) write slot 0 back unchanged: it is the null page's, and no
        # token lives there. No host sync, so this can be captured too.
        keep = (slot_mapping >= 0)[:, None, None]
        safe = slot_mapping.clamp(min=0)
        for half, new in ((slots[0], k), (slots[1], v)):
            half.index_copy_(0, safe, torch.where(keep, new, half.index_select(0, safe)))

    def paged_attention(
        self, q: torch.Tensor, kv_layer: torch.Tensor, meta: AttentionMetadata, layer: LayerAttention
    ) -> torch.Tensor:
        out = torch.empty_like(q)
        n = meta.num_decodes
        if n:
            out[:n] = self._decode_all(q[:n], kv_layer, meta, layer)
        for s in range(n, meta.num_seqs):
            start, end = meta.query_start_host[s], meta.query_start_host[s + 1]
            out[start:end] = self._prefill(
                q[start:end], kv_layer, meta.block_tables[s], meta.seq_lens_host[s], layer
            )
        return out

    def _decode_all(
        self, q: torch.Tensor, kv_layer: torch.Tensor, meta: AttentionMetadata, layer: LayerAttention
    ) -> torch.Tensor:
        """Attention for the step's decodes, the first meta.num_decodes sequences: q [n, Hq, D]."""
        n = q.shape[0]
        if q.is_cuda:  # one group, padded to decode_max_len, which CUDA graphs fix
            return self._decode(
                q, kv_layer, meta.block_tables[:n], meta.seq_lens[:n], meta.decode_max_len, layer
            )
        out = torch.empty_like(q)
        for rows, max_len in self._decode_groups(meta, kv_layer.shape[2]):
            out[rows] = self._decode(
                q[rows], kv_layer, meta.block_tables[rows], meta.seq_lens[rows], max_len, layer
            )
        return out

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is not None:
            x = residual + x
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        return weight * normed.to(x.dtype), x

    def rotary(
        self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        table = cos_sin[positions]  # [T, 2, D]
        cos, sin = table[:, 0].unsqueeze(1), table[:, 1].unsqueeze(1)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up

    def prepare_linear(self, weight: Weight, dtype: torch.dtype) -> Weight:
        return weight

    def linear(self, x: torch.Tensor, weight: Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
        weight = plain_weight(weight)
        if isinstance(weight, QuantizedWeight):
            return quantized_linear(x, weight, bias)
        return F.linear(x, weight, bias)

    def gated_linear(
        self, x: torch.Tensor, gate_up: Weight, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        return self.silu_and_mul(self.linear(x, gate_up, bias))

    moe = staticmethod(moe_reference)

    @staticmethod
    def _gather(
        kv_layer: torch.Tensor, pages: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the given pages [..., n] as [..., n * B, Hkv, D] in dtype: one row copy per page."""
        num_pages, page_size, kv_heads, head_dim = kv_layer.shape[1:]
        rows = kv_layer.view(2, num_pages, -1).index_select(1, pages.flatten()).to(dtype)
        kv = rows.view(2, *pages.shape[:-1], pages.shape[-1] * page_size, kv_heads, head_dim)
        return kv[0], kv[1]

    def _decode_groups(self, meta: AttentionMetadata, page_size: int) -> list[tuple[torch.Tensor, int]]:
        """The step's decodes in groups of similar length: (their rows, the longest one's length) each."""
        if self._groups[0] is not meta:
            lengths = meta.seq_lens_host[: meta.num_decodes]
            device = meta.seq_lens.device
            # A group's first row has its most pages, which is all that its gather needs to know.
            groups = [
                (torch.tensor(rows, device=device), lengths[rows[0]])
                for rows in group_by_length(lengths, page_size, self.group_cost)
            ]
            self._groups = (meta, groups)
        return self._groups[1]

    def _decode(
        self,
        q: torch.Tensor,
        kv_layer: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        max_len: int,
        layer: LayerAttention,
    ) -> torch.Tensor:
        seqs, q_heads, head_dim = q.shape
        page_size, kv_heads = kv_layer.shape[2], kv_layer.shape[3]
        k, v = self._gather(kv_layer, block_tables[:, : -(-max_len // page_size)], q.dtype)  # [S, L, Hkv, D]
        key_pos = torch.arange(k.shape[1], device=q.device)
        valid = key_pos < seq_lens[:, None]  # [S, L]
        if layer.window:
            valid &= key_pos >= seq_lens[:, None] - layer.window
        _zero_stale_tail(k, v, seq_lens, page_size)
        # One query token each: the query heads that share a KV head form a short "sequence" of queries
        # against it, which needs no GQA expansion of K and V.
        group = q_heads // kv_heads
        sinks = None if layer.sinks is None else layer.sinks.view(1, kv_heads, group, 1)
        out = _attend(
            q.view(seqs, kv_heads, group, head_dim),
            k.transpose(1, 2),
            v.transpose(1, 2),
            valid[:, None, None, :],
            layer,
            sinks,
        )
        return out.reshape(seqs, q_heads, head_dim)  # CUDA fp32 SDPA may return it non-contiguous

    def _prefill(
        self,
        q: torch.Tensor,
        kv_layer: torch.Tensor,
        block_table: torch.Tensor,
        seq_len: int,
        layer: LayerAttention,
    ) -> torch.Tensor:
        n, q_heads, head_dim = q.shape
        page_size, kv_heads = kv_layer.shape[2], kv_layer.shape[3]
        group = q_heads // kv_heads
        k, v = self._gather(kv_layer, block_table[: -(-seq_len // page_size)], q.dtype)  # [L, Hkv, D]
        # [Hkv, G, L, D] views: each KV head broadcast over its query heads, without a copy.
        k = k[:seq_len].transpose(0, 1).unsqueeze(1).expand(kv_heads, group, seq_len, head_dim)
        v = v[:seq_len].transpose(0, 1).unsqueeze(1).expand(kv_heads, group, seq_len, head_dim)
        queries = q.view(n, kv_heads, group, head_dim).permute(1, 2, 0, 3)  # [Hkv, G, n, D]
        cached = seq_len - n
        if cached == 0 and layer.plain:
            out = F.scaled_dot_product_attention(queries, k, v, is_causal=True, scale=layer.scale)
        else:
            query_pos = torch.arange(cached, seq_len, device=q.device)[:, None]
            key_pos = torch.arange(seq_len, device=q.device)[None, :]
            visible = key_pos <= query_pos  # [n, L]
            if layer.window:
                visible &= key_pos > query_pos - layer.window
            sinks = None if layer.sinks is None else layer.sinks.view(kv_heads, group, 1, 1)
            out = _attend(queries, k, v, visible, layer, sinks)
        return out.permute(2, 0, 1, 3).reshape(n, q_heads, head_dim)


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    layer: LayerAttention,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """softmax(scores) v over the keys mask lets through, with scores = q k^T scale, softcapped, and sinks
    (shaped to broadcast over the scores' leading dimensions) in each softmax's denominator."""
    if layer.softcap == 0 and sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=layer.scale)
    scores = (q.float() @ k.float().transpose(-1, -2)) * layer.scale
    if layer.softcap:
        scores = layer.softcap * torch.tanh(scores / layer.softcap)
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        scores = torch.cat((scores, sinks.float().expand(*scores.shape[:-1], 1)), dim=-1)
    probs = scores.softmax(dim=-1)
    if sinks is not None:
        probs = probs[..., :-1]
    return probs.to(v.dtype) @ v


def group_by_length(lengths: Sequence[int], page_size: int, group_cost: int) -> list[list[int]]:
    """Split rows into groups, each padded to its longest row's pages, at the least cost: padded token slots
    plus group_cost a group. Groups are runs of the rows sorted by length, longest first, so a dynamic
    program over the distinct page counts finds the best split."""
    pages = [-(-length // page_size) for length in lengths]
    order = sorted(range(len(pages)), key=lambda row: -pages[row])
    # Runs of equal page counts never split: run r covers order[starts[r]:starts[r + 1]].
    starts = [i for i in range(len(order)) if i == 0 or pages[order[i]] != pages[order[i - 1]]]
    starts.append(len(order))
    runs = len(starts) - 1
    best = [0] + [math.inf] * runs  # best[j]: the least cost of the first j runs
    cut = [0] * (runs + 1)  # where the last group of that best split begins
    for j in range(1, runs + 1):
        for i in range(j):  # the last group: runs i..j-1, padded to run i's pages
            cost = best[i] + (starts[j] - starts[i]) * pages[order[starts[i]]] * page_size + group_cost
            if cost < best[j]:
                best[j], cut[j] = cost, i
    groups, j = [], runs
    while j:
        groups.append(order[starts[cut[j]] : starts[j]])
        j = cut[j]
    return groups[::-1]


def _zero_stale_tail(k: torch.Tensor, v: torch.Tensor, seq_lens: torch.Tensor, page_size: int) -> None:
    """Zero the slots of each sequence's last page past its end, in gathered K and V [S, L, Hkv, D].

    They hold whatever an earlier owner of the page wrote, and a softmax mask alone lets a stale inf or NaN
    through (0 * NaN). Pages further on are the null page, which stays zero. Only S pages are touched, with
    no host sync.
    """
    seqs = k.shape[0]
    last = (seq_lens - 1) // page_size  # each sequence's last page, as an index into its table
    stale = torch.arange(page_size, device=k.device) >= (seq_lens - last * page_size)[:, None]  # [S, B]
    rows = torch.arange(seqs, device=k.device)
    for gathered in (k, v):
        pages = gathered.view(seqs, -1, page_size, *gathered.shape[2:])
        pages[rows, last] = pages[rows, last].masked_fill(stale[:, :, None, None], 0.0)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
