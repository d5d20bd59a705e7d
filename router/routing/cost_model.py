"""The cost model of DESIGN.md "Routing": every option priced in predicted seconds.

For a decode worker D, the prompt is computed either

    remote on P:  overhead(remote) + queue_wait(P) + uncached(P) / rate(P) + kv_bytes(uncached on D) / link(P, D)
    local on D:   overhead(local) + queued(D) / rate(D) + uncached(D) / rate(D) + chunks * decode_step(D)

(with ``--kv-layerwise``, on a pair whose transport streams layers, the pull runs while P computes: only
``max(kv_bytes / link - uncached(P) / rate(P), 0)`` is left after P's last layer), and the lower
``ttft + stall`` wins, unless local prefill would push D's running decodes past the ITL target (each of
D's steps then carries a prefill chunk) while the remote plan breaks this request's TTFT target by no more
(relative to each target: a short prompt's one slow step beats a 10 s wait in a queued prefill pool, a long
prompt's seconds-long stall of D's decodes does not); past both, local must also cost less.
Under ``floor_tokens`` uncached tokens, always local.

``stall`` is what a local prefill costs D's *other* sequences: while D computes the prompt's ``uncached``
tokens its steps carry the chunks, so each of its ``running`` sequences is delayed by about
``uncached / rate(D)`` seconds in all: ``stall = interference_weight * running * uncached / rate(D)``.
The weight defaults to 1, a second of another request's delay priced like a second of this one's. The
cost prices this request's decode as ``steps * itl``, its whole decode time, not a per-token figure; a
victim's stall amortised over its remaining tokens raises its ITL by ``stall / remaining``, and priced
the same way (``remaining`` times that) is the whole stall again. A weight of ``1 / expected_output_tokens``
would set one victim's per-token rise against this request's total: 64 times too weak to stop a decode
worker holding a shared prefix from taking most requests and prefilling them on top of its running
decodes (the benchmark in docs/benchmarks.md: 40 of 48). A remote plan stalls nobody (D only pulls KV),
so a busy prefix holder is moved to a remote prefill, or the request to another decode worker. Not
priced: the ``per_seq_s`` one more sequence adds to each running one's steps (only this request's own
``itl`` with the batch grown by one is).

D itself is priced ``ttft + stall + steps * itl(D with this request added)``, where a decode step grows
with D's batch and with the KV it holds (its used blocks plus this request's), so a prefix holder's own
queue counts against it. ``steps`` is the request's ``max_tokens - 1`` (the first token comes from the
prefill) capped at ``expected_output_tokens``, which also prices a request that states no limit: a
short request is priced as short, a long limit (often never reached) as the cap. The caller only offers
decode workers whose free blocks hold the request. ``overhead`` is each route kind's fixed cost (RPC
hops, the pull's setup), learned from measured TTFTs (``Rates.overhead_s``). Pure logic: no I/O, no
clock, the RNG is passed in.
"""

from __future__ import annotations

import functools

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from kv_transfer.errors import KVTransferError
from kv_transfer.layout import KVLayout
from kv_transfer.transport import served_kinds, streams_layers
from router.routing.rates import Rates

if TYPE_CHECKING:
    from router.routing.policy import Candidate, RouteRequest


