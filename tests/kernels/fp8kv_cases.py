"""FP8 KV cases for the Triton kernels (append, decode, prefill, the MLA latent's append,
decode and prefill), run by ``test_kv_fp8_interp`` in a TRITON_INTERPRET=1 subprocess.

Each case fills an FP8 cache (a strided layer view, scattered pages, lengths ending mid-page)
and returns an error: for appends the fraction of stored bytes that differ from the torch
reference's (0 expected; the interpreter's own cast error is set aside, see there), for attention the relative L2 error against the torch reference
over the same FP8 pages with the same scales (dequantized inside both)."""

from __future__ import annotations

from typing import Any

TOL = {"float32": 1e-5, "bfloat16": 1.5e-2}  # attention outputs; appends must be exact


def all_cases() -> list[str]:
    ids = []
    for dt in ("float32", "bfloat16"):
        ids += [f"append-{dt}", f"decode1-{dt}", f"decode3-{dt}", f"prefill-{dt}",
                f"mla_append-{dt}", f"mla_decode1-{dt}", f"mla_decode3-{dt}", f"mla_prefill-{dt}"]
    return ids


def _rel(out: Any, ref: Any) -> float:
    import torch

    if not torch.isfinite(out.float()).all():
        return float("inf")
    diff = (out.double() - ref.double()).norm()
    return float(diff / ref.double().norm().clamp_min(1e-30))


def run_case(cid: str, device: str = "cpu") -> float:
    """One case on ``device`` (a GPU: the appends are checked without the interpreter's
    exemption below, every byte)."""
    import torch

    from disagg.kernels import reference
    from disagg.kernels.kv_quant import FP8_KV

    kind, dt = cid.split("-")
    dtype = getattr(torch, dt)
    gen = torch.Generator().manual_seed(7)
    page, lens = 4, [9, 1, 6]
    mla = kind.startswith("mla")
    heads, width = (1, 48) if mla else (2, 32)  # MLA: a 32 + 16 latent row
    nq = 4 if mla else 4  # query heads (GQA group 2)
    pages = 3 * 3 + 2
    alloc = torch.zeros((2, pages, 1 if mla else 2, heads, page, width), dtype=FP8_KV)
    kc, vc = alloc[1, :, 0], alloc[1, :, -1]
    perm = torch.randperm(pages, generator=gen)[: 9].view(3, 3).to(torch.int32)
    total = sum(lens)
    slots = torch.cat([perm[b, torch.arange(n) // page].long() * page + torch.arange(n) % page
                       for b, n in enumerate(lens)])
    k = (torch.randn(total, heads, width, generator=gen) * 4).to(dtype)
    v = (torch.randn(total, heads, width, generator=gen) * 4).to(dtype)
    k[0, 0, 0] = 5000.0  # saturates
    ks = torch.rand(heads, generator=gen) + 0.25
    vs = ks if mla else torch.rand(heads, generator=gen) + 0.25
    if mla:
        v = k
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    alloc, perm, slots, seq_lens = (x.to(device) for x in (alloc, perm, slots, seq_lens))
    k, v, ks, vs = (x.to(device) for x in (k, v, ks, vs))
    if mla:
        v = k
    kc, vc = alloc[1, :, 0], alloc[1, :, -1]
    if kind.endswith("append"):
        ref_alloc = alloc.clone()
        rk, rv = ref_alloc[1, :, 0], ref_alloc[1, :, -1]
        reference.append_kv(k, v, rk, rv, slots, (ks, vs))
        if mla:
            from disagg.kernels.mla import append_latent

            append_latent(k, kc, slots, ks)
        else:
            from disagg.kernels.append import append_kv

            append_kv(k, v, kc, vc, slots, (ks, vs))
        same = alloc.view(torch.uint8) == ref_alloc.view(torch.uint8)
        got, want = alloc.float(), ref_alloc.float()
        # the interpreter's float -> e4m3 cast drops the carry when rounding up crosses a power
        # of two (1.97 -> 1.0, not 2.0; a GPU rounds it right): those bytes are its, not ours
        m, e = torch.frexp(want)
        carry = (m.abs() == 0.5) & (got * 2 == want) & (device == "cpu")
        return float((~same & ~carry).float().mean())
    reference.append_kv(k, v, kc, vc, slots, (ks, vs))
    decode = "decode" in kind
    q_rows = len(lens) if decode else total
    q = (torch.randn(q_rows, nq, width, generator=gen)).to(device, dtype)
    cu = (torch.arange(len(lens) + 1, dtype=torch.int32) if decode
          else torch.tensor([0, 9, 10, 16], dtype=torch.int32)).to(device)
    scale = width**-0.5
    if mla:
        from disagg.kernels import mla as m

        lat = 32
        if decode:
            out = m.mla_decode(q, kc, perm, seq_lens, scale, lat,
                               num_splits=int(kind[-1]), kv_scale=ks)
        else:
            out = m.mla_prefill(q, kc, perm, seq_lens, cu, scale, lat, kv_scale=ks)
        ref = m.reference_attention(q, kc, perm, seq_lens, cu, scale, lat, ks)
        return _rel(out, ref)
    if decode:
        from disagg.kernels.decode import paged_decode_attention

        out = paged_decode_attention(q, kc, vc, perm, seq_lens, scale,
                                     num_splits=int(kind[-1]), block_n=16, kv_scales=(ks, vs))
    else:
        from disagg.kernels.prefill import paged_prefill_attention

        out = paged_prefill_attention(q, kc, vc, perm, seq_lens, cu, scale, kv_scales=(ks, vs))
    ref = reference.paged_attention(q, kc, vc, perm, seq_lens, cu, scale, (ks, vs))
    return _rel(out, ref)


if __name__ == "__main__":
    from interp import serve

    serve(run_case)
