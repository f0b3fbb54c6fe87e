"""Bad input raises an exception of the engine's typed error, naming the
values, before anything is written: the caches stay untouched."""

import pathlib
import re

import numpy as np
import pytest
import torch

import flashattn
from flashattn import errors, flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache


def test_every_engine_error_has_a_class():
    source = pathlib.Path(__file__).parents[2] / "src" / "error.rs"
    body = source.read_text().split("pub enum Error {", 1)[1].split("\n}\n", 1)[0]
    variants = re.findall(r"^    ([A-Z][A-Za-z0-9]*)\b", body, flags=re.M)
    assert sorted(variants) == sorted(errors.VARIANTS)
    for name in variants:
        assert issubclass(getattr(flashattn, name), errors.FlashAttnError)


def test_head_dim_too_large_carries_its_fields():
    x = torch.randn(1, 4, 2, 600)
    with pytest.raises(flashattn.HeadDimTooLarge) as e:
        flash_attn_func(x, x, x, backend="cpu")
    assert isinstance(e.value, ValueError)
    assert (e.value.head_dim, e.value.max) == (600, flashattn.max_head_dim())
    assert "600" in str(e.value)


def test_wrong_dtype():
    x = torch.randn(1, 4, 2, 8, dtype=torch.float64)
    with pytest.raises(flashattn.UnsupportedDtype) as e:
        flash_attn_func(x, x, x)
    assert (e.value.tensor, e.value.dtype) == ("q", "float64")
    q, k = torch.randn(1, 4, 2, 8), torch.randn(1, 4, 2, 8).half()
    with pytest.raises(flashattn.DtypeMismatch) as e:
        flash_attn_func(q, k, k, backend="cpu")
    assert e.value.dtype == "f16" and e.value.expected == "f32"


def test_wrong_device_or_kind():
    q = torch.randn(1, 4, 2, 8)
    with pytest.raises(flashattn.DeviceMismatch) as e:
        flash_attn_func(q, q.numpy(), q)
    assert e.value.tensor == "k"
    with pytest.raises(flashattn.DeviceMismatch):
        flash_attn_func(q, q.to("meta"), q)


def test_wrong_shapes():
    with pytest.raises(flashattn.Rank) as e:
        flash_attn_func(torch.randn(4, 2, 8), torch.randn(1, 4, 2, 8), torch.randn(1, 4, 2, 8))
    assert (e.value.tensor, e.value.rank, e.value.expected) == ("q", 3, 4)
    q, k = torch.randn(1, 4, 3, 8), torch.randn(1, 4, 2, 8)
    with pytest.raises(flashattn.HeadsNotDivisible) as e:
        flash_attn_func(q, k, k, backend="cpu")
    assert (e.value.heads_q, e.value.heads_kv) == (3, 2)


def test_cu_seqlens_must_be_int32():
    q = torch.randn(6, 2, 8)
    cu = torch.tensor([0, 2, 6])
    with pytest.raises(flashattn.UnsupportedDtype) as e:
        flash_attn_varlen_func(q, q, q, cu, cu.int(), 4, 4)
    assert (e.value.tensor, e.value.dtype, e.value.expected) == ("cu_seqlens_q", "int64", "int32")
    with pytest.raises(flashattn.MaxSeqlen) as e:
        flash_attn_varlen_func(q, q, q, cu.int(), cu.int(), 3, 4)
    assert (e.value.argument, e.value.value, e.value.longest) == ("max_seqlen_q", 3, 4)
    with pytest.raises(flashattn.CuSeqlensTotal):
        flash_attn_varlen_func(q, q, q, torch.tensor([0, 2, 5], dtype=torch.int32), cu.int(), 4, 4)


def test_dropout_on_wgpu_draws_the_cpu_backends_mask():
    x = torch.randn(1, 4, 2, 8)
    run = lambda backend, p: flash_attn_func(x, x, x, dropout_p=p, dropout_seed=3, backend=backend)  # noqa: E731
    torch.testing.assert_close(run("wgpu", 0.5), run("cpu", 0.5))
    assert not torch.equal(run("wgpu", 0.5), run("wgpu", 0.0))


@pytest.mark.parametrize("p", [1.0, 1.5, -0.1, float("nan")])
def test_dropout_outside_zero_one_is_a_typed_error(p):
    x = torch.randn(1, 4, 2, 8)
    with pytest.raises(flashattn.InvalidDropout) as e:
        flash_attn_func(x, x, x, dropout_p=p, backend="cpu")
    assert isinstance(e.value, ValueError)


