"""The in-memory mirror's bitmap walk (issue 23, item 4): the same answer as ``walk_chain`` (the Lua script's twin)
on any holdings and any history of stores, removals, drops and resyncs; compact ids reused; a ``ChainMatch``
answers one holder's depths and the groups from the deepest down without naming every holder; and the walk's
work does not grow with the holders of a block."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from kv_transfer.index_schema import STORE, TieredLookup, walk_chain
from router.routing.chain_match import TieredMatch
from router.routing.index_mirror import IndexMirror

CHAIN = [bytes([0xA0 + i]) * 16 for i in range(8)]
HOLDERS = ["a", "b", "c", "d", "e", STORE]


def rows_of(mirror: IndexMirror, hashes: list[bytes]) -> list[dict[str, str] | None]:
    """Per block, {holder: tier} as Redis would hold it (from each holder's own view, ``held``)."""
    held = {h: mirror.held(h) for h in HOLDERS}
    return [{h: held[h][b] for h in HOLDERS if b in held[h]} or None for b in hashes]


def step(mirror: IndexMirror, rng: random.Random) -> None:
    holder, roll = rng.choice(HOLDERS), rng.random()
    if roll < 0.05:
        mirror.drop(holder)
    elif roll < 0.1:
        mirror.replace(holder, {b: rng.choice(["gpu", "cpu"]) if holder != STORE else "store"
                                for b in rng.sample(CHAIN, rng.randint(0, 5))})
    elif roll < 0.35:
        mirror.remove(holder, rng.sample(CHAIN, rng.randint(0, 3)))
    else:
        tier = "store" if holder == STORE else rng.choice(["gpu", "gpu", "cpu"])
        mirror.store(holder, rng.sample(CHAIN, rng.randint(1, 5)), tier)


@settings(max_examples=150, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), steps=st.integers(1, 60))
def test_property_the_bitmap_walk_is_walk_chain_after_any_history(seed, steps):
    rng, mirror = random.Random(seed), IndexMirror()
    for _ in range(steps):
        step(mirror, rng)
        for start in range(0, len(CHAIN), 3):
            rows = rows_of(mirror, CHAIN[start:])
            assert mirror.lookup_tiers(CHAIN[start:]) == walk_chain(rows), (start, rows)
    blocks = {b for h in HOLDERS for b in mirror.held(h)}
    assert len(mirror) == len(blocks)
    assert mirror.num_entries == sum(len(mirror.held(h)) for h in HOLDERS)


def test_a_match_answers_one_holder_and_groups_deepest_first():
    mirror = IndexMirror()
    mirror.store("a", CHAIN[:5])
    mirror.store("b", CHAIN[:2])
    mirror.store("c", CHAIN[:5])
    mirror.store("c", CHAIN[1:2], "cpu")  # c's block 1 is in its host tier: its KV-pool prefix is 1 block
    match = mirror.match(CHAIN)
    assert match.depths("a") == (5, 5) and match.depths("c") == (1, 5) and match.depths("b") == (2, 2)
    assert match.depths("nobody") == (0, 0)
    groups = [(depth, sorted(group), len(group)) for depth, group in match.groups()]
    assert groups == [(5, ["a", "c"], 2), (2, ["b"], 1)]
    assert "a" in next(match.groups())[1] and "b" not in next(match.groups())[1]
    assert match.to_tiered() == TieredLookup(gpu={"a": 5, "b": 2, "c": 1}, gpu_or_cpu={"a": 5, "b": 2, "c": 5})
    tiered = TieredMatch(match.to_tiered())
    assert [(d, sorted(g)) for d, g in tiered.groups()] == [(5, ["a", "c"]), (2, ["b"])]
    assert tiered.depths("c") == (1, 5)


def test_a_dropped_holders_id_is_reused_and_a_match_keeps_the_names_of_its_lookup():
    mirror = IndexMirror()
    for holder in ("a", "b", "c"):
        mirror.store(holder, CHAIN[:3])
    before = mirror.match(CHAIN)
    mirror.drop("b")
    mirror.store("z", CHAIN[:1])  # takes b's id, the lowest free one
    assert mirror._ids["z"] == 1  # noqa: SLF001 - the compact id is the point
    assert sorted(next(before.groups())[1]) == ["a", "b", "c"]  # the old match still names b
    assert mirror.lookup(CHAIN) == {"a": 3, "c": 3, "z": 1}
    assert mirror.held("b") == {} and mirror.holders() == ["a", "c", "z"]


def test_a_block_held_once_stores_no_bitmap():
    mirror = IndexMirror()
    for i in range(300):
        mirror.store(f"w{i}", [bytes([i % 256, i // 256]) * 8])
    assert all(value < 0 for value in mirror._holders.values())  # noqa: SLF001 - ~id, not 1 << id
    mirror.store("w299", [bytes([0, 0]) * 8])  # a second holder: a bitmap now
    assert mirror._holders[bytes([0, 0]) * 8] == 1 | 1 << 299  # noqa: SLF001
    mirror.remove("w0", [bytes([0, 0]) * 8])
    assert mirror._holders[bytes([0, 0]) * 8] == ~299  # noqa: SLF001 - back to one holder


class CountingDict(dict):
    gets = 0

    def get(self, key, default=None):
        CountingDict.gets += 1
        return super().get(key, default)


def test_the_walk_touches_each_block_once_whatever_the_number_of_holders():
    """1,000 holders of a 64-block chain (ending at every depth) and 1 holder: the walk reads each block's
    bitmap once and records one end group per depth where prefixes end; holders are named only on demand."""
    chain = [bytes([i]) * 16 for i in range(64)]
    for holders in (1, 1000):
        mirror = IndexMirror()
        for i in range(holders):
            mirror.store(f"w{i}", chain[: 1 + i % 64])
        mirror._holders = CountingDict(mirror._holders)  # noqa: SLF001 - count the walk's reads
        mirror._off_gpu = CountingDict(mirror._off_gpu)  # noqa: SLF001
        CountingDict.gets = 0
        match = mirror.match(chain)
        assert CountingDict.gets <= 2 * 64, holders  # a bitmap and an off-pool one per block, whatever the holders
        assert len(match.any_ends) == min(holders, 64)
        assert match.depths(f"w{holders - 1}") == ((holders - 1) % 64 + 1,) * 2


def test_a_mirror_past_its_entry_limit_frees_itself_and_stays_off():
    from router.routing.mirror_sync import MirrorSync

    sync = MirrorSync(index=None, max_entries=5, stale_after_s=float("inf"))  # type: ignore[arg-type] - no Redis
    sync.mirror.store("a", CHAIN[:3])
    sync.ready = True
    assert sync.within_limit() and sync.match(CHAIN) is not None
    sync.mirror.store("b", CHAIN[:3])  # 6 entries
    assert not sync.within_limit()
    assert sync.over_limit and not sync.ready and len(sync.mirror) == 0 and sync.match(CHAIN) is None


def test_nothing_the_garbage_collector_walks_grows_with_the_index():
    """A full collection visits every entry of every tracked container: none of the mirror's may hold entries."""
    import gc

    mirror = IndexMirror()
    mirror.store("a", CHAIN)
    mirror.store("b", CHAIN[:3], "cpu")
    mirror.store(STORE, CHAIN[:2], "store")
    assert not gc.is_tracked(mirror._holders) and not gc.is_tracked(mirror._off_gpu)  # noqa: SLF001
    assert not any(gc.is_tracked(held) for held in mirror._held)  # noqa: SLF001