@dataclass(frozen=True, slots=True, kw_only=True)
class CostConfig:
    itl_target_s: float = 0.100  # local prefill may not push D's running decodes' step time past this...
    ttft_target_s: float = 1.0  # ...unless the remote plan's TTFT is past this one and costs more
    prefill_chunk_tokens: int = 512  # prompt tokens D adds to one step when it prefills locally
    expected_output_tokens: int = 64  # decode steps priced on D: with no max_tokens, and at most with one
    interference_weight: float = 1.0  # cost per second a local prefill stalls each of D's running sequences
    kv_bytes_per_token: float = 131_072.0  # when neither the layout nor a measurement says (8B-class, bf16)
    temperature_s: float = 0.0  # softmax temperature over costs (0: argmin, deterministic)
    power_of_two_above: int = 8  # more fitting decode workers than this: price only two of them
    # Costs within this fraction of the best count as a tie, won by the longest cached prefix: the
    # prediction is noisy (loads lag by a heartbeat) and reuse also saves KV memory the model does not price.
    affinity_tolerance: float = 0.10
    # The router streams KV by layer (--kv-layerwise): on a pair that streams, the pull runs while P
    # computes, so only the part of it longer than P's compute delays D.
    kv_layerwise: bool = False
    # Cross-worker prefix reuse: a local plan may pull the longest cached prefix another worker holds
    # (Worker/LeasePrefix) instead of recomputing it, when the pull plus this fixed cost (one more RPC and
    # the pull's setup) is cheaper than the compute. Off: every worker recomputes what it lacks.
    prefix_import: bool = True
    prefix_import_overhead_s: float = 0.005
    # Host tier (--kv-host-blocks): a prefix held in a worker's host memory is copied up into its KV pool before
    # it computes the rest, at about this rate (memcpy on a CPU host; pinned host-to-device copies are faster).
    host_copy_gb_per_s: float = 8.0
    # Store tier (--kv-store): a prefix the shared store holds past a worker's own tiers is fetched before it
    # computes the rest, at about this rate (Mooncake Store over TCP measured 0.4-1.2 GB/s here)
    store_gb_per_s: float = 0.5

    def __post_init__(self) -> None:
        if not self.itl_target_s > 0 or not self.ttft_target_s > 0 or self.prefill_chunk_tokens < 1 or self.kv_bytes_per_token <= 0:
            raise ValueError(f"CostConfig: itl_target_s, ttft_target_s, prefill_chunk_tokens, kv_bytes_per_token must be > 0: {self}")
        if self.expected_output_tokens < 0 or self.temperature_s < 0 or self.power_of_two_above < 2 \
                or self.affinity_tolerance < 0 or self.interference_weight < 0 or self.prefix_import_overhead_s < 0:
            raise ValueError(f"CostConfig: expected_output_tokens, temperature_s, affinity_tolerance, "
                             f"interference_weight, prefix_import_overhead_s >= 0; power_of_two_above >= 2: {self}")


@dataclass(slots=True, kw_only=True)  # not frozen: built for every decode worker of every request
class PrefillPlan:
    """One way to compute the prompt for a given D, with its predicted TTFT split into terms."""

    kind: Literal["remote", "local"]
    prefill_id: str | None
    uncached_tokens: int
    queue_s: float
    compute_s: float
    transfer_s: float = 0.0
    interference_s: float = 0.0  # local: D's decode steps interleaved with the prompt's chunks
    itl_s: float = 0.0  # local: D's step time while a chunk rides along (0 when D runs no decodes)
    overhead_s: float = 0.0  # the route kind's fixed cost
    stall_s: float = 0.0  # local: D's running sequences' delay x interference_weight (not in this ttft)
    host_tokens: int = 0  # prompt tokens the computing worker copies up from its host tier instead (host_s)
    host_s: float = 0.0
    store_tokens: int = 0  # ... and fetches from the shared store instead (store_s)
    store_s: float = 0.0
    import_from: str | None = None  # local: the worker whose cached prefix D pulls first (transfer_s)
    import_tokens: int = 0

    @property
    def ttft_s(self) -> float:
        return (self.overhead_s + self.queue_s + self.compute_s + self.host_s + self.store_s + self.transfer_s
                + self.interference_s)

    @property
    def cost_s(self) -> float:
        """What the plan costs: this request's TTFT and the stall it inflicts on D's running sequences."""
        return self.ttft_s + self.stall_s

    def describe(self) -> str:
        terms = f"overhead {self.overhead_s:.4f} + queue {self.queue_s:.4f} + prefill {self.compute_s:.4f}"
        if self.host_tokens:
            terms += f" + host copy {self.host_s:.4f} ({self.host_tokens} tokens from host memory)"
        if self.store_tokens:
            terms += f" + store fetch {self.store_s:.4f} ({self.store_tokens} tokens from the store)"
        if self.kind == "remote":
            terms += f" + transfer {self.transfer_s:.4f}"
            return f"remote on {self.prefill_id} {self.ttft_s:.4f} s = {terms}"
        if self.import_from is not None:
            terms += f" + import {self.transfer_s:.4f} ({self.import_tokens} tokens from {self.import_from})"
        return (f"local {self.ttft_s:.4f} s = {terms} + interference {self.interference_s:.4f} "
                f"(itl {self.itl_s:.4f}, stall of running {self.stall_s:.4f})")


