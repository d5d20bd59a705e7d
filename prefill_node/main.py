"""``baton prefill`` / ``baton decode``: run one worker process until SIGINT or SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal

from engine.config import EngineConfig


def parser(role: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"baton {role}", description=f"Run a Baton {role} worker.")
    p.add_argument("--redis-url", required=True, help="Redis of the KV index and registry, e.g. redis://127.0.0.1:6379")
    p.add_argument("--model", default=None, help="Hugging Face checkpoint folder (default: the tiny model)")
    p.add_argument("--namespace", default="baton", help="Redis key namespace")
    p.add_argument("--host", default="127.0.0.1", help="address to serve gRPC and the KV data plane on")
    p.add_argument("--port", type=int, default=0, help="gRPC port (0: any free port)")
    p.add_argument("--kv-transport", default="tcp", choices=["tcp"], help="KV data plane")
    p.add_argument("--kv-port", type=int, default=0, help="KV data-plane port (0: any free port)")
    p.add_argument("--worker-id", default=None)
    p.add_argument("--num-blocks", type=int, default=None, help="KV cache blocks (default: sized from memory)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-waiting", type=int, default=None,
                   help="admission control: refuse new requests (RESOURCE_EXHAUSTED) past this many queued")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="auto")
    p.add_argument("--num-threads", type=int, default=None, help="torch threads (CPU)")
    p.add_argument("--lease-ttl-s", type=float, default=30.0, help="how long unpulled KV stays pinned")
    p.add_argument("--heartbeat-ttl-s", type=float, default=6.0)
    p.add_argument("--metrics-port", type=int, default=9400,
                   help="serve Prometheus /metrics on --host at this port (default: %(default)s; 0: no endpoint)")
    p.add_argument("--log-level", default="INFO")
    return p


def worker_config(role: str, args: argparse.Namespace):
    from prefill_node.node import WorkerConfig

    engine = EngineConfig(
        model=args.model, dtype=args.dtype, device=args.device, block_size=args.block_size,
        num_blocks=args.num_blocks, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
        max_num_waiting=args.max_num_waiting, num_threads=args.num_threads,
    )
    return WorkerConfig(
        role=role, engine=engine, redis_url=args.redis_url, namespace=args.namespace, host=args.host,
        grpc_port=args.port, kv_transport=args.kv_transport, kv_port=args.kv_port, worker_id=args.worker_id,
        lease_ttl_s=args.lease_ttl_s, heartbeat_ttl_s=args.heartbeat_ttl_s,
        heartbeat_interval_s=min(2.0, args.heartbeat_ttl_s / 3), metrics_port=args.metrics_port,
    )


async def serve(role: str, args: argparse.Namespace) -> None:
    if role == "decode":
        from decode_node.node import DecodeNode as Node
    else:
        from prefill_node.node import WorkerNode as Node
    node = Node(worker_config(role, args))
    await node.start()
    print(f"{role} worker {node.worker_id} ready: grpc={node.grpc_address} kv={node.kv_uri}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await node.stop()


def run(role: str, argv: list[str]) -> int:
    args = parser(role).parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format=f"%(asctime)s {role} %(name)s %(levelname)s %(message)s")
    asyncio.run(serve(role, args))
    return 0


def main(argv: list[str]) -> int:
    return run("prefill", argv)
