"""A step's input preparation: persistent buffers and incremental block tables vs rebuilding from lists.

    python -m bench.step_prep [--repeat 200]

Times, per step shape, ``StepInputs.fill`` (persistent buffers, each request's block-table row written
incrementally; what the runner does) and, as the baseline in the same run, ``StepBatch.from_slices`` (the same
batch rebuilt from Python lists every step), each followed by the torch backend's ``build_metadata``. The
inputs are synthetic: decode contexts drawn below the stated length, blocks distinct per request. CPU tensors
(on CUDA the fill adds one host-to-device copy). Best of 5 runs of ``--repeat`` steps each.
"""

from __future__ import annotations

import argparse
import random
import timeit
from types import SimpleNamespace

import torch

from engine.attention.base import SeqSlice, StepBatch
from engine.attention.torch_backend import TorchAttentionBackend
from engine.core.outputs import ScheduledSeq
from engine.step_inputs import StepInputs

BLOCK_SIZE = 16
SHAPES = {  # name -> (decodes, longest decode context, prefill chunk tokens)
    "64 decodes, contexts < 2k": (64, 2048, 0),
    "256 decodes, contexts < 2k": (256, 2048, 0),
    "8 decodes + a 2k-token prefill": (8, 1024, 2048),
}


def scheduled(num_decodes: int, max_context: int, prefill: int) -> list[ScheduledSeq]:
    rng, seqs = random.Random(0), []
    for i in range(num_decodes):
        context = rng.randrange(20, max_context)
        request = SimpleNamespace(request_id=f"d{i}", all_token_ids=list(range(context + 1)), num_preemptions=0, num_window_freed=0)
        blocks = tuple(range(i * 200, i * 200 + context // BLOCK_SIZE + 1))
        seqs.append(ScheduledSeq(request, context, 1, blocks, True))
    if prefill:
        request = SimpleNamespace(request_id="p", all_token_ids=list(range(prefill)), num_preemptions=0, num_window_freed=0)
        seqs.append(ScheduledSeq(request, 0, prefill, tuple(range(60000, 60000 + prefill // BLOCK_SIZE)), True))
    return seqs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.step_prep", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=200)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    cpu, backend = torch.device("cpu"), TorchAttentionBackend()
    print(f"{'step':<34}{'incremental us':>16}{'rebuilt us':>12}{'ratio':>8}")
    for name, shape in SHAPES.items():
        seqs, inputs = scheduled(*shape), StepInputs(cpu, BLOCK_SIZE)

        def incremental() -> None:
            backend.build_metadata(inputs.fill(seqs)[2])

        def rebuilt() -> None:
            slices = [SeqSlice(s.start, s.num_new_tokens, s.block_ids) for s in seqs]
            backend.build_metadata(StepBatch.from_slices(slices, BLOCK_SIZE, cpu))

        times = [min(timeit.repeat(f, number=args.repeat, repeat=5)) / args.repeat * 1e6 for f in (incremental, rebuilt)]
        print(f"{name:<34}{times[0]:>16.0f}{times[1]:>12.0f}{times[1] / times[0]:>7.1f}x", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
