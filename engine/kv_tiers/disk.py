"""The disk tier: one content-addressed safetensors file per block, an LRU under a byte capacity.

Layout: <disk_dir>/<model fingerprint hex>/<first 2 hex of key>/<key hex>.safetensors

Atomicity: a payload is written to a temp file in the same folder (".<key>.<pid>.<rand>.tmp"),
flushed, fsynced and renamed over the final name, so a final name always holds a whole payload;
a reader never sees a partial one. A writer killed mid-write leaves only a temp file: lookups
never see it, and the start-up scan deletes temp files older than TMP_GRACE_S (younger ones may
belong to a live writer in another process).

Eviction order: least recently used first (a use is a store or a load; a sequence is touched
last-to-first, so a suffix goes before its prefix). The order is kept in memory and mirrored in
each file's mtime (a strictly increasing stamp per touch), so the start-up scan, which seeds the
LRU by mtime, restores the exact order of the last run. A file that fails its check on load is a
miss and is deleted.

Privacy: the payloads are the tenants' prompts in another form. Every folder the tier creates is
0700 and every file 0600, from the moment it exists (private.py); a model folder an older version
left open is closed (chmod go=) at start. The payload checksum is keyed with the secret in
<disk_dir>/.secret (created once, 0600; a restart or another rank reads the same one), so a file
planted by whoever can write the folder, or an older version's file, fails its check like a
corrupt one. If the secret cannot be made or read (read-only folder, a secret open to other
users), the tier uses a key of its own for this run: files on disk are then misses.

Failures: a write that fails with ENOSPC ("no_space"), EROFS/EACCES/EPERM ("read_only") or any
other OSError ("io") is counted by kind and pauses stores for disk_error_backoff_s (a breaker with
threshold 1); loads keep working. One lock guards the index; file I/O happens outside it.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import secrets
import threading
import time
from collections import OrderedDict

import torch

from tierserve.engine.core.block_hash import BlockHash
from tierserve.engine.kv_tiers import codec, private
from tierserve.engine.kv_tiers.base import KVTier
from tierserve.engine.kv_tiers.breaker import CircuitBreaker
from tierserve.engine.kv_tiers.config import TierConfig
from tierserve.engine.kv_tiers.errors import TierError, TierMiss
from tierserve.engine.kv_tiers.layout import BlockLayout
from tierserve.engine.core.tier_descriptor import Locality, Medium

SUFFIX = ".safetensors"
TMP_GRACE_S = 60.0
_NAME = re.compile(r"^([0-9a-f]{32})\.safetensors$")
_STORE_ERRNO = {errno.ENOSPC: "no_space", errno.EDQUOT: "no_space", errno.EROFS: "read_only",
                errno.EACCES: "read_only", errno.EPERM: "read_only"}

log = logging.getLogger(__name__)


class DiskTier(KVTier):
    name = "disk"
    medium = Medium.STORAGE
    locality = Locality.LOCAL

    def __init__(self, config: TierConfig, layout: BlockLayout):
        super().__init__(config, layout)
        assert config.disk_dir is not None
        self.root = os.path.join(config.disk_dir, layout.fingerprint_hex)
        self._capacity = config.disk_bytes
        self._lock = threading.Lock()
        self._index: OrderedDict[BlockHash, int] = OrderedDict()  # key -> file size, LRU first
        self._used = 0
        self._stamp = 0
        self._breaker = CircuitBreaker(1, config.disk_error_backoff_s,
                                       4 * config.disk_error_backoff_s)
        self.cleaned_tmp_files = 0
        """Stale temp files the start-up scan deleted."""
        self._mac_key = self._make_folder()
        """The payload checksum's key (from <disk_dir>/.secret)."""
        self._open()

    # ---- start-up ------------------------------------------------------------------------
    def _make_folder(self) -> bytes:
        """Create the model folder (0700) and return the checksum key."""
        try:
            private.makedirs(self.root)
        except OSError as e:  # read-only or full at start: serve what is there, retry later
            self._store_failed(TierError(str(e), kind=_STORE_ERRNO.get(e.errno, "io")))
            self.counters.error(_STORE_ERRNO.get(e.errno, "io"))
        if private.restrict(self.root):
            log.warning("disk tier: %s was open to other users; now 0700", self.root)
        return _secret(self.config.disk_dir)

    def _open(self) -> None:
        found = sorted(self._scan())
        for _, key, size in found:
            self._index[key] = size
            self._used += size
        self._stamp = max([time.time_ns()] + [m for m, _, _ in found])
        with self._lock:
            victims = self._evict_for(0)  # the capacity may have shrunk since the last run
        self._unlink(victims)  # no log is connected yet: nothing is announced

    def _scan(self) -> list[tuple[int, BlockHash, int]]:
        """(mtime_ns, key, size) of every payload file; deletes stale temp files."""
        out = []
        for shard in _listdir(self.root):
            folder = os.path.join(self.root, shard)
            for entry in _listdir(folder):
                path = os.path.join(folder, entry)
                if entry.endswith(".tmp"):
                    self._clean_tmp(path)
                elif (m := _NAME.match(entry)) and m.group(1)[:2] == shard:
                    with contextlib.suppress(OSError):
                        st = os.stat(path)
                        out.append((st.st_mtime_ns, BlockHash(bytes.fromhex(m.group(1))),
                                    st.st_size))
        return out

    def _clean_tmp(self, path: str) -> None:
        with contextlib.suppress(OSError):
            if time.time() - os.stat(path).st_mtime > TMP_GRACE_S:
                os.unlink(path)
                self.cleaned_tmp_files += 1

    # ---- KVTier --------------------------------------------------------------------------
    @property
    def used_bytes(self) -> int:
        return self._used

    @property
    def capacity_bytes(self) -> int:
        return self._capacity

    @property
    def breaker_state(self) -> str:
        return self._breaker.state.value

    def keys(self) -> list[BlockHash]:
        with self._lock:
            return list(self._index)

    def path(self, key: BlockHash) -> str:
        h = key.hex()
        return os.path.join(self.root, h[:2], h + SUFFIX)

    def _has(self, key: BlockHash) -> bool:
        return key in self._index

    def _read(self, key: BlockHash) -> torch.Tensor:
        if key not in self._index:
            raise TierMiss(f"disk tier: no block {key.hex()}")
        try:
            with open(self.path(key), "rb") as f:
                data = f.read()
        except FileNotFoundError:  # removed behind our back (another process, an operator)
            self.remove(key)
            raise TierMiss(f"disk tier: file of {key.hex()} vanished") from None
        except OSError as e:
            raise TierError(f"disk tier: reading {key.hex()}: {e}") from e
        lay = self.layout
        return codec.decode(data, [key], lay.dtype, lay.block_shape, self._mac_key)[0]

    def _write(self, key: BlockHash, block: torch.Tensor) -> int:
        if key in self._index:
            return 0
        data = codec.encode([key], block.unsqueeze(0), self._mac_key)
        size = len(data)
        if size > self._capacity:
            raise TierError(f"disk tier: a {size}-byte payload exceeds the capacity",
                            kind="too_large")
        with self._lock:
            victims = self._evict_for(size)
            self._used += size  # reserved now, so concurrent writers respect the capacity
        self._unlink(victims)
        try:
            _write_atomic(self.path(key), data)
        except OSError as e:
            with self._lock:
                self._used -= size
            raise TierError(f"disk tier: writing {key.hex()}: {e}",
                            kind=_STORE_ERRNO.get(e.errno, "io")) from e
        with self._lock:
            if key in self._index:  # another writer stored the same key meanwhile
                self._used -= size
                return 0
            self._index[key] = size
        return size

    def _evict_for(self, size: int) -> list[BlockHash]:
        """Pop LRU entries until `size` more bytes fit; the lock is held. Returns their keys."""
        victims = []
        while self._index and self._used + size > self._capacity:
            key, n = self._index.popitem(last=False)
            self._used -= n
            victims.append(key)
        return victims

    def _unlink(self, victims: list[BlockHash]) -> None:
        for key in victims:
            with contextlib.suppress(OSError):
                os.unlink(self.path(key))
        self._evicted(victims)

    def _touch(self, key: BlockHash) -> None:
        with self._lock:
            if key not in self._index:
                return
            self._index.move_to_end(key)
            self._stamp = max(self._stamp + 1, time.time_ns())
            stamp = self._stamp
        with contextlib.suppress(OSError):  # a read-only disk still serves loads
            os.utime(self.path(key), ns=(stamp, stamp))

    def _delete(self, key: BlockHash) -> bool:
        with self._lock:
            size = self._index.pop(key, None)
            if size is not None:
                self._used -= size
        with contextlib.suppress(OSError):
            os.unlink(self.path(key))
        return size is not None

    def _allow_store(self) -> bool:
        return self._breaker.allow()

    def _store_failed(self, error: TierError) -> None:
        if error.kind != "too_large":
            self._breaker.record_failure()

    def _store_succeeded(self) -> None:
        self._breaker.record_success()


def _secret(folder: str) -> bytes:
    """The checksum key of the tier's folder; a key of this run's own if there is none to use."""
    try:
        return private.load_or_create_secret(folder)
    except OSError as e:
        log.warning("disk tier: no usable secret (%s). This run checks blocks with a key of "
                    "its own, so the blocks on disk are misses; a secret open to other users "
                    "should be removed (the next start makes a new one)", e)
        return secrets.token_bytes(32)


def _write_atomic(path: str, data: bytes) -> None:
    folder, name = os.path.split(path)
    private.makedirs(folder)
    tmp = os.path.join(folder, f".{name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        with os.fdopen(private.create(tmp), "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []
