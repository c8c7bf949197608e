"""Who owns a run directory: one run (or resume) at a time, and a dead holder's lock taken over.

Model: a run holds its directory's lock from before it reads `run.json` until it has written
its report, so the fresh-run check, resume's clean-up and every commit happen under it. A
second run or resume on the same directory is refused in one line naming the holder (host,
pid, start time). The lock takes the strongest form the storage offers:

- **local disk**: `lock.json` held with flock(2). The kernel releases it when the holder's
  process ends, however it ends (`kill -9` included), so a stale lock cannot exist: the next
  run simply takes it. The file's content names the holder, for the refusal. A lock file
  removed or replaced while the run is live (a user cleaning up, a sync tool, a backup
  restore) lets another run take a new one, so the holder checks before every commit that
  the path still names the inode it locked, and stops when it does not: it re-takes nothing.
  (On a network filesystem whose locks do not work, the lease below is used instead.)
- **object store** (no locks): a lease object `lock.json` {token, host, pid, started,
  expires_at}. It is created exclusively where the store can (else written, then read back
  after a short settle time: the last writer wins and the others see it), renewed every
  third of its time to live by a background thread, and taken over once expired. The
  holder confirms its lease before every commit and stops cleanly when it cannot: two runs
  never commit at once as long as the machines' clocks agree within a sixth of the lease
  time and the store reads its own writes (S3, GCS and Azure Blob do).

Neither form alone survives a holder that is paused past its lease or whose lock file was
removed: the lock says who may start, and the session records of `forge.io.journal` fence
what is published, so a commit of a holder that lost the directory never counts.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid
from abc import ABC, abstractmethod
from datetime import datetime, timezone
from pathlib import Path

from forge.errors import ForgeError, LockLost
from forge.io import nofollow
from forge.io.location import Location
from forge.io.nofollow import check_owner

LOCK_FILE = "lock.json"
LEASE_TTL_S = 60.0  # an object-store lease lives this long unless renewed
LEASE_SETTLE_S = 0.5  # wait this long after writing a lease before reading it back


def holder_info() -> dict:
    """This process, as a lock names it."""
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


def describe_holder(info: dict | None) -> str:
    if not info:
        return "a process that is just starting"
    return f"host {info.get('host', '?')}, pid {info.get('pid', '?')}, started {info.get('started', '?')}"


def _busy(output_dir, info: dict | None, extra: str = "") -> ForgeError:
    return ForgeError(
        f"output_dir={output_dir} is in use by another Forge run ({describe_holder(info)}){extra}; "
        "wait for it to end, or choose another output_dir"
    )


class RunLock(ABC):
    """The lock of one run directory, held by this process once made."""

    @abstractmethod
    def check(self) -> None:
        """Raise LockLost if the lock may no longer be ours (a commit must not happen then)."""

    @abstractmethod
    def release(self) -> None: ...


class FileLock(RunLock):
    """flock(2) on `lock.json` of a local directory. The file is Forge's own: made here (O_EXCL),
    or one that holds a record of Forge's (or nothing: a released lock); a link, a hard link, or
    a file that holds anything else is refused by name and never written to."""

    def __init__(self, root: Path, output_dir):
        import fcntl

        check_owner(root)
        root.mkdir(parents=True, exist_ok=True)
        self._path = root / LOCK_FILE
        self._fd: int | None = _open_own(root, output_dir)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            info = _parse(os.pread(self._fd, 4096, 0))
            self._close()
            raise _busy(output_dir, info) from None
        except OSError:
            self._close()
            raise
        data = json.dumps(holder_info()).encode()
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, data, 0)

    def check(self) -> None:
        if self._fd is None:
            raise LockLost("the run directory's lock was released")
        held = os.fstat(self._fd)
        try:
            now = os.lstat(self._path)  # a link put in its place is a replacement too
        except FileNotFoundError:
            raise LockLost(f"{self._path} was removed while this run held it; nothing more is committed") from None
        if (now.st_dev, now.st_ino) != (held.st_dev, held.st_ino):
            raise LockLost(f"{self._path} was replaced while this run held it; nothing more is committed")

    def release(self) -> None:
        if self._fd is not None:
            try:
                self.check()  # a lock file removed or replaced is someone else's now: leave it as it is
                os.ftruncate(self._fd, 0)  # no holder named once the run has ended
            except OSError:
                pass
        self._close()  # closing the descriptor releases the flock

    def _close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class LeaseLock(RunLock):
    """A renewed lease object on a store without locks (see the module's Model)."""

    def __init__(self, where: Location, output_dir, ttl_s: float | None = None, settle_s: float | None = None):
        self.where, self.output_dir = where, output_dir
        self.ttl_s = LEASE_TTL_S if ttl_s is None else ttl_s
        settle_s = LEASE_SETTLE_S if settle_s is None else settle_s
        self.token = uuid.uuid4().hex
        self.info = holder_info()
        self.lost: str | None = None  # why the lease is no longer ours
        self.confirmed_until = 0.0  # the expiry of the last lease written and read back as ours
        current = self._read()
        now = time.time()
        if current is not None and current.get("token") != self.token and current.get("expires_at", 0) > now:
            raise self._refusal(current, now)
        record = self._record()
        if current is None:
            if not where.create(LOCK_FILE, record):
                raise self._refusal(self._read(), now)
        else:
            where.write_bytes(LOCK_FILE, record)  # an expired lease: its holder is gone
        time.sleep(settle_s)
        seen = self._read()
        if seen is None or seen.get("token") != self.token:
            raise self._refusal(seen, time.time())
        self.confirmed_until = json.loads(record)["expires_at"]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._renew_loop, name="forge-lease", daemon=True)
        self._thread.start()

    def _record(self) -> bytes:
        return json.dumps({**self.info, "token": self.token, "expires_at": time.time() + self.ttl_s}).encode()

    def _read(self) -> dict | None:
        try:
            return _parse(self.where.read_bytes(LOCK_FILE))
        except FileNotFoundError:
            return None

    def _refusal(self, current: dict | None, now: float) -> ForgeError:
        left = max(0.0, (current or {}).get("expires_at", now) - now)
        return _busy(
            self.output_dir,
            current,
            f"; if that run is gone, its lease expires in {left:.0f} s and a run or resume may take over then",
        )

    def _renew_loop(self) -> None:
        while not self._stop.wait(self.ttl_s / 3):
            try:
                seen = self._read()
                if seen is None or seen.get("token") != self.token:
                    self.lost = f"another run took the lease ({describe_holder(seen)})"
                    return
                record = self._record()
                self.where.write_bytes(LOCK_FILE, record)
                self.confirmed_until = json.loads(record)["expires_at"]
            except Exception as exc:  # noqa: BLE001 - a store error: try again, `check` sees the age
                self.lost = None if time.time() < self.confirmed_until else f"renewing it failed ({exc})"

    def check(self) -> None:
        margin = self.ttl_s / 6
        if self.lost is not None or time.time() > self.confirmed_until - margin:
            raise LockLost(
                f"the lease on output_dir={self.output_dir} is no longer ours "
                f"({self.lost or 'not renewed in time'}); nothing more is committed"
            )

    def release(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        try:
            seen = self._read()
            if seen is not None and seen.get("token") == self.token:
                self.where.remove(LOCK_FILE)
        except Exception:  # noqa: BLE001 - an unreleased lease simply expires
            pass


def acquire(where: Location, output_dir) -> RunLock:
    """The run directory's lock, or a ForgeError naming its holder."""
    if where.durable_rename:
        try:
            return FileLock(Path(where.root), output_dir)
        except ForgeError:
            raise
        except OSError as exc:
            import errno

            if exc.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                raise
            # a filesystem without working locks (some network mounts): a lease instead
    return LeaseLock(where, output_dir)


def _open_own(root: Path, output_dir) -> int:
    """lock.json opened for the lock: created, or an existing one that is Forge's (see FileLock)."""
    try:
        return nofollow.open_file(root, LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_EXCL)
    except FileExistsError:
        pass
    fd = nofollow.open_file(root, LOCK_FILE, os.O_RDWR)  # a link is refused there, by name
    st = os.fstat(fd)
    data = os.pread(fd, 4096, 0)
    record = _parse(data)
    ours = st.st_nlink == 1 and st.st_uid == os.geteuid() and (not data.strip() or _names_holder(record))
    if not ours:
        os.close(fd)
        raise ForgeError(
            f"output_dir={output_dir}: {root / LOCK_FILE} was not written by Forge (it holds no lock record"
            f"{', and other names link to it' if st.st_nlink > 1 else ''}); Forge leaves it as it is: "
            "move it away, or choose another output_dir"
        )
    return fd


def _names_holder(record: dict | None) -> bool:
    return record is not None and {"host", "pid", "started"} <= set(record)


def _parse(data: bytes) -> dict | None:
    try:
        value = json.loads(data)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None
