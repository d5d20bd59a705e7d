"""Baton: router — the public ``baton.v1.Generation`` API in front of the prefill and decode pools.

Never imports torch (it imports engine's torch-free modules only: tokenizer, text_stream, errors,
sampling_params, model_source, gguf_file); modules are imported explicitly (nothing here). By concern:

    the serving core (this package)
        main          `baton router`: flags -> RouterConfig -> serve
        server        gRPC Generation servicer, error interceptor, start/stop of every front
        config        RouterConfig, ModelCard (config.json or GGUF metadata facts)
        frontend      validation + tokenization -> Job          admission  in-flight limit (429 / RESOURCE_EXHAUSTED)
        relay         one request's flow: stages, failures       control    Abort / ReleaseLease in the background
        handoff       the KV lease D is handed (one lifecycle)
        convert       proto <-> engine SamplingParams            errors     typed errors -> gRPC status
        trace         per-request timings                        tracing    OpenTelemetry spans of a request
        metrics       Prometheus series                          generate_cli  `baton generate`
    routing/          where a request goes: policy, cost model, learned rates, in-flight books, worker directory
    openai/           the OpenAI-compatible HTTP front (request parsing, logprobs)
    admin/            baton.v1.Admin: servicer, `baton admin` CLI, planner, profiling, traffic, Kubernetes scaling

Arrows (tests/unit/test_import_arrows.py): routing imports no other part of the router but ``router.errors``;
openai and admin may import the serving core; the core imports them only to serve them.
"""
