"""The engine's one seam to the model: an Executor runs a step wherever the model lives, and says
what it holds, without the engine asking which kind it is (vLLM's Executor).

    LocalExecutor     the model in this process (a ModelRunner)
    TPExecutor        one process per tensor-parallel rank (engine/worker/tp/executor.py)

The engine calls execute once a step; allocate_kv and capture_graphs at start-up (gpu_blocks
first when a GPU's cache is sized by profiling); tier_worker when KV tiers are on; facts() for
what it reports (the server's EngineInfo, the start-up log); sparse_stats() for the metrics;
close() at the end.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from tierserve.engine.core.scheduler import SchedulerOutput

if TYPE_CHECKING:
    from tierserve.engine.kv_tiers.config import TierConfig
    from tierserve.engine.worker.kv_worker import KVConnectorWorker
    from tierserve.engine.worker.model_runner import Constrain, ModelRunner, StepResult
    from tierserve.engine.worker.sparse import SparseStats


@dataclass(frozen=True)
class ExecutorFacts:
    """What an executor holds and chose (under tensor parallel: rank 0's choices, the bytes of
    every rank summed, a block's shape across every rank's heads)."""

    backend: str
    """The decode attention backend's name."""
    sparse: bool
    """The decode backend can run sparse top-k decode."""
    routes: dict[str, str]
    """Each route the backend router decided (prefill, decode ...) -> backend name."""
    kv_dtype: torch.dtype
    weight_bytes: int
    kv_bytes: int
    block_shape: tuple[int, ...]
    """One block's KV for every layer: [layers, 2 (K, V), kv heads, block size, head dim]."""
    quant_kinds: dict[str, str]
    """Which kernel each kind of layer runs under --quantization (empty: none)."""
    graph_reserved_blocks: int
    """KV blocks kept out of the pool for the decode CUDA graphs' scratch (0: no graphs)."""


class TierWorker(Protocol):
    """The KV connector's worker side (KVConnectorWorker, or tensor parallel's TPTierWorker)."""

    manager: object
    """The tiers' reporting face: descriptors(), layout, events, stats(), flush()."""

    def attach(self, cost) -> None: ...


class Executor(Protocol):
    def facts(self) -> ExecutorFacts: ...

    def execute(self, out: SchedulerOutput, constrain: Constrain | None = None) -> StepResult: ...

    def gpu_blocks(self, utilization: float, block_bytes: int) -> int: ...

    def allocate_kv(self, num_blocks: int, max_model_len: int) -> None: ...

    def capture_graphs(self, pool_blocks: int) -> None: ...

    def tier_worker(self, tiers: TierConfig, fingerprint: bytes) -> TierWorker: ...

    def sparse_stats(self) -> SparseStats: ...

    def close(self) -> None: ...


def runner_facts(runner: ModelRunner) -> ExecutorFacts:
    """A ModelRunner's facts (a tensor-parallel rank reports its own with this too)."""
    return ExecutorFacts(backend=runner.backend.name, sparse=runner.backend.capabilities.sparse,
                         routes=dict(runner.routes), kv_dtype=runner.kv_dtype,
                         weight_bytes=runner.weight_bytes, kv_bytes=runner.kv_bytes,
                         block_shape=runner.block_shape, quant_kinds=dict(runner.quant_kinds),
                         graph_reserved_blocks=runner.graph_reserved_blocks)


class LocalExecutor:
    """The model in this process: every call goes to one ModelRunner."""

    def __init__(self, runner: ModelRunner):
        self.runner = runner

    def facts(self) -> ExecutorFacts:
        return runner_facts(self.runner)

    def execute(self, out: SchedulerOutput, constrain: Constrain | None = None) -> StepResult:
        return self.runner.execute(out, constrain)

    def gpu_blocks(self, utilization: float, block_bytes: int) -> int:
        """Profile a full step, then the blocks of `block_bytes` that gpu_memory_utilization
        leaves room for (engine/worker/device.py)."""
        from tierserve.engine.worker.device import measure_gpu_kv_bytes

        return measure_gpu_kv_bytes(self.runner, utilization) // block_bytes

    def allocate_kv(self, num_blocks: int, max_model_len: int) -> None:
        self.runner.allocate_kv(num_blocks, max_model_len)

    def capture_graphs(self, pool_blocks: int) -> None:
        self.runner.capture_graphs(pool_blocks)

    def tier_worker(self, tiers: TierConfig, fingerprint: bytes) -> KVConnectorWorker:
        """A TierManager over whole blocks of this cache, and the worker that moves them."""
        from tierserve.engine.kv_tiers.manager import TierManager
        from tierserve.engine.worker.kv_worker import KVConnectorWorker

        manager = TierManager(tiers, fingerprint, self.runner.block_shape, self.runner.kv_dtype)
        return KVConnectorWorker(manager, self.runner, tiers.load_timeout_s)

    def sparse_stats(self) -> SparseStats:
        return self.runner.sparse.stats

    def close(self) -> None:
        pass  # the runner's memory goes with the engine
