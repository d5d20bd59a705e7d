"""The forms of a linear layer's product on the CPU, at a model's real shapes with its weights cold.

    python -m bench linear-forms [--model smollm2] [--rows 1 2 4 8 16 32 64 256 2048] [--threads 2] [--runs 8]

For each row count (tokens in a step), the time of one token's worth of products (every layer's q/k/v, o, gate/up
and down weights, then the lm_head), each weight a distinct tensor as in a real step, in four forms:
``F.linear(x, W)``; 8 batched products of slices of W's output features; oneDNN's product on W packed once
(``engine.model.layers.pack_weight``); and ``engine.model.layers.linear``, which takes the slices for one row and
the packed product for more. Best of ``--runs``, in ms. The memory floor (the weights' bytes over ``sum()``'s speed
on the same tensors) is printed first.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from engine.model.layers import linear, pack_weight


def shapes(model: str) -> tuple[int, list[tuple[int, int]], tuple[int, int]]:
    """(layers, a layer's (out, in) weights, the lm_head's (out, in)) from the model's config."""
    from bench.engines import model_config
    from engine.model_source import resolve_model

    config = model_config(resolve_model(model))
    hidden, inter, heads = config["hidden_size"], config["intermediate_size"], config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads", heads)
    head_dim = config.get("head_dim") or hidden // heads
    layer = [((heads + 2 * kv_heads) * head_dim, hidden), (hidden, heads * head_dim), (2 * inter, hidden),
             (hidden, inter)]
    return config["num_hidden_layers"], layer, (config["vocab_size"], hidden)


def best_ms(fn, runs: int) -> float:
    fn()
    best = float("inf")
    for _ in range(runs):
        started = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - started)
    return best * 1e3


def onednn(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """oneDNN's product on a weight packed by ``pack_weight``, whatever the rows (the engine's for more than one)."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench linear-forms", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 256, 2048])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--runs", type=int, default=8)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    num_layers, layer, head = shapes(args.model)
    weights = [torch.randn(out, inp) for _ in range(num_layers) for out, inp in layer] + [torch.randn(*head)]
    nbytes = sum(w.numel() * w.element_size() for w in weights)
    flat = torch.randn(nbytes // 4)
    floor = best_ms(lambda: flat.sum(), args.runs)
    print(f"{len(weights)} products, {nbytes / 1e6:.0f} MB of weights; sum() over as many bytes: {floor:.1f} ms "
          f"({nbytes / floor / 1e6:.1f} GB/s), {args.threads} threads")
    packed = [pack_weight(w) for w in weights]
    print("| rows | F.linear(x, W) ms | 8 slices ms | oneDNN packed ms | engine linear ms |")
    print("|---|---|---|---|---|")
    for rows in args.rows:
        inputs = {w.shape[1]: torch.randn(rows, w.shape[1]) for w in weights}
        forms = [lambda x=inputs: [F.linear(x[w.shape[1]], w) for w in weights],
                 lambda x=inputs: [linear(x[w.shape[1]], w) for w in weights],  # no packed weight: the slices
                 lambda x=inputs: [onednn(x[w.shape[1]], p) for w, p in zip(weights, packed)],
                 lambda x=inputs: [linear(x[w.shape[1]], w, packed=p) for w, p in zip(weights, packed)]]
        cells = [best_ms(form, args.runs) if i != 2 or packed[0] is not None else None for i, form in enumerate(forms)]
        print(f"| {rows} | " + " | ".join("-" if c is None else f"{c:.1f}" for c in cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
