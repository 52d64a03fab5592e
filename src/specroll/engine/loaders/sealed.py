"""Sealed folders: a folder of files written whole or not at all, with every file's size and SHA-256
in ``checksums.json``, checked when it is read. Trainer checkpoints and drafters are written so.

Writing ``NAME`` (:func:`write_folder`; one writer per folder at a time):

1. a staging folder ``.NAME.staging-XXXX`` is made beside it (the staging and trash folders a
   killed writer left are removed first);
2. the caller writes its files into the staging folder; each is fsynced and hashed, then
   ``checksums.json`` is written (temporary name, fsync, rename) and the folder fsynced;
3. the swap: the ``NAME.prev`` of the write before is moved to a trash name and removed, an
   existing ``NAME`` is renamed ``NAME.prev``, the staging folder takes the name ``NAME`` and the
   parent is fsynced; without ``keep_previous`` ``NAME.prev`` is then removed.

So the two complete copies stay while the new one is written (three are on disk until the swap),
and a SIGKILL or a power cut at any point leaves ``NAME`` complete or, between the two renames of
the swap, only ``NAME.prev``, complete (the next write first renames it back); besides them at most
a staging or trash folder no reader looks at. A full disk (ENOSPC, EDQUOT, EFBIG:
:data:`OUT_OF_SPACE`) fails in step 2: the staging folder is removed, the ``OSError`` raised and
``NAME`` and ``NAME.prev`` left as they were.

Reading: :func:`check_folder` compares each listed file's size and SHA-256 with ``checksums.json``
and raises :class:`ChecksumError` naming the file; a folder without ``checksums.json`` (written
before checksums, or by another tool) is not checked. :func:`read_newest` reads ``NAME``, else
``NAME.prev``, and says which it refused and why.
"""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Generic, TypeVar

import msgspec

from specroll.engine.loaders.errors import ChecksumError

CHECKSUMS_FILE = "checksums.json"
"""Each sealed folder's list of its files: ``{"format": 1, "files": {name: {"bytes", "sha256"}}}``."""
FORMAT = 1
PREV_SUFFIX = ".prev"
OUT_OF_SPACE = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})
"""``OSError.errno`` values of a full disk, a full quota or a file-size limit."""

T = TypeVar("T")