def test_unknown_backend():
    x = torch.randn(1, 4, 2, 8)
    with pytest.raises(flashattn.UnknownName) as e:
        flash_attn_func(x, x, x, backend="tpu")
    assert (e.value.what, e.value.name) == ("backend", "tpu")


def _caches():
    k_cache = torch.randn(4, 8, 2, 16)
    v_cache = torch.randn(4, 8, 2, 16)
    return k_cache, v_cache, k_cache.clone(), v_cache.clone()


def test_block_table_out_of_range_leaves_the_caches_untouched(backend):
    k_cache, v_cache, k0, v0 = _caches()  # 4 pages of 8
    q = torch.randn(2, 1, 2, 16)
    new = torch.randn(2, 1, 2, 16)
    table = torch.tensor([[0, 1], [2, 9]], dtype=torch.int32)
    seqlens = torch.tensor([3, 12], dtype=torch.int32)
    with pytest.raises(flashattn.PageOutOfRange) as e:
        flash_attn_with_kvcache(
            q, k_cache, v_cache, new, new, cache_seqlens=seqlens, block_table=table,
            backend=backend,
        )  # fmt: skip
    assert (e.value.batch, e.value.page, e.value.pages) == (1, 9, 4)
    assert torch.equal(k_cache, k0) and torch.equal(v_cache, v0)


def test_cache_too_small_for_the_append_leaves_the_caches_untouched(backend):
    k_cache, v_cache, k0, v0 = _caches()  # dense: 4 sequences of 8
    q = torch.randn(4, 3, 2, 16)
    new = torch.randn(4, 3, 2, 16)
    seqlens = torch.tensor([0, 1, 6, 2], dtype=torch.int32)
    with pytest.raises(flashattn.CacheOverflow) as e:
        flash_attn_with_kvcache(q, k_cache, v_cache, new, new, cache_seqlens=seqlens, backend=backend)
    assert (e.value.batch, e.value.cache_len, e.value.new, e.value.capacity) == (2, 6, 3, 8)
    assert torch.equal(k_cache, k0) and torch.equal(v_cache, v0)


def test_index_tensors_must_be_int32():
    k_cache, v_cache, _, _ = _caches()
    q = torch.randn(2, 1, 2, 16)
    with pytest.raises(flashattn.UnsupportedDtype) as e:
        flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=torch.tensor([1, 2]))
    assert e.value.tensor == "cache_seqlens"
    with pytest.raises(flashattn.UnsupportedDtype) as e:
        flash_attn_with_kvcache(
            q, k_cache, v_cache, cache_seqlens=3, block_table=torch.zeros(2, 1, dtype=torch.int64)
        )
    assert e.value.tensor == "block_table"


def test_numpy_float64_is_refused_with_its_name():
    x = np.zeros((1, 4, 2, 8), dtype=np.float64)
    with pytest.raises(flashattn.UnsupportedDtype) as e:
        flash_attn_func(x, x, x)
    assert e.value.dtype == "float64"


def test_error_fields_parser_reads_nested_values():
    name, fields = flashattn._native._error_fields(
        'SizeOverflow { what: "q", op: "product", operands: [4, 5], max: 7 }'
    )
    assert name == "SizeOverflow"
    assert fields == {"what": "q", "op": "product", "operands": [4, 5], "max": 7}


def test_alibi_slopes_of_another_shape_raise():
    # flash-attn takes (heads_q,) or (batch, heads_q) exactly. Slopes of the
    # right count in another shape, e.g. (heads_q, batch), would pair heads
    # with the wrong slopes: AlibiShape, in every function.
    q = torch.randn(2, 5, 3, 8)
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    calls = {
        "func": lambda s: flash_attn_func(q, q, q, alibi_slopes=s, backend="cpu"),
        "func grad": lambda s: flash_attn_func(
            q.clone().requires_grad_(), q, q, alibi_slopes=s, backend="cpu"
        ),
        "varlen": lambda s: flash_attn_varlen_func(q[0], q[0], q[0], cu, cu, 3, 3, alibi_slopes=s, backend="cpu"),
        "kvcache": lambda s: flash_attn_with_kvcache(q, q.clone(), q.clone(), alibi_slopes=s, backend="cpu"),
    }
    for what, call in calls.items():
        for shape in [(3, 2), (2, 3, 1), (1, 3), (6,)]:
            with pytest.raises(flashattn.AlibiShape) as e:
                call(torch.rand(shape))
            assert list(e.value.shape) == list(shape), what
        assert call(torch.rand(3)).shape == call(torch.rand(2, 3)).shape, what
