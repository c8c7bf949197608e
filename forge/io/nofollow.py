"""Files of a local run directory, opened never through a link.

A run directory may be prepared by someone else (a shared scratch or temp path): a symbolic link
planted in it (`lock.json -> ~/.bashrc`, `sessions -> /elsewhere`) would make a plain `open` write
through it, into a file Forge did not create. Every path here is walked from the run directory one
component at a time, each opened with O_NOFOLLOW relative to the one before (openat(2)), so a link
anywhere below the run directory is a refusal that names it, never followed. Creating a file is
O_EXCL; a file is replaced by renaming a fresh one over it, which replaces a link itself, never
its target. The run directory itself is the user's choice and may be a link; one owned by another
user is refused (`check_owner`), since its owner could swap its entries under a running job.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from forge.errors import ForgeError

NOFOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC


def link_refused(path: Path | str) -> ForgeError:
    return ForgeError(
        f"{path} is a symbolic link (or not a plain file or folder); Forge never reads or writes "
        "through a link in a run directory: remove it, or choose another output_dir"
    )


def check_owner(root: Path) -> None:
    """Refuse a run directory (if it exists) that belongs to another user."""
    try:
        st = os.stat(root)
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(st.st_mode):
        raise ForgeError(f"output_dir={root} is not a folder; choose another output_dir")
    if st.st_uid != os.geteuid():
        raise ForgeError(
            f"output_dir={root} belongs to another user (uid {st.st_uid}); Forge writes only into a "
            "folder you own, since its owner could swap what is in it: choose another output_dir"
        )


@contextmanager
def folder(root: Path, rel_dir: str, create: bool) -> Iterator[int]:
    """A descriptor of the folder `rel_dir` under `root` ('' = root), each component opened
    without following a link (made when `create`). FileNotFoundError when it is missing."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for part in [p for p in rel_dir.split("/") if p]:
            if create:
                try:
                    os.mkdir(part, 0o777, dir_fd=fd)
                except FileExistsError:
                    pass
            try:
                child = os.open(part, os.O_RDONLY | os.O_DIRECTORY | NOFOLLOW, dir_fd=fd)
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise link_refused(root / rel_dir) from None
                raise
            os.close(fd)
            fd = child
        yield fd
    finally:
        os.close(fd)


def _split(rel: str) -> tuple[str, str]:
    parent, _, name = rel.rpartition("/")
    return parent, name


def open_file(root: Path, rel: str, flags: int, mode: int = 0o666) -> int:
    """A descriptor of the plain file `rel` under `root`, opened without following a link."""
    parent, name = _split(rel)
    with folder(root, parent, create=bool(flags & os.O_CREAT)) as dir_fd:
        try:
            fd = os.open(name, flags | NOFOLLOW, mode, dir_fd=dir_fd)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise link_refused(root / rel) from None
            raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise link_refused(root / rel)
    return fd


def read_bytes(root: Path, rel: str) -> bytes:
    with os.fdopen(open_file(root, rel, os.O_RDONLY), "rb") as f:
        return f.read()


def create(root: Path, rel: str, data: bytes) -> bool:
    """Write a new file; False if `rel` exists (a link included: it is never written through)."""
    try:
        fd = open_file(root, rel, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    except FileExistsError:
        return False
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    return True


def replace(root: Path, rel: str, data: bytes, tmp_suffix: str) -> None:
    """Replace `rel` whole: a fresh temporary file (O_EXCL; a stale one of a crash is removed
    first), renamed over it."""
    parent, name = _split(rel)
    tmp = name + tmp_suffix
    with folder(root, parent, create=True) as dir_fd:
        remove_stale(dir_fd, tmp, root / rel)
        try:
            write_new(dir_fd, tmp, data)
            os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except BaseException:
            try:
                os.unlink(tmp, dir_fd=dir_fd)  # a full disk: no half-written temporary left behind
            except FileNotFoundError:
                pass
            raise


def write_new(dir_fd: int, name: str, data: bytes) -> None:
    """A new file `name` in the folder `dir_fd` (O_EXCL: never an existing file or a link)."""
    fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | NOFOLLOW, 0o666, dir_fd=dir_fd)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def remove_stale(dir_fd: int, name: str, shown: Path) -> None:
    """Remove a temporary file a crash left at `name`; a link or a folder there is refused."""
    try:
        st = os.lstat(name, dir_fd=dir_fd)
    except FileNotFoundError:
        return
    if not stat.S_ISREG(st.st_mode):
        raise link_refused(shown.with_name(name))
    os.unlink(name, dir_fd=dir_fd)


def prepare_staging(root: Path, rel: str, tmp_suffix: str) -> Path:
    """The path a library writes `rel` to before it is put in place: its folders made without
    following a link, and nothing (no link) at the path itself."""
    parent, name = _split(rel)
    with folder(root, parent, create=True) as dir_fd:
        remove_stale(dir_fd, name + tmp_suffix, root / rel)
    return root / (rel + tmp_suffix)


def put(root: Path, staged: Path, rel: str, mode: int) -> None:
    """Move a staged file into place, durable: flushed, then renamed, then its folder flushed."""
    parent, name = _split(rel)
    with folder(root, parent, create=True) as dir_fd:
        fd = os.open(staged.name, os.O_RDWR | NOFOLLOW, dir_fd=dir_fd)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise link_refused(staged)
            os.fsync(fd)
            os.fchmod(fd, mode)  # the mode the umask gives, whatever the writer chose
        finally:
            os.close(fd)
        os.replace(staged.name, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        os.fsync(dir_fd)


def unlink(root: Path, rel: str) -> None:
    """Remove `rel` (a link there is removed itself, never its target); nothing if absent."""
    parent, name = _split(rel)
    try:
        with folder(root, parent, create=False) as dir_fd:
            os.unlink(name, dir_fd=dir_fd)
    except FileNotFoundError:
        pass


def exists(root: Path, rel: str) -> bool:
    """Whether `rel` is there (a link counts: it is there, and refused when opened)."""
    parent, name = _split(rel)
    try:
        with folder(root, parent, create=False) as dir_fd:
            os.lstat(name, dir_fd=dir_fd)
    except (FileNotFoundError, NotADirectoryError):
        return False
    return True
