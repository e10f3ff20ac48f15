"""How a model's layers share the pool's pages: the hybrid layout of models whose layers attend differently
(Gemma 2 and 3, gpt-oss: sliding-window layers beside full ones), as vLLM's hybrid allocator has it.

A pool page holds `size` layers' K and V for its tokens. The layers of one kind (full attention, or one
window) form groups of `size` layers, and a sequence has a block table for each group. So the pages of a
sliding group that fall wholly before its window go back to the pool while the sequence runs, and the full
groups keep theirs. A model whose layers all attend alike is one group: a page holds every layer.

Each group's pages enter the prefix cache under keys of their own (`group_key`): group 0 keeps the chain's
keys, so that a one-group model's pages are keyed as they always were.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

from memory_daemon.prefix import KEY_BYTES


@dataclass(frozen=True)
class KVGroups:
    size: int  # layers a page holds
    windows: tuple[int, ...]  # each group's window; 0 for full attention
    group_of: tuple[int, ...]  # each layer's group
    slot_of: tuple[int, ...]  # each layer's place among its group's layers (in the page)

    @property
    def count(self) -> int:
        return len(self.windows)


def kv_groups(windows: Sequence[int]) -> KVGroups:
    """The groups of layers with these windows (0: full attention), full layers first: each kind's layers in
    groups of as many as the rarest kind has, so that no page holds layers of two kinds. (A kind whose count
    is no multiple of that leaves its last group's page part empty.)"""
    layers_of: dict[int, list[int]] = {}
    for layer, window in enumerate(windows):
        layers_of.setdefault(window, []).append(layer)
    size = min(len(layers) for layers in layers_of.values())
    group_windows: list[int] = []
    group_of, slot_of = [0] * len(windows), [0] * len(windows)
    for window, layers in sorted(layers_of.items()):
        for first in range(0, len(layers), size):
            for slot, layer in enumerate(layers[first : first + size]):
                group_of[layer], slot_of[layer] = len(group_windows), slot
            group_windows.append(window)
    return KVGroups(size, tuple(group_windows), tuple(group_of), tuple(slot_of))


def group_key(key: bytes, group: int) -> bytes:
    """The prefix-cache key of group `group`'s page whose chain key is `key` (ROOT_KEY for a chain's parent):
    group 0's is the chain's own, and the other groups' never meet it or each other."""
    if group == 0:
        return key
    person = b"pagedserve-group"
    return hashlib.blake2b(key + group.to_bytes(2, "little"), digest_size=KEY_BYTES, person=person).digest()