class FileSum(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One file of a sealed folder."""

    bytes: Annotated[int, msgspec.Meta(ge=0)]
    sha256: Annotated[str, msgspec.Meta(pattern="^[0-9a-f]{64}$")]


class Checksums(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """``checksums.json``."""

    format: int
    files: dict[str, FileSum]


@dataclass(frozen=True)
class Newest(Generic[T]):
    """What :func:`read_newest` read: the folder and its value (both None when none was read), and
    the errors of the newer folders it refused, newest first."""

    path: Path | None
    value: T | None
    refused: list[Exception] = field(default_factory=list)


def write_folder(target: Path, write: Callable[[Path], object], *, keep_previous: bool = False) -> Path:
    """Write the sealed folder ``target`` (module docstring): ``write(staging)`` puts its files, plain
    files with names not starting with a dot, into the empty staging folder; returns ``target``.

    Raises:
        OSError: a file cannot be written (a full disk: ``errno`` in :data:`OUT_OF_SPACE`), or
            ``target`` holds a file this write would not replace (named; nothing is overwritten).
            The staging folder is removed and ``target`` left as it was.
    """
    target = Path(target).absolute()
    target.parent.mkdir(parents=True, exist_ok=True)
    prev = _prev(target)
    for stale in (*target.parent.glob(f".{target.name}.staging-*"), *target.parent.glob(f".{target.name}.trash-*")):
        shutil.rmtree(stale, ignore_errors=True)  # a killed writer's: this is the folder's one writer
    if prev.exists() and not target.exists():  # a writer killed in the swap: prev is the newest
        os.rename(prev, target)
    check_replaceable(target)  # before the write: a target it cannot replace fails it at once
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.staging-"))
    try:
        os.chmod(staging, 0o777 & ~_umask())  # mkdtemp makes 0700; a folder of the usual mode
        write(staging)
        seal(staging)
        if target.exists():
            _check_replaceable(target, staging)
            old = _trash(prev) if prev.exists() else None  # the one before: the newest becomes the previous
            try:
                os.rename(target, prev)
            except BaseException:
                if old is not None:  # the newest cannot move (EPERM, EXDEV): the one before stays
                    os.rename(old / prev.name, prev)
                    old.rmdir()
                raise
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
        os.rename(staging, target)
        _fsync(target.parent)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if not keep_previous and prev.exists():
        _remove(prev)
    return target


def seal(folder: Path) -> Checksums:
    """fsync every file of ``folder`` (names not starting with a dot), write its ``checksums.json``
    (atomically) and fsync the folder; returns what was written.

    Raises:
        OSError: a file cannot be read, synced or written.
        ValueError: ``folder`` holds something other than plain files.
    """
    files: dict[str, FileSum] = {}
    for path in sorted(folder.iterdir()):
        if path.name.startswith(".") or path.name == CHECKSUMS_FILE:
            continue
        if not path.is_file() or path.is_symlink():
            raise ValueError(f"{path}: not a plain file; a sealed folder holds plain files only")
        with path.open("rb") as f:
            os.fsync(f.fileno())
            size = os.fstat(f.fileno()).st_size
            files[path.name] = FileSum(bytes=size, sha256=hashlib.file_digest(f, "sha256").hexdigest())
    checksums = Checksums(format=FORMAT, files=files)
    write_bytes_atomic(folder / CHECKSUMS_FILE, msgspec.json.format(msgspec.json.encode(checksums), indent=1) + b"\n")
    return checksums


def check_folder(folder: Path, contents: bool = True) -> bool:
    """Check ``folder`` against its ``checksums.json``: each listed file present, of its size and,
    with ``contents``, of its SHA-256 (reads every byte). Returns False when the folder has no
    ``checksums.json`` (not checked), True when it passed.

    Raises:
        ChecksumError: naming the file: missing, of another size (cut short), of another SHA-256
            (changed after it was written), or a ``checksums.json`` that does not parse.
    """
    listing = folder / CHECKSUMS_FILE
    try:
        raw = listing.read_bytes()
    except (FileNotFoundError, NotADirectoryError):  # not sealed, or no folder: the caller says what is missing
        return False
    except OSError as exc:
        raise ChecksumError(listing, f"cannot read it ({exc.strerror or exc})") from None
    try:
        checksums = msgspec.json.decode(raw, type=Checksums)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise ChecksumError(listing, f"not a checksum list ({exc}); expected the one specroll writes") from None
    if checksums.format != FORMAT:
        raise ChecksumError(listing, f"format {checksums.format}, expected {FORMAT}")
    for name, expected in checksums.files.items():
        path = folder / name
        if Path(name).name != name or name.startswith(".") or name == CHECKSUMS_FILE:
            raise ChecksumError(listing, f"lists {name!r}, expected a file name of this folder")
        try:
            with path.open("rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size != expected.bytes:
                    raise ChecksumError(path, f"{size} bytes, {CHECKSUMS_FILE} says {expected.bytes} (cut short "
                                              "or changed after it was written)")
                if contents and (digest := hashlib.file_digest(f, "sha256").hexdigest()) != expected.sha256:
                    raise ChecksumError(path, f"SHA-256 {digest[:16]}…, {CHECKSUMS_FILE} says "
                                              f"{expected.sha256[:16]}… (changed after it was written)")
        except FileNotFoundError:
            raise ChecksumError(path, f"missing; {CHECKSUMS_FILE} lists it") from None
        except OSError as exc:
            raise ChecksumError(path, f"cannot read it ({exc.strerror or exc})") from None
    return True


def versions(target: Path) -> list[Path]:
    """``target`` and ``target.prev``, those that exist, newest first."""
    return [p for p in (Path(target), _prev(Path(target))) if p.is_dir()]


def read_newest(target: Path, read: Callable[[Path], T],
                refuse: tuple[type[Exception], ...] = (ChecksumError,)) -> Newest[T]:
    """``read`` the newest of :func:`versions` it does not fail on with one of ``refuse``.

    Raises:
        Exception: whatever ``read`` raises other than ``refuse``.
    """
    refused: list[Exception] = []
    for path in versions(target):
        try:
            return Newest(path, read(path), refused)
        except refuse as exc:
            refused.append(exc)
    return Newest(None, None, refused)


def write_bytes_atomic(path: Path, data: bytes, mode: int | None = None) -> Path:
    """Write ``data`` to ``path`` all or nothing: a temporary file beside it, fsynced, renamed over
    ``path``, the folder fsynced; on any error the temporary file is removed and ``path`` untouched.
    ``mode``: the file's permissions (None: the usual ones under the umask).

    Raises:
        OSError: the folder is not writable or the disk is full.
    """
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
            os.fchmod(f.fileno(), usual_mode() if mode is None else mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync(path.parent)
    return path


def usual_mode() -> int:
    """The permissions of a new file under the process's umask (``0o666 & ~umask``)."""
    return 0o666 & ~_umask()


def _prev(target: Path) -> Path:
    return target.with_name(target.name + PREV_SUFFIX)


def check_replaceable(target: Path) -> None:
    """``target`` is absent, or a folder :func:`write_folder` may replace: not a file or a link, and,
    when sealed, holding only what its ``checksums.json`` lists (and dot files).

    Raises:
        FileExistsError: naming ``target`` and what is wrong with it.
    """
    if not os.path.lexists(target):
        return
    if not target.is_dir() or target.is_symlink():
        raise FileExistsError(errno.EEXIST, "exists and is not a folder; expected a folder to replace", str(target))
    try:
        listed = set(msgspec.json.decode((target / CHECKSUMS_FILE).read_bytes(), type=Checksums).files)
    except (OSError, msgspec.ValidationError, msgspec.DecodeError):
        return  # not sealed (or its list unreadable): the check against the new folder's names decides
    other = sorted(p.name for p in target.iterdir()
                   if p.name not in listed and p.name != CHECKSUMS_FILE and not p.name.startswith("."))
    if other:
        raise FileExistsError(errno.EEXIST, f"holds files this write would not replace ({', '.join(other[:4])}); "
                                            "expected a folder written by specroll", str(target))


def _check_replaceable(target: Path, staging: Path) -> None:
    """``target`` may be replaced: a folder holding only names the new one has (and dot files)."""
    if not target.is_dir() or target.is_symlink():
        raise FileExistsError(errno.EEXIST, "exists and is not a folder; expected a folder to replace", str(target))
    ours = {p.name for p in staging.iterdir()}
    other = sorted(p.name for p in target.iterdir() if p.name not in ours and not p.name.startswith("."))
    if other:
        raise FileExistsError(errno.EEXIST, f"holds files this write would not replace ({', '.join(other[:4])}); "
                                            "expected a folder written by specroll", str(target))


def _remove(folder: Path) -> None:
    """Remove ``folder`` at once for a reader: renamed to a trash name, then deleted."""
    shutil.rmtree(_trash(folder), ignore_errors=True)


def _trash(folder: Path) -> Path:
    """Move ``folder`` out of readers' sight, into a new trash folder beside it (returned), which the
    next write removes if this one does not."""
    trash = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{folder.name.removesuffix(PREV_SUFFIX)}.trash-"))
    os.rename(folder, trash / folder.name)
    return trash


def _umask() -> int:
    """The process's umask, read from /proc (setting it to read it back races with other threads)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