@dataclass(slots=True)  # not frozen: built per prefill worker per request (treat as read-only)
class PrefillQuote:
    """A prefill worker's part of a remote plan, the same for every D: its queue and the prompt's compute."""

    prefill: Candidate
    queue_s: float
    compute_s: float
    uncached_tokens: int  # the tokens P computes (its host tier's copied up instead: host_tokens, host_s)
    prefill_id: str = ""  # set by quote_prefills (read for every (P, D) pair: no property chain)
    kv_uri: str = ""
    host_tokens: int = 0
    host_s: float = 0.0
    store_tokens: int = 0
    store_s: float = 0.0

    @property
    def base_s(self) -> float:
        return self.queue_s + self.compute_s + self.host_s + self.store_s


@dataclass(slots=True, kw_only=True)  # not frozen: built for every decode worker of every request
class PricedDecode:
    decode: Candidate
    plan: PrefillPlan
    itl_s: float  # D's predicted decode step with this request added
    decode_steps: int  # decode steps the request is priced for (``decode_steps``)
    cost_s: float
    verdict: str  # why this plan
    alternative: PrefillPlan | None = None  # the plan it was compared with
    decode_wait_s: float = 0.0  # remote: D's queued prompts, before its first decode step for this request

    def describe(self) -> str:
        """The decision's terms and values (built only for the chosen worker)."""
        plans = self.plan.describe()
        if self.alternative is not None:
            pair = (self.plan, self.alternative)
            remote, local = pair if self.plan.kind == "remote" else pair[::-1]
            plans = f"{remote.describe()} vs {local.describe()}"
        wait = f" + wait for D's queue {self.decode_wait_s:.4f}" if self.decode_wait_s else ""
        return (f"{self.decode.worker_id}: cost {self.cost_s:.4f} s = ttft {self.plan.ttft_s:.4f} + stall "
                f"{self.plan.stall_s:.4f}{wait} + {self.decode_steps} x itl {self.itl_s:.4f}; {plans}; {self.verdict}")


def decode_steps(request: RouteRequest, config: CostConfig) -> int:
    """Decode steps D runs for the request: ``max_tokens - 1`` (the prefill samples the first token),
    capped at ``expected_output_tokens``, which also stands in when the request states no limit."""
    if request.max_tokens is None:
        return config.expected_output_tokens
    return min(max(request.max_tokens - 1, 0), config.expected_output_tokens)


def kv_bytes_per_token(decode: Candidate, rates: Rates, config: CostConfig) -> float:
    """KV bytes D pulls per prompt token: measured, else from D's registered layout, else the default."""
    return rates.kv_bytes_per_token(_layout_bytes_per_token(decode.info.layout_json) or config.kv_bytes_per_token)


@functools.lru_cache(maxsize=256)
def _layout_bytes_per_token(layout_json: str) -> float | None:
    """From a registered layout (parsed once per distinct string); None without the model's dimensions."""
    try:
        layout = KVLayout.from_json(layout_json)
    except KVTransferError:  # a layout without the model's dimensions (test doubles)
        return None
    return layout.model_bytes_per_block / layout.block_size  # every tensor-parallel rank's share


def host_load(request: RouteRequest, worker: Candidate, rate: float, rates: Rates,
              config: CostConfig) -> tuple[int, float]:
    """(tokens, seconds) of copying the worker's host-tier prefix up, or (0, 0) when none, or when computing
    those tokens at ``rate`` would be no slower (the worker's engine then recomputes them too)."""
    return _tier_load(request.host_tokens(worker), worker, rate, rates, config, config.host_copy_gb_per_s)


