"""Tensor parallelism (``--tensor-parallel-size N``): the model's heads and MLP columns split across N rank
processes in lockstep (``shard``: who holds what; ``layers``: the row-parallel linear; ``leader``: rank 0's side,
which starts, drives and stops the others; ``rank``: a rank process's main loop; ``kv_memory``: the ranks' KV
caches in one shared-memory tensor). Nothing heavy is imported here."""
