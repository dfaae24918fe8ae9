"""A stand-in for flash-attn's two entry points nano-vllm calls, in plain torch, for machines
where no flash-attn wheel exists. Same arguments and layouts: packed variable-length prefill
(optionally over a paged KV cache), and one-token decode over a paged cache. Causal masks are
aligned bottom-right, as flash-attn 2.1+ aligns them; scores and softmax in float32, the output
in the query's dtype.
"""

import torch


def _paged(cache, block_table_row, n):
    """The first `n` entries of one sequence's paged cache `[blocks, block_size, heads, dim]`."""
    bs = cache.shape[1]
    blocks = block_table_row[: (n + bs - 1) // bs].long()
    return cache[blocks].reshape(-1, cache.shape[2], cache.shape[3])[:n]


def _attend(q, k, v, scale, causal):
    """q `[m, hq, d]`, k/v `[n, hk, d]`: softmax(q·kᵀ·scale)·v, query i seeing keys up to
    n - m + i when causal."""
    m, hq, _ = q.shape
    n, hk, _ = k.shape
    if hq != hk:
        k = k.repeat_interleave(hq // hk, dim=1)
        v = v.repeat_interleave(hq // hk, dim=1)
    s = torch.einsum("qhd,khd->hqk", q.float(), k.float()) * scale
    if causal:
        qi = torch.arange(m, device=q.device).unsqueeze(1)
        kj = torch.arange(n, device=q.device).unsqueeze(0)
        s = s.masked_fill(kj > qi + (n - m), float("-inf"))
    p = torch.softmax(s, dim=-1)
    return torch.einsum("hqk,khd->qhd", p, v.float()).to(q.dtype)


def flash_attn_varlen_func(q, k, v, max_seqlen_q=None, cu_seqlens_q=None, max_seqlen_k=None,
                           cu_seqlens_k=None, softmax_scale=None, causal=False, block_table=None,
                           **_):
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    cu_q = cu_seqlens_q.tolist()
    cu_k = cu_seqlens_k.tolist()
    out = torch.empty_like(q)
    for i in range(len(cu_q) - 1):
        qi = q[cu_q[i]:cu_q[i + 1]]
        nk = cu_k[i + 1] - cu_k[i]
        if block_table is not None:
            ki, vi = _paged(k, block_table[i], nk), _paged(v, block_table[i], nk)
        else:
            ki, vi = k[cu_k[i]:cu_k[i + 1]], v[cu_k[i]:cu_k[i + 1]]
        out[cu_q[i]:cu_q[i + 1]] = _attend(qi, ki, vi, scale, causal)
    return out


def flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=None, block_table=None,
                            softmax_scale=None, causal=False, **_):
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    b = q.shape[0]
    out = torch.empty_like(q)
    lens = cache_seqlens.tolist()
    for i in range(b):
        n = int(lens[i])
        ki, vi = _paged(k_cache, block_table[i], n), _paged(v_cache, block_table[i], n)
        out[i] = _attend(q[i], ki, vi, scale, causal)
    return out
