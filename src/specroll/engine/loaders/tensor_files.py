"""Writing a safetensors file, with a failed write raised as the ``OSError`` it is.

``safetensors`` reports an I/O error as a ``SafetensorError`` whose message ends ``(os error N)``
(Rust's ``std::io::Error``); a caller deciding what a full disk means (``sealed.OUT_OF_SPACE``)
needs the errno, so :func:`save_tensors` raises ``OSError(N, strerror, path)`` instead.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

from specroll.engine.loaders.sealed import usual_mode

_OS_ERROR = re.compile(r"os error (\d+)\)")


def save_tensors(tensors: Mapping[str, torch.Tensor], path: Path, metadata: dict[str, str] | None = None) -> None:
    """``safetensors.torch.save_file`` of ``tensors`` (CPU, contiguous, sharing no storage) to ``path``,
    a file of the usual mode under the umask (safetensors makes it 0600).

    Raises:
        OSError: the file cannot be written (``errno`` as the operating system gave it, e.g. ENOSPC
            or EFBIG; ``filename`` is ``path``).
        SafetensorError: the tensors cannot be serialized.
    """
    try:
        save_file(dict(tensors), str(path), metadata=metadata)
    except SafetensorError as exc:
        found = _OS_ERROR.search(str(exc))
        if found is None:
            raise
        code = int(found.group(1))
        raise OSError(code, os.strerror(code), str(path)) from exc
    os.chmod(path, usual_mode())
