"""Atomic file writes: readers see the old file or the whole new one, never half of it.

Here, at the bottom of the tree, so that the passes' dumps and remat_compiler's plans, caches and
pictures share one writer.

Each writer makes a temporary file in the destination folder, fills and fsyncs it, gives it the
permissions an ordinary ``open`` would (``mkstemp`` makes 0600), then renames it over the target.

>>> atomic_write_text("plan.json", plan.to_json())                          # doctest: +SKIP
>>> atomic_write("timeline.png", lambda f: fig.savefig(f, format="png"))    # doctest: +SKIP
"""
from __future__ import annotations

import os
import tempfile
from typing import IO, Callable

__all__ = ["atomic_write", "atomic_write_text"]


def atomic_write(path: str | os.PathLike, write: Callable[[IO[bytes]], object]) -> str:
    """Create ``path`` atomically from what ``write`` writes into a binary file object.

    Parameters
    ----------
    path : str or PathLike
        The file to create or replace.
    write : callable
        Called once with the temporary file, open for binary writing; its return value is ignored.

    Returns
    -------
    str
        ``path``, made absolute.

    Raises
    ------
    OSError
        If the folder is not writable. Whatever ``write`` raises is raised unchanged. Either way no
        partial file is left behind and an existing ``path`` is untouched.
    """
    path = os.path.abspath(os.fspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=os.path.dirname(path))
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` as UTF-8 to ``path`` atomically (see :func:`atomic_write`).

    Raises
    ------
    OSError
        If the folder is not writable; no partial file is left behind.
    """
    atomic_write(path, lambda f: f.write(text.encode("utf-8")))
