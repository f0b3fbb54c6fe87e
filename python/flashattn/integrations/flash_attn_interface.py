"""flash-attn's low-level interface on this engine: ``_flash_attn_forward``,
``_flash_attn_backward`` and their varlen forms, with flash-attn 2.7's
signatures and return values, so that code written against
``flash_attn.flash_attn_interface`` runs on any backend. Ring attention
packages are the main such code: ring-flash-attn calls these four
functions once per shard pair and merges the results itself::

    from flashattn.integrations import flash_attn_interface
    flash_attn_interface.install()          # where flash-attn is absent
    from ring_flash_attn import zigzag_ring_flash_attn_func

The contract, as flash-attn's: ``out`` in q's dtype, ``softmax_lse``
float32 ``(batch, heads_q, seqlen_q)`` (varlen: ``(heads_q, total_q)``);
the backward takes the forward's ``out`` and ``softmax_lse``, writes
``dq``, ``dk`` and ``dv`` into the tensors it is given (views included)
and returns ``softmax_d`` (the row sums of ``dout ∘ out``, float32, lse's
shape). Dropout draws a seed from torch's generator, as flash-attn draws
its Philox state; ``rng_state`` (int64 ``[seed, offset]``) carries it to
the backward. ``S_dmask`` is ``None`` (no probabilities are returned, as
with :func:`flashattn.flash_attn_func`'s ``return_attn_probs``); the
engine's backward is always deterministic, so ``deterministic`` changes
nothing. Positions are the call's own (bottom-right aligned masks, as in
flash-attn); for masks in global positions see :mod:`flashattn.partial`.
"""

from __future__ import annotations

import importlib.machinery
import sys
import types
from typing import Any, Optional, Tuple

import flashattn

from .. import errors, functional
from .._tensors import torch
from ..functional import backward_host, default_backend, forward_host, options

# Its public functions are flashattn's drop-ins, under flash-attn's names.
_PUBLIC = tuple(name for name in flashattn.__all__ if name.startswith("flash_attn_"))
globals().update({name: getattr(functional, name) for name in _PUBLIC})

if torch is None:
    raise ImportError("flashattn.integrations.flash_attn_interface needs torch")


def _dropout(dropout_p: float, rng_state: Optional[Any]) -> Optional[Tuple[float, int, int]]:
    if not dropout_p:
        return None
    if rng_state is None:
        raise errors.error(
            "Unsupported",
            "a backward with dropout_p > 0 needs the forward's rng_state",
            what="_flash_attn_backward",
            feature="dropout without rng_state",
        )
    seed, offset = (int(x) for x in rng_state.reshape(-1)[:2].tolist())
    return (float(dropout_p), seed, offset)


def _forward(q, k, v, dropout_p, softmax_scale, causal, window, softcap, alibi_slopes, cu=None):
    seed = functional._draw_seed(q) if dropout_p else 0
    rng_state = torch.tensor([seed, 0], dtype=torch.int64)
    opts = options(
        causal, window, softcap, softmax_scale, alibi_slopes,
        cu_seqlens_q=cu and cu[0], cu_seqlens_k=cu and cu[1],
        dropout=_dropout(dropout_p, rng_state),
    )  # fmt: skip
    out, lse = forward_host(q, k, v, opts, default_backend())
    return out, lse, None, rng_state


def _backward(dout, q, k, v, out, lse, dq, dk, dv, dropout_p, softmax_scale, causal, window,
              softcap, alibi_slopes, rng_state, cu=None):  # fmt: skip
    opts = options(
        causal, window, softcap, softmax_scale, alibi_slopes,
        cu_seqlens_q=cu and cu[0], cu_seqlens_k=cu and cu[1],
        dropout=_dropout(dropout_p, rng_state),
    )  # fmt: skip
    grads = backward_host(dout.contiguous(), q, k, v, out.contiguous(), lse, opts, default_backend())
    for into, grad in zip((dq, dk, dv), grads[:3]):
        if into is not None:
            into.copy_(grad)
    # softmax_d: D_i = Σ_c dout_ic · out_ic, in lse's layout (heads before rows).
    return (dout.float() * out.float()).sum(-1).transpose(-1, -2).contiguous()