def store_load(request: RouteRequest, worker: Candidate, rate: float, rates: Rates,
               config: CostConfig) -> tuple[int, float]:
    """(tokens, seconds) of fetching the store's prefix past the worker's own tiers, or (0, 0)."""
    return _tier_load(request.store_tokens(worker), worker, rate, rates, config, config.store_gb_per_s)


def _tier_load(tokens: int, worker: Candidate, rate: float, rates: Rates, config: CostConfig,
               gb_per_s: float) -> tuple[int, float]:
    if not tokens:
        return 0, 0.0
    seconds = tokens * kv_bytes_per_token(worker, rates, config) / (gb_per_s * 1e9)
    return (tokens, seconds) if seconds < tokens / rate else (0, 0.0)


def quote_prefills(request: RouteRequest, prefills: Sequence[Candidate], rates: Rates,
                   config: CostConfig | None = None) -> list[PrefillQuote]:
    """Each prefill worker's queue wait, host-tier copy and compute for this prompt; priced once per request."""
    config = config or CostConfig()
    quotes = []
    for prefill in prefills:
        rate = rates.prefill_tokens_per_s(prefill.worker_id, prefill.load)
        hosted, host_s = host_load(request, prefill, rate, rates, config)
        stored, store_s = store_load(request, prefill, rate, rates, config)
        computed = request.uncached_tokens(prefill) - hosted - stored
        quotes.append(PrefillQuote(prefill, prefill.queued_prefill_tokens / rate, computed / rate, computed,
                                   prefill.info.worker_id, prefill.info.kv_uri, hosted, host_s, stored, store_s))
    quotes.sort(key=lambda q: (q.base_s, q.prefill_id))  # remote_plan stops at the first that cannot win
    return quotes


def remote_plan(
    request: RouteRequest, quotes: Sequence[PrefillQuote], decode: Candidate, rates: Rates, config: CostConfig
) -> PrefillPlan:
    """The fastest remote plan for D: each P's quote plus the pull of what D lacks over that pair's link."""
    num_bytes = request.uncached_tokens(decode) * kv_bytes_per_token(decode, rates, config)
    decode_id, decode_uri, layerwise = decode.info.worker_id, decode.info.kv_uri, config.kv_layerwise
    link_gb_per_s = rates.link_gb_per_s
    best, best_s, best_transfer_s = None, math.inf, 0.0
    for quote in quotes:  # a plain loop: this runs for every (P, D) pair of every request
        if quote.base_s > best_s:  # sorted by base_s, and a transfer is never negative: none left can win
            break
        transfer_s = num_bytes / (link_gb_per_s(quote.prefill_id, decode_id) * 1e9)
        if layerwise and streams_layers(quote.kv_uri, decode_uri):
            transfer_s = max(transfer_s - quote.compute_s, 0.0)  # hidden behind the layers still computing
        total_s = quote.base_s + transfer_s
        if total_s < best_s or total_s == best_s and best is not None and quote.prefill_id < best.prefill_id:
            best, best_s, best_transfer_s = quote, total_s, transfer_s
    assert best is not None, "remote_plan needs at least one prefill quote"
    quote, transfer_s = best, best_transfer_s
    return PrefillPlan(
        kind="remote", prefill_id=quote.prefill_id, uncached_tokens=quote.uncached_tokens,
        queue_s=quote.queue_s, compute_s=quote.compute_s, transfer_s=transfer_s, overhead_s=rates.overhead_s("remote"),
        host_tokens=quote.host_tokens, host_s=quote.host_s, store_tokens=quote.store_tokens, store_s=quote.store_s,
    )


