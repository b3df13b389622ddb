"""A GGUF file's tokenizer, converted once per machine and cached as a Hugging Face fast tokenizer.

transformers builds a GGUF model's tokenizer by parsing every metadata item of the file and
converting its vocabulary and merges: ≈ 13 s for SmolLM2 on a 2-core machine, paid by every process
that tokenizes (each XP instance replica, the offline ``LLM``, the benchmark client). The result is
saved (``save_pretrained``: tokenizer.json, its config and chat template) under the user cache,
keyed by the file (path, size, modification time) and the transformers version; later loads read
that (≈ 0.3 s). An unwritable cache only means converting each time.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from .util.user_cache import cache_root

log = logging.getLogger(__name__)


def cache_folder(gguf_path: Path) -> Path:
    """Where the converted tokenizer of ``gguf_path`` (as it is now) is cached."""
    import transformers

    p = gguf_path.resolve()
    st = p.stat()
    key = f"{p}|{st.st_size}|{st.st_mtime_ns}|{transformers.__version__}"
    return cache_root() / "tokenizers" / hashlib.sha256(key.encode()).hexdigest()[:24]


def load_gguf_tokenizer(gguf_path: Path) -> Any:
    """The transformers fast tokenizer of a GGUF file: from the cache when it holds one, else converted
    from the file and then cached."""
    from transformers import AutoTokenizer

    folder = cache_folder(gguf_path)
    if (folder / "tokenizer.json").is_file():
        try:
            return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        except (OSError, ValueError) as e:  # a damaged entry: convert again and replace it
            log.warning("cached tokenizer %s unreadable (%s); converting %s again", folder, e, gguf_path)
            shutil.rmtree(folder, ignore_errors=True)
    tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name, local_files_only=True)
    _save(tok, folder)
    return tok


def _save(tok: Any, folder: Path) -> None:
    """Write the entry whole or not at all (a sibling temp folder renamed into place; a process that
    converted at the same time and renamed first wins)."""
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=folder.parent))
    except OSError as e:
        log.info("tokenizer cache not writable (%s): converting at each start", e)
        return
    try:
        tok.save_pretrained(str(tmp))
        os.replace(tmp, folder)
    except OSError:  # another process cached it first, or the disk is full: keep theirs / none
        shutil.rmtree(tmp, ignore_errors=True)