def _flash_attn_forward(
    q, k, v, dropout_p, softmax_scale, causal, window_size_left=-1, window_size_right=-1,
    softcap=0.0, alibi_slopes=None, return_softmax=False,
):  # fmt: skip
    """``(out, softmax_lse, S_dmask, rng_state)`` of q ``(batch, seqlen_q,
    heads_q, d)`` over k, v ``(batch, seqlen_k, heads_kv, d)``."""
    window = (window_size_left, window_size_right)
    return _forward(q, k, v, dropout_p, softmax_scale, causal, window, softcap, alibi_slopes)


def _flash_attn_varlen_forward(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
    causal, window_size_left=-1, window_size_right=-1, softcap=0.0, alibi_slopes=None,
    return_softmax=False, block_table=None, leftpad_k=None, seqused_k=None, zero_tensors=False,
):  # fmt: skip
    """The packed form: q ``(total_q, heads_q, d)``, sequences cut by
    ``cu_seqlens_q``/``cu_seqlens_k``; ``softmax_lse`` ``(heads_q, total_q)``.
    Paged K/V (``block_table``), ``leftpad_k`` and ``seqused_k`` raise
    ``Unsupported`` (:func:`flashattn.flash_attn_with_kvcache` decodes on
    paged caches)."""
    for name, value in (("block_table", block_table), ("leftpad_k", leftpad_k), ("seqused_k", seqused_k)):
        if value is not None:
            raise errors.error(
                "Unsupported",
                f"_flash_attn_varlen_forward does not take {name}",
                what="_flash_attn_varlen_forward",
                feature=name,
            )
    window = (window_size_left, window_size_right)
    cu = (cu_seqlens_q, cu_seqlens_k)
    return _forward(q, k, v, dropout_p, softmax_scale, causal, window, softcap, alibi_slopes, cu)


def _flash_attn_backward(
    dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal,
    window_size_left=-1, window_size_right=-1, softcap=0.0, alibi_slopes=None,
    deterministic=False, rng_state=None,
):  # fmt: skip
    """Gradients into ``dq``, ``dk``, ``dv`` (any of them ``None``: not
    written); returns ``softmax_d``."""
    window = (window_size_left, window_size_right)
    return _backward(
        dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal, window,
        softcap, alibi_slopes, rng_state,
    )  # fmt: skip


def _flash_attn_varlen_backward(
    dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
    max_seqlen_k, dropout_p, softmax_scale, causal, window_size_left=-1, window_size_right=-1,
    softcap=0.0, alibi_slopes=None, deterministic=False, rng_state=None, zero_tensors=False,
):  # fmt: skip
    """The packed form of :func:`_flash_attn_backward`."""
    window = (window_size_left, window_size_right)
    return _backward(
        dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal, window,
        softcap, alibi_slopes, rng_state, cu=(cu_seqlens_q, cu_seqlens_k),
    )  # fmt: skip


def install(force: bool = False) -> bool:
    """Make ``import flash_attn.flash_attn_interface`` give this module,
    and ``flash_attn``'s public functions flashattn's drop-ins, for code
    that imports them (only in this process: ``sys.modules``, no files, no
    package metadata, so Transformers still sees no flash-attn). Where
    flash-attn itself imports, nothing changes unless ``force``. Returns
    whether it installed."""
    if not force:
        try:
            import flash_attn  # noqa: F401

            return False
        except ImportError:
            pass
    package = types.ModuleType("flash_attn")
    package.__spec__ = importlib.machinery.ModuleSpec("flash_attn", None, is_package=True)
    package.__path__ = []
    package.__doc__ = "flash-attn's interface served by flashattn (flash_attn_interface.install)."
    this = sys.modules[__name__]
    for name in _PUBLIC:
        setattr(package, name, getattr(this, name))
    package.flash_attn_interface = this
    sys.modules["flash_attn"] = package
    sys.modules["flash_attn.flash_attn_interface"] = this
    return True
