"""The worker shell both roles share (engine thread, gRPC server, KV data-plane servers, transfer leases,
heartbeat and index publisher, drain, metrics, the CLI).

Owns: ``node`` (the shell), ``leases`` (every transfer lease, one lifecycle), ``servicer`` (the calls both roles
serve, the error -> status mapping), ``config``, ``convert`` (proto <-> engine), ``publisher``, ``drain``,
``metrics``, ``main``. May import: engine, kv_transfer, proto. ``prefill_node`` and ``decode_node`` build on it;
it never imports them (``tests/unit/test_import_arrows.py``).
"""
