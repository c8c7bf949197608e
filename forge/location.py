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
from pathlib import Path
from typing import Any, Callable

from forge.errors import ForgeError

TMP_SUFFIX = ".tmp"
LOCAL_PROTOCOLS = ("file", "local")


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
    return Path(text[len(prefix):] if text.startswith(prefix) else text)


def check_output_dir(output_dir: str | Path) -> None:
    """Refuse, before any work, a URL whose protocol fsspec does not know or whose package
    is not installed: one line naming what to pip install."""
    if local_path(output_dir) is not None:
        return
    import fsspec

    for protocol in _chain_protocols(str(output_dir)):
        try:
            fsspec.get_filesystem_class(protocol)
        except ValueError:
            raise ForgeError(f"output_dir={output_dir}: fsspec knows no protocol {protocol!r}; use a local path "
                             "or a URL such as s3://bucket/run, gs://bucket/run, memory://run") from None
        except ImportError as exc:
            package = getattr(exc.__cause__, "name", None) or _package_of(protocol)
            raise ForgeError(f"output_dir={output_dir}: the {protocol}:// protocol needs a package that is not "
                             f"installed: pip install {package}") from None


def _chain_protocols(url: str) -> list[str]:
    """The protocols of a (possibly chained, 'simplecache::s3://...') fsspec URL."""
    from fsspec.utils import get_protocol

    return [get_protocol(part) for part in url.split("::")]


def _package_of(protocol: str) -> str:
    from fsspec.registry import known_implementations

    return known_implementations.get(protocol, {}).get("class", protocol).split(".")[0]


def hydra_dir(output_dir: str) -> str:
    """Where Hydra writes its own files (.hydra/, the job log) for `output_dir`: the directory
    itself when it is local, else a local staging folder (its .hydra/ is copied to the URL
    when the run starts; see `forge.cli`). Registered as the `forge_hydra_dir` resolver."""
    path = local_path(output_dir)
    if path is not None:
        return str(path)
    return os.path.join(tempfile.gettempdir(), "forge-hydra", hashlib.sha1(output_dir.encode()).hexdigest()[:16])


def run_dir_of(output_dir: str, hydra_output_dir: str | Path) -> str | Path:
    """The run directory of a Hydra job: Hydra's own for a local output_dir; for a URL, the
    URL plus the job's place under the staging folder (a sweep's job number)."""
    if local_path(output_dir) is not None:
        return Path(hydra_output_dir)
    rel = os.path.relpath(hydra_output_dir, hydra_dir(output_dir))
    return output_dir.rstrip("/") + ("" if rel == "." else "/" + Path(rel).as_posix())


def reach(output_dir, step: Callable[[], Any]) -> Any:
    """Run a first read or write of the run directory; a store that cannot be reached (no
    credentials, no bucket, no permission) is one line, before any work."""
    try:
        return step()
    except ForgeError:
        raise
    except Exception as exc:  # noqa: BLE001 - whatever the filesystem package raises
        first = (str(exc).strip().splitlines() or [""])[0]
        raise ForgeError(f"output_dir={output_dir}: cannot read or write there: "
                         f"{type(exc).__name__}: {first}") from None


def open_location(output_dir: str | Path) -> "Location":
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
    def staging(self, rel: str) -> Path:
        """A local path to write the file `rel` to before `put` moves it into place."""

    @abstractmethod
    def put(self, staged: Path, rel: str) -> None:
        """Move a file written at `staging(rel)` into place, whole and durable."""

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
    durable_rename = True

    def __init__(self, path: Path):
        self.root = Path(path)

    def exists(self, rel: str) -> bool:
        return (self.root / rel).exists()

    def read_bytes(self, rel: str) -> bytes:
        return (self.root / rel).read_bytes()

    def write_bytes(self, rel: str, data: bytes) -> None:
        path = self.root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + TMP_SUFFIX)
        tmp.write_bytes(data)
        os.replace(tmp, path)

    def staging(self, rel: str) -> Path:
        path = self.root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        return path.with_name(path.name + TMP_SUFFIX)

    def put(self, staged: Path, rel: str) -> None:
        with open(staged, "rb+") as f:
            os.fsync(f.fileno())
        path = self.root / rel
        os.replace(staged, path)
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def files(self, under: str = "") -> list[str]:
        return [p.relative_to(self.root).as_posix() for p in (self.root / under).rglob("*") if p.is_file()]

    def remove(self, rel: str) -> None:
        (self.root / rel).unlink(missing_ok=True)

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

    def staging(self, rel: str) -> Path:
        if self._staging is None:
            self._staging = tempfile.mkdtemp(prefix="forge-staging-")
        path = Path(self._staging) / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        return path

    def put(self, staged: Path, rel: str) -> None:
        self.fs.put_file(str(staged), self._full(rel))
        staged.unlink()

    def files(self, under: str = "") -> list[str]:
        folder = self._full(under)
        if not self.fs.exists(folder):
            return []
        prefix = self._path + "/"
        return [p[len(prefix):] for p in self.fs.find(folder) if p.startswith(prefix)]

    def remove(self, rel: str) -> None:
        try:
            self.fs.rm_file(self._full(rel))
        except FileNotFoundError:
            pass

    def close(self) -> None:
        if self._staging is not None:
            shutil.rmtree(self._staging, ignore_errors=True)
            self._staging = None
