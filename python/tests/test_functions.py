"""flash_attn_func, flash_attn_varlen_func and flash_attn_with_kvcache
against the f64 reference under docs/semantics.md's accuracy rule (and
against torch SDPA where it computes the same thing), on every backend."""

import numpy as np
import pytest
import torch

import flashattn
from flashattn import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache, testing
from helpers import DTYPES, assert_forward, assert_same_as_sdpa, band_mask, options, qkv, sdpa

# (name, kwargs of flash_attn_func): every mask and score variant the
# kernels branch on; SDPA computes all but softcap.
CASES = {
    "plain": {},
    "causal": {"causal": True},
    "window": {"window_size": (7, 3)},
    "causal_window": {"causal": True, "window_size": (5, -1)},
    "softcap": {"softcap": 5.0, "softmax_scale": 0.3},
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES)
def test_flash_attn_func(backend, dtype, case):
    kw = CASES[case]
    # seqlen_q != seqlen_k, odd sizes, GQA (4 query heads on 2 kv heads).
    q, k, v = qkv(2, 37, 45, 4, 2, 32, DTYPES[dtype], scale=2.0)
    o, lse, probs = flash_attn_func(q, k, v, return_attn_probs=True, backend=backend, **kw)
    assert probs is None
    assert o.dtype == q.dtype and o.shape == q.shape and lse.shape == (2, 4, 37)
    assert lse.dtype == torch.float32
    opts = options(
        causal=kw.get("causal", False),
        window_size=kw.get("window_size", (-1, -1)),
        softcap=kw.get("softcap", 0.0),
        softmax_scale=kw.get("softmax_scale"),
    )
    checks = assert_forward(q, k, v, o, lse, opts, f"{case} {dtype} on {backend}")
    if case != "softcap":
        left, right = kw.get("window_size", (-1, -1))
        mask = band_mask(37, 45, kw.get("causal", False), left, right)
        o_sdpa = sdpa(q.float(), k.float(), v.float(), mask).to(q.dtype)
        assert_same_as_sdpa(o, o_sdpa, q, k, v, opts, checks)


def test_head_dims_and_sizes(backend):
    # One query row, a head dim past 128 with v of its own head dim, and
    # large-magnitude scores.
    q, k, v = qkv(1, 1, 113, 2, 1, 160, torch.float32, dv=96, scale=8.0)
    o, lse, _ = flash_attn_func(q, k, v, return_attn_probs=True, backend=backend)
    assert o.shape == (1, 1, 2, 96)
    assert_forward(q, k, v, o, lse, options(), "d 160 / dv 96")


def test_alibi_sinks_and_block_mask(backend):
    q, k, v = qkv(2, 40, 40, 4, 4, 32, torch.float32)
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625])
    sinks = torch.tensor([0.0, 1.0, -1.0, 2.0])
    mask = torch.rand(1, 4, 3, 3) > 0.3
    kw = dict(alibi_slopes=slopes, causal=True)
    o, lse, _ = flash_attn_func(
        q, k, v, **kw, sinks=sinks, block_mask=mask, block_size=16, return_attn_probs=True,
        backend=backend,
    )  # fmt: skip
    opts = options(
        causal=True, alibi_slopes=slopes, sinks=sinks, block_mask=mask, block_size=16
    )
    assert_forward(q, k, v, o, lse, opts, "alibi + sinks + block mask")


