"""Everything the app writes under its data directory (prepared models, converted and routed models, stored
served formats) is written here, and read back through the checks here.

A target (a directory) is built in a staging directory beside it and renamed into place, so a reader sees either
no target or a whole one; a completeness stamp inside it says so. Writers of one target take a lock on a lock file
(`fcntl.flock`): a second writer waits, and a staging (or set-aside) directory whose target lock is free belongs to
a dead process (kill -9, power loss) and is removed by `clean_stale`. The lock file lies beside a target inside the
app's own directories; a target the user named (`chatapp convert`, `chatapp route --out`) passes `locks`, a
directory of the app's, so nothing but the output itself appears where the user pointed. A lock file is removed
by the writer that holds it as it finishes (`target_lock`), and one a killed writer left by `clean_locks`.
`check_output` is the rule for a user-named output directory: a new or empty directory, or one chatapp wrote itself
(its stamp), never a directory of the user's own files nor a link; `check_output_file` the same rule for an output
file: a new path, or a regular file chatapp wrote, never a user's file, a directory, a device, a FIFO or a link. Reads go through `open_regular`, which opens non-blocking and
refuses anything but a regular file, so a FIFO or a device in the store never hangs a reader.

This module is a leaf: it imports only `chatapp.errors` and the standard library.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import re
import shutil
import stat
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

from chatapp.errors import DataDirError

STAMP = ".complete"
"""The file inside a target that says it was written whole (JSON: the store's format version)."""
STAMP_FORMAT = 1
_STAGING = ".staging-"  # .NAME.staging-XXXXXXXX : a target being written
_ASIDE = ".old-"  # .NAME.old-XXXXXXXX : a replaced target on its way out
_LOCK = ".lock"  # .NAME.lock : the target's lock file
_OURS = re.compile(r"^\.(?P<name>.+)\.(?:staging|old)-[a-z0-9_]{8}$")
# What earlier versions left (`tempfile.mkdtemp(prefix=f".{name}.")`): only removed where `legacy=True`.
_LEGACY = re.compile(r"^\.(?P<name>.+)\.[a-z0-9_]{8}$")

_held: dict[tuple[Path, int], list] = {}  # (lock path, thread) -> [fd, depth]: re-entrant within a thread
_held_guard = threading.Lock()
_live: set[Path] = set()  # this process's staging directories being written


def lock_path(target: Path, locks: Path | None = None) -> Path:
    """The lock file of `target`: beside it, hidden; or in the directory `locks`, named by a hash of the target's
    resolved path (so that `out`, `./out` and a symlink to it share one lock)."""
    if locks is None:
        return target.parent / f".{target.name}{_LOCK}"
    digest = hashlib.sha256(os.fsencode(Path(target).expanduser().resolve())).hexdigest()[:32]
    return locks / f"{digest}{_LOCK}"


@contextlib.contextmanager
def target_lock(target: str | Path, *, blocking: bool = True, locks: Path | None = None) -> Iterator[bool]:
    """Hold the lock of `target` (yields True), waiting for another writer unless `blocking` is False (then yields
    False at once when another process or thread holds it). Re-entrant within a thread. `locks`: the directory
    of the lock file (`lock_path`), created if missing."""
    path = lock_path(Path(target), locks)
    key = (path, threading.get_ident())
    with _held_guard:
        entry = _held.get(key)
        if entry is not None:
            entry[1] += 1
    if entry is not None:
        try:
            yield True
        finally:
            with _held_guard:
                entry[1] -= 1
        return
    if locks is not None:
        locks.mkdir(parents=True, exist_ok=True)
    fd = _locked_fd(path, blocking)
    if fd is None:
        yield False
        return
    try:
        with _held_guard:
            _held[key] = entry = [fd, 1]
        try:
            yield True
        finally:
            with _held_guard:
                entry[1] -= 1
                if entry[1] == 0:
                    del _held[key]
    finally:
        # Unlinked while still held: a waiter that then gets the lock of the unlinked file sees that the path no
        # longer names it (`_locked_fd`) and locks the path's new file instead, so no two writers ever both hold one.
        with contextlib.suppress(OSError):
            os.unlink(path)
        os.close(fd)  # releases the flock


def _locked_fd(path: Path, blocking: bool) -> int | None:
    """An open descriptor of the lock file `path`, flock-ed exclusively, that `path` still names; None when
    `blocking` is False and another holds it."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
        except BlockingIOError:
            os.close(fd)
            return None
        except BaseException:
            os.close(fd)
            raise
        try:
            now = os.stat(path)
        except FileNotFoundError:
            now = None
        held = os.fstat(fd)
        if now is not None and (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino):
            return fd
        os.close(fd)  # the holder before us removed this file as it finished: lock the path's new one


def is_complete(target: str | Path) -> bool:
    """Whether `target` is a directory written whole by `staged_dir` (its stamp is there and readable)."""
    return _read_stamp(Path(target)) is not None


def _read_stamp(target: Path) -> dict | None:
    try:
        stamp = json.loads(read_regular_bytes(target / STAMP, _STAMP_BYTES))
    except (DataDirError, OSError, ValueError):
        return None
    return stamp if isinstance(stamp, dict) and stamp.get("format") == STAMP_FORMAT else None


_STAMP_BYTES = 1 << 20  # a stamp with checksums names every file of its target: a few hundred bytes each


def write_stamp(directory: str | Path, *, checksums: bool = False) -> None:
    """Put the completeness stamp in `directory`, once everything else in it is written (`is_complete`); with
    `checksums`, the stamp also records every file's size and SHA-256 (`files_damage` checks them)."""
    stamp: dict = {"format": STAMP_FORMAT}
    if checksums:
        stamp[_FILES] = {name: _file_record(Path(directory) / name) for name in _stamped_names(Path(directory))}
    (Path(directory) / STAMP).write_text(json.dumps(stamp, indent=1) + "\n", encoding="utf-8")


# ------------------------------------------------------------------------------------------ checking what is read
# A target written with checksums is checked when it is read back (`files_damage`), because its files are what a
# later command runs (the prepared default model: 570 MB that `generate` would otherwise serve whatever a disk or a
# stray write left in them). Hashing them at every start costs too much (sha256 of the default model's files: 0.5 s
# of a 3 s `generate` on the 2-core box), so each file's record also keeps its identity when it was last hashed:
# size, modification time, inode change time (ctime) and inode number. Any write to a file through the file system
# moves its ctime, which no user call can set back (`touch -d` and `os.utime` set mtime, and move ctime doing so), and
# a copy gets a new inode: a file whose identity is unchanged has had nothing written to it since it was hashed, and
# is not read. A file whose identity changed is hashed whole and compared; when it still matches (a copied or backed
# up data directory) its new identity is recorded, so the next start reads nothing again. Damage below the file
# system (a failing disk) leaves the identity alone; the served store, which is what a CPU start reads, checks its
# own bytes every load (`stt.served.check_sums`).
_FILES = "files"


def _stamped_names(directory: Path) -> list[str]:
    """The files under `directory` a stamp records (relative, POSIX), the stamp itself excepted."""
    names = []
    for path in sorted(directory.rglob("*")):
        if path.is_file() and not path.is_symlink() and path.name != STAMP:
            names.append(path.relative_to(directory).as_posix())
    return names


def _identity(info: os.stat_result) -> list[int]:
    return [info.st_size, info.st_mtime_ns, info.st_ctime_ns, info.st_ino]


def _sha256(path: Path) -> tuple[str, os.stat_result]:
    with open_regular(path) as fh:
        digest = hashlib.file_digest(fh, "sha256").hexdigest()
        return digest, os.fstat(fh.fileno())


def _file_record(path: Path) -> dict:
    digest, info = _sha256(path)
    return {"size": info.st_size, "sha256": digest, "seen": _identity(info)}


def has_checksums(target: str | Path) -> bool:
    """Whether `target` is complete and its stamp records its files' checksums (`write_stamp(checksums=True)`)."""
    stamp = _read_stamp(Path(target))
    return stamp is not None and isinstance(stamp.get(_FILES), dict)


def files_damage(target: str | Path, *, locks: Path | None = None) -> str | None:
    """What is wrong with the files of `target` against the checksums its stamp records, or None when every file is
    whole. A target without a stamp, or whose stamp records no checksums, is reported too (nothing vouches for it).
    Cheap when nothing was written to the files since they were last hashed (see above: no file is read then);
    a file whose identity moved is hashed, and when it matches, its new identity is recorded (best effort: under
    the target's lock, in `locks` as `target_lock` has it, when no writer holds it)."""
    target = Path(target)
    stamp = _read_stamp(target)
    if stamp is None:
        return f"its completeness stamp {STAMP} is missing or unreadable"
    files = stamp.get(_FILES)
    if not isinstance(files, dict) or not files:
        return f"its stamp {STAMP} records no checksums"
    moved = False
    try:
        for name, record in files.items():
            path = target / name
            try:
                info = os.stat(path, follow_symlinks=False)
            except FileNotFoundError:
                return f"{name} is missing"
            if not stat.S_ISREG(info.st_mode):
                return f"{name} is not a regular file ({_kind(info.st_mode)})"
            if info.st_size != record["size"]:
                return f"{name} is {info.st_size} bytes, not the {record['size']} it was written with"
            if _identity(info) == record.get("seen"):
                continue
            digest, now = _sha256(path)
            if digest != record["sha256"]:
                return f"{name} does not match its checksum (its bytes changed after it was written)"
            record["seen"] = _identity(now)
            moved = True
    except (OSError, DataDirError) as err:
        return f"its files cannot be read: {getattr(err, 'message', None) or err}"
    except (KeyError, TypeError) as err:
        return f"its stamp {STAMP} does not describe its files ({err})"
    if moved:
        _remember_identities(target, stamp, locks)
    return None


def _remember_identities(target: Path, stamp: dict, locks: Path | None) -> None:
    text = json.dumps(stamp, indent=1) + "\n"

    def write(tmp: Path) -> None:
        tmp.write_text(text, encoding="utf-8")
        tmp.chmod(0o644)  # as the stamp it replaces (a temporary file is created private)

    try:
        with target_lock(target, blocking=False, locks=locks) as locked:
            if locked:
                atomic_write(target / STAMP, write)
    except OSError:
        pass  # a read-only data directory: the next start hashes the files again, and finds them as whole


def check_output(target: str | Path, what: str) -> Path:
    """`target` as a directory a command may write its output to, checked before any work and creating nothing:
    a new path whose nearest existing ancestor is writable, an empty directory, or a directory chatapp wrote itself
    (its stamp: `is_complete`) that can be replaced. A directory of anything else is the user's, and refused."""
    target = Path(target).expanduser()
    if target.is_symlink() and not target.exists():
        raise DataDirError(f"the {what} {target} is a dangling symbolic link", hint="remove it or pick another path")
    if target.is_symlink():
        # The output is renamed into place: over a link that would fail only after the work (a directory cannot
        # replace a link), or replace the link itself, which is the user's.
        raise DataDirError(
            f"the {what} {target} is a symbolic link (to {_link_text(target)})",
            hint=f"give the directory itself ({target.resolve()}) or a new path",
        )
    if target.exists() and not target.is_dir():
        raise DataDirError(
            f"the {what} {target} already exists and is not a directory", hint="give a new (or empty) directory"
        )
    check_writable_dir(target.parent, f"parent directory of the {what}", create=False)
    if target.is_dir():
        try:
            empty = not any(os.scandir(target))
        except OSError as err:
            raise DataDirError(f"cannot read the {what} {target}: {err.strerror or err}", hint=_new_dir_hint) from None
        if not empty and not is_complete(target):
            raise DataDirError(
                f"the {what} {target} already exists and holds files chatapp did not write",
                hint=_new_dir_hint,
            )
        check_writable_dir(target, what, create=False)  # replacing it removes what is in it
    return target


_new_dir_hint = "give a new (or empty) directory: chatapp replaces only a directory it wrote itself"


def check_output_file(target: str | Path, what: str, *, ours: Callable[[Path], bool]) -> Path:
    """`target` as a file a command may write its output to (`atomic_write` renames it into place), checked before
    any work and creating nothing: a new path whose directory (or nearest existing ancestor) is writable, or a
    regular file chatapp wrote itself (`ours(target)`), which is replaced whole. Anything else is refused: a user's
    file (its contents would be gone), a directory, a FIFO, a device (`-o /dev/null` would replace the machine's
    /dev/null with a regular file), a socket, a symbolic link (the rename replaces the link, not what it names)."""
    target = Path(target).expanduser()
    try:
        mode: int | None = os.lstat(target).st_mode
    except FileNotFoundError:
        mode = None
    except OSError as err:  # a file where a directory of the path should be, or a directory that cannot be searched
        raise DataDirError(
            f"cannot use the {what} {target}: {err.strerror or err}", hint="give a path in a writable directory"
        ) from None
    new_file = "give the path of a new file"
    if mode is not None:
        if stat.S_ISLNK(mode):
            raise DataDirError(
                f"the {what} {target} is a symbolic link (to {_link_text(target)})",
                hint=f"{new_file}: chatapp never writes through a link",
            )
        if stat.S_ISDIR(mode):
            raise DataDirError(f"the {what} {target} is a directory", hint=f"{new_file}, e.g. one inside {target}")
        if not stat.S_ISREG(mode):
            raise DataDirError(f"the {what} {target} is {_kind(mode)}, not a file", hint=new_file)
        if not ours(target):
            raise DataDirError(
                f"the {what} {target} already exists and is not a file chatapp wrote",
                hint=f"{new_file}: chatapp replaces only a file it wrote itself",
            )
    check_writable_dir(target.parent, f"directory of the {what}", create=False)
    return target


def _link_text(path: Path) -> str:
    try:
        return os.readlink(path)
    except OSError:
        return "?"


@contextlib.contextmanager
def staged_dir(
    target: str | Path,
    *,
    stamp: bool = True,
    what: str = "directory",
    locks: Path | None = None,
    checksums: bool = False,
) -> Iterator[Path]:
    """Yield an empty staging directory beside `target`; when the block ends without an exception, put the
    completeness stamp in it (unless `stamp` is False) and rename it into place, replacing any earlier `target`. On
    any exception (KeyboardInterrupt too) the staging directory is removed and `target` is left as it was. The
    target's lock (in `locks`, else beside it: `lock_path`) is held throughout, and stale staging and set-aside
    directories of the same target are removed first. `checksums`: the stamp records every file's checksum, for
    `files_damage` to check when the target is read back."""
    target = Path(target)
    check_writable_dir(target.parent, f"parent of the {what}")
    if target.exists() and not target.is_dir():
        raise DataDirError(
            f"the {what} {target} exists and is not a directory", hint=f"remove {target} or pick another path"
        )
    if target.is_dir():
        check_writable_dir(target, what)  # else its files could not be removed once it is replaced
    with target_lock(target, locks=locks):
        clean_stale(target.parent, target.name, locks=locks)
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}{_STAGING}", dir=target.parent))
        _live.add(staging)
        try:
            yield staging
            if stamp:
                write_stamp(staging, checksums=checksums)
            os.chmod(staging, 0o755)  # mkdtemp makes it private; a model directory is not
            _replace_dir(staging, target)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        finally:
            _live.discard(staging)


