"""Which slice of the model a tensor-parallel rank holds (torch-free, apart from the all-reduce it names).

Rank r of N holds heads ``[r * H / N, (r + 1) * H / N)`` of q and of k/v (so each rank attends with its own KV
heads and holds only their slice of the paged cache), and columns ``[r * I / N, (r + 1) * I / N)`` of the MLP's
gate and up projections; o_proj and down_proj are row-parallel (each rank multiplies its slice of their input
and an all-reduce sums the partial outputs, their bias added once, after it). The embedding, the norms and the
lm_head are replicated: only rank 0 computes logits and samples.
"""

from __future__ import annotations

from typing import Any

from engine.errors import InvalidRequest


class TensorParallel:
    """This process's place in a tensor-parallel group of ``size`` ranks, and the process group its all-reduces
    run over (``group``: a private torch.distributed group, set once the ranks have met; never the global one)."""

    __slots__ = ("rank", "size", "group")

    def __init__(self, rank: int, size: int) -> None:
        if size < 1 or not 0 <= rank < size:
            raise InvalidRequest(f"tensor-parallel rank {rank} of {size} does not exist")
        self.rank, self.size = rank, size
        self.group: Any = None

    def part(self, total: int) -> tuple[int, int]:
        """``[start, stop)`` of this rank's equal share of ``total`` (which ``check_divisible`` checked)."""
        share = total // self.size
        return self.rank * share, (self.rank + 1) * share

    def all_reduce(self, x):  # x: any tensor, summed over the ranks in place (bounded by the group's timeout)
        self.group.allreduce([x]).wait()
        return x


def check_divisible(size: int, *, num_heads: int, num_kv_heads: int, intermediate_size: int) -> None:
    """Refuse a degree that does not split the model's heads and MLP evenly, naming what does not divide."""
    if size < 1:
        raise InvalidRequest(f"tensor_parallel_size must be >= 1, got {size}")
    for name, total in (("attention heads", num_heads), ("KV heads", num_kv_heads),
                        ("MLP intermediate size", intermediate_size)):
        if total % size:
            raise InvalidRequest(f"tensor_parallel_size {size} does not divide the model's {name} ({total}): "
                                 "every rank must hold an equal share")
