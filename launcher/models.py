"""Where a model's files are: a local folder, or a Hugging Face id already cached.

Nothing is ever downloaded: an id that is not in the local cache is a clear error.
"""

from __future__ import annotations

import os
from pathlib import Path


class ModelNotFoundError(RuntimeError):
    pass


def resolve_model(name: str, revision: str | None = None, cache_dir: str | None = None) -> str:
    """An absolute folder holding config.json for `name` (a path or an HF id cached in
    `cache_dir`, vLLM's --download-dir, or the default cache)."""
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(f"{path} is a folder but holds no config.json")
        return str(path.resolve())
    if path.is_absolute() or name.startswith(".") or name.count("/") > 1:
        raise ModelNotFoundError(f"model folder {name} does not exist")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        folder = snapshot_download(
            name, revision=revision, cache_dir=cache_dir, local_files_only=True
        )
    except (LocalEntryNotFoundError, FileNotFoundError, OSError) as e:
        cache = (
            cache_dir
            or os.environ.get("HF_HUB_CACHE")
            or os.environ.get("HF_HOME")
            or "~/.cache/huggingface"
        )
        raise ModelNotFoundError(
            f"model {name!r} is neither a local folder nor in the local Hugging Face cache "
            f"({cache}); zserve never downloads: fetch it first (e.g. `hf download {name}`) "
            f"or pass a folder ({type(e).__name__})"
        ) from None
    if not (Path(folder) / "config.json").is_file():
        raise ModelNotFoundError(f"the cached snapshot of {name!r} has no config.json")
    return folder