def _replace_dir(staging: Path, target: Path) -> None:
    """Rename `staging` to `target`. A directory cannot be renamed over a non-empty one, so an existing target is
    first renamed aside, over an empty directory of a fresh name in the same parent (a crash in between leaves no
    target and the aside directory, which `clean_stale` removes). A rename that fails puts everything back."""
    try:
        os.rename(staging, target)
        return
    except OSError as err:
        if err.errno not in (errno.ENOTEMPTY, errno.EEXIST):
            raise _replace_error(target, err) from None
    aside = Path(tempfile.mkdtemp(prefix=f".{target.name}{_ASIDE}", dir=target.parent))
    try:
        os.rename(target, aside)
    except OSError as err:
        with contextlib.suppress(OSError):
            os.rmdir(aside)
        raise _replace_error(target, err) from None
    try:
        os.rename(staging, target)
    except OSError as err:
        with contextlib.suppress(OSError):
            os.rename(aside, target)
        raise _replace_error(target, err) from None
    shutil.rmtree(aside, ignore_errors=True)


def _replace_error(target: Path, err: OSError) -> DataDirError:
    return DataDirError(
        f"cannot replace {target}: {err.strerror or err}",
        hint=f"make {target} and {target.parent} writable, or write the output somewhere else",
    )


def _stale_entries(parent: Path, name: str | None, legacy: bool) -> dict[str, list[Path]]:
    found: dict[str, list[Path]] = {}
    try:
        entries = list(os.scandir(parent))
    except OSError:
        return found
    for entry in entries:
        match = _OURS.match(entry.name) or (_LEGACY.match(entry.name) if legacy else None)
        if match is None or entry.name.endswith(_LOCK):
            continue
        if name is not None and match["name"] != name:
            continue
        try:
            if not entry.is_dir(follow_symlinks=False):
                continue
        except OSError:
            continue
        found.setdefault(match["name"], []).append(Path(entry.path))
    return found


