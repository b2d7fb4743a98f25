"""Embedding disagg in your own asyncio server: no CLI, only the public Python API.

Starts a prefill node and a decode node inside this process (each with its own executor
processes), then serves a tiny line protocol on a local TCP port: send a prompt line, get the
completion back. The script then acts as its own client once, prints what it got and where the
KV came from, and shuts everything down.

    python examples/embedded_decode_server.py [--model HF_DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import socket

from disagg.client import AsyncClient
from disagg.config import CacheConfig, DisaggConfig, ExecutorConfig, NodeConfig
from disagg.node import Node
from disagg.protocol import SamplingParams


def free_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


class LineServer:
    """One line in (a prompt), one line out (its completion), via the decode node."""

    def __init__(self, client: AsyncClient, max_tokens: int):
        self.client = client
        self.max_tokens = max_tokens

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        line = (await reader.readline()).decode().strip()
        words = line.split()
        if words and all(w.isdigit() for w in words):  # token ids, for models without a tokenizer
            kw: dict = {"prompt_token_ids": [int(w) for w in words]}
        else:
            kw = {"prompt": line}
        ids, text, fin = await self.client.complete(
            sampling=SamplingParams(max_tokens=self.max_tokens, ignore_eos=True), **kw)
        writer.write(f"{fin.reason} {' '.join(map(str, ids))} | {text}\n".encode())
        await writer.drain()
        writer.close()


async def main(model: str | None, prompt: str, max_tokens: int) -> None:
    executor = ExecutorConfig(model=model, threads=1)
    cache = CacheConfig(page_size=16, num_pages=256)
    prefill = Node(NodeConfig(role="prefill", listen=free_address(), executor=executor,
                              cache=cache))
    await prefill.start()
    assert prefill.address is not None
    decode = Node(NodeConfig(role="decode", listen=free_address(), executor=executor, cache=cache,
                             disagg=DisaggConfig(prefill_peers=[prefill.address],
                                                 heartbeat_s=0.2)))
    await decode.start()
    assert decode.address is not None
    client = AsyncClient(decode.address)
    server = await asyncio.start_server(LineServer(client, max_tokens).handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        while (await client.stats()).prefill_peers_alive == 0:
            await asyncio.sleep(0.1)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(prompt.encode() + b"\n")
        await writer.drain()
        print("server replied:", (await reader.readline()).decode().strip())
        writer.close()
        stats = await client.stats()
        print(f"decode node received {stats.kv_units_received} KV units from the prefill node")
    finally:
        server.close()
        await server.wait_closed()
        await client.close()
        await decode.stop()
        await prefill.stop()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="HF directory (default: the embedded model)")
    ap.add_argument("--prompt", default="The capital of France is")
    ap.add_argument("--max-tokens", type=int, default=8)
    args = ap.parse_args()
    asyncio.run(main(args.model, args.prompt, args.max_tokens))
