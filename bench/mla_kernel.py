"""MLA latent-attention kernels (``disagg.kernels.mla``) on one CUDA device.

Decode: batch 1/64/256 at a 4k context, 16 heads (DeepSeek-V2-Lite) and 128 (V3 at TP1), page
16, timed with ``triton.testing.do_bench_cudagraph``; bandwidth counts the latent bytes read
(``B * ctx * 576 * 2``) against a 1 GiB ``copy_`` measured in the same run (bytes read +
written per second) and a 1 GiB ``sum`` (bytes read per second). Prefill: one 8k causal prompt,
TFLOP/s in absorbed FLOPs (``2 * (576 + 512)`` a visible query-key pair and head) against a
bf16 8192^3 matmul. With
``--sweep`` a few tile choices per shape are timed too. Prints a table; ``--out DIR`` writes
``mla_kernel.json``.

    python bench/mla_kernel.py --sweep --out /tmp/mla

``--flashinfer``: FlashInfer 0.2.14.post1's MLA decode (``BatchMLAPagedAttentionWrapper``,
backends ``fa3`` then ``fa2``; ``--fi-backends`` to choose) against ``mla_decode`` at 16 heads,
batch 1/64/256, ``--ctx``, page 16 and 64, on the same random query, cache and block tables
(FlashInfer's ``kv_indices`` are each block-table row's first ``ceil(len / page)`` pages,
flattened). Its ``ckv``/``kpe`` caches are strided views of our ``[pages, 1, page, 576]``
cache (``[:, 0, :, :512]`` and ``[:, 0, :, 512:]``: its run passes the page and token strides
to the kernel and checks no contiguity); it is also timed on contiguous copies (its own
layout). Both outputs are latent ``[B, H, 512]``: the relative L2 error between them is printed.
``plan()`` runs outside the timing; ``run`` is timed from a CUDA graph with
``do_bench_cudagraph`` like ours. Rows ``kind="flashinfer_decode"`` carry ``flashinfer_us``
(on the views; on the copies, ``layout="copies"``, if the views' result is off),
``flashinfer_views_us``, ``flashinfer_copies_us``, ``rel_err*``, ``ours_us`` and ``ratio = ours_us / flashinfer_us``. A
FlashInfer failure is printed and the rest still runs and saves; each backend JIT-builds once
(~28 s on an H200). ``--flashinfer-only`` skips our own decode/prefill tables.

On the H200 machine (no network) FlashInfer runs from its sdist, JIT-built, as in the shared
GPU notes. Here, once: ``pip download --no-deps --no-binary=flashinfer-python
flashinfer-python==0.2.14.post1 -d .fi/`` (``/.fi/`` is git-ignored). The device call names
``.fi`` in ``carry`` and runs (one line):

    mkdir -p /tmp/fi && tar xzf .fi/flashinfer_python-0.2.14.post1.tar.gz -C /tmp/fi && R=/tmp/fi/flashinfer_python-0.2.14.post1 && rm -rf $R/flashinfer/data && mkdir -p $R/flashinfer/data && ln -s $R/csrc $R/flashinfer/data/csrc && ln -s $R/include $R/flashinfer/data/include && ln -s $R/3rdparty/cutlass $R/flashinfer/data/cutlass && ln -s $R/3rdparty/spdlog $R/flashinfer/data/spdlog && export PYTHONPATH=$R:$PWD:$PYTHONPATH FLASHINFER_CUDA_ARCH_LIST=9.0 TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16 PYTHONUNBUFFERED=1 && python3 bench/mla_kernel.py --flashinfer --out $OUT/mla

(add ``--flashinfer-only`` to skip our own tables and save device time.)
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import torch
import triton
from triton.testing import do_bench_cudagraph

from disagg.kernels import mla

LAT, ROPE, PAGE = 512, 64, 16
SCALE = 192**-0.5


def copy_rates() -> tuple[float, float]:
    """Bytes per second moved by a 1 GiB ``copy_`` (read + written) and read by a 1 GiB
    ``sum`` (read only), timed launch by launch like ``bench/experiment_engine.py``'s ceiling
    (a 1 GiB copy replayed from a graph read 35% slower on an H200: 2.7 against 4.2 TB/s)."""
    from triton.testing import do_bench

    src = torch.randn(1 << 29, dtype=torch.float32, device="cuda").to(torch.bfloat16)
    dst = torch.empty_like(src)
    nbytes = src.numel() * 2
    copy_ms = do_bench(lambda: dst.copy_(src), warmup=50, rep=300, return_mode="median")
    sum_ms = do_bench(lambda: src.sum(dtype=torch.float32), warmup=50, rep=300,
                      return_mode="median")
    return 2 * nbytes / (copy_ms * 1e-3), nbytes / (sum_ms * 1e-3)


def matmul_tflops() -> float:
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    ms = do_bench_cudagraph(lambda: a @ b)
    return 2 * 8192**3 / (ms * 1e-3) / 1e12


def cache_for(batch: int, ctx: int,
              page: int = PAGE) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    width = math.ceil(ctx / page)
    pages = batch * width
    cache = torch.randn(pages, 1, page, LAT + ROPE, dtype=torch.bfloat16, device="cuda")
    bt = torch.randperm(pages, device="cuda").to(torch.int32).view(batch, width)
    sl = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    return cache, bt, sl


def bench_decode(batch: int, heads: int, ctx: int, tiles: tuple[int, int, int, int] | None,
                 copy_rate: float, read_rate: float) -> dict[str, Any]:
    cache, bt, sl = cache_for(batch, ctx)
    q = torch.randn(batch, heads, LAT + ROPE, dtype=torch.bfloat16, device="cuda")
    out = torch.empty(batch, heads, LAT, dtype=torch.bfloat16, device="cuda")

    def run() -> None:
        mla.mla_decode(q, cache, bt, sl, SCALE, LAT, max_seq_len=ctx, out=out, tiles=tiles)

    run()
    ms = do_bench_cudagraph(run)
    nbytes = batch * ctx * (LAT + ROPE) * 2
    rate = nbytes / (ms * 1e-3)
    used = mla.tiles_used("decode", tiles or mla.decode_tiles(heads, 2))
    return dict(kind="decode", batch=batch, heads=heads, ctx=ctx, tiles=list(used),
                us=ms * 1e3, gbps=rate / 1e9, of_copy=rate / copy_rate, of_read=rate / read_rate,
                tflops=batch * ctx * heads * 2 * (LAT + ROPE + LAT) / (ms * 1e-3) / 1e12)


def bench_prefill(heads: int, n: int, tiles: tuple[int, int, int, int] | None,
                  mm: float) -> dict[str, Any]:
    cache, bt, sl = cache_for(1, n)
    q = torch.randn(n, heads, LAT + ROPE, dtype=torch.bfloat16, device="cuda")
    cu = torch.tensor([0, n], dtype=torch.int32, device="cuda")
    out = torch.empty(n, heads, LAT, dtype=torch.bfloat16, device="cuda")

    def run() -> None:
        mla.mla_prefill(q, cache, bt, sl, cu, SCALE, LAT, max_q_len=n, out=out, tiles=tiles)

    run()
    ms = do_bench_cudagraph(run)
    flops = heads * n * (n + 1) / 2 * 2 * (LAT + ROPE + LAT)
    tflops = flops / (ms * 1e-3) / 1e12
    used = mla.tiles_used("prefill", tiles or mla.prefill_tiles(2))
    return dict(kind="prefill", heads=heads, tokens=n, tiles=list(used), ms=ms,
                tflops=tflops, of_matmul=tflops / mm)


def flashinfer_note() -> str:
    try:
        import flashinfer
    except Exception as e:  # ImportError, or a dependency of its import failing
        return f"flashinfer not importable ({type(e).__name__}: {e})"
    return f"flashinfer {getattr(flashinfer, '__version__', '?')} importable"


def flashinfer_mla_class() -> tuple[Any, str]:
    """FlashInfer's ``BatchMLAPagedAttentionWrapper``, or ``(None, why)`` when it cannot be
    imported (never raises)."""
    try:
        from flashinfer.mla import BatchMLAPagedAttentionWrapper
    except Exception as e:
        return None, f"{type(e).__name__}: {e}"
    return BatchMLAPagedAttentionWrapper, ""


def flashinfer_kv(bt: torch.Tensor, sl: torch.Tensor,
                  page: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Our block tables ``[B, width]`` and ``seq_lens`` ``[B]`` (int32) -> FlashInfer's
    ``kv_indptr`` ``[B + 1]`` and ``kv_indices`` (int32): each row's first
    ``ceil(len / page)`` pages, rows one after another."""
    used = (sl.to(torch.int64) + page - 1) // page
    indptr = torch.zeros(bt.shape[0] + 1, dtype=torch.int32, device=bt.device)
    indptr[1:] = torch.cumsum(used, 0).to(torch.int32)
    keep = torch.arange(bt.shape[1], device=bt.device)[None, :] < used[:, None]
    return indptr, bt[keep].to(torch.int32).contiguous()


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    """``|a - b| / |b|`` over all elements, in float32."""
    a32, b32 = a.float(), b.float()
    return float((a32 - b32).norm() / b32.norm().clamp_min(1e-30))


