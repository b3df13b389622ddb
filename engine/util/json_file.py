"""Reading a user-named JSON or text file (an estimator profile, a profiler's raw samples, a step log)
with errors that name the file and say what is wrong with it, not a decoder's traceback."""

from __future__ import annotations

import gzip
import json
import zlib
from pathlib import Path
from typing import Any


def read_text_file(path: str | Path) -> str:
    """The file's UTF-8 text (a ``.gz`` name is gunzipped first). FileNotFoundError as usual; ValueError
    naming ``path`` for a folder, an unreadable file, a broken gzip file or one that is not UTF-8 text
    (a binary file)."""
    try:
        if str(path).endswith(".gz"):
            with gzip.open(path, "rt", encoding="utf-8") as f:
                return f.read()
        return Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise
    except (gzip.BadGzipFile, EOFError, zlib.error) as e:
        raise ValueError(f"{path}: not a readable gzip file ({e})") from None
    except UnicodeDecodeError:
        raise ValueError(f"{path}: not a text file (not UTF-8; a binary file?)") from None
    except OSError as e:
        raise ValueError(f"{path}: cannot read it ({e.strerror or e})") from None


def read_json_file(path: str | Path) -> Any:
    """The file's JSON value; errors as ``read_text_file``, and a ValueError naming ``path`` and the
    place for invalid JSON."""
    text = read_text_file(path)
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: invalid JSON (line {e.lineno}, column {e.colno}: {e.msg})") from None
