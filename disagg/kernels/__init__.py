"""Attention and cache kernels over the HND paged KV cache.

Layout: one allocation per executor, viewed as
``[num_layers, num_pages, 2 (K, V), num_kv_heads, page_size, head_dim]``. A layer's K cache is
``kv[layer, :, 0]``: shape ``[num_pages, num_kv_heads, page_size, head_dim]`` with a page stride of
``2 * num_kv_heads * page_size * head_dim`` elements (K and V of one page are adjacent, so a whole
page of one layer is one contiguous run of bytes). Every kernel accepts such strided views; the
head, token and dim strides are always ``page_size * head_dim``, ``head_dim`` and ``1``.

``reference`` holds the plain torch implementations (CPU default, test oracle). Triton kernels
live in their own modules and are imported lazily; CPU-only code never imports Triton.
"""