FI_WORKSPACE_BYTES = 256 << 20  # FlashInfer's float workspace (split-KV partials); 128 MB advised
FI_ERR_OK = 2e-2  # bf16 outputs of two kernels; above this the view layout is not trusted


def flashinfer_build(cls: Any, backend: str, heads: int, page: int,
                     workspace: torch.Tensor) -> None:
    """Plan and run a one-token problem so the backend's JIT build (~28 s) happens here and
    a backend that cannot be built or run fails once, not once per shape."""
    cache = torch.randn(1, page, LAT + ROPE, dtype=torch.bfloat16, device="cuda")
    q = torch.randn(1, heads, LAT + ROPE, dtype=torch.bfloat16, device="cuda")
    one = torch.tensor([0, 1], dtype=torch.int32, device="cuda")
    w = cls(workspace, backend=backend)
    w.plan(one, one, torch.zeros(1, dtype=torch.int32, device="cuda"),
           torch.ones(1, dtype=torch.int32, device="cuda"), heads, LAT, ROPE, page, False,
           SCALE, torch.bfloat16, torch.bfloat16)
    w.run(q[..., :LAT].contiguous(), q[..., LAT:].contiguous(), cache[..., :LAT].contiguous(),
          cache[..., LAT:].contiguous())
    torch.cuda.synchronize()


