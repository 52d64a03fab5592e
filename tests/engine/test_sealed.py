"""Sealed folders (``specroll.engine.loaders.sealed``): written whole or not at all, checked on load,
through a SIGKILL at every point of a write and a full disk, in real child processes."""

from __future__ import annotations

import errno
import hashlib
import json
import os
from pathlib import Path

import pytest
from helpers.storage_faults import DISK_FULL, can_mount, disk_folder, run_child, run_to_stop

from specroll.engine.loaders import sealed
from specroll.engine.loaders.errors import ChecksumError
from specroll.engine.loaders.sealed import CHECKSUMS_FILE, check_folder, read_newest, write_folder

DATA_BYTES = 64 * 1024


def writer(version: int):  # type: ignore[no-untyped-def]
    """A folder's files: ``data.bin`` (written in two halves) and ``version.txt``."""

    def write(folder: Path) -> None:
        with open(folder / "data.bin", "wb") as f:
            f.write(bytes([version]) * (DATA_BYTES // 2))
            f.flush()
            os.fsync(f.fileno())  # a point of its own: half a file on disk
            f.write(bytes([version]) * (DATA_BYTES // 2))
        (folder / "version.txt").write_text(str(version))

    return write


def version_of(folder: Path) -> int:
    """The version a folder holds, after its checksums and its data agree."""
    check_folder(folder)
    version = int((folder / "version.txt").read_text())
    assert (folder / "data.bin").read_bytes() == bytes([version]) * DATA_BYTES
    return version


def leftovers(parent: Path, name: str) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name not in (name, name + ".prev"))


# ---- the files ----------------------------------------------------------------------------------


def test_a_sealed_folder_lists_each_file_size_and_sha256(tmp_path: Path) -> None:
    target = write_folder(tmp_path / "out", writer(3))
    listing = json.loads((target / CHECKSUMS_FILE).read_text())
    assert listing["format"] == 1
    assert listing["files"] == {name: {"bytes": (target / name).stat().st_size,
                                       "sha256": hashlib.sha256((target / name).read_bytes()).hexdigest()}
                                for name in ("data.bin", "version.txt")}
    assert check_folder(target) is True and version_of(target) == 3
    assert leftovers(tmp_path, "out") == []  # no staging folder or temporary file left
    umask = os.umask(0o22)
    os.umask(umask)
    assert (target.stat().st_mode & 0o777, (target / "data.bin").stat().st_mode & 0o777) == (
        0o777 & ~umask, 0o666 & ~umask)


@pytest.mark.parametrize("damage", ["flip a byte", "truncate", "delete a file", "garble the list", "list a stranger"])
def test_a_damaged_folder_is_refused_naming_the_file(tmp_path: Path, damage: str) -> None:
    target = write_folder(tmp_path / "out", writer(1))
    data, listing = target / "data.bin", target / CHECKSUMS_FILE
    if damage == "flip a byte":
        raw = bytearray(data.read_bytes())
        raw[DATA_BYTES // 3] ^= 0x01
        data.write_bytes(bytes(raw))
        bad, says = data, "SHA-256"
    elif damage == "truncate":
        os.truncate(data, DATA_BYTES - 100)
        bad, says = data, f"{DATA_BYTES - 100} bytes, checksums.json says {DATA_BYTES}"
    elif damage == "delete a file":
        data.unlink()
        bad, says = data, "missing"
    elif damage == "garble the list":
        listing.write_text(listing.read_text()[:40])
        bad, says = listing, "not a checksum list"
    else:
        raw = json.loads(listing.read_text())
        raw["files"]["../elsewhere"] = raw["files"]["data.bin"]
        listing.write_text(json.dumps(raw))
        bad, says = listing, "expected a file name of this folder"
    with pytest.raises(ChecksumError) as refused:
        check_folder(target)
    assert refused.value.path == bad and str(refused.value).startswith(f"{bad}: ") and says in str(refused.value)
    if damage == "flip a byte":  # the size-only check passes what only the contents show
        assert check_folder(target, contents=False) is True


def test_a_folder_without_checksums_is_not_checked(tmp_path: Path) -> None:
    target = write_folder(tmp_path / "out", writer(1))
    (target / CHECKSUMS_FILE).unlink()  # as written before checksums, or by another tool
    assert check_folder(target) is False
    assert check_folder(tmp_path / "missing") is False


def test_the_previous_folder_is_kept_and_never_more_than_one(tmp_path: Path) -> None:
    for version in range(4):
        write_folder(tmp_path / "out", writer(version), keep_previous=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "out.prev"]
    assert (version_of(tmp_path / "out"), version_of(tmp_path / "out.prev")) == (3, 2)
    write_folder(tmp_path / "out", writer(4))  # without keep_previous: the one before goes
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_read_newest_falls_back_to_the_previous_and_says_what_it_refused(tmp_path: Path) -> None:
    for version in (1, 2):
        write_folder(tmp_path / "out", writer(version), keep_previous=True)
    os.truncate(tmp_path / "out" / "data.bin", 10)
    found = read_newest(tmp_path / "out", version_of)
    assert (found.path, found.value) == (tmp_path / "out.prev", 1)
    assert [getattr(e, "path", None) for e in found.refused] == [tmp_path / "out" / "data.bin"]
    os.truncate(tmp_path / "out.prev" / "version.txt", 0)
    found = read_newest(tmp_path / "out", version_of)
    assert (found.path, found.value, len(found.refused)) == (None, None, 2)


def test_a_folder_holding_other_files_is_not_replaced(tmp_path: Path) -> None:
    target = tmp_path / "out"
    target.mkdir()
    (target / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match=r"notes\.txt"):
        write_folder(target, writer(1))
    assert sorted(p.name for p in target.iterdir()) == ["notes.txt"] and leftovers(tmp_path, "out") == []


@pytest.mark.parametrize("what", ["a file", "a sealed folder with a stranger"])
def test_a_target_that_cannot_be_replaced_keeps_the_previous_folder(tmp_path: Path, what: str) -> None:
    """The check comes before the previous folder is removed: a refused write loses no good copy."""
    target = tmp_path / "out"
    for version in (1, 2):
        write_folder(target, writer(version), keep_previous=True)
    if what == "a file":
        for p in target.iterdir():
            p.unlink()
        target.rmdir()
        target.write_text("hi")
    else:
        (target / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="is not a folder" if what == "a file" else r"notes\.txt"):
        write_folder(target, writer(3), keep_previous=True)
    assert version_of(tmp_path / "out.prev") == 1 and leftovers(tmp_path, "out") == []


def test_both_copies_stay_while_a_new_one_is_written_and_when_it_fails(tmp_path: Path) -> None:
    """The previous folder goes only in the swap: a write that fails (a full disk) or is killed while
    it writes its files loses neither the newest copy nor the one before it."""
    target = tmp_path / "out"
    for version in (1, 2):
        write_folder(target, writer(version), keep_previous=True)
    seen: list[tuple[int, int]] = []

    def fill_the_disk(folder: Path) -> None:
        seen.append((version_of(target), version_of(tmp_path / "out.prev")))
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OSError, match="No space"):
        write_folder(target, fill_the_disk, keep_previous=True)
    assert seen == [(2, 1)]  # both, while it wrote
    assert (version_of(target), version_of(tmp_path / "out.prev")) == (2, 1) and leftovers(tmp_path, "out") == []


def test_a_newest_copy_that_cannot_move_keeps_the_one_before(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The swap's first rename fails (an immutable folder: EPERM even for root): the one before,
    already out of sight, comes back; nothing is lost and nothing is left."""
    target = tmp_path / "out"
    for version in (1, 2):
        write_folder(target, writer(version), keep_previous=True)
    rename = os.rename

    def immutable(src: os.PathLike[str] | str, dst: os.PathLike[str] | str) -> None:
        if Path(src) == target:
            raise PermissionError(errno.EPERM, "Operation not permitted", str(src))
        rename(src, dst)

    monkeypatch.setattr(sealed.os, "rename", immutable)
    with pytest.raises(PermissionError):
        write_folder(target, writer(3), keep_previous=True)
    assert (version_of(target), version_of(tmp_path / "out.prev")) == (2, 1) and leftovers(tmp_path, "out") == []


# ---- a SIGKILL anywhere in a write ----------------------------------------------------------------

KILLED_WRITER = """
import os, sys
from pathlib import Path
from helpers.storage_faults import stop_before_call
from specroll.engine.loaders.sealed import write_folder

target, keep = Path(sys.argv[1]), sys.argv[3] == "1"
version, n, size = int(sys.argv[2]), int(sys.argv[4]), int(sys.argv[5])

def write(folder):  # as writer() in the test module
    with open(folder / "data.bin", "wb") as f:
        f.write(bytes([version]) * (size // 2))
        f.flush()
        os.fsync(f.fileno())
        f.write(bytes([version]) * (size // 2))
    (folder / "version.txt").write_text(str(version))

stop_before_call(n)
write_folder(target, write, keep_previous=keep)
"""


@pytest.mark.integration
@pytest.mark.parametrize("keep_previous", [True, False], ids=["keep-previous", "replace"])
def test_a_sigkill_at_any_point_of_a_write_leaves_the_old_or_the_new_folder(tmp_path: Path,
                                                                            keep_previous: bool) -> None:
    """The writer of version 3 is SIGKILLed before its n-th file-system call, for every n: the folder
    read afterwards is version 2 or 3, never refused; the next write succeeds and leaves nothing else."""
    kills, n = 0, 0
    while True:
        n += 1
        parent = tmp_path / f"kill-{n}"
        target = parent / "out"
        for version in (1, 2):
            write_folder(target, writer(version), keep_previous=keep_previous)
        if not run_to_stop(KILLED_WRITER, target, 3, int(keep_previous), n, DATA_BYTES):
            break  # the write ran to its end: every point before it was killed once
        kills += 1
        found = read_newest(target, version_of)
        assert found.refused == [] and found.value in (2, 3), (n, found)
        write_folder(target, writer(4), keep_previous=keep_previous)
        assert leftovers(parent, "out") == [], n  # the killed writer's staging and trash folders are gone
        assert version_of(target) == 4
        if keep_previous:
            assert version_of(parent / "out.prev") == found.value  # the newest before is the one kept
    assert kills >= 10  # the write has that many points at least: staging, files, list, swap
    assert read_newest(target, version_of).value == 3


# ---- a full disk ------------------------------------------------------------------------------------

FULL_WRITER = """
import errno, json, sys
from pathlib import Path
from helpers.storage_faults import make_disk_full
from specroll.engine.loaders.sealed import write_folder

target, fault = Path(sys.argv[1]), sys.argv[2]
make_disk_full(fault, target.parent)
try:
    write_folder(target, lambda folder: (folder / "data.bin").write_bytes(b"x" * 65536), keep_previous=True)
except OSError as e:
    print(json.dumps({"errno": e.errno, "message": str(e)}))
else:
    print(json.dumps({"errno": None}))
"""


@pytest.mark.integration
@pytest.mark.parametrize("fault", sorted(DISK_FULL))
def test_a_full_disk_fails_the_write_and_leaves_the_folder_as_it_was(tmp_path: Path, fault: str) -> None:
    if fault == "ENOSPC" and not can_mount():
        pytest.skip("ENOSPC needs a tmpfs, which only root with mount rights makes; EFBIG runs here instead")
    folder = tmp_path / "disk"
    with disk_folder(fault, folder, 1 << 20):
        target = folder / "out"
        write_folder(target, writer(1), keep_previous=True)
        done = run_child(FULL_WRITER, target, fault)
        assert done.returncode == 0, done.stderr
        result = json.loads(done.stdout)
        assert result["errno"] == DISK_FULL[fault], result
        assert version_of(target) == 1 and read_newest(target, version_of).refused == []
        assert sorted(p.name for p in folder.iterdir() if p.name != ".filler") == ["out"]  # no staging left
        assert errno.errorcode[DISK_FULL[fault]] == fault
