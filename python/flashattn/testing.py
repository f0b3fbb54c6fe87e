"""Checks against the engine's f64 reference under docs/semantics.md's
accuracy rule: ``max|x − ref| ≤ R·max|baseline − ref| + 2·ulp + 1e-5·max(1, max|ref|)``,
the baseline being the naive algorithm in the storage precision. The
reference and the rule are the Rust library's own (``flashattn::reference``,
``flashattn::accuracy``), so Python results are judged exactly as the
engine's Rust tests judge theirs."""

from __future__ import annotations

from typing import Any, Dict, List, NamedTuple, Optional

from . import _native
from ._tensors import host, raw, raw_codes


class Check(NamedTuple):
    """The verdict on one output."""

    name: str
    max_error: float
    bound: float
    passed: bool
    line: str


def _checks(rows) -> List[Check]:
    return [Check(*r) for r in rows]


def check_forward(q, k, v, o, lse, opts: Dict[str, Any]) -> List[Check]:
    """``o`` and ``lse`` of a forward on q, k, v (any dtype, the call's
    options as :func:`flashattn.functional.options` builds them)."""
    t = [host(x) for x in (q, k, v, o, lse)]
    return _checks(_native.check_forward(*(raw(x) for x in t), opts))


def check_backward(q, k, v, d_o, dq, dk, dv, dsinks: Optional[Any], opts: Dict[str, Any]) -> List[Check]:
    """Gradients (and ``dsinks`` with sinks) of a backward."""
    t = [host(x) for x in (q, k, v, d_o, dq, dk, dv)]
    ds = None
    if dsinks is not None:
        ds = [float(x) for x in host(dsinks).reshape(-1).tolist()]
    return _checks(_native.check_backward(*(raw(x) for x in t), ds, opts))


def check_decode(
    q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table, o, lse, opts,
    head_dim_v=None,
) -> List[Check]:  # fmt: skip
    """A decoding step's ``o`` and ``lse``, given the caches as they were
    before the step (lists for the index arrays; ``block_table`` as
    ``(flat pages, max_pages)``). A latent cache: ``v_cache`` and ``v``
    ``None``, V the first ``head_dim_v`` columns of ``k_cache``."""
    qh, kc, oh, lh = (host(x) for x in (q, k_cache, o, lse))
    # Host copies stay referenced until the engine has read them (``raw``
    # keeps only an address).
    vch = None if v_cache is None else host(v_cache)
    new_rows = None if k is None else (host(k), None if v is None else host(v))
    new_kv = None if new_rows is None else tuple(None if x is None else raw(x) for x in new_rows)
    return _checks(
        _native.check_decode(
            raw(qh), raw(kc), None if vch is None else raw(vch), block_table is not None, new_kv, list(cache_seqlens),
            cache_batch_idx, block_table, raw(oh), raw(lh), opts, head_dim_v,
        )  # fmt: skip
    )


def check_decode_quantized(
    q, k_codes, v_codes, k_scales, v_scales, cache_dtype, paged, k, v, cache_seqlens,
    cache_batch_idx, block_table, o, lse, opts, head_dim_v=None,
) -> List[Check]:  # fmt: skip
    """A step on a quantized cache: ``o`` and ``lse`` against the f64
    reference on the values of the codes and scales *after* the step (its
    new rows in them); ``cache_seqlens`` are those before it. A latent
    cache: ``v_codes``, ``v_scales`` and ``v`` ``None``, V the first
    ``head_dim_v`` columns of ``k_codes``."""
    qh, kc, ks, oh, lh = (host(x) for x in (q, k_codes, k_scales, o, lse))
    # Host copies stay referenced until the engine has read them.
    vch = None if v_codes is None else host(v_codes)
    vsh = None if v_scales is None else host(v_scales)
    new_rows = None if k is None else (host(k), None if v is None else host(v))
    new_kv = None if new_rows is None else tuple(None if x is None else raw(x) for x in new_rows)
    return _checks(
        _native.check_decode_quantized(
            raw(qh), raw_codes(kc), None if vch is None else raw_codes(vch),
            raw(ks), None if vsh is None else raw(vsh), cache_dtype, paged, new_kv,
            list(cache_seqlens), cache_batch_idx, block_table, raw(oh), raw(lh), opts, head_dim_v,
        )  # fmt: skip
    )


def reference_forward(q, k, v, opts: Dict[str, Any]):
    """The f64 reference: ``(o, lse)`` as flat lists in the standard layouts."""
    t = [host(x) for x in (q, k, v)]
    return _native.reference_forward(*(raw(x) for x in t), opts)


def assert_passed(checks: List[Check], what: str = "") -> None:
    """Raise ``AssertionError`` listing every check when one failed."""
    if not all(c.passed for c in checks):
        lines = "\n  ".join(c.line for c in checks)
        raise AssertionError(f"{what} failed the accuracy rule:\n  {lines}")