def bench_flashinfer(cls: Any, backend: str, workspace: torch.Tensor, batch: int, heads: int,
                     ctx: int, page: int) -> dict[str, Any]:
    """FlashInfer's MLA decode against ``mla_decode`` on one random problem (see the module
    docstring)."""
    cache, bt, sl = cache_for(batch, ctx, page)
    q = torch.randn(batch, heads, LAT + ROPE, dtype=torch.bfloat16, device="cuda")
    ours = torch.empty(batch, heads, LAT, dtype=torch.bfloat16, device="cuda")

    def run_ours() -> None:
        mla.mla_decode(q, cache, bt, sl, SCALE, LAT, max_seq_len=ctx, out=ours)

    run_ours()
    ours_ms = do_bench_cudagraph(run_ours)
    run_ours()
    ref = ours.float()  # latent space [B, H, 512], like FlashInfer's output

    q_nope = q[..., :LAT].contiguous()  # [B, H, 512]
    q_pe = q[..., LAT:].contiguous()  # [B, H, 64]
    kv_indptr, kv_indices = flashinfer_kv(bt, sl, page)
    qo_indptr = torch.arange(batch + 1, dtype=torch.int32, device="cuda")  # one query each
    w = cls(workspace, backend=backend)
    w.plan(qo_indptr, kv_indptr, kv_indices, sl, heads, LAT, ROPE, page, False, SCALE,
           q.dtype, cache.dtype)  # causal False: one query per sequence sees its whole context
    torch.cuda.synchronize()  # plan's pinned-host -> device copy of its schedule
    fi_out = torch.empty(batch, heads, LAT, dtype=torch.bfloat16, device="cuda")

    def time_fi(ckv: torch.Tensor, kpe: torch.Tensor) -> tuple[float, float]:
        def run_fi() -> None:
            w.run(q_nope, q_pe, ckv, kpe, out=fi_out)

        fi_out.zero_()
        run_fi()
        torch.cuda.synchronize()
        err = rel_l2(fi_out, ref)
        return do_bench_cudagraph(run_fi) * 1e3, err

    # strided views of our cache: [pages, page, 512] and [pages, page, 64], token stride 576
    view_us, view_err = time_fi(cache[:, 0, :, :LAT], cache[:, 0, :, LAT:])
    ckv_c = cache[:, 0, :, :LAT].contiguous()
    kpe_c = cache[:, 0, :, LAT:].contiguous()
    copy_us, copy_err = time_fi(ckv_c, kpe_c)
    layout = "views" if view_err <= FI_ERR_OK else "copies"
    fi_us = view_us if layout == "views" else copy_us
    ours_us = ours_ms * 1e3
    return dict(kind="flashinfer_decode", backend=backend, batch=batch, heads=heads, ctx=ctx,
                page=page, layout=layout, flashinfer_us=fi_us, flashinfer_views_us=view_us,
                flashinfer_copies_us=copy_us, ours_us=ours_us, ratio=ours_us / fi_us,
                rel_err=view_err if layout == "views" else copy_err, rel_err_views=view_err,
                rel_err_copies=copy_err)


