"""Where a run's files live: a local directory, or any fsspec URL (memory://, s3://, gs://, ...).

A `Location` reads and writes the files of one run directory by path relative to it
("activations/meta.json"). Every write is whole: a reader sees the old file or the new one,
never half of one. Locally that is a temporary name renamed into place (flushed to disk
first for shards); on an object store an object PUT is already atomic, so files are written
directly. Plain paths, `file://` and `local://` URLs are local directories; any other
protocol goes through fsspec, whose package for it (s3fs, gcsfs, ...) must be installed.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path
from typing import Any

from forge.errors import ForgeError
from forge.io import nofollow

TMP_SUFFIX = ".tmp"
LOCAL_PROTOCOLS = ("file", "local")
# the process's umask, read once at import (reading it means setting it): files the run writes
# through libraries that pick their own mode (safetensors: 0600) get the mode the rest of the run has
_UMASK = os.umask(0o022)
os.umask(_UMASK)
FILE_MODE = 0o666 & ~_UMASK


def _protocol(output_dir: str | Path) -> str:
    from fsspec.utils import get_protocol

    return "file" if isinstance(output_dir, Path) else get_protocol(str(output_dir))


def local_path(output_dir: str | Path) -> Path | None:
    """The local directory `output_dir` names (a plain path or a file:// URL); None for a URL
    of another protocol."""
    if isinstance(output_dir, Path):
        return output_dir
    text = str(output_dir)
    protocol = _protocol(text)
    if protocol not in LOCAL_PROTOCOLS:
        return None
    prefix = f"{protocol}://"
    return Path(os.path.expanduser(text[len(prefix) :] if text.startswith(prefix) else text))


def check_output_dir(output_dir: str | Path) -> None:
    """Refuse, before any work, an empty output_dir, or a URL whose protocol fsspec does not
    know or whose package is not installed: one line naming what to pip install."""
    if not str(output_dir).strip():
        raise ForgeError(
            "output_dir is empty; set output_dir=PATH (or a URL), or leave it out for a fresh directory under outputs/"
        )
    local = local_path(output_dir)
    if local is not None:
        if os.path.islink(local) and not os.path.exists(local):
            raise ForgeError(
                f"output_dir={output_dir} is a symbolic link to {os.readlink(local)}, which does not exist; "
                "make that directory, or give output_dir a real path"
            )
        return
    import fsspec

    for protocol in _chain_protocols(str(output_dir)):
        try:
            fsspec.get_filesystem_class(protocol)
        except ValueError:
            raise ForgeError(
                f"output_dir={output_dir}: fsspec knows no protocol {protocol!r}; use a local path "
                "or a URL such as s3://bucket/run, gs://bucket/run, memory://run"
            ) from None
        except ImportError as exc:
            package = getattr(exc.__cause__, "name", None) or _package_of(protocol)
            raise ForgeError(
                f"output_dir={output_dir}: the {protocol}:// protocol needs a package that is not "
                f"installed: pip install {package}"
            ) from None


def _chain_protocols(url: str) -> list[str]:
    """The protocols of a (possibly chained, 'simplecache::s3://...') fsspec URL."""
    from fsspec.utils import get_protocol

    return [get_protocol(part) for part in url.split("::")]


def _package_of(protocol: str) -> str:
    from fsspec.registry import known_implementations

    return known_implementations.get(protocol, {}).get("class", protocol).split(".")[0]


def hydra_dir(output_dir: str) -> str:
    """Where Hydra writes its own files (.hydra/, the job log) for `output_dir`: a local staging
    folder of this process, never the run directory itself. Forge copies the job's .hydra/ into
    the run directory once the run owns it (`forge.io.store.RunStore`), so a directory that another
    run holds, or that is not a Forge run, is never written into. Registered as the
    `forge_hydra_dir` resolver; one answer per output_dir all through a process."""
    key = hashlib.sha1(f"{os.getpid()}:{output_dir}".encode()).hexdigest()[:16]
    if os.getpid() not in _STAGED:  # what Hydra leaves there (a sweep's multirun.yaml) goes at the process's end
        import atexit

        atexit.register(_remove_staged)
        _STAGED[os.getpid()] = set()
    where = (os.environ.get("XDG_RUNTIME_DIR") or "", tempfile.gettempdir(), os.getuid())
    if where not in _STAGING:
        _STAGING[where] = _staging_root(*where)
    _STAGED[os.getpid()].add(os.path.join(_STAGING[where], key))
    return os.path.join(_STAGING[where], key)


_STAGING: dict[tuple[str, str, int], str] = {}  # ($XDG_RUNTIME_DIR, temp dir, uid) -> staging root
_STAGED: dict[int, set[str]] = {}  # pid -> its staging folders (a forked child inherits, not owns, them)


def staging_problem(path: str | Path, uid: int) -> str | None:
    """Why `path` may not hold user `uid`'s staging folders, or None: it must be a folder (not a
    link) of `uid`'s that no one else may write to (who made it first could swap a job's files)."""
    import stat

    try:
        st = os.lstat(path)
    except OSError as exc:
        return f"cannot be read ({exc.strerror})"
    if not stat.S_ISDIR(st.st_mode):
        return "is not a folder"
    if st.st_uid != uid:
        return f"is owned by uid {st.st_uid}, not {uid}"
    return f"is writable by others (mode {st.st_mode & 0o7777:04o})" if st.st_mode & 0o022 else None


def _staging_root(runtime_dir: str, temp_dir: str, uid: int) -> str:
    """`forge-hydra` in $XDG_RUNTIME_DIR when that is usable, else `forge-hydra-<uid>` (0700) in the
    temp dir: one name for all users there would be the first one's alone. A folder that another
    user made, or that others may write to, is not used: a fresh private one is, with a note."""
    import sys

    folders = [os.path.join(temp_dir, f"forge-hydra-{uid}")]
    if runtime_dir and staging_problem(runtime_dir, uid) is None and os.access(runtime_dir, os.W_OK | os.X_OK):
        folders.insert(0, os.path.join(runtime_dir, "forge-hydra"))
    for folder in folders:
        try:
            os.mkdir(folder, 0o700)
        except OSError:
            pass  # there already (checked next), or not makeable here
        problem = staging_problem(folder, uid) or (None if os.access(folder, os.W_OK | os.X_OK) else "is not writable")
        if problem is None:
            return folder
    fresh = tempfile.mkdtemp(prefix="forge-hydra-", dir=temp_dir)
    _STAGED.setdefault(os.getpid(), set()).add(fresh)
    note = f"forge: note: {folder} {problem}; staging Hydra's files in {fresh} (remove {folder} to stop this note)"
    print(note, file=sys.stderr)
    return fresh


def _remove_staged() -> None:  # at exit, the process's own only
    for folder in sorted(_STAGED.pop(os.getpid(), ()), reverse=True):  # a fresh root after what it holds
        shutil.rmtree(folder, ignore_errors=True)


def run_dir_of(output_dir: str, hydra_output_dir: str | Path) -> str | Path:
    """The run directory of a Hydra job: output_dir plus the job's place under the staging
    folder (a sweep's job number); a Path when output_dir is local."""
    rel = os.path.relpath(hydra_output_dir, hydra_dir(output_dir))
    sub = "" if rel == "." else Path(rel).as_posix()
    path = local_path(output_dir)
    if path is not None:
        return path / sub if sub else path
    return output_dir.rstrip("/") + (f"/{sub}" if sub else "")


def reach(output_dir, step: Callable[[], Any]) -> Any:
    """Run a first read or write of the run directory; a store that cannot be reached (no
    credentials, no bucket, no permission) is one line, before any work."""
    try:
        return step()
    except ForgeError:
        raise
    except Exception as exc:  # noqa: BLE001 - whatever the filesystem package raises
        first = (str(exc).strip().splitlines() or [""])[0]
        raise ForgeError(
            f"output_dir={output_dir}: cannot read or write there: {type(exc).__name__}: {first}"
        ) from None


def open_location(output_dir: str | Path) -> Location:
    path = local_path(output_dir)
    if path is not None:
        return LocalLocation(path)
    check_output_dir(output_dir)
    return ObjectLocation(str(output_dir))


class Location(ABC):
    """The files of one run directory, by path relative to it."""

    root: str | Path  # the directory as given: a Path when local, else the URL
    durable_rename: bool  # True: files are renamed into place (a local disk), else written whole (an object store)

    def url(self, rel: str = "") -> str:
        """Where a file lives, for reports and messages."""
        return str(self.root).rstrip("/") + (f"/{rel}" if rel else "")

    @abstractmethod
    def exists(self, rel: str) -> bool: ...

    @abstractmethod
    def read_bytes(self, rel: str) -> bytes: ...

    @abstractmethod
    def write_bytes(self, rel: str, data: bytes) -> None:
        """Replace the file whole (never seen half-written)."""

    @abstractmethod
    def create(self, rel: str, data: bytes) -> bool:
        """Write the file only if it does not exist yet; False if it does. Atomic where the
        storage can make it so (O_EXCL on a local disk, exclusive create on a store that
        offers it); elsewhere a check then a write."""

    @abstractmethod
    def staging(self, rel: str) -> Path:
        """A local path to write the file `rel` to before `put` moves it into place."""

    @abstractmethod
    def put(self, staged: Path, rel: str) -> None:
        """Move a file written at `staging(rel)` into place, whole and durable."""

    @abstractmethod
    def entries(self) -> list[str]:
        """The names directly inside the directory (files and folders); [] when it does not exist."""

    @abstractmethod
    def files(self, under: str = "") -> list[str]:
        """Every file under the directory, or under its folder `under` (paths relative to the
        directory), staged ones included."""

    @abstractmethod
    def remove(self, rel: str) -> None: ...

    def local_file(self, rel: str) -> Path | None:
        """The file on local disk, for readers that map it; None on an object store."""
        return None

    def close(self) -> None:
        """Drop staging space."""


class LocalLocation(Location):
    """A local directory, every file in it opened never through a link (`forge.io.nofollow`)."""

    durable_rename = True
    root: Path

    def __init__(self, path: Path):
        self.root = Path(path)

    def exists(self, rel: str) -> bool:
        return nofollow.exists(self.root, rel)

    def read_bytes(self, rel: str) -> bytes:
        return nofollow.read_bytes(self.root, rel)

    def write_bytes(self, rel: str, data: bytes) -> None:
        nofollow.replace(self.root, rel, data, TMP_SUFFIX)

    def create(self, rel: str, data: bytes) -> bool:
        return nofollow.create(self.root, rel, data)

    def staging(self, rel: str) -> Path:
        return nofollow.prepare_staging(self.root, rel, TMP_SUFFIX)

    def put(self, staged: Path, rel: str) -> None:
        nofollow.put(self.root, staged, rel, FILE_MODE)

    def entries(self) -> list[str]:
        return sorted(p.name for p in self.root.iterdir()) if self.root.is_dir() else []

    def files(self, under: str = "") -> list[str]:
        return [p.relative_to(self.root).as_posix() for p in (self.root / under).rglob("*") if p.is_file()]

    def remove(self, rel: str) -> None:
        nofollow.unlink(self.root, rel)

    def local_file(self, rel: str) -> Path | None:
        return self.root / rel


class ObjectLocation(Location):
    """A run directory behind an fsspec URL. Shards are staged in a local temporary folder
    (functions write them with libraries that want a path) and uploaded whole."""

    durable_rename = False

    def __init__(self, url: str):
        from fsspec.core import url_to_fs

        self.root = url.rstrip("/")
        self.fs, path = url_to_fs(url)
        self._path = path.rstrip("/")
        self._staging: str | None = None  # local temporary folder, made on first use

    def _full(self, rel: str) -> str:
        return f"{self._path}/{rel}" if rel else self._path

    def exists(self, rel: str) -> bool:
        return self.fs.exists(self._full(rel))

    def read_bytes(self, rel: str) -> bytes:
        return self.fs.cat_file(self._full(rel))

    def write_bytes(self, rel: str, data: bytes) -> None:
        self.fs.pipe_file(self._full(rel), data)

    def create(self, rel: str, data: bytes) -> bool:
        try:
            with self.fs.open(self._full(rel), "xb") as f:
                f.write(data)
            return True
        except FileExistsError:
            return False
        except (ValueError, NotImplementedError, TypeError):  # no exclusive create on this store
            if self.exists(rel):
                return False
            self.write_bytes(rel, data)
            return True

    def staging(self, rel: str) -> Path:
        if self._staging is None:
            self._staging = tempfile.mkdtemp(prefix="forge-staging-")
        path = Path(self._staging) / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        return path

    def put(self, staged: Path, rel: str) -> None:
        self.fs.put_file(str(staged), self._full(rel))
        staged.unlink()

    def entries(self) -> list[str]:
        if not self.fs.isdir(self._path):
            return []
        return sorted(p.rstrip("/").rpartition("/")[2] for p in self.fs.ls(self._path, detail=False))

    def files(self, under: str = "") -> list[str]:
        folder = self._full(under)
        if not self.fs.exists(folder):
            return []
        prefix = self._path + "/"
        return [p[len(prefix) :] for p in self.fs.find(folder) if p.startswith(prefix)]

    def remove(self, rel: str) -> None:
        try:
            self.fs.rm_file(self._full(rel))
        except FileNotFoundError:
            pass

    def close(self) -> None:
        if self._staging is not None:
            shutil.rmtree(self._staging, ignore_errors=True)
            self._staging = None
