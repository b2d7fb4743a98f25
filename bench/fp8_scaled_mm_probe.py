"""Probe: does this torch's ``torch._scaled_mm`` take block-FP8 scales (1x128 activations,
128x128 weights) on this GPU, and how fast is it against ``fp8_linear`` and cuBLAS bf16 at a
prefill shape? Prints what each call form did.

    python3 bench/fp8_scaled_mm_probe.py
"""

from __future__ import annotations

import torch
from triton.testing import do_bench

from disagg.kernels import fp8_gemm, reference
from disagg.model.fp8 import quantize_blocks


def main() -> None:
    dev = torch.device("cuda:0")
    print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name(dev), flush=True)
    from disagg.kernels.fp8_gemm import cublas_fp8_linear

    w = torch.randn(4096, 4096, device=dev) * 0.02
    wq, ws = quantize_blocks(w, (128, 128))
    for m in (1, 16, 17, 64, 100, 256, 1000, 1024, 1025, 1031, 1040, 2047, 4099, 8192):
        x = torch.randn(m, 4096, device=dev, dtype=torch.bfloat16)
        try:
            cublas_fp8_linear(x, wq, ws, torch.bfloat16)
            torch.cuda.synchronize()
            print(f"M={m}: cuBLASLt block FP8 ok", flush=True)
        except RuntimeError as e:
            print(f"M={m}: refused ({str(e)[:80]})", flush=True)
    for m in (64, 256, 8192):  # decode batches and a prefill chunk, the 8B shape's GEMMs
        for n, k in ((4096, 4096), (12288, 4096), (4096, 12288)):
            probe(m, n, k, dev)


def probe(m: int, n: int, k: int, dev: torch.device) -> None:
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(n, k, generator=gen) * 0.02
    wq, ws = (t.to(dev) for t in quantize_blocks(w, (128, 128)))
    x = (torch.randn(m, k, generator=gen) * 2).to(dev, torch.bfloat16)
    q, s = fp8_gemm.quantize_groups(x)
    want = reference.fp8_block_matmul(q, s, wq, ws, torch.float32)
    wb = w.to(dev, torch.bfloat16)
    flops = 2 * m * n * k
    bf = do_bench(lambda: x @ wb.T, warmup=20, rep=100)
    ours = do_bench(lambda: fp8_gemm.fp8_block_matmul(q, s, wq, ws), warmup=20, rep=100)
    try:  # quantization included, as fp8_linear runs it
        lt = do_bench(lambda: fp8_gemm.cublas_fp8_linear(x, wq, ws, torch.bfloat16),
                      warmup=20, rep=100)
        lt_txt = f"{lt * 1e3:.0f} us ({flops / lt / 1e9:.0f} TF/s)"
    except RuntimeError as e:
        lt_txt = f"refused ({str(e)[:60]})"
    print(f"[{m}x{n}x{k}] bf16 {bf * 1e3:.0f} us ({flops / bf / 1e9:.0f} TF/s), "
          f"triton fp8 {ours * 1e3:.0f} us ({flops / ours / 1e9:.0f} TF/s), "
          f"cuBLASLt fp8 {lt_txt}", flush=True)
    forms = {
        "scale_a [M,K/128] row-major, scale_b [K/128,N/128]": lambda: torch._scaled_mm(
            q, wq.T, scale_a=s, scale_b=ws.T, out_dtype=torch.bfloat16),
        "scale_a [M,K/128] col-major, scale_b [K/128,N/128]": lambda: torch._scaled_mm(
            q, wq.T, scale_a=s.T.contiguous().T, scale_b=ws.T, out_dtype=torch.bfloat16),
        "scale_a col-major, scale_b [N/128,K/128] contiguous .T": lambda: torch._scaled_mm(
            q, wq.T, scale_a=s.T.contiguous().T, scale_b=ws.T.contiguous(),
            out_dtype=torch.bfloat16),
    }
    for name, fn in forms.items():
        try:
            out = fn()
            err = float((out.double() - want.double()).norm() / want.double().norm())
            t = do_bench(fn, warmup=20, rep=100)
            print(f"  _scaled_mm {name}: err {err:.2e}, {t * 1e3:.0f} us "
                  f"({flops / t / 1e9:.0f} TF/s)", flush=True)
        except Exception as e:
            print(f"  _scaled_mm {name}: {type(e).__name__}: {str(e)[:200]}", flush=True)
    try:
        from torch.nn.functional import ScalingType, SwizzleType, scaled_mm

        def fn():
            return scaled_mm(q, wq.T, s, ScalingType.BlockWise1x128, ws.T,
                             ScalingType.BlockWise128x128, swizzle_a=SwizzleType.NO_SWIZZLE,
                             swizzle_b=SwizzleType.NO_SWIZZLE, output_dtype=torch.bfloat16)
        out = fn()
        err = float((out.double() - want.double()).norm() / want.double().norm())
        t = do_bench(fn, warmup=20, rep=100)
        print(f"  F.scaled_mm BlockWise: err {err:.2e}, {t * 1e3:.0f} us "
              f"({flops / t / 1e9:.0f} TF/s)", flush=True)
    except Exception as e:
        print(f"  F.scaled_mm BlockWise: {type(e).__name__}: {str(e)[:200]}", flush=True)


if __name__ == "__main__":
    main()
