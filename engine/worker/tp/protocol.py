"""What the main process and the ranks agree on: the step message (a request's prompt and
parameters once, then per step its slice of the batch), the error a lost rank raises, and the
key space of a rank's KV tier shards."""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass

from tierserve.engine.kv_tiers.config import TierConfig


class WorkerDied(RuntimeError):
    """A tensor-parallel rank exited or failed: the engine cannot go on."""


@dataclass(frozen=True)
class NewRequest:
    prompt_token_ids: list[int]
    params: object
    hints: object


@dataclass(frozen=True)
class StepEntry:
    request_id: str
    start: int
    num_new_tokens: int
    block_ids: tuple[int, ...]
    samples: bool
    spec_token_ids: tuple[int, ...]
    new_output: tuple[int, ...]
    """Output tokens the workers have not seen yet."""
    new: NewRequest | None = None
    """Sent the first time the request is scheduled."""


@dataclass(frozen=True)
class StepMessage:
    entries: tuple[StepEntry, ...]
    num_batched_tokens: int
    dropped: tuple[str, ...] = ()
    """Requests that finished: the workers forget them."""
    masks: dict = dataclasses.field(default_factory=dict)
    """Structured outputs: the next token's bitmask row (int32 numpy) per constrained request."""
    mask_vocab: int = 0
    """The vocabulary the bitmasks cover (the grammar compiler's)."""


def rank_fingerprint(fingerprint: bytes, rank: int, size: int) -> bytes:
    """The key space of rank `rank`'s shards (the model fingerprint already names the size)."""
    return hashlib.sha256(fingerprint + f"|tp rank {rank} of {size}".encode()).digest()[:16]


def rank_tier_config(config: TierConfig, size: int) -> TierConfig:
    """Each rank's share of the byte budgets."""
    return dataclasses.replace(config, cpu_bytes=config.cpu_bytes // size,
                               disk_bytes=config.disk_bytes // size)