def local_plan(request: RouteRequest, decode: Candidate, rates: Rates, config: CostConfig,
               source: Candidate | None = None) -> PrefillPlan:
    """D prefills itself: its queued prompts, this one's chunks, and a decode step of its batch per chunk;
    its ``running`` sequences each wait ``uncached / rate`` in all for those chunks (the stall). With a
    ``source`` holding a longer cached prefix, D first pulls what of it D lacks, when that is cheaper."""
    rate = rates.prefill_tokens_per_s(decode.worker_id, decode.load, on_decode=True)
    uncached = request.uncached_tokens(decode)
    hosted, host_s = host_load(request, decode, rate, rates, config)
    stored, store_s = store_load(request, decode, rate, rates, config)
    imported, import_s = _prefix_import(request, decode, source, rate, rates, config)
    if imported and hosted:  # both cover the tokens after D's pool prefix: the cheaper way over the longer span
        if host_s + max(imported - hosted, 0) / rate <= import_s + max(hosted - imported, 0) / rate:
            imported, import_s = 0, 0.0
        else:
            hosted, host_s = 0, 0.0  # an imported prefix lands in D's pool: its host tier is not read
    if imported:
        stored, store_s = 0, 0.0  # the worker's store fetch is for plain requests (not an import)
    uncached -= imported + hosted + stored
    running = decode.num_active
    interference_s = itl_s = 0.0
    if running:
        step_s = decode_step_s(decode, rates, running, used_kv_blocks(decode))
        interference_s = math.ceil(uncached / config.prefill_chunk_tokens) * step_s
        itl_s = step_s + min(uncached, config.prefill_chunk_tokens) / rate
    return PrefillPlan(
        kind="local", prefill_id=None, uncached_tokens=uncached, queue_s=decode.queued_prefill_tokens / rate,
        compute_s=uncached / rate, interference_s=interference_s, itl_s=itl_s, overhead_s=rates.overhead_s("local"),
        stall_s=config.interference_weight * running * uncached / rate, transfer_s=import_s,
        import_from=source.worker_id if imported else None, import_tokens=imported, host_tokens=hosted, host_s=host_s,
        store_tokens=stored, store_s=store_s,
    )


def _prefix_import(request: RouteRequest, decode: Candidate, source: Candidate | None, rate: float, rates: Rates,
                   config: CostConfig) -> tuple[int, float]:
    """(tokens, seconds) of pulling ``source``'s longer cached prefix into D, or (0, 0) when recomputing
    them on D (at ``rate``) is no slower."""
    if source is None or source.worker_id == decode.worker_id or not config.prefix_import:
        return 0, 0.0
    extra = request.cached_tokens(source) - request.cached_tokens(decode)
    if extra <= 0:
        return 0, 0.0
    num_bytes = extra * kv_bytes_per_token(decode, rates, config)
    seconds = config.prefix_import_overhead_s + num_bytes / (rates.link_gb_per_s(source.worker_id,
                                                                                 decode.worker_id) * 1e9)
    return (extra, seconds) if seconds < extra / rate else (0, 0.0)


def prefix_source(request: RouteRequest, candidates: Sequence[Candidate]) -> Candidate | None:
    """The worker (either role) holding the longest cached prefix of the prompt that it can lease to another worker
    over Baton's data plane (a worker whose engine moves its own KV, as vLLM's does, leases none); None when none
    holds a block. Ties: the fewer queued prefill tokens, then the worker id."""
    holders = [c for c in candidates if c.cached_blocks > 0 and not c.draining and served_kinds(c.info.kv_uri)]
    if not holders:
        return None
    return min(holders, key=lambda c: (-c.cached_blocks, c.queued_prefill_tokens, c.worker_id))


def used_kv_blocks(decode: Candidate) -> int:
    """KV blocks D's running requests hold, as last reported."""
    return max(decode.info.total_blocks - decode.free_blocks, 0)


def decode_step_s(decode: Candidate, rates: Rates, batch_size: int, kv_blocks: int) -> float:
    return rates.decode_step_s(decode.worker_id, decode.load, batch_size, kv_blocks,
                               total_blocks=decode.info.total_blocks)


