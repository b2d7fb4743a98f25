"""The examples run as a user would run them."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tinymodels import NodeProcess, free_port, hf_greedy, make_tiny_model

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
PROMPT = [5, 17, 33, 101, 7, 9, 12, 44]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model("qwen3", tmp_path_factory.mktemp("examples") / "qwen3")


def test_raw_client_speaks_the_documented_protocol(model_dir, tmp_path):
    source = (EXAMPLES / "raw_client.py").read_text()
    assert "disagg" not in re.sub(r'""".*?"""', "", source, flags=re.S).replace("examples/", "")
    addr = f"tcp://127.0.0.1:{free_port()}"
    node = NodeProcess(["--model", str(model_dir), "--listen", addr, "--num-pages", "32",
                        "--threads", "1"], tmp_path / "node.log")
    try:
        node.wait_ready()
        out = subprocess.run(
            [sys.executable, str(EXAMPLES / "raw_client.py"), "--connect", addr,
             "--prompt-token-ids", ",".join(map(str, PROMPT)), "--max-tokens", "6"],
            capture_output=True, text=True, timeout=120, check=True)
    finally:
        assert node.stop() == []
    result = json.loads(out.stdout)
    assert result["token_ids"] == hf_greedy(model_dir, PROMPT, 6)
    assert result["finish_reason"] == "length" and result["usage"]["completion_tokens"] == 6
    assert result["stats_after"]["finished"] == result["stats_before"]["finished"] + 1


@pytest.mark.fabric
def test_embedded_decode_server(model_dir):
    out = subprocess.run(
        [sys.executable, str(EXAMPLES / "embedded_decode_server.py"), "--model", str(model_dir),
         "--prompt", " ".join(map(str, PROMPT)), "--max-tokens", "5"],
        capture_output=True, text=True, timeout=180, check=True)
    m = re.search(r"server replied: (\w+) ([\d ]+)", out.stdout)
    assert m, out.stdout + out.stderr
    assert m.group(1) == "length"
    assert [int(t) for t in m.group(2).split()] == hf_greedy(model_dir, PROMPT, 5)
    # 7 prefilled tokens fit one page of 16: 2 layers x 1 page + 1 context write
    assert "received 3 KV units" in out.stdout
