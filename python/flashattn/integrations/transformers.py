"""flashattn as a Hugging Face Transformers attention backend::

    from flashattn.integrations.transformers import register
    model = AutoModelForCausalLM.from_config(config, attn_implementation=register())

:func:`register` adds :func:`attention_forward` to ``transformers.AttentionInterface``
and returns the name it used, ``"portable_attention"`` by default.

Why that name: Transformers treats every ``attn_implementation`` whose name
contains ``"flash"`` as a flavour of flash-attn (``is_flash_attention_requested``)
and loads it through ``lazy_import_flash_attention``, which imports the
``flash_attn`` package or a Hub kernel: there is no clean way to hand it this
engine, so :func:`register` refuses names with ``"flash"`` in them.

Why a mask function too: for a name ``AttentionMaskInterface`` does not know,
Transformers builds no mask at all and padding would be silently ignored. So
:func:`register` registers sdpa's mask function under the same name: ``None``
where the causal (and sliding-window) flags already say everything, otherwise a
boolean ``(batch, 1, q, kv)`` mask. :func:`attention_forward` never trusts that
mask blindly: it reads it as the causal/window mask AND one contiguous range of
valid keys per sequence (left or right padding, a KV cache), rebuilds the mask
from those flags and ranges, and compares every entry. A match runs the dense
:func:`flashattn.flash_attn_func` (no padding) or :func:`flashattn.flash_attn_varlen_func`
over the valid rows; anything else (packed sequences, block-diagonal or custom
masks, additive biases) raises :class:`flashattn.errors.Unsupported` rather than
computing something else.

With a KV cache the queries are the last rows of a longer key range; the
offset between a query row and its own key is read from the mask (``kv - q``
with a dynamic cache, the past length with a static one, whose unused slots are
cut off), so the engine's bottom-right alignment matches the model's mask. Causal
query rows of padding tokens (rows whose own key is padding) are not computed:
they get zeros, as in Transformers' own flash-attn path. Non-causal rows are all
computed; a non-causal window is aligned bottom-right within each sequence's
valid keys, so one over right-padded keys does not match and raises. The mask is
read on the host at every call (its values decide the layout), so this function
is not for ``torch.compile`` graphs. Sinks (gpt-oss's
``s_aux``), the softcap (Gemma 2), the scale and GQA go to the engine as they
are: k and v keep their fewer heads. ``dropout > 0`` (``attention_dropout``
in training) runs on every backend.
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional, Tuple

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from .. import errors
from ..functional import flash_attn_func, flash_attn_varlen_func

#: The name :func:`register` uses unless told.
DEFAULT_NAME = "portable_attention"


def register(name: str = DEFAULT_NAME, backend: Optional[str] = None) -> str:
    """Register :func:`attention_forward` (and sdpa's mask function) under ``name``
    and return ``name``, for ``attn_implementation=``. ``backend`` fixes the
    engine's backend; by default each call uses ``$FLASHATTN_BACKEND`` or ``"auto"``."""
    if "flash" in name:
        raise ValueError(
            f"attn_implementation name {name!r} contains 'flash': Transformers would route it "
            "to the flash_attn package instead of this function; choose another name"
        )
    fn = attention_forward
    if backend is not None:
        fn = functools.partial(attention_forward, flashattn_backend=backend)
    AttentionInterface.register(name, fn)
    AttentionMaskInterface.register(name, sdpa_mask)
    return name


class _Ranges(NamedTuple):
    """Per sequence: query rows ``[qlo, qhi)`` attend keys ``[klo, khi)`` (int64, ``(batch,)``)."""

    qlo: torch.Tensor
    qhi: torch.Tensor
    klo: torch.Tensor
    khi: torch.Tensor


def _unsupported(message: str, feature: str) -> errors.FlashAttnError:
    return errors.error(
        "Unsupported",
        message + "; use attn_implementation='sdpa' or 'eager' for this model or input",
        what="transformers attention backend",
        feature=feature,
    )


def _allowed(mask: torch.Tensor, batch: int, lq: int, lk: int) -> torch.Tensor:
    """The mask as ``(batch, lq, lk)`` bool: True where a key takes part."""
    if mask.ndim != 4 or mask.shape[-2] != lq or mask.shape[-1] < lk:
        raise _unsupported(
            f"attention mask of shape {list(mask.shape)} for {lq} queries and {lk} keys "
            "(expected (batch, 1, q, >= kv))",
            "attention mask shape",
        )
    mask = mask[..., :lk]
    if mask.dtype != torch.bool:
        # An additive mask: 0 keeps a key, the dtype's minimum (or -inf) drops it.
        blocked = mask <= torch.finfo(mask.dtype).min / 2
        if not bool(((mask == 0) | blocked).all()):
            raise _unsupported(
                "the attention mask adds a bias to the scores (values other than 0 and -inf)",
                "additive attention bias",
            )
        mask = ~blocked
    if mask.shape[1] != 1:
        if not bool((mask == mask[:, :1]).all()):
            raise _unsupported("the attention mask differs between heads", "per-head mask")
        mask = mask[:, :1]
    return mask[:, 0].expand(batch, lq, lk)


def _ranges(mask: torch.Tensor, causal: bool, window: Tuple[int, int]) -> _Ranges:
    """Read ``mask`` (``(batch, lq, lk)`` bool) as the causal/window flags AND one
    contiguous range of valid keys per sequence; raise if it is anything else.

    With ``causal``, row ``i`` is the token at key position ``i + d`` (``d`` read
    from the mask: ``lk - lq`` with a dynamic cache, the past length with a static
    one) and sees keys ``klo <= j < khi``, ``j <= i + d`` (and ``j >= i + d - left``).
    Rows whose own position is a padding key are padding tokens: not computed.
    """
    batch, lq, lk = mask.shape
    dev = mask.device
    rows = torch.arange(lq, device=dev)
    cols = torch.arange(lk, device=dev)
    keys = mask.any(1)  # (batch, lk): keys any row sees
    has = keys.any(1)
    klo = torch.where(has, keys.int().argmax(1), 0)
    khi = torch.where(has, lk - keys.flip(1).int().argmax(1), 0)
    i, j = rows[None, :, None], cols[None, None, :]
    lo, hi = klo[:, None, None], khi[:, None, None]
    left, right = window
    if causal:
        last = lk - 1 - mask.flip(2).int().argmax(2)  # (batch, lq): last key of each row
        offset = torch.where(mask.any(2), last - rows, -(lq + lk)).max(1).values
        d = torch.where(has, offset, 0)
        dd = d[:, None, None]
        expected = (j >= lo) & (j < hi) & (j <= i + dd)
        if left >= 0:
            expected = expected & (j >= i + dd - left)
        qlo = (klo - d).clamp(0, lq)
        qhi = torch.maximum((khi - d).clamp(0, lq), qlo)
        # Keys past the last computed row's position are causally out of reach.
        khi_used = torch.where(qhi > qlo, qhi + d, klo)
    else:
        # Every row is computed; flags align bottom-right within the valid keys.
        off = (hi - lo) - lq
        expected = (j >= lo) & (j < hi)
        if right >= 0:
            expected = expected & (j - lo <= i + off + right)
        if left >= 0:
            expected = expected & (j - lo >= i + off - left)
        qlo = torch.zeros_like(klo)
        qhi = torch.where(has, lq, 0)
        khi_used = khi
    if not bool((expected == mask).all()):
        b, r, c = (int(x) for x in (expected != mask).nonzero()[0])
        raise _unsupported(
            f"the attention mask is not a {'causal' if causal else 'full'} mask"
            f"{f' with window {window}' if window != (-1, -1) else ''} over one contiguous "
            f"range of valid keys per sequence: entry (batch {b}, query {r}, key {c}) is "
            f"{bool(mask[b, r, c])}, the nearest such mask (valid keys {int(klo[b])}.."
            f"{int(khi[b])}) has {bool(expected[b, r, c])}",
            "attention mask pattern",
        )
    return _Ranges(qlo, qhi, klo, khi_used)


def attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    is_causal: Optional[bool] = None,
    sliding_window: Optional[int] = None,
    softcap: Optional[float] = None,
    s_aux: Optional[torch.Tensor] = None,
    flashattn_backend: Optional[str] = None,
    **kwargs,
) -> Tuple[torch.Tensor, None]:
    """Transformers' attention-function contract (as ``sdpa_attention_forward``):
    ``query`` ``(b, heads, q, d)``, ``key``/``value`` ``(b, kv_heads, kv, d)``;
    returns ``((b, q, heads, d_v), None)``."""
    if kwargs.get("position_bias") is not None:
        raise _unsupported("position_bias (T5-style relative bias)", "position_bias")
    causal = getattr(module, "is_causal", True) if is_causal is None else bool(is_causal)
    window = (-1, -1)
    if sliding_window is not None:
        # Transformers: key j is in the window of query i iff i - j < sliding_window
        # (causal), |i - j| <= sliding_window (bidirectional).
        window = (sliding_window - 1, 0) if causal else (sliding_window, sliding_window)
    batch, heads, lq, _ = query.shape
    lk = key.shape[2]
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    common = dict(
        dropout_p=dropout,
        softmax_scale=scaling,
        causal=causal,
        window_size=window,
        softcap=0.0 if softcap is None else float(softcap),
        sinks=s_aux,
        backend=flashattn_backend,
    )
    def dense(keys: int) -> Tuple[torch.Tensor, None]:
        kk, vv = k[:, :keys].contiguous(), v[:, :keys].contiguous()
        return flash_attn_func(q.contiguous(), kk, vv, **common), None

    if attention_mask is None:
        # sdpa's rule: a causal call without a mask and with more keys than queries
        # is top-left aligned (a static cache's prefill): the keys past the queries
        # are unused slots.
        return dense(lq if causal and 1 < lq < lk else lk)

    r = _ranges(_allowed(attention_mask, batch, lq, lk), causal, window)
    no_padding = (r.qlo == 0).all() & (r.qhi == lq).all() & (r.klo == 0).all()
    if bool(no_padding & (r.khi == r.khi[0]).all()) and int(r.khi[0]) > 0:
        return dense(int(r.khi[0]))

    dev = query.device
    rows = torch.arange(lq, device=dev)[None, :]
    cols = torch.arange(lk, device=dev)[None, :]
    q_sel = ((rows >= r.qlo[:, None]) & (rows < r.qhi[:, None])).reshape(-1)
    k_sel = ((cols >= r.klo[:, None]) & (cols < r.khi[:, None])).reshape(-1)
    dv = value.shape[-1]
    out = query.new_zeros(batch * lq, heads, dv)
    if not bool(q_sel.any()) or not bool(k_sel.any()):
        return out.reshape(batch, lq, heads, dv), None
    q_len, k_len = r.qhi - r.qlo, r.khi - r.klo
    zero = torch.zeros(1, dtype=torch.int32, device=dev)
    cu_q = torch.cat([zero, q_len.cumsum(0).to(torch.int32)])
    cu_k = torch.cat([zero, k_len.cumsum(0).to(torch.int32)])
    o = flash_attn_varlen_func(
        q.reshape(batch * lq, heads, -1)[q_sel],
        k.reshape(batch * lk, key.shape[1], -1)[k_sel],
        v.reshape(batch * lk, value.shape[1], -1)[k_sel],
        cu_q,
        cu_k,
        int(q_len.max()),
        int(k_len.max()),
        **common,
    )
    out = out.index_put((q_sel,), o)
    return out.reshape(batch, lq, heads, dv), None


__all__ = ["DEFAULT_NAME", "attention_forward", "register"]
