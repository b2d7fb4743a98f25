"""Quality sanity of the block-FP8 format on real weights: the embedded default model
(SmolLM2-135M-Instruct) quantized by ``disagg-quantize``, teacher-forced top-1 agreement with
the unquantized model (the fraction of positions where both pick the same next token, both fed
the unquantized model's own greedy continuation).

    .venv/bin/python bench/fp8_quality.py [--prompts 32] [--tokens 128] [--block 128]

The FP8 weights are dequantized by ``disagg.model.fp8`` (as the loader does) into the same
transformers model, so the difference measured is the format's, not an engine's.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

TOPICS = ["The history of", "A recipe for", "How to repair", "The best way to learn",
          "In the year 2050,", "My favourite book is", "The theory of", "Why do cats",
          "Write a poem about", "The main causes of", "Explain to a child how", "A letter to",
          "The difference between", "Ten facts about", "The city of", "When the rain stopped,"]
SUBJECTS = ["the ocean", "a bicycle", "mathematics", "the moon"]


def main() -> None:
    import transformers
    from safetensors import safe_open

    from disagg.model.default import default_model_dir
    from disagg.model.fp8 import dequantize
    from disagg.model.loader import safetensors_files
    from disagg.model.quantize import quantize_dir

    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--block", type=int, default=128)
    args = ap.parse_args()
    torch.manual_seed(0)
    src = default_model_dir()
    tok = transformers.AutoTokenizer.from_pretrained(src)
    ref = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        n = quantize_dir(src, Path(tmp) / "fp8", (args.block, args.block))
        fp8 = Path(tmp) / "fp8"
        state = {}
        for file in safetensors_files(fp8):
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118
                    if name.endswith("_scale_inv"):
                        continue
                    t = f.get_tensor(name)
                    if t.dtype == torch.float8_e4m3fn:
                        t = dequantize(name, t, f.get_tensor(f"{name}_scale_inv"),
                                       (args.block, args.block))
                    state[name] = t
        quant_s = time.perf_counter() - t0
    q = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    missing, unexpected = q.load_state_dict(state, strict=False)
    assert not unexpected and all("lm_head" in m for m in missing), (missing, unexpected)
    prompts = [f"{TOPICS[i % len(TOPICS)]} {SUBJECTS[i // len(TOPICS) % len(SUBJECTS)]}"
               for i in range(args.prompts)]
    agree = total = 0
    first_token_same = 0
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([tok(p)["input_ids"]])
            seq = ref.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                               max_new_tokens=args.tokens, min_new_tokens=args.tokens,
                               pad_token_id=tok.eos_token_id or 0)
            a = ref(seq).logits[0, ids.shape[1] - 1:-1].argmax(-1)
            b = q(seq).logits[0, ids.shape[1] - 1:-1].argmax(-1)
            agree += int((a == b).sum())
            total += a.numel()
            first_token_same += int(a[0] == b[0])
    print(json.dumps({"model": "SmolLM2-135M-Instruct (embedded default)", "weights_fp8": n,
                      "block": [args.block, args.block], "prompts": args.prompts,
                      "tokens": args.tokens, "top1_agreement": round(agree / total, 4),
                      "first_token_same": f"{first_token_same}/{args.prompts}",
                      "quantize_s": round(quant_s, 1)}))


if __name__ == "__main__":
    main()
