"""How far a weight format's results are from the model's own: next-token agreement and KL, teacher-forced.

    python -m bench weight-agreement [--model smollm2] [--weights int4] [--threads 2]

Both engines (``weights=auto`` and ``--weights``) score the same texts (a few English paragraphs below, tokenized by
the model's tokenizer, and as many prompts of seeded random token ids): at every position, whether the two argmax
next tokens agree, and the KL divergence of the format's next-token distribution from the model's. Then each
greedily continues every text for ``--new-tokens``: the share of continuations that are identical and the mean
number of tokens before the first difference.
"""

from __future__ import annotations

import argparse
import random

import torch

TEXTS = (
    ("The river ran high that spring, and the ferry stopped running for almost a month. People on the far bank "
     "walked the long way round by the old stone bridge, which took most of a morning."),
    ("To make bread, mix flour, water, salt and yeast, knead the dough until it is smooth, and leave it to rise in a "
     "warm place. Shape it into a loaf, let it rise again, then bake it in a hot oven."),
    ("A hash table stores keys and values in an array of buckets. The key's hash picks the bucket; when two keys "
     "land in the same bucket, the table keeps both, in a list or in the next free slot."),
    ("The meeting is moved to Thursday at ten. Please bring the figures for the third quarter and the draft of the "
     "new plan, and let me know by tomorrow if you cannot come."),
)


def _distributions(llm, prompts: list[list[int]]) -> list[torch.Tensor]:
    return [llm.engine.prompt_logits(p).float().log_softmax(-1) for p in prompts]  # [T, vocab] each


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench weight-agreement", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--weights", default="int4")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--random-prompts", type=int, default=4, help="prompts of seeded random token ids, besides the texts")
    p.add_argument("--random-length", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=64)
    args = p.parse_args(argv)
    from engine.llm import LLM
    from engine.model_source import resolve_model
    from engine.sampling_params import SamplingParams

    path = str(resolve_model(args.model).path)
    base = LLM(path, num_threads=args.threads, num_blocks=512)
    other = LLM(path, num_threads=args.threads, num_blocks=512, weights=args.weights)
    texts = [base.tokenizer.encode(t) for t in TEXTS]
    rng = random.Random(0)
    vocab = base.engine.model_config.vocab_size
    randoms = [[rng.randrange(vocab) for _ in range(args.random_length)] for _ in range(args.random_prompts)]
    print(f"{args.model}: weights {args.weights} against the model's own ({base.engine.model_config.dtype}), "
          f"{args.threads} threads")
    print("| prompts | positions | next-token agreement | mean KL (nats) | max KL | greedy continuations identical "
          "| tokens before the first difference (mean) |")
    print("|---|---|---|---|---|---|---|")
    params = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)
    for name, prompts in (("texts", texts), ("random ids", randoms)):
        pairs = zip(_distributions(base, prompts), _distributions(other, prompts))
        rows = [(a.argmax(-1) == b.argmax(-1), (a.exp() * (a - b)).sum(-1)) for a, b in pairs]
        agree, kls = torch.cat([r[0] for r in rows]), torch.cat([r[1] for r in rows])
        outs = [(x.outputs[0].token_ids, y.outputs[0].token_ids)
                for x, y in zip(base.generate(prompts, params), other.generate(prompts, params))]
        same = sum(x == y for x, y in outs)
        before = [next((i for i, (s, t) in enumerate(zip(x, y)) if s != t), len(x)) for x, y in outs]
        print(f"| {name} ({len(prompts)}) | {agree.numel()} | {agree.float().mean():.3f} | {kls.mean():.4f} | "
              f"{kls.max():.3f} | {same}/{len(outs)} | {sum(before) / len(before):.1f} |", flush=True)
    base.close()
    other.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
