"""Reading files the harness did not write: bounded, without following links, no pickles.

Golden folders come from someone else and may be truncated or crafted. This
module reads their bytes and arrays defensively and knows nothing of what they mean:

* ``read_file``: the bytes of a regular file, refusing symlinks (``O_NOFOLLOW`` where the system
  has it), devices and FIFOs, and anything over a size limit, before reading it;
* ``read_npz``: the arrays of ``.npz`` bytes, each ``.npy`` header read before any data: only
  plain bool, integer, float and unicode dtypes (never objects, so never a pickle), at most
  ``MAX_ARRAY_BYTES`` per array, ``MAX_LOADED_BYTES`` per file and ``MAX_MEMBERS`` members.

Every refusal raises the caller's ``error`` type with a one-line message naming the file.
"""

from __future__ import annotations

import io
import os
import stat
import struct
import zipfile
import zlib
from pathlib import Path
from typing import Any

import numpy as np
from numpy.lib import format as npy_format

from ..usage import UsageError

#: Largest array a ``.npy`` header may declare (``prod(shape) * itemsize``).
MAX_ARRAY_BYTES = 64 * 2**20
#: Largest total of the arrays one file may declare (guards against zip bombs).
MAX_LOADED_BYTES = 256 * 2**20
#: Most members (arrays) one file may hold (a real file holds fewer than 100).
MAX_MEMBERS = 4096
#: Largest ``.npy`` header read (NumPy's own default limit).
MAX_HEADER_BYTES = 10_000


class UntrustedFileError(UsageError):
    """A file that is unreadable, too large, or holds what the harness never writes."""


def read_file(path: Path, limit: int, *, follow: bool = False,
              error: type[Exception] = UntrustedFileError) -> bytes:
    """The bytes of the regular file ``path`` (at most ``limit``), without following a symlink
    unless ``follow``; ``error`` otherwise."""
    flags = os.O_RDONLY | getattr(os, "O_BINARY", 0) | getattr(os, "O_NONBLOCK", 0)
    if not follow:
        if path.is_symlink():
            raise error(f"{path} is a symlink; only plain files are read")
        flags |= getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        raise error(f"{path} cannot be opened ({exc.strerror or exc})") from exc
    try:
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode):
                raise error(f"{path} is not a regular file")
            if st.st_size > limit:
                raise error(f"{path} is {st.st_size} bytes, over the limit of {limit}")
            data = f.read(limit + 1)
    except OSError as exc:
        raise error(f"{path} cannot be read ({exc.strerror or exc})") from exc
    if len(data) > limit:
        raise error(f"{path} is over the limit of {limit} bytes")
    return data


def _header(f: Any, where: str, error: type[Exception]) -> tuple[tuple[int, ...], bool, np.dtype]:
    """Shape, Fortran order and dtype from a ``.npy`` header, refusing what ``save`` never
    writes."""
    version = npy_format.read_magic(f)
    if version == (1, 0):
        shape, fortran, dtype = npy_format.read_array_header_1_0(
            f, max_header_size=MAX_HEADER_BYTES)
    elif version == (2, 0):
        shape, fortran, dtype = npy_format.read_array_header_2_0(
            f, max_header_size=MAX_HEADER_BYTES)
    else:
        raise error(f"{where}: unsupported .npy format version {version}")
    if dtype.hasobject:
        raise error(f"{where}: object array (pickles are refused)")
    if dtype.kind not in "biufU" or dtype.fields is not None or dtype.subdtype is not None \
            or dtype.itemsize == 0:
        raise error(f"{where}: unsupported dtype {dtype.str}")
    if not all(isinstance(n, int) and n >= 0 for n in shape):
        raise error(f"{where}: invalid shape {shape}")
    return tuple(shape), bool(fortran), dtype


def _nbytes(shape: tuple[int, ...], dtype: np.dtype) -> int:
    n = dtype.itemsize
    for d in shape:
        n *= d
    return n


def read_npz(data: bytes, label: str,
             error: type[Exception] = UntrustedFileError) -> dict[str, np.ndarray]:
    """Every member of the ``.npz`` bytes ``data``, headers and sizes checked before any array
    is allocated (``label`` names the file in ``error``'s messages); a broken zip or ``.npy``
    is an ``error`` too, never a traceback."""
    try:
        return _read_npz(data, label, error)
    except error:
        raise
    except (zipfile.BadZipFile, zipfile.LargeZipFile, zlib.error, struct.error, EOFError, OSError,
            ValueError, KeyError, TypeError, OverflowError, NotImplementedError,
            RuntimeError) as exc:
        raise error(f"{label} is not a readable .npz ({type(exc).__name__}: {exc})") from exc


def _read_npz(data: bytes, label: str, error: type[Exception]) -> dict[str, np.ndarray]:
    zf = zipfile.ZipFile(io.BytesIO(data))
    infos = zf.infolist()
    if len(infos) > MAX_MEMBERS:
        raise error(f"{label}: {len(infos)} members, over the limit of {MAX_MEMBERS}")
    headers: dict[str, tuple[zipfile.ZipInfo, tuple[int, ...], bool, np.dtype]] = {}
    total = 0
    for info in infos:
        if not info.filename.endswith(".npy"):
            raise error(f"{label}: member {info.filename!r} is not a .npy array")
        key = info.filename[:-4]
        if key in headers:
            raise error(f"{label}: member {info.filename!r} appears twice")
        where = f"{label}: {key}"
        with zf.open(info) as f:
            shape, fortran, dtype = _header(f, where, error)
        size = _nbytes(shape, dtype)
        if size > MAX_ARRAY_BYTES:
            raise error(f"{where}: declares {size} bytes (shape {shape}), over the limit "
                              f"of {MAX_ARRAY_BYTES}")
        total += size
        if total > MAX_LOADED_BYTES:
            raise error(f"{label}: its arrays declare more than {MAX_LOADED_BYTES} bytes")
        headers[key] = (info, shape, fortran, dtype)
    arrays = {}
    for key, (info, shape, fortran, dtype) in headers.items():
        size = _nbytes(shape, dtype)
        with zf.open(info) as f:
            _header(f, f"{label}: {key}", error)
            raw = f.read(size)
        if len(raw) != size:
            raise error(f"{label}: {key} is truncated ({len(raw)} of {size} bytes)")
        flat = np.frombuffer(raw, dtype=dtype).copy()
        arrays[key] = (flat.reshape(shape[::-1]).transpose() if fortran
                       else flat.reshape(shape))
    return arrays


__all__ = ["MAX_ARRAY_BYTES", "MAX_HEADER_BYTES", "MAX_LOADED_BYTES", "MAX_MEMBERS",
           "UntrustedFileError", "read_file", "read_npz"]