def clean_stale(
    parent: str | Path, name: str | None = None, *, legacy: bool = False, locks: Path | None = None
) -> list[Path]:
    """Remove staging (and set-aside) directories in `parent` left by dead processes: those whose target's lock is
    free (a live writer holds it). `name` limits this to one target's; `legacy` also removes earlier versions'
    staging names (`.NAME.XXXXXXXX`; only in directories that hold nothing else hidden, as the data directory's);
    `locks`: where the targets' lock files are (`lock_path`). Never raises: a directory that cannot be cleaned is
    left for the next start. Returns what was removed."""
    parent = Path(parent)
    removed = []
    for target_name, paths in _stale_entries(parent, name, legacy).items():
        try:
            with target_lock(parent / target_name, blocking=False, locks=locks) as locked:
                if not locked:
                    continue
                for path in paths:
                    if path in _live:  # this thread is writing it
                        continue
                    shutil.rmtree(path, ignore_errors=True)
                    if not path.exists():
                        removed.append(path)
        except OSError:
            continue
    return removed


def clean_locks(locks: str | Path) -> list[Path]:
    """Remove the lock files in `locks` that no process holds: those of writers killed before they finished
    (kill -9 skips `target_lock`'s removal). Safe against a writer taking one meanwhile: it checks that the path
    still names the file it locked (`_locked_fd`). Never raises. Returns what was removed."""
    removed = []
    try:
        entries = [entry for entry in os.scandir(locks) if entry.name.endswith(_LOCK)]
    except OSError:
        return removed
    for entry in entries:
        try:
            fd = os.open(entry.path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            held, now = os.fstat(fd), os.stat(entry.path)
            if (held.st_dev, held.st_ino) == (now.st_dev, now.st_ino):
                os.unlink(entry.path)
                removed.append(Path(entry.path))
        except OSError:  # held by a live writer (BlockingIOError), or gone meanwhile
            pass
        finally:
            os.close(fd)
    return removed


# ------------------------------------------------------------------------------------------------------ reading
def atomic_write(path: str | Path, write: Callable[[Path], object], *, mode: int | None = None) -> None:
    """Call `write(tmp)` for a temporary file beside `path`, then rename it over `path`: a reader (or a run resumed
    after kill -9) sees the previous file or the whole new one, never a part. `mode`: the file's permissions (else
    the temporary file's private 0600), for a file the user reads with other tools."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(Path(tmp))
        if mode is not None:
            os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def open_regular(path: str | Path) -> BinaryIO:
    """Open `path` for reading in binary, refusing (DataDirError) anything but a regular file without blocking: a
    FIFO is opened non-blocking and refused by its type, where a plain `open` would wait for a writer forever."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as err:
        raise DataDirError(f"cannot read {path}: {err.strerror or err}", hint=_remove_hint(path)) from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise DataDirError(f"{path} is not a regular file ({_kind(mode)})", hint=_remove_hint(path))
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_regular_bytes(path: str | Path, max_bytes: int) -> bytes:
    """The contents of the regular file `path`, refusing (DataDirError) a non-regular file or one larger than
    `max_bytes` before reading it."""
    with open_regular(path) as fh:
        size = os.fstat(fh.fileno()).st_size
        if size > max_bytes:
            raise DataDirError(
                f"{path} is {size} bytes, more than the {max_bytes} expected", hint=_remove_hint(Path(path))
            )
        data = fh.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise DataDirError(f"{path} grew past {max_bytes} bytes while it was read", hint=_remove_hint(Path(path)))
    return data


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def _remove_hint(path: Path) -> str:
    return f"remove {path} (chatapp writes it again when needed)"


# ------------------------------------------------------------------------------------------------ the directory
def check_writable_dir(path: str | Path, what: str, *, create: bool = True) -> Path:
    """`path` as a directory this process can write in, created (with its parents) if missing; otherwise a
    DataDirError naming the path, what it is for, and the fix. Writability is probed by creating a file (mode bits
    say nothing for root, nor for a read-only mount). With `create` False a missing `path` is not created: its
    nearest existing ancestor must be a writable directory."""
    path = Path(path).expanduser()
    hint = "use a path in a writable directory"
    if path.exists() and not path.is_dir():
        raise DataDirError(f"the {what} {path} is not a directory", hint=f"remove the file {path}, or {hint}")
    if not create and not path.exists():
        above = next((p for p in path.parents if p.exists()), Path("/"))
        if not above.is_dir():
            raise DataDirError(f"cannot create the {what} {path}: {above} is a file, not a directory", hint=hint)
        if writable_dir_problem(above, what, create=False) is not None:
            raise DataDirError(f"cannot create the {what} {path}: {above} is not writable", hint=hint)
        return path
    try:
        path.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise DataDirError(f"the {what} {path} is not a directory", hint=f"remove the file {path}, or {hint}") from None
    except NotADirectoryError:
        blocker = _first_file_above(path)
        raise DataDirError(
            f"cannot create the {what} {path}: {blocker} is a file, not a directory", hint=hint
        ) from None
    except OSError as err:
        raise DataDirError(f"cannot create the {what} {path}: {err.strerror or err}", hint=hint) from None
    try:
        fd, probe = tempfile.mkstemp(prefix=".write-probe-", dir=path)
        os.close(fd)
        os.unlink(probe)
    except OSError as err:
        raise DataDirError(
            f"the {what} {path} is not writable: {err.strerror or err}", hint=f"make {path} writable, or {hint}"
        ) from None
    return path


def writable_dir_problem(path: str | Path, what: str, *, create: bool = False) -> str | None:
    """Why `check_writable_dir(path, what)` would fail, or None; for reports (`chatapp info`) that must not fail
    (and, by default, create nothing)."""
    try:
        check_writable_dir(path, what, create=create)
    except DataDirError as err:
        return err.message
    return None


def _first_file_above(path: Path) -> Path:
    for candidate in reversed(path.parents):
        if candidate.exists() and not candidate.is_dir():
            return candidate
    return path
