"""The s3 tier: one object per block in an S3-compatible bucket, behind a circuit breaker.

Object key: <s3_prefix>/<model fingerprint hex>/<block key hex>; the body is a codec payload.
Credentials come from boto3's standard chain (env vars, profile, instance role); the endpoint,
region, timeouts and attempt count from TierConfig, so a dead or hanging endpoint costs at most
connect/read timeout times attempts per request.

Breaker: each public operation (a contains_prefix, one block's load, a store call) asks the
breaker first; while it is open the lookup is a miss and the store is dropped at once (counted as
"unavailable"). Every request reports back: any HTTP answer (a 404 included) is a success, a
timeout, refused connection, 5xx or auth failure is a failure.

There is no eviction here: the bucket's lifecycle rules bound it, and what they expire is never
announced as BlockRemoved. used_bytes counts what this process wrote. clear() deletes only the
keys this process uploaded (remembered in memory, ~100 bytes each): blocks that other processes
or earlier runs put under the prefix stay, although AllBlocksCleared is announced; a shared
bucket is not emptied under its other users' feet. The bucket is created (when
s3_create_bucket) before the first write, not in the constructor, so building a tier does no
network I/O. Thread-safe: the boto3 client is shared,
its connection pool sized for the probe, load and store threads.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Sequence

import torch

from tierserve.engine.core.block_hash import BlockHash
from tierserve.engine.kv_tiers import codec
from tierserve.engine.kv_tiers.base import KVTier
from tierserve.engine.kv_tiers.breaker import CircuitBreaker
from tierserve.engine.kv_tiers.config import TierConfig
from tierserve.engine.kv_tiers.errors import TierError, TierMiss, TierUnavailable
from tierserve.engine.kv_tiers.layout import BlockLayout
from tierserve.engine.core.tier_descriptor import Locality, Medium

_MISSING = {"404", "NoSuchKey", "NotFound"}


class S3Tier(KVTier):
    name = "s3"
    medium = Medium.STORAGE
    locality = Locality.REMOTE

    def __init__(self, config: TierConfig, layout: BlockLayout):
        super().__init__(config, layout)
        assert config.s3_bucket is not None
        self.bucket = config.s3_bucket
        self.prefix = f"{config.s3_prefix.strip('/')}/{layout.fingerprint_hex}/"
        self.breaker = CircuitBreaker(config.breaker_threshold, config.breaker_backoff_s,
                                      config.breaker_max_backoff_s)
        self._client = _make_client(config)
        self._probes = ThreadPoolExecutor(config.s3_probe_batch, thread_name_prefix="kv-s3-probe")
        self._lock = threading.Lock()
        self._used = 0
        self._uploaded: set[BlockHash] = set()
        self._bucket_ready = not config.s3_create_bucket

    @property
    def used_bytes(self) -> int:
        return self._used

    @property
    def capacity_bytes(self) -> None:
        return None

    @property
    def breaker_state(self) -> str:
        return self.breaker.state.value

    def object_key(self, key: BlockHash) -> str:
        return self.prefix + key.hex()

    def keys(self) -> list[BlockHash]:
        """Every key under this model's prefix (lists the bucket: for tests and tools)."""
        pages = self._client.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=self.prefix)
        return [BlockHash(bytes.fromhex(o["Key"][len(self.prefix):]))
                for page in pages for o in page.get("Contents", [])]

    def contains_prefix(self, keys: Sequence[BlockHash]) -> int:
        """HEAD requests in growing parallel batches (1, 2, 4... up to s3_probe_batch): a miss
        on the first key costs one request, a long run costs len/batch round trips."""
        if not keys:
            return 0
        if not self.breaker.allow():
            self.counters.error(TierUnavailable.kind)
            return 0
        n, size = 0, 1
        while n < len(keys):
            found = list(self._probes.map(self._exists, keys[n:n + size]))
            for f in found:
                if not f:
                    return n
                n += 1
            size = min(2 * size, self.config.s3_probe_batch)
        return n

    def close(self) -> None:
        self._probes.shutdown(wait=False, cancel_futures=True)
        self._client.close()

    # ---- hooks ---------------------------------------------------------------------------
    def _exists(self, key: BlockHash) -> bool:
        try:
            self._request("head_object", Key=self.object_key(key))
            return True
        except TierMiss:
            return False
        except TierError as e:
            self.counters.error(e.kind)
            return False

    def _has(self, key: BlockHash) -> bool:
        return self._exists(key)

    def _read(self, key: BlockHash) -> torch.Tensor:
        data = self._request("get_object", Key=self.object_key(key), body=True)
        lay = self.layout
        return codec.decode(data, [key], lay.dtype, lay.block_shape)[0]

    def _write(self, key: BlockHash, block: torch.Tensor) -> int:
        if not self._bucket_ready:
            self._ensure_bucket()
        try:
            self._request("head_object", Key=self.object_key(key))
            return 0  # content-addressed: same key, same bytes; skip the upload
        except TierMiss:
            pass
        data = codec.encode([key], block.unsqueeze(0))
        try:
            self._request("put_object", Key=self.object_key(key), Body=data)
        except TierError as e:
            if e.kind == "no_bucket":  # deleted behind our back: create it again next time
                self._bucket_ready = not self.config.s3_create_bucket
            raise
        with self._lock:
            self._used += len(data)
            self._uploaded.add(key)
        return len(data)

    def _delete(self, key: BlockHash) -> bool:
        try:
            self._request("delete_object", Key=self.object_key(key))
        except TierError:
            return False
        with self._lock:
            self._uploaded.discard(key)
        return True

    def _clearable(self) -> list[BlockHash]:
        with self._lock:
            return list(self._uploaded)

    def _allow_load(self) -> bool:
        return self.breaker.allow()

    def _allow_store(self) -> bool:
        return self.breaker.allow()

    def _ensure_bucket(self) -> None:
        try:
            self._request("head_bucket")
        except TierMiss:
            self._request("create_bucket", **_location(self.config.s3_region))
        self._bucket_ready = True

    # ---- one request ---------------------------------------------------------------------
    def _request(self, op: str, body: bool = False, **kwargs: Any) -> Any:
        """Call one S3 operation (and read its body); report to the breaker; raise TierError
        (TierMiss for a 404) with a kind."""
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            out = getattr(self._client, op)(Bucket=self.bucket, **kwargs)
            if body:
                out = out["Body"].read()
        except ClientError as e:
            status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
            code = str(e.response.get("Error", {}).get("Code", ""))
            kind = _status_kind(status, code)
            (self.breaker.record_failure if kind in ("http_5xx", "auth")
             else self.breaker.record_success)()
            if kind == "miss":
                raise TierMiss(f"s3 tier: {op} {kwargs.get('Key', '')}: {code}") from None
            raise TierError(f"s3 tier: {op}: {e}", kind=kind) from e
        except BotoCoreError as e:
            self.breaker.record_failure()
            raise TierError(f"s3 tier: {op}: {e}", kind=_transport_kind(e)) from e
        self.breaker.record_success()
        return out


