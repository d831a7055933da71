"""The prefill benchmark's problem on the GPU and its implementations
(``bench_prefill.py``): a paged cache holding the batch's K/V with the same
tokens gathered contiguous, and a caller for each implementation returning
``(run, output, impl_detail, extra columns)``."""
import numpy as np

from bench_common import csr_pages, flashinfer_workspace, prefill_without_guard


def cu_seqlens(q_lens):
    """Query row offsets ``[0, n0, n0 + n1, ...]`` (int32): ours and FlashInfer's ``qo_indptr``."""
    return np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)


# -- the problem on the GPU ---------------------------------------------------------------

def kernel_regs(plan):
    try:
        return ";".join(str(getattr(k, "regs_per_thread", ""))
                        for k in plan._kernel.overloads.values())
    except Exception:  # noqa: BLE001 - informational column only
        return ""


def as_torch(arr, tdtype):
    """A torch tensor over a numba device array (bf16 is stored as uint16 bits)."""
    import torch

    if tdtype == torch.bfloat16:
        return torch.as_tensor(arr.view(np.int16), device="cuda").view(torch.bfloat16)
    return torch.as_tensor(arr, device="cuda")


class Problem:
    """A paged cache holding the batch's K/V, the queries, and the same tokens contiguous."""

    def __init__(self, q_lens, kv_lens, num_heads, num_kv_heads, head_size, block_size, dtype,
                 kv_dtype="", seed=0):
        import torch
        from numba import cuda

        import paged_numba as pn

        self.q_lens, self.kv_lens = list(q_lens), list(kv_lens)
        self.num_heads, self.num_kv_heads, self.head_size = num_heads, num_kv_heads, head_size
        self.block_size, self.dtype = block_size, dtype
        self.tdtype = tdtype = getattr(torch, dtype)
        gen = torch.Generator(device="cuda").manual_seed(seed)
        used = [-(-kv // block_size) for kv in kv_lens]
        num_blocks = sum(used)
        self.kv_dtype = kv_dtype
        self.cache = pn.PagedKVCache(num_blocks, block_size, num_kv_heads, head_size,
                                     kv_dtype or dtype, "nhd")
        if kv_dtype:        # fp8 codes (uint8): fp16 normals rounded to the format, scales 1
            fmt = getattr(torch, kv_dtype)
            self.k_pool = torch.as_tensor(self.cache.key_cache, device="cuda").view(fmt)
            self.v_pool = torch.as_tensor(self.cache.value_cache, device="cuda").view(fmt)
            for pool in (self.k_pool, self.v_pool):
                for chunk in pool.view(pool.shape[0], -1).split(4096):
                    chunk.copy_(torch.randn(chunk.shape, dtype=torch.float16, device="cuda",
                                            generator=gen).to(fmt))
            # SDPA's K and V: the codes' values (exact in fp16)
            self.k_ref, self.v_ref = self.k_pool.to(tdtype), self.v_pool.to(tdtype)
        else:
            self.k_pool = as_torch(self.cache.key_cache, tdtype)      # FlashInfer's NHD pages
            self.v_pool = as_torch(self.cache.value_cache, tdtype)
            self.k_pool.normal_(generator=gen)
            self.v_pool.normal_(generator=gen)
            self.k_ref, self.v_ref = self.k_pool, self.v_pool
        perm = torch.randperm(num_blocks, device="cuda", generator=gen).to(torch.int32)
        table = torch.full((len(kv_lens), max(used)), -1, dtype=torch.int32, device="cuda")
        pos = 0
        for i, u in enumerate(used):
            table[i, :u] = perm[pos:pos + u]
            pos += u
        self.table_t = table
        self.table = cuda.as_cuda_array(table)
        self.cu = cu_seqlens(q_lens)
        self.total_q = int(self.cu[-1])
        self.query_t = torch.randn(self.total_q, num_heads, head_size, dtype=tdtype,
                                   device="cuda", generator=gen)
        self.query = self.query_t          # PrefillPlan wraps torch tensors (bf16 included)

    def contiguous(self, i):
        """``(q [1, H, n, D], k, v [1, Hkv, L, D])`` of sequence ``i``, gathered."""
        a, b, kv = int(self.cu[i]), int(self.cu[i + 1]), self.kv_lens[i]
        used = -(-kv // self.block_size)
        blocks = self.table_t[i, :used].long()
        k = self.k_ref[blocks].reshape(-1, self.num_kv_heads, self.head_size)[:kv]
        v = self.v_ref[blocks].reshape(-1, self.num_kv_heads, self.head_size)[:kv]
        q = self.query_t[a:b]
        return (q.transpose(0, 1).unsqueeze(0).contiguous(),
                k.transpose(0, 1).unsqueeze(0).contiguous(),
                v.transpose(0, 1).unsqueeze(0).contiguous())


def bias_lower_right(n, kv):
    """Bottom-right causal mask: query ``j`` of ``n`` sees keys ``<= kv - n + j``."""
    from torch.nn.attention.bias import causal_lower_right

    return causal_lower_right(n, kv)


# -- the implementations: each caller returns (run, output, impl_detail, extra columns) ---

def numba_caller(prob, tiling=None, guard=True):
    """``PrefillPlan.run`` over the problem; ``guard=False``: the plan's
    tensor-core kernel built without the device guard (``RuntimeError`` where
    the plan has none such)."""
    import torch

    import paged_numba as pn

    fp8 = dict(query_dtype=prob.dtype) if prob.kv_dtype else {}
    plan = pn.PrefillPlan(prob.cache, prob.cu, np.asarray(prob.kv_lens, np.int32),
                          prob.num_heads, causal=True, **fp8, **(tiling or {}))
    why = None if guard else prefill_without_guard(plan)
    if why:
        raise RuntimeError(f"no kernel without the guard: {why}")
    stream = torch.cuda.current_stream()
    plan.run(prob.query, prob.table, stream=stream, validate=True)

    def run():
        return plan.run(prob.query, prob.table, stream=stream)
    tiling_s = (f"hpb={plan.heads_per_block} bq={plan.block_q} bn={plan.block_n} "
                f"warps={plan.num_warps} tiles={plan.num_tiles}")
    detail = "tensor_cores" if getattr(plan, "tensor_cores", False) else "cuda_cores"
    on = [k for k, v in getattr(plan, "kernel_options", {}).items() if v is True]
    detail += "".join(f"+{k}" for k in on) + ("" if guard else " guard=False")
    return run, lambda: as_torch(run(), prob.tdtype), detail, dict(tiling=tiling_s,
                                                                   regs=kernel_regs(plan))


def sdpa_caller(prob):
    """A function running SDPA over the whole batch, and one returning its output
    ``[total_q, H, D]`` (for the checks)."""
    import torch
    import torch.nn.functional as F

    same = (len(set(prob.q_lens)) == 1 and prob.q_lens == prob.kv_lens)
    if same:
        parts = [prob.contiguous(i) for i in range(len(prob.q_lens))]
        q = torch.cat([p[0] for p in parts])
        k = torch.cat([p[1] for p in parts])
        v = torch.cat([p[2] for p in parts])
        del parts

        def run():
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

        def output():
            return run().permute(0, 2, 1, 3).reshape(prob.total_q, prob.num_heads, -1)
        return run, output, "contiguous_batched", {}

    # decode tokens (q_len 1 sees every key): one batched call, K/V padded to the
    # longest context with a key mask; chunks: one call each, bottom-right causal
    items, dec = [], [i for i, n in enumerate(prob.q_lens) if n == 1]
    for i, (n, kv) in enumerate(zip(prob.q_lens, prob.kv_lens)):
        if n == 1:
            continue
        q, k, v = prob.contiguous(i)
        items.append((i, q, k, v, None if n == kv else bias_lower_right(n, kv), n == kv))
    if dec:
        longest = max(prob.kv_lens[i] for i in dec)
        dq, dk, dv = [], [], []
        mask = torch.zeros(len(dec), 1, 1, longest, dtype=torch.bool, device="cuda")
        for j, i in enumerate(dec):
            q, k, v = prob.contiguous(i)
            dq.append(q)
            dk.append(F.pad(k, (0, 0, 0, longest - k.shape[2])))
            dv.append(F.pad(v, (0, 0, 0, longest - v.shape[2])))
            mask[j, ..., :prob.kv_lens[i]] = True
        items.append((dec, torch.cat(dq), torch.cat(dk), torch.cat(dv), mask, False))

    def call(q, k, v, m, c):
        if gqa[0]:
            try:
                return F.scaled_dot_product_attention(q, k, v, attn_mask=m, is_causal=c,
                                                      enable_gqa=True)
            except Exception:  # noqa: BLE001 - e.g. a mask type without GQA support
                gqa[0] = False
        g = q.shape[1] // k.shape[1]
        if m is not None and not isinstance(m, torch.Tensor):    # CausalBias -> bool mask
            n, kv = q.shape[2], k.shape[2]
            m = torch.ones(n, kv, dtype=torch.bool, device=q.device).tril(kv - n)
        return F.scaled_dot_product_attention(q, k.repeat_interleave(g, 1),
                                              v.repeat_interleave(g, 1), attn_mask=m, is_causal=c)

    gqa = [True]

    def run():
        return [call(q, k, v, m, c) for _, q, k, v, m, c in items]

    def output():
        out = torch.empty(prob.total_q, prob.num_heads, prob.head_size, dtype=prob.tdtype,
                          device="cuda")
        for (idx, *_), o in zip(items, run()):
            rows = [int(prob.cu[i]) for i in idx] if isinstance(idx, list) else None
            if rows is None:
                out[int(prob.cu[idx]):int(prob.cu[idx + 1])] = o[0].transpose(0, 1)
            else:
                out[rows] = o[:, :, 0]
        return out
    run()                                   # settle the GQA fallback before timing
    return run, output, "contiguous_grouped", {}


def flashinfer_caller(fi, prob, backend):
    """FlashInfer's paged prefill on the problem's own pools and pages: ``plan()``
    here (not timed), ``run()`` into a preallocated output."""
    import torch

    cc = torch.cuda.get_device_capability()
    if backend == "fa3" and cc != (9, 0):
        raise RuntimeError(f"fa3 runs on sm90 only, this GPU is sm{cc[0]}{cc[1]}")
    if backend == "fa3" and prob.k_pool.element_size() == 1 and prob.tdtype != prob.k_pool.dtype:
        # seen with 0.6.0: its sm90 kernel fails to build (a static assertion on
        # the operand order of V for 8-bit inputs), after a minute or two of compiling
        raise RuntimeError("FlashInfer's fa3 kernel does not build for an fp8 cache with "
                           "fp16/bf16 queries")
    indptr, indices, last_page_len = csr_pages(prob.table_t, prob.kv_lens, prob.block_size)
    qo_indptr = torch.as_tensor(prob.cu, device="cuda")
    wrapper = fi.BatchPrefillWithPagedKVCacheWrapper(flashinfer_workspace(), "NHD",
                                                     backend=backend)
    wrapper.plan(qo_indptr, indptr, indices, last_page_len, prob.num_heads, prob.num_kv_heads,
                 prob.head_size, prob.block_size, causal=True, pos_encoding_mode="NONE",
                 q_data_type=prob.tdtype, kv_data_type=prob.k_pool.dtype)
    out = torch.empty_like(prob.query_t)
    kv = (prob.k_pool, prob.v_pool)

    def run():
        return wrapper.run(prob.query_t, kv, out=out)
    run()                                   # a backend that cannot run this shape raises here
    return run, run, f"backend={backend}", {}
