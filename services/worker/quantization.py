"""--quantization's choices, apart from services/worker/models/quantized.py, which applies them and imports
torch: the worker's settings (and `pagedserve up`, which reads them) load without it."""

from typing import Literal

Quantization = Literal["none", "int8"]