def _make_client(config: TierConfig):
    import boto3
    from botocore.config import Config

    pool = config.s3_probe_batch + config.load_workers + config.store_workers + 2
    cfg = Config(connect_timeout=config.s3_connect_timeout_s,
                 read_timeout=config.s3_read_timeout_s,
                 retries={"total_max_attempts": config.s3_max_attempts, "mode": "standard"},
                 max_pool_connections=pool)
    # Own session: boto3's default session is not safe to share between threads.
    return boto3.session.Session().client("s3", endpoint_url=config.s3_endpoint_url,
                                          region_name=config.s3_region, config=cfg)


def _location(region: str | None) -> dict:
    if region in (None, "us-east-1"):
        return {}
    return {"CreateBucketConfiguration": {"LocationConstraint": region}}


def _status_kind(status: int, code: str) -> str:
    if code == "NoSuchBucket":
        return "no_bucket"
    if status == 404 or code in _MISSING:
        return "miss"
    if status >= 500:
        return "http_5xx"
    if status in (401, 403):
        return "auth"
    return "client"


def _transport_kind(e: Exception) -> str:
    from botocore.exceptions import (ConnectionError, ConnectTimeoutError, HTTPClientError,
                                     NoCredentialsError, PartialCredentialsError,
                                     ReadTimeoutError)

    if isinstance(e, (ConnectTimeoutError, ReadTimeoutError)):
        return "timeout"
    if isinstance(e, (ConnectionError, HTTPClientError)):
        return "connect"
    if isinstance(e, (NoCredentialsError, PartialCredentialsError)):
        return "auth"
    return "io"

