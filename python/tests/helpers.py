"""Inputs and judgements shared by the test files."""

import importlib.util
import sys
import types
from typing import Optional

import torch

from flashattn import testing
from flashattn.functional import options

DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}


def qkv(b, sq, sk, hq, hkv, d, dtype, dv=None, scale=1.0, grad=False):
    q = (torch.randn(b, sq, hq, d) * scale).to(dtype)
    k = (torch.randn(b, sk, hkv, d) * scale).to(dtype)
    v = torch.randn(b, sk, hkv, dv or d).to(dtype)
    if grad:
        for t in (q, k, v):
            t.requires_grad_(True)
    return q, k, v


def assert_forward(q, k, v, o, lse, opts, what):
    checks = testing.check_forward(q, k, v, o, lse, opts)
    testing.assert_passed(checks, what)
    return checks


def band_mask(sq: int, sk: int, causal: bool, left: int, right: int) -> torch.Tensor:
    """docs/semantics.md's band, bottom-right aligned: key j allowed for row i
    iff i + off - left <= j <= i + off + right, off = sk - sq (-1: unbounded)."""
    i = torch.arange(sq)[:, None]
    j = torch.arange(sk)[None, :]
    off = sk - sq
    if causal:
        right = 0 if right < 0 else min(right, 0)
    allowed = torch.ones(sq, sk, dtype=torch.bool)
    if left >= 0:
        allowed &= j >= i + off - left
    if right >= 0:
        allowed &= j <= i + off + right
    return allowed


def attention_f64(q, k, v, causal=False, window=(-1, -1), softcap=0.0, alibi=None, scale=None,
                  sinks=None):
    """Plain softmax attention in float64, written out (no engine code):
    ``(o, lse)`` of q ``(b, sq, hq, d)`` over k, v ``(b, sk, hkv, d)``,
    differentiable. Masks bottom-right aligned; empty rows give o = 0 and
    lse = -inf (with sinks: lse = the sink)."""
    q, k, v = q.double(), k.double(), v.double()
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    k = k.repeat_interleave(hq // hkv, dim=2)
    v = v.repeat_interleave(hq // hkv, dim=2)
    scale = d**-0.5 if scale is None else scale
    s = torch.einsum("bihd,bjhd->bhij", q, k) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    off = sk - sq
    i = torch.arange(sq)[:, None]
    j = torch.arange(sk)[None, :]
    if alibi is not None:
        a = alibi.double()
        a = a[None, :, None, None] if a.ndim == 1 else a[:, :, None, None]
        s = s - a * (i + off - j).abs()
    s = s.masked_fill(~band_mask(sq, sk, causal, *window), float("-inf"))
    if sinks is not None:
        sink = sinks.double()[None, :, None, None].expand(b, hq, sq, 1)
        lse = torch.logsumexp(torch.cat([s, sink], -1), -1)
    else:
        lse = torch.logsumexp(s, -1)
    safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    p = torch.exp(s - safe[..., None])
    return torch.einsum("bhij,bjhd->bihd", p, v), lse


def sdpa(q, k, v, mask: Optional[torch.Tensor] = None, scale=None):
    """torch SDPA in flash-attn's layout, GQA through enable_gqa."""
    t = lambda x: x.transpose(1, 2)  # noqa: E731
    gqa = q.shape[2] != k.shape[2]
    o = torch.nn.functional.scaled_dot_product_attention(
        t(q), t(k), t(v), attn_mask=mask, scale=scale, enable_gqa=gqa
    )
    return t(o)


def reference_o(q, k, v, opts) -> torch.Tensor:
    o, _ = testing.reference_forward(q, k, v, opts)
    return torch.tensor(o, dtype=torch.float64).reshape(*q.shape[:-1], v.shape[-1])


def assert_same_as_sdpa(o, o_sdpa, q, k, v, opts, checks):
    """SDPA computes the same thing: its output passes the same rule against
    the f64 reference, so the two differ by at most the sum of their errors."""
    ref = reference_o(q, k, v, opts)
    bound = next(c.bound for c in checks if c.name == "o")
    sdpa_err = (o_sdpa.double() - ref).abs().max().item()
    assert sdpa_err <= bound, f"SDPA itself is off the reference: {sdpa_err} > {bound}"
    diff = (o.double() - o_sdpa.double()).abs().max().item()
    own = next(c.max_error for c in checks if c.name == "o")
    assert diff <= own + sdpa_err + 1e-12, f"flashattn vs SDPA {diff} > {own} + {sdpa_err}"


def load_ring_flash_attn():
    """ring-flash-attn's ring and zigzag functions, their flash-attn calls
    served by this engine (``flash_attn_interface.install``). Its modules
    are loaded without the package's ``__init__``, which also imports a
    Transformers adapter that fails on Transformers 5; the ring code itself
    is the package's, unchanged."""
    from flashattn.integrations import flash_attn_interface

    flash_attn_interface.install()
    if "ring_flash_attn" not in sys.modules:
        spec = importlib.util.find_spec("ring_flash_attn")
        if spec is None:
            raise ImportError("ring-flash-attn is not installed (scripts/test-python.sh setup installs it)")
        package = types.ModuleType("ring_flash_attn")
        package.__spec__ = spec
        package.__path__ = list(spec.submodule_search_locations)
        sys.modules["ring_flash_attn"] = package
    from ring_flash_attn.ring_flash_attn import ring_flash_attn_func
    from ring_flash_attn.zigzag_ring_flash_attn import zigzag_ring_flash_attn_func

    return {"ring": ring_flash_attn_func, "zigzag": zigzag_ring_flash_attn_func}


__all__ = [
    "DTYPES",
    "qkv",
    "options",
    "assert_forward",
    "band_mask",
    "attention_f64",
    "sdpa",
    "assert_same_as_sdpa",
    "load_ring_flash_attn",
]
