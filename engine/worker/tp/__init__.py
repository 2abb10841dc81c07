"""Tensor parallel: one worker process per rank, joined by torch.distributed (gloo on the CPU,
nccl on CUDA), each holding a Megatron-style shard of the model and of the KV cache.

    main process                         rank r of N (a spawned process)
    scheduler, tokenizer, the tiers'     ModelRunner over the shard: its heads' KV cache, its
    scheduler side, server; TPExecutor   own attention route, its tier shards; all-reduce after
    (the runner's face)                  o_proj and down_proj, vocab-parallel embedding (all-
        -- one StepMessage a step -->    reduce) and LM head (all-gather), so every rank has
        <-- rank 0's StepResult          the logits and samples the same tokens

Sharding at load (shard_model): q/k/v by heads (column-parallel; KV heads with the query heads
that read them, replicated when N exceeds the KV heads), o_proj by its input columns (row-
parallel), gate/up by rows, down by columns, embedding and LM head by vocabulary rows (padded to
a multiple of N). The scheduler's block tables and prefix cache are one for all ranks: a block id
means the same positions in every rank's cache.

The step message is compact and typed: per scheduled request its id, start, token count, block
ids, proposals and the output tokens the workers have not seen (a request's prompt and sampling
parameters go once, when it is first scheduled); finished requests are dropped by id. Workers keep
a mirror Request per request id, which is all the runner reads.

The KV tiers: each rank stores and loads its own shard of every block under a key space named by
its rank and the world size; the main process keeps the tiers' scheduler side (tiers.py).

Faults: the executor waits for rank 0's answer while checking every process; a rank that exits
(or reports an error) raises WorkerDied, which stops the engine loop; workers exit when their
pipe closes, so none outlives the main process.

The room, one side per file:
    protocol.py   what both sides agree on: the step message, WorkerDied, the tiers' key names
    shard.py      the sharding (ShardPlan, shard_model, shard_blocks) and a rank's collectives
                  (Shard, which the model takes at construction)
    executor.py   the main process's side: TPExecutor, the engine's executor over the ranks
    tiers.py      the main process's side of the KV tiers (TPTierWorker, TPTierManager)
    rank.py       a rank's process: `python -m tierserve.engine.worker.tp.rank`, its model
                  runner, its tiers (RankTiers)
"""