def price_decode(
    request: RouteRequest, decode: Candidate, quotes: Sequence[PrefillQuote], rates: Rates, config: CostConfig,
    *, floor_tokens: int, no_remote_reason: str = "no prefill workers", source: Candidate | None = None,
) -> PricedDecode:
    """D's best prefill plan and its cost; ``quotes`` are the usable prefill workers' (may be empty);
    ``source``: the longest cached prefix's holder, which a local plan may import from."""
    itl_s = decode_step_s(decode, rates, decode.num_active + 1, used_kv_blocks(decode) + request.blocks_to_admit)
    local = local_plan(request, decode, rates, config, source)
    plan, alternative, verdict = _choose_plan(
        request, decode, local, quotes, rates, config, floor_tokens=floor_tokens, no_remote_reason=no_remote_reason
    )
    steps = decode_steps(request, config)
    # a remote plan's first token comes from P, but D decodes the next one only after the prompts queued on D
    # (a local prefill's step can take seconds): one gap, priced once (a local plan has it in its ttft)
    wait_s = local.queue_s if plan.kind == "remote" and steps else 0.0
    return PricedDecode(decode=decode, plan=plan, itl_s=itl_s, decode_steps=steps,
                        cost_s=plan.cost_s + wait_s + steps * itl_s, verdict=verdict, alternative=alternative,
                        decode_wait_s=wait_s)


def _choose_plan(
    request: RouteRequest, decode: Candidate, local: PrefillPlan, quotes: Sequence[PrefillQuote], rates: Rates,
    config: CostConfig, *, floor_tokens: int, no_remote_reason: str,
) -> tuple[PrefillPlan, PrefillPlan | None, str]:
    """(chosen, the other, verdict): lower ttft + stall wins unless local breaks D's ITL target; a floor first."""
    uncached = local.uncached_tokens
    if uncached <= floor_tokens:
        return local, None, f"{uncached} uncached prompt tokens <= threshold {floor_tokens}"
    if not quotes:
        return local, None, no_remote_reason
    remote = remote_plan(request, quotes, decode, rates, config)
    above = f"{uncached} uncached prompt tokens > threshold {floor_tokens}"
    if local.itl_s > config.itl_target_s:
        breaks_itl = f"local would push itl past target {config.itl_target_s:.4f}"
        itl_over, ttft_over = local.itl_s / config.itl_target_s, remote.ttft_s / config.ttft_target_s
        if ttft_over <= itl_over or remote.cost_s <= local.cost_s:
            return remote, local, f"{breaks_itl}; {above}"
        # both targets cannot hold (a queued prefill pool) and remote breaks its own further: local, cheaper
        return local, remote, (f"local would push itl {itl_over:.1f}x past its target {config.itl_target_s:.4f}, "
                               f"remote ttft {ttft_over:.1f}x past its {config.ttft_target_s:.4f}: local "
                               f"predicts the lower ttft + stall")
    if local.cost_s < remote.cost_s:
        return local, remote, "local predicts the lower ttft + stall"
    return remote, local, f"remote predicts the lower ttft + stall; {above}"


def sample_decodes(decodes: Sequence[Candidate], config: CostConfig, rng: random.Random) -> list[Candidate]:
    """Power of two choices in a large pool: the longest cached prefix (when any) and one at random."""
    if len(decodes) <= config.power_of_two_above:
        return list(decodes)
    best_cached = max(decodes, key=lambda c: (c.cached_blocks, c.worker_id))
    if best_cached.cached_blocks == 0:
        return rng.sample(list(decodes), 2)
    others = [c for c in decodes if c is not best_cached]
    return [best_cached, rng.choice(others)]


def choose(priced: Sequence[PricedDecode], config: CostConfig, rng: random.Random) -> PricedDecode:
    """Lowest cost, near-ties (``affinity_tolerance``) going to the longest cached prefix, then worker id;
    with a temperature, softmax over ``-cost / temperature_s``."""
    ordered = sorted(priced, key=lambda p: (p.cost_s, p.decode.worker_id))
    if config.temperature_s == 0 or len(ordered) == 1:
        near = [p for p in ordered if p.cost_s <= ordered[0].cost_s * (1 + config.affinity_tolerance)]
        return min(near, key=lambda p: (-p.decode.cached_blocks, p.cost_s, p.decode.worker_id))
    best = ordered[0].cost_s
    weights = [math.exp(-(p.cost_s - best) / config.temperature_s) for p in ordered]
    return rng.choices(ordered, weights=weights)[0]