@pytest.mark.parametrize("dtype", DTYPES)
def test_varlen_with_empty_sequences(backend, dtype):
    # Empty sequences on either side; a query with no key has o = 0, lse = -inf.
    lens_q, lens_k = [3, 0, 17, 2, 9], [5, 0, 20, 0, 9]
    cu_q = torch.tensor(np.cumsum([0] + lens_q), dtype=torch.int32)
    cu_k = torch.tensor(np.cumsum([0] + lens_k), dtype=torch.int32)
    q = torch.randn(sum(lens_q), 4, 32).to(DTYPES[dtype])
    k = torch.randn(sum(lens_k), 2, 32).to(DTYPES[dtype])
    v = torch.randn(sum(lens_k), 2, 32).to(DTYPES[dtype])
    o, lse, _ = flash_attn_varlen_func(
        q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=True, return_attn_probs=True,
        backend=backend,
    )  # fmt: skip
    assert o.shape == q.shape and lse.shape == (4, sum(lens_q))
    rows = slice(cu_q[3].item(), cu_q[4].item())  # the sequence with no keys
    assert torch.all(o[rows] == 0) and torch.all(lse[:, rows] == float("-inf"))
    opts = options(causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    assert_forward(q, k, v, o, lse, opts, f"varlen {dtype}")


def _cache_case(paged, dtype, with_idx=False):
    b, hq, hkv, d, new = 3, 4, 2, 32, 3
    seqlens = torch.tensor([10, 0, 25], dtype=torch.int32)
    if paged:
        page, max_pages = 16, 3
        pages = torch.randperm(b * max_pages + 2)[: b * max_pages]
        table = pages.reshape(b, max_pages).to(torch.int32)
        shape = (b * max_pages + 2, page, hkv, d)
    else:
        table = None
        shape = (b + 1, 40, hkv, d)  # one spare row for cache_batch_idx
    k_cache = torch.randn(shape).to(dtype)
    v_cache = torch.randn(shape).to(dtype)
    q = torch.randn(b, new, hq, d).to(dtype)
    k = torch.randn(b, new, hkv, d).to(dtype)
    v = torch.randn(b, new, hkv, d).to(dtype)
    idx = torch.tensor([3, 0, 1], dtype=torch.int32) if with_idx else None
    return q, k_cache, v_cache, k, v, seqlens, idx, table


def _expected_cache(cache, new, seqlens, idx, table):
    """docs/semantics.md's append: token t of sequence b goes to page
    table[b, t // page], slot t % page (dense: row idx[b], position t)."""
    out = cache.clone()
    for b in range(new.shape[0]):
        for t in range(new.shape[1]):
            pos = int(seqlens[b]) + t
            if table is not None:
                page = cache.shape[1]
                out[int(table[b, pos // page]), pos % page] = new[b, t]
            else:
                row = int(idx[b]) if idx is not None else b
                out[row, pos] = new[b, t]
    return out


# Masks and score terms of a decoding step: causal, a causal window with
# softcap, and ALiBi with sinks (each query head of a GQA pair its own).
MASKS = {
    "causal": {"causal": True},
    "window_softcap": {"causal": True, "window_size": (6, -1), "softcap": 4.0},
    "alibi_sinks": {
        "causal": True,
        "alibi_slopes": torch.tensor([0.5, 0.25, 0.0625, 0.0]),
        "sinks": torch.tensor([0.5, -1.0, 2.0, 0.0]),
    },
}


@pytest.mark.parametrize("layout", ["dense", "dense_idx", "paged"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_splits", [0, 3])
@pytest.mark.parametrize("mask", MASKS)
def test_kvcache_with_appends(backend, layout, dtype, num_splits, mask):
    q, k_cache, v_cache, k, v, seqlens, idx, table = _cache_case(
        layout == "paged", DTYPES[dtype], with_idx=layout == "dense_idx"
    )
    before_k, before_v = k_cache.clone(), v_cache.clone()
    o, lse = flash_attn_with_kvcache(
        q, k_cache, v_cache, k, v, cache_seqlens=seqlens, cache_batch_idx=idx,
        block_table=table, num_splits=num_splits, return_softmax_lse=True, backend=backend,
        **MASKS[mask],
    )  # fmt: skip
    assert o.shape == q.shape and o.dtype == q.dtype and lse.shape == (3, 4, 3)
    # Appended in place, exactly where the rule says, nothing else touched.
    assert torch.equal(k_cache, _expected_cache(before_k, k, seqlens, idx, table))
    assert torch.equal(v_cache, _expected_cache(before_v, v, seqlens, idx, table))
    tab = None if table is None else (table.reshape(-1).tolist(), table.shape[1])
    checks = testing.check_decode(
        q, before_k, before_v, k, v, seqlens.tolist(),
        None if idx is None else idx.tolist(), tab, o, lse, options(**MASKS[mask]),
    )  # fmt: skip
    testing.assert_passed(checks, f"kvcache {layout} {dtype} {mask}")


def test_kvcache_with_a_v_head_dim_of_its_own(backend):
    b, hq, hkv, d, dv = 2, 4, 2, 48, 32
    seqlens = torch.tensor([20, 7], dtype=torch.int32)
    k_cache, v_cache = torch.randn(b, 40, hkv, d), torch.randn(b, 40, hkv, dv)
    q, k, v = torch.randn(b, 1, hq, d), torch.randn(b, 2, hkv, d), torch.randn(b, 2, hkv, dv)
    before_k, before_v = k_cache.clone(), v_cache.clone()
    o, lse = flash_attn_with_kvcache(
        q, k_cache, v_cache, k, v, cache_seqlens=seqlens, causal=True,
        return_softmax_lse=True, backend=backend,
    )  # fmt: skip
    assert o.shape == (b, 1, hq, dv)
    assert torch.equal(v_cache, _expected_cache(before_v, v, seqlens, None, None))
    checks = testing.check_decode(
        q, before_k, before_v, k, v, seqlens.tolist(), None, None, o, lse, options(causal=True)
    )
    testing.assert_passed(checks, "kvcache dv 32")


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("seqlen_q", [1, 4])
def test_kvcache_latent_mla(backend, paged, seqlen_q):
    # DeepSeek's MLA: one latent cache of width 576 whose first 512 columns
    # are V, 128 query heads on one kv head; k alone appends.
    b, hq, d, dv = 2, 128, 576, 512
    seqlens = torch.tensor([37, 5], dtype=torch.int32)
    if paged:
        table = torch.tensor([[3, 0, 5], [1, 4, 2]], dtype=torch.int32)
        k_cache = torch.randn(6, 16, 1, d)
    else:
        table = None
        k_cache = torch.randn(b, 48, 1, d)
    q, k = torch.randn(b, seqlen_q, hq, d), torch.randn(b, seqlen_q, 1, d)
    before = k_cache.clone()
    o, lse = flash_attn_with_kvcache(
        q, k_cache, None, k, cache_seqlens=seqlens, block_table=table, head_dim_v=dv,
        causal=True, num_splits=3, return_softmax_lse=True, backend=backend,
    )  # fmt: skip
    assert o.shape == (b, seqlen_q, hq, dv)
    assert torch.equal(k_cache, _expected_cache(before, k, seqlens, None, table))
    tab = None if table is None else (table.reshape(-1).tolist(), table.shape[1])
    checks = testing.check_decode(
        q, before, None, k, None, seqlens.tolist(), None, tab, o, lse, options(causal=True),
        head_dim_v=dv,
    )  # fmt: skip
    testing.assert_passed(checks, f"latent paged={paged} seqlen_q={seqlen_q}")


@pytest.mark.parametrize("cache_dtype", ["int8", "fp8"])
def test_kvcache_latent_quantized(backend, cache_dtype):
    # A quantized latent cache: K's codes and scales alone, V their first
    # head_dim_v columns; k alone appends, quantized in place.
    b, hq, d, dv = 2, 16, 576, 512
    seqlens = torch.tensor([37, 5], dtype=torch.int32)
    table = torch.tensor([[3, 0, 5], [1, 4, 2]], dtype=torch.int32)
    k_cache = torch.randn(6, 16, 1, d)
    kc, vc, ks, vs = flashattn.quantize_kv_cache(k_cache, None, cache_dtype, paged=True)
    assert vc is None and vs is None and ks.shape == (6, 1)
    q, k = torch.randn(b, 2, hq, d), torch.randn(b, 2, 1, d)
    before = (kc.clone(), ks.clone())
    kw = dict(cache_seqlens=seqlens, block_table=table, head_dim_v=dv, backend=backend)
    o, lse = flash_attn_with_kvcache(
        q, kc, None, k, causal=True, return_softmax_lse=True, cache_dtype=cache_dtype,
        k_scales=ks, num_splits=2, **kw,
    )  # fmt: skip
    assert o.shape == (b, 2, hq, dv)
    assert not torch.equal(kc, before[0]) and torch.all(ks >= before[1])
    tab = (table.reshape(-1).tolist(), table.shape[1])
    checks = testing.check_decode_quantized(
        q, kc, None, ks, None, cache_dtype, True, k, None, seqlens.tolist(), None, tab, o, lse,
        options(causal=True), head_dim_v=dv,
    )  # fmt: skip
    testing.assert_passed(checks, f"latent {cache_dtype}")
    # V's scales are K's: none of their own, refused without a change.
    after = (kc.clone(), ks.clone())
    with pytest.raises(flashattn.LatentAppend):
        flash_attn_with_kvcache(q, kc, None, k, cache_dtype=cache_dtype, k_scales=ks, v_scales=ks, **kw)
    assert torch.equal(kc, after[0]) and torch.equal(ks, after[1])


def test_kvcache_latent_errors(backend):
    k_cache = torch.randn(1, 8, 1, 16)
    before = k_cache.clone()
    q, k, v = torch.randn(1, 1, 2, 16), torch.randn(1, 1, 1, 16), torch.randn(1, 1, 1, 8)
    with pytest.raises(flashattn.LatentViewTooWide):
        flash_attn_with_kvcache(q, k_cache, None, head_dim_v=17, cache_seqlens=3, backend=backend)
    with pytest.raises(flashattn.LatentAppend):
        flash_attn_with_kvcache(q, k_cache, None, k, v, head_dim_v=8, cache_seqlens=3, backend=backend)
    with pytest.raises(flashattn.UnsupportedError):
        flash_attn_with_kvcache(q, k_cache, None, cache_seqlens=3, backend=backend)
    assert torch.equal(k_cache, before)


def test_kvcache_appends_non_contiguous_new_rows(backend):
    # k and v as strided views (a transpose, a slice of a packed kv): the
    # engine reads host copies, which must outlive the call's reads.
    q, k_cache, v_cache, k, v, seqlens, _, _ = _cache_case(False, torch.float32)
    kv = torch.stack([k, v], dim=2)  # (b, s, 2, h, d)
    k_view = k.transpose(1, 2).contiguous().transpose(1, 2)
    assert not k_view.is_contiguous() and not kv[:, :, 1].is_contiguous()
    before_k, before_v = k_cache.clone(), v_cache.clone()
    o, lse = flash_attn_with_kvcache(
        q, k_cache, v_cache, k_view, kv[:, :, 1], cache_seqlens=seqlens,
        return_softmax_lse=True, backend=backend,
    )  # fmt: skip
    assert torch.equal(k_cache, _expected_cache(before_k, k, seqlens, None, None))
    assert torch.equal(v_cache, _expected_cache(before_v, v, seqlens, None, None))
    checks = testing.check_decode(
        q, before_k, before_v, k_view, kv[:, :, 1], seqlens.tolist(), None, None, o, lse, options()
    )
    testing.assert_passed(checks, "kvcache, strided new rows")


def test_kvcache_takes_flash_attns_positional_order(backend):
    # flash-attn's order: k, v, rotary_cos, rotary_sin, cache_seqlens,
    # cache_batch_idx, cache_leftpad, block_table, softmax_scale, causal, ...
    q, k_cache, v_cache, _, _, seqlens, _, _ = _cache_case(False, torch.float32)
    by_name = flash_attn_with_kvcache(
        q, k_cache, v_cache, cache_seqlens=seqlens, softmax_scale=0.3, causal=True,
        rotary_interleaved=False, backend=backend,
    )  # fmt: skip
    by_position = flash_attn_with_kvcache(
        q, k_cache, v_cache, None, None, None, None, seqlens, None, None, None, 0.3, True,
        backend=backend,
    )  # fmt: skip
    assert torch.equal(by_name, by_position)
    # A numpy integer is a length for every sequence, as an int is.
    as_np = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=np.int64(7), backend=backend)
    as_int = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=7, backend=backend)
    assert torch.equal(as_np, as_int)


def test_varlen_block_table_is_unsupported(backend):
    q, k, v = (torch.randn(10, 2, 16) for _ in range(3))
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    table = torch.zeros(2, 1, dtype=torch.int32)
    with pytest.raises(flashattn.UnsupportedError):
        flash_attn_varlen_func(q, k, v, cu, cu, 6, 6, block_table=table, backend=backend)


def test_kvcache_without_append_reads_the_cache(backend):
    q, k_cache, v_cache, _, _, seqlens, _, _ = _cache_case(False, torch.float32)
    before = k_cache.clone()
    o = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, backend=backend)
    assert torch.equal(k_cache, before)
    # Sequence 1 holds no keys: its rows are zeros.
    assert torch.all(o[1] == 0)


def test_numpy_in_numpy_out(backend):
    q, k, v = (x.numpy() for x in qkv(1, 19, 23, 2, 2, 16, torch.float32))
    o = flash_attn_func(q, k, v, causal=True, backend=backend)
    assert isinstance(o, np.ndarray) and o.dtype == np.float32 and o.shape == q.shape
    o2, lse, _ = flash_attn_func(q, k, v, causal=True, backend=backend, return_attn_probs=True)
    assert_forward(q, k, v, o2, lse, options(causal=True), "numpy")
    assert np.array_equal(o, o2)


def test_non_contiguous_inputs_are_copied(backend):
    # (b, h, s, d) tensors transposed to (b, s, h, d): strided views.
    q, k, v = (torch.randn(1, 2, 21, 16).transpose(1, 2) for _ in range(3))
    assert not q.is_contiguous()
    o = flash_attn_func(q, k, v, backend=backend)
    o_contig = flash_attn_func(q.contiguous(), k.contiguous(), v.contiguous(), backend=backend)
    assert torch.equal(o, o_contig)


def test_fp8_forward(backend):
    if backend == "wgpu":
        info = flashattn.backend_info("wgpu")["name"]
        assert info  # the FP8 forward runs on every wgpu adapter (emulated where needed)
    q, k, v = qkv(1, 64, 64, 2, 2, 64, torch.float16)
    o = flash_attn_func(q, k, v, precision="fp8", hadamard=True, backend=backend)
    assert o.dtype == torch.float16 and o.shape == q.shape
    ref = sdpa(q.double(), k.double(), v.double())
    # e4m3 keeps 3 mantissa bits (unit roundoff 2^-4) on q, k, v and P: the
    # relative RMSE of o stays within a few units of it.
    rel = ((o.double() - ref).norm() / ref.norm()).item()
    assert rel < 4 * 2**-4, rel


def test_packed_forms_are_the_unpacked_calls(backend):
    qkv = torch.randn(2, 19, 3, 2, 16, requires_grad=True)
    o = flashattn.flash_attn_qkvpacked_func(qkv, causal=True, backend=backend)
    q, k, v = qkv.unbind(2)
    assert torch.equal(o, flash_attn_func(q, k, v, causal=True, backend=backend))
    o.sum().backward()
    assert qkv.grad is not None and qkv.grad.shape == qkv.shape
    kv = torch.stack([k, v], dim=2)
    assert torch.equal(o, flashattn.flash_attn_kvpacked_func(q, kv, causal=True, backend=backend))
    cu = torch.tensor([0, 7, 19], dtype=torch.int32)
    packed = qkv.detach()[0]
    o_var = flashattn.flash_attn_varlen_qkvpacked_func(packed, cu, 12, backend=backend)
    o_ref = flash_attn_varlen_func(*packed.unbind(1), cu, cu, 12, 12, backend=backend)
    assert torch.equal(o_var, o_ref)
    o_kv = flashattn.flash_attn_varlen_kvpacked_func(
        packed[:, 0], packed[:, 1:], cu, cu, 12, 12, backend=backend
    )
    assert torch.equal(o_kv, o_ref)


@pytest.mark.parametrize("cache_dtype", ["int8", "fp8"])
@pytest.mark.parametrize("layout", ["dense", "paged"])
@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_kvcache_quantized(backend, cache_dtype, layout, dtype):
    paged = layout == "paged"
    q, k_cache, v_cache, k, v, seqlens, _, table = _cache_case(paged, DTYPES[dtype])
    kc, vc, ks, vs = flashattn.quantize_kv_cache(k_cache, v_cache, cache_dtype, paged=paged)
    assert kc.dtype == (torch.int8 if cache_dtype == "int8" else torch.uint8)
    blocks = k_cache.shape[0] * (1 if paged else 40 // 16 + 1)
    assert ks.shape == (blocks, 2) and ks.dtype == torch.float32
    before = (kc.clone(), ks.clone())
    o, lse = flash_attn_with_kvcache(
        q, kc, vc, k, v, cache_seqlens=seqlens, block_table=table, causal=True,
        return_softmax_lse=True, backend=backend, cache_dtype=cache_dtype, k_scales=ks, v_scales=vs,
    )  # fmt: skip
    assert o.dtype == q.dtype and o.shape == q.shape
    # The appends were quantized in place: codes changed, scales only grew.
    assert not torch.equal(kc, before[0]) and torch.all(ks >= before[1])
    tab = None if table is None else (table.reshape(-1).tolist(), table.shape[1])
    checks = testing.check_decode_quantized(
        q, kc, vc, ks, vs, cache_dtype, paged, k, v, seqlens.tolist(), None, tab, o, lse,
        options(causal=True),
    )  # fmt: skip
    testing.assert_passed(checks, f"kvcache {cache_dtype} {layout} {dtype}")
    # Close to the float cache's own result.
    o_plain = flash_attn_with_kvcache(
        q, k_cache, v_cache, k, v, cache_seqlens=seqlens, block_table=table, causal=True,
        backend="cpu",
    )  # fmt: skip
    err = (o.float() - o_plain.float()).pow(2).mean().sqrt() / o_plain.float().pow(2).mean().sqrt()
    assert 0 < err < (0.03 if cache_dtype == "int8" else 0.08), err


def test_kvcache_quantized_errors():
    q, k_cache, v_cache, k, v, seqlens, _, _ = _cache_case(False, torch.float32)
    kc, vc, ks, vs = flashattn.quantize_kv_cache(k_cache, v_cache, "int8")
    kw = dict(cache_seqlens=seqlens, backend="cpu")
    # Codes of the other format, missing scales, an unknown format.
    with pytest.raises(flashattn.DtypeMismatch, match="cache_dtype fp8 needs uint8"):
        flash_attn_with_kvcache(q, kc, vc, cache_dtype="fp8", k_scales=ks, v_scales=vs, **kw)
    with pytest.raises(flashattn.Unsupported, match="needs v_scales"):
        flash_attn_with_kvcache(q, kc, vc, cache_dtype="int8", k_scales=ks, **kw)
    with pytest.raises(flashattn.UnknownName):
        flash_attn_with_kvcache(q, kc, vc, cache_dtype="int4", k_scales=ks, v_scales=vs, **kw)
    # A bad scale: a typed error, the caches untouched.
    bad = ks.clone()
    bad[2, 1] = float("nan")
    before = kc.clone()
    with pytest.raises(flashattn.InvalidCacheScale):
        flash_attn_with_kvcache(
            q, kc, vc, k, v, cache_dtype="int8", k_scales=bad, v_scales=vs, **kw
        )
    assert torch.equal(kc, before)
    # torch's own dtypes name the formats too.
    o = flash_attn_with_kvcache(q, kc, vc, cache_dtype=torch.int8, k_scales=ks, v_scales=vs, **kw)
    assert o.shape == q.shape
