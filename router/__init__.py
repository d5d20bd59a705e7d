"""Baton: router — the public ``baton.v1.Generation`` API in front of the prefill and decode pools.

Never imports torch; modules are imported explicitly (nothing here)::

    config      RouterConfig, ModelCard (config.json facts)        main          `baton router`
    policy      pure routing: decode worker, remote vs local, P    generate_cli  `baton generate`
    frontend    validation + tokenization -> Job                   server        gRPC servicer, error interceptor
    convert     proto <-> engine SamplingParams                    relay         Prefill -> Decode orchestration
    output      incremental text + stop strings                    directory     Redis registry cache, channels
    trace       per-request timings                                control       Abort / ReleaseLease in background
"""
