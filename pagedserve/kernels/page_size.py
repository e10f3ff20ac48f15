"""The page sizes a KV pool may have: the tokens a page holds, those the CUDA kernels are built for. Apart
from the backend interface, which imports torch, so that the worker's settings (and `pagedserve up`, which
reads them) load without it."""

from typing import Literal

PageSize = Literal[8, 16, 32]
