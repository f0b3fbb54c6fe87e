"""Partial attention: the primitives ring attention (context parallelism)
is built from, flash-attn's ``_flash_attn_forward``/``_flash_attn_backward``
contract with global positions.

A long sequence is cut into shards. ``forward_partial`` attends a shard of
queries to a shard of keys with the masks and ALiBi of the whole sequence:
row ``i`` is global row ``q_offset + i``, key ``j`` global key ``k_offset +
j``. Its ``o`` is normalised within the shard and its ``lse`` (float32) is
``-inf`` for rows that see no key of the shard. ``merge_partials`` combines
the shards' results exactly by their LSE, in float32. ``backward_partial``
gives one shard pair's gradients from the *global* ``o`` and ``lse``: the
sum of its ``dq`` over key shards, and of its ``dk``/``dv`` over query
shards, are the gradients of the whole attention.

Sinks, block-sparse masks and packed batches belong to whole sequences: with
shard positions they raise ``Unsupported``.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence, Tuple

from . import errors
from ._tensors import check_device, check_float, check_rank, is_torch, torch
from .functional import backward_host, default_backend, forward_host, options


def _opts(q_offset, k_offset, causal, window_size, softmax_scale, softcap, alibi_slopes):
    for name, value in (("q_offset", q_offset), ("k_offset", k_offset)):
        if int(value) < 0:
            raise errors.error(
                "NegativeIndex",
                f"{name} is {value}: shard positions are at least 0",
                tensor=name,
                index=0,
                value=int(value),
            )
    return options(
        causal, window_size, softcap, softmax_scale, alibi_slopes,
        positions=(int(q_offset), int(k_offset)),
    )  # fmt: skip


def _check(named):
    for name, t in named:
        check_float(t, name)
        check_rank(t, name, (4,))
    check_device(named[1:], named[0][1])


def forward_partial(
    q,
    k,
    v,
    q_offset: int,
    k_offset: int,
    causal: bool = False,
    window_size: Tuple[int, int] = (-1, -1),
    softmax_scale: Optional[float] = None,
    softcap: float = 0.0,
    alibi_slopes: Any = None,
    backend: Optional[str] = None,
):
    """``(o, lse)`` of q's shard (global rows from ``q_offset``) over k's
    and v's shard (global keys from ``k_offset``); ``lse`` is ``(batch,
    heads_q, seqlen_q)`` float32. No autograd: see :func:`backward_partial`."""
    _check([("q", q), ("k", k), ("v", v)])
    opts = _opts(q_offset, k_offset, causal, window_size, softmax_scale, softcap, alibi_slopes)
    return forward_host(q, k, v, opts, backend or default_backend())


def backward_partial(
    d_o,
    q,
    k,
    v,
    o,
    lse,
    q_offset: int,
    k_offset: int,
    causal: bool = False,
    window_size: Tuple[int, int] = (-1, -1),
    softmax_scale: Optional[float] = None,
    softcap: float = 0.0,
    alibi_slopes: Any = None,
    backend: Optional[str] = None,
    d_lse: Any = None,
):
    """``(dq, dk, dv)`` of one shard pair, given the *global* ``o`` and
    ``lse`` of q's rows (the merged forward) and ``d_o``; ``d_lse`` (torch,
    lse's shape), a gradient of the global ``lse`` too."""
    _check([("q", q), ("k", k), ("v", v), ("o", o), ("do", d_o)])
    opts = _opts(q_offset, k_offset, causal, window_size, softmax_scale, softcap, alibi_slopes)
    be = backend or default_backend()
    dq, dk, dv, _ = backward_host(d_o, q, k, v, o, lse, opts, be, d_lse)
    return dq, dk, dv


def merge_partials(parts: Sequence[Tuple[Any, Any]]):
    """Exact merge by LSE in float32: ``lse = log Σ exp(lse_s)``, ``o = Σ
    exp(lse_s − lse) · o_s``; rows where every part has ``lse = -inf`` give
    ``o = 0`` and ``lse = -inf``. ``o_s`` is ``(batch, seqlen, heads, d)``,
    ``lse_s`` ``(batch, heads, seqlen)``; the result's ``o`` is float32."""
    if not parts:
        raise errors.error(
            "EmptyDim", "merge_partials needs at least one part", dim="parts"
        )
    if not is_torch(parts[0][0]):
        import numpy as np

        lses = np.stack([np.asarray(l, dtype=np.float32) for _, l in parts])
        top = lses.max(axis=0)
        safe = np.where(np.isfinite(top), top, 0.0)
        w = np.exp(lses - safe)
        total = w.sum(axis=0)
        lse = np.where(total > 0, np.log(np.where(total > 0, total, 1.0)) + safe, -np.inf)
        scale = np.where(total > 0, w / np.where(total > 0, total, 1.0), 0.0)
        o = sum(
            np.asarray(p, dtype=np.float32) * s.transpose(0, 2, 1)[..., None]
            for (p, _), s in zip(parts, scale)
        )
        return o.astype(np.float32), lse.astype(np.float32)
    lses = torch.stack([l.float() for _, l in parts])
    top = lses.amax(dim=0)
    safe = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    w = torch.exp(lses - safe)
    total = w.sum(dim=0)
    nonzero = total > 0
    lse = torch.where(nonzero, torch.log(torch.where(nonzero, total, 1.0)) + safe, float("-inf"))
    scale = torch.where(nonzero, w / torch.where(nonzero, total, 1.0), 0.0)
    o = None
    for (part, _), s in zip(parts, scale):
        term = part.float() * s.transpose(1, 2).unsqueeze(-1)
        o = term if o is None else o + term
    return o, lse