def run_flashinfer(rows: list[dict[str, Any]], ctx: int, backends: list[str],
                   save: Any) -> None:
    """The ``--flashinfer`` comparison: rows appended (and saved) as they come; a failure is
    printed, never raised."""
    cls, why = flashinfer_mla_class()
    if cls is None:
        print(f"flashinfer: not importable ({why}): no comparison", flush=True)
        rows.append(dict(kind="flashinfer_decode", error=f"import: {why}"))
        save()
        return
    heads = 16
    try:
        workspace = torch.empty(FI_WORKSPACE_BYTES, dtype=torch.int8, device="cuda")
    except Exception as e:
        print(f"flashinfer: workspace: {type(e).__name__}: {e}", flush=True)
        rows.append(dict(kind="flashinfer_decode", error=f"workspace: {type(e).__name__}: {e}"))
        save()
        return
    done: list[dict[str, Any]] = []
    for backend in backends:
        try:
            flashinfer_build(cls, backend, heads, PAGE, workspace)
        except Exception as e:
            print(f"flashinfer {backend}: build/run failed, backend skipped: "
                  f"{type(e).__name__}: {e}", flush=True)
            rows.append(dict(kind="flashinfer_decode", backend=backend,
                             error=f"{type(e).__name__}: {e}"))
            save()
            continue
        for page in (16, 64):
            for batch in (1, 64, 256):
                try:
                    r = bench_flashinfer(cls, backend, workspace, batch, heads, ctx, page)
                except Exception as e:
                    print(f"flashinfer {backend} B={batch} page={page}: {type(e).__name__}: "
                          f"{e}", flush=True)
                    rows.append(dict(kind="flashinfer_decode", backend=backend, batch=batch,
                                     heads=heads, ctx=ctx, page=page,
                                     error=f"{type(e).__name__}: {e}"))
                    save()
                    continue
                rows.append(r)
                done.append(r)
                warn = "" if r["layout"] == "views" else "  (views gave a wrong result: copies)"
                print(f"flashinfer {backend} B={batch:<4d} H={heads} page={page:<3d} ctx={ctx}: "
                      f"fi {r['flashinfer_us']:7.1f} us ({r['layout']}; views "
                      f"{r['flashinfer_views_us']:.1f}, copies {r['flashinfer_copies_us']:.1f})"
                      f"  ours {r['ours_us']:7.1f} us  ours/fi {r['ratio']:.2f}  rel err views "
                      f"{r['rel_err_views']:.1e} copies {r['rel_err_copies']:.1e}{warn}",
                      flush=True)
                save()
    if done:
        print("\n| backend | B | page | flashinfer_us | ours_us | ratio (ours/fi) | rel err |"
              "\n|---|---|---|---|---|---|---|")
        for r in done:
            print(f"| {r['backend']} | {r['batch']} | {r['page']} | {r['flashinfer_us']:.1f} "
                  f"({r['layout']}) | {r['ours_us']:.1f} | {r['ratio']:.2f} | "
                  f"{r['rel_err']:.1e} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--prefill-tokens", type=int, default=8192)
    ap.add_argument("--sweep", action="store_true", help="also time a few tile choices")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--flashinfer", action="store_true",
                    help="also compare against FlashInfer's MLA decode (module docstring)")
    ap.add_argument("--fi-backends", default="fa3,fa2",
                    help="FlashInfer MLA backends to try, in order (default fa3,fa2)")
    ap.add_argument("--flashinfer-only", action="store_true",
                    help="with --flashinfer: skip our own decode/prefill tables")
    args = ap.parse_args()
    rows: list[dict[str, Any]] = []
    copy_rate, read_rate = copy_rates()
    mm = matmul_tflops()
    name = torch.cuda.get_device_name()
    print(f"{name}: copy_ {copy_rate / 1e9:.0f} GB/s (read + written), sum {read_rate / 1e9:.0f} "
          f"GB/s read; bf16 matmul {mm:.0f} TFLOP/s; triton {triton.__version__}; "
          f"{flashinfer_note()}")

    def save() -> None:
        if args.out is not None:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "mla_kernel.json").write_text(json.dumps(dict(
                device=name, copy_gbps=copy_rate / 1e9, read_gbps=read_rate / 1e9,
                matmul_tflops=mm, rows=rows),
                indent=1))

    dec_sweep: dict[int, list[tuple[int, int, int, int] | None]] = {
        16: [None, (16, 32, 2, 4), (16, 32, 3, 4), (16, 16, 4, 4), (16, 32, 4, 4)],
        128: [None, (32, 64, 2, 4)],
    }
    own = not (args.flashinfer and args.flashinfer_only)
    for heads in (16, 128) if own else ():
        for batch in (1, 64, 256):
            for tiles in (dec_sweep[heads] if args.sweep else [None]):
                try:
                    r = bench_decode(batch, heads, args.ctx, tiles, copy_rate, read_rate)
                except Exception as e:  # a tile choice that does not compile
                    print(f"decode B={batch} H={heads} tiles={tiles}: {type(e).__name__}")
                    continue
                rows.append(r)
                print(f"decode  B={batch:<4d} H={heads:<4d} ctx={args.ctx} tiles={r['tiles']}: "
                      f"{r['us']:8.1f} us  {r['gbps']:5.0f} GB/s = {100 * r['of_copy']:3.0f}% of "
                      f"copy_, {100 * r['of_read']:3.0f}% of sum  {r['tflops']:4.0f} TFLOP/s",
                      flush=True)
                save()
    pre_sweep: list[tuple[int, int, int, int] | None] = [None, (32, 64, 2, 4)]
    for heads in (16, 128) if own else ():
        for tiles in (pre_sweep if args.sweep else [None]):
            try:
                r = bench_prefill(heads, args.prefill_tokens, tiles, mm)
            except Exception as e:
                print(f"prefill H={heads} tiles={tiles}: {type(e).__name__}")
                continue
            rows.append(r)
            print(f"prefill H={heads:<4d} {args.prefill_tokens} causal tiles={r['tiles']}: "
                  f"{r['ms']:8.2f} ms  {r['tflops']:6.1f} TFLOP/s  {100 * r['of_matmul']:5.1f}% "
                  "of matmul", flush=True)
            save()
    if args.flashinfer:  # last: a fault in FlashInfer cannot lose the rows above
        run_flashinfer(rows, args.ctx, [b for b in args.fi_backends.split(",") if b], save)
    save()


if __name__ == "__main__":
    main()
