"""Files only this user can read: folders 0700, files 0600, and the disk tier's secret.

KV payloads are the tenants' prompts in another form, so the disk tier creates everything with
these modes from the start (os.mkdir and os.open take the mode; the umask can only narrow it):
never a world-readable file that is chmod-ed afterwards, which another user could open in the
moment between.

The secret keys the payload checksum (codec.py), so whoever can write the folder but not read
the secret cannot plant a block that verifies. It is created once, beside the tier, and every
later process (a restart, another tensor-parallel rank) reads the same one. Two processes
starting together agree: each writes a candidate to its own temp file and hard-links it to the
final name, which fails with EEXIST for all but the first (O_EXCL's guarantee, with the bytes
already in place), so a reader never sees a half-written secret. Where the filesystem has no
hard links, the final name is created with O_EXCL directly and a reader waits out a short read.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import secrets
import stat
import time

DIR_MODE = 0o700
FILE_MODE = 0o600
SECRET_NAME = ".secret"
"""The disk tier's secret, in the disk tier's folder (beside the model folders)."""
MIN_SECRET_CHARS = 16
"""A secret shorter than this (after stripping whitespace) is refused."""
_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
_READ = (os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
         | getattr(os, "O_CLOEXEC", 0))  # no symlink; a FIFO must not hang the start


class SecretError(OSError):
    """A secret that is missing, unreadable, too short, not this user's or open to others."""


def makedirs(path: str) -> None:
    """os.makedirs with every folder it creates 0700 (os.makedirs gives the mode only to the
    last one). Folders that exist already are left as they are."""
    if os.path.isdir(path):
        return
    parent = os.path.dirname(path)
    if parent and parent != path:
        makedirs(parent)
    try:
        os.mkdir(path, DIR_MODE)
    except FileExistsError:  # another process made it meanwhile
        if not os.path.isdir(path):
            raise


def create(path: str) -> int:
    """A new file, 0600, open for writing (fails if the name exists); returns its descriptor."""
    return os.open(path, _CREATE, FILE_MODE)


def mac_key(material: bytes) -> bytes:
    """The 32-byte checksum key derived from a secret's contents (any length)."""
    return hashlib.blake2b(material.strip(), digest_size=32, person=b"tierserve-kv").digest()


def read_secret(path: str) -> bytes:
    """The checksum key of a secret file that only this user can read; raises SecretError."""
    try:
        fd = os.open(path, _READ)
    except OSError as e:
        raise SecretError(e.errno, f"secret {path}: {e.strerror}") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        material = f.read(4096)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
        raise SecretError(errno.EPERM, f"secret {path} is {stat.filemode(st.st_mode)} owned by "
                          f"uid {st.st_uid}: it must be a regular file, 0600, this user's")
    if len(material.strip()) < MIN_SECRET_CHARS:
        raise SecretError(errno.EINVAL, f"secret {path} holds {len(material.strip())} "
                          f"characters, at least {MIN_SECRET_CHARS} are needed")
    return mac_key(material)


def load_or_create_secret(folder: str, wait_s: float = 2.0) -> bytes:
    """The checksum key of `folder`'s secret, created (0600, 256 random bits) if missing."""
    path = os.path.join(folder, SECRET_NAME)
    if not os.path.lexists(path):
        _create_secret(path)
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return read_secret(path)
        except SecretError as e:  # a short file may be an O_EXCL writer still writing
            if e.errno != errno.EINVAL or time.monotonic() > deadline:
                raise
            time.sleep(0.01)


def _create_secret(path: str) -> None:
    """Put a fresh secret at `path` unless another process gets there first."""
    data = (secrets.token_hex(32) + "\n").encode()
    tmp = f"{path}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    try:
        _write(tmp, data)
        os.link(tmp, path)
    except FileExistsError:
        pass  # another process won: its secret is the one
    except OSError as e:
        if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV,
                           errno.EMLINK):
            raise
        with contextlib.suppress(FileExistsError):  # no hard links here
            _write(path, data)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)


def _write(path: str, data: bytes) -> None:
    fd = create(path)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def restrict(path: str) -> bool:
    """Take group and other users' access off a folder of ours that an older version left open
    (0755); True if it changed. New folders are created 0700 (makedirs) and never need this."""
    try:
        st = os.stat(path)
        if st.st_uid != os.geteuid() or not st.st_mode & 0o077:
            return False
        os.chmod(path, stat.S_IMODE(st.st_mode) & 0o700)
    except OSError:  # read-only, or not ours to change: left as it is
        return False
    return True
