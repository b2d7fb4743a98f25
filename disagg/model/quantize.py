"""Write a bf16 / fp16 / fp32 Hugging Face directory in the block-FP8 format of DeepSeek-V3
and the Qwen3 FP8 releases (``disagg.model.fp8``)::

    disagg-quantize SRC DST [--block-size 128 128] [--skip NAME ...]
    python -m disagg.model.quantize SRC DST

Every linear weight inside the decoder layers (attention and MLA projections, dense and
shared-expert MLPs, routed experts, per-expert or fused ``gate_up_proj`` / ``down_proj``) is
stored as ``float8_e4m3fn`` with a float32 ``<name>_scale_inv`` per block; embeddings,
``lm_head``, norms, router gates, biases and any module named by ``--skip`` (substring match,
as transformers' ``modules_to_not_convert``) stay as stored. ``config.json`` gains the
``quantization_config`` transformers' fine-grained FP8 support reads; the other files
(tokenizer, generation config) are copied. Shards keep the source's file split.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch

from disagg.model.fp8 import Fp8Format, quantizable, quantize_blocks


def quantize_dir(src: Path, dst: Path, block: tuple[int, int] = (128, 128),
                 skip: tuple[str, ...] = ()) -> int:
    """Write ``src`` to ``dst`` in block-FP8; returns the number of weights quantized."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from disagg.model.loader import safetensors_files

    cfg = json.loads((src / "config.json").read_text())
    if cfg.get("quantization_config") is not None:
        raise ValueError(f"{src} is already quantized "
                         f"({cfg['quantization_config'].get('quant_method')})")
    if dst.resolve() == src.resolve():
        raise ValueError("the destination must differ from the source")
    dst.mkdir(parents=True, exist_ok=True)
    files = safetensors_files(src)
    weight_map: dict[str, str] = {}
    count = 0
    for file in files:
        out: dict[str, torch.Tensor] = {}
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                t = f.get_tensor(name)
                if quantizable(name, t, skip):
                    out[name], out[f"{name}_scale_inv"] = quantize_blocks(t, block)
                    count += 1
                else:
                    out[name] = t.contiguous()
        save_file(out, str(dst / file.name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(out, file.name))
    for item in src.iterdir():  # tokenizer, generation config, ...
        if item.is_file() and item.suffix != ".safetensors" and item.name not in (
                "config.json", "model.safetensors.index.json"):
            shutil.copy2(item, dst / item.name)
    if (src / "model.safetensors.index.json").is_file():
        size = sum((dst / n).stat().st_size for n in set(weight_map.values()))
        (dst / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": size}, "weight_map": dict(sorted(weight_map.items()))},
            indent=2))
    cfg["quantization_config"] = Fp8Format("fp8", block, skip).config()
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return count


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="disagg-quantize", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src", type=Path, help="a Hugging Face model directory (safetensors)")
    ap.add_argument("dst", type=Path, help="where the FP8 copy goes")
    ap.add_argument("--block-size", type=int, nargs=2, default=[128, 128], metavar=("ROWS", "COLS"),
                    help="rows and columns of weights sharing one scale (default 128 128)")
    ap.add_argument("--skip", action="append", default=[], metavar="NAME",
                    help="leave modules whose name contains NAME unquantized (repeatable)")
    args = ap.parse_args(argv)
    if min(args.block_size) <= 0:
        ap.error("--block-size must be positive")
    try:
        n = quantize_dir(args.src, args.dst, (args.block_size[0], args.block_size[1]),
                         tuple(args.skip))
    except (OSError, ValueError) as e:
        sys.stderr.write(f"disagg-quantize: {e}\n")
        return 2
    sys.stdout.write(f"{n} weights quantized to FP8 ({args.block_size[0]}x"
                     f"{args.block_size[1]} blocks) in {args.dst}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
