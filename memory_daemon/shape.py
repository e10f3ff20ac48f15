"""The geometry of a pool: what one page holds, and how the pool tensor is laid out."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from pagedserve.plumbing.errors import InvalidArgument

DType = Literal["float32", "float16", "bfloat16"]  # the one list of the dtypes a pool (and a model) can have
ITEMSIZE: dict[str, int] = {"float32": 4, "float16": 2, "bfloat16": 2}
DEFAULT_PAGE_SIZE = 16
_LIMITS = {"num_layers": 1024, "num_kv_heads": 1024, "head_dim": 1024, "page_size": 1024}


@dataclass(frozen=True)
class PoolShape:
    """One page holds `page_size` tokens of K and V, for all layers and KV heads."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: DType
    page_size: int = DEFAULT_PAGE_SIZE

    def __post_init__(self) -> None:
        for name, limit in _LIMITS.items():
            value = getattr(self, name)
            if not 1 <= value <= limit:
                raise InvalidArgument(f"{name} must be between 1 and {limit}, got {value}")
        if self.dtype not in get_args(DType):
            raise InvalidArgument(f"dtype must be one of {', '.join(get_args(DType))}, got {self.dtype!r}")

    @property
    def itemsize(self) -> int:
        return ITEMSIZE[self.dtype]

    @property
    def page_bytes(self) -> int:
        return self.num_layers * 2 * self.page_size * self.num_kv_heads * self.head_dim * self.itemsize

    def tensor_shape(self, num_pages: int) -> tuple[int, ...]:
        """[num_layers, 2, num_pages, page_size, num_kv_heads, head_dim]"""
        return (self.num_layers, 2, num_pages, self.page_size, self.num_kv_heads, self.head_dim)

    def __str__(self) -> str:
        return (
            f"{self.num_layers} layers x {self.num_kv_heads} KV heads x head dim {self.head_dim}, "
            f"{self.dtype}, {self.page_size} tokens a page"
        )
