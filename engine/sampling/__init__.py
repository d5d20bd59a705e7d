"""The sampler's parts: the batch (``batch``), its per-step building and per-request state (``builder``,
``penalty_state``), penalties, filters on candidates, and the seeded noise. ``engine.sampler`` holds the
Sampler itself and re-exports what callers use."""
