"""Routing: where a request goes — pure decisions plus the worker directory they read.

Owns: ``policy`` (decode worker, remote vs local prefill, prefill worker; baselines), ``cost_model`` (each
plan priced in predicted seconds), ``rates`` (prefill rates, step times, link bandwidths learned online),
``in_progress`` (prefills in flight and prefixes being computed), ``prefix_reuse`` (leasing another worker's
cached prefix), ``directory`` (the registry's workers, cached, with their gRPC channels), ``index_mirror``
(an in-memory mirror of the Redis KV index, bitmaps over compact holder ids), ``chain_match`` (a lookup's answer,
holders named on demand), ``mirror_sync`` (keeps it in step with Redis's event streams), ``preselect`` (which
workers a large pool prices), ``shared_books`` (several routers: the others' books priced beside this one's) and
``books_sync`` (publishes and reads them in Redis).
May import: ``router.errors``, kv_transfer, proto, engine's torch-free modules; never the serving core,
``router.openai`` or ``router.admin``.
"""
