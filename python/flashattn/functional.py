"""flash-attn's functions on this engine: ``flash_attn_func``,
``flash_attn_varlen_func`` and ``flash_attn_with_kvcache``, with the same
signatures and semantics, plus the engine's extras as keyword arguments.

With torch tensors the forward is the custom op ``flashattn::fwd`` and its
gradient the custom op ``flashattn::bwd`` (the engine's deterministic
backward, ``dsinks`` included), so autograd and ``torch.compile`` see
them. numpy arrays work too (forward only).
"""

from __future__ import annotations

import math
import os
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np

from . import _native, errors
from ._tensors import (
    as_bytes,
    check_device,
    check_float,
    check_rank,
    dtype_name,
    empty,
    float_list,
    host,
    int32_list,
    is_torch,
    raw,
    raw_codes,
    to_device,
    torch,
)

#: The seed of the Hadamard signs ``hadamard=True`` uses (the engine's default).
HADAMARD_SEED = 0x4ADA3A2D


def default_backend() -> str:
    """The backend calls use unless told: ``$FLASHATTN_BACKEND`` or ``"auto"``."""
    return os.environ.get("FLASHATTN_BACKEND", "auto")


def backend_info(backend: Optional[str] = None) -> Dict[str, str]:
    """Which backend ``backend`` (default: :func:`default_backend`) opens on
    this machine, and why: ``{"kind", "name", "reason"}``."""
    kind, name, reason = _native.backend_info(backend or default_backend())
    return {"kind": kind, "name": name, "reason": reason}


def options(
    causal: bool = False,
    window_size: Tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    softmax_scale: Optional[float] = None,
    alibi_slopes: Any = None,
    sinks: Any = None,
    block_mask: Any = None,
    block_size: Union[int, Tuple[int, int], None] = None,
    cu_seqlens_q: Any = None,
    cu_seqlens_k: Any = None,
    positions: Optional[Tuple[int, int]] = None,
    dropout: Optional[Tuple[float, int, int]] = None,
) -> Dict[str, Any]:
    """The engine's options from flash-attn's arguments (and the extras;
    ``positions``: a shard's global ``(q_offset, k_offset)``; ``dropout``:
    ``(p, seed, offset)``, docs/dropout.md)."""
    left, right = window_size
    mask = None
    if block_mask is not None:
        if block_size is None:
            raise errors.error(
                "BlockSize",
                "block_mask needs block_size (an int or a (block_m, block_n) pair)",
                bm=0,
                bn=0,
            )
        bm, bn = (block_size, block_size) if isinstance(block_size, int) else block_size
        check_rank(block_mask, "block_mask", (4,))
        mask = (as_bytes(block_mask), list(block_mask.shape), int(bm), int(bn))
    cu = None
    if cu_seqlens_q is not None or cu_seqlens_k is not None:
        cu = (
            int32_list(cu_seqlens_q, "cu_seqlens_q") or [],
            int32_list(cu_seqlens_k, "cu_seqlens_k") or [],
        )
    return {
        "causal": bool(causal),
        "window": (int(left), int(right)),
        "softcap": float(softcap),
        "scale": None if softmax_scale is None else float(softmax_scale),
        # With their shape: (heads_q,) or (batch, heads_q), not another shape
        # of the same count (a transposed (heads_q, batch) would misassign).
        "alibi": None
        if alibi_slopes is None
        else (float_list(alibi_slopes), [int(n) for n in np.shape(alibi_slopes)]),
        "sinks": float_list(sinks),
        "block_mask": mask,
        "cu_seqlens": cu,
        "positions": None if positions is None else (int(positions[0]), int(positions[1])),
        "dropout": None if dropout is None else (float(dropout[0]), int(dropout[1]), int(dropout[2])),
    }


def _lse_shape(q: Any, varlen: bool) -> List[int]:
    if varlen:
        return [q.shape[1], q.shape[0]]
    return [q.shape[0], q.shape[2], q.shape[1]]


def forward_host(
    q: Any,
    k: Any,
    v: Any,
    opts: Dict[str, Any],
    backend: str,
    fp8: bool = False,
    hadamard: Optional[int] = None,
) -> Tuple[Any, Any]:
    """The engine's forward on any tensors: ``(o, lse)`` on q's device."""
    qh, kh, vh = host(q), host(k), host(v)
    o = empty(list(q.shape[:-1]) + [v.shape[-1]], qh, float32=fp8)
    lse = empty(_lse_shape(q, opts["cu_seqlens"] is not None), qh, float32=True)
    _native.forward(raw(qh), raw(kh), raw(vh), raw(o), raw(lse), opts, backend, fp8, hadamard)
    if fp8:
        o = o.to(q.dtype) if is_torch(o) else o.astype(q.dtype)
    return to_device(o, q), to_device(lse, q)


def backward_host(
    d_o: Any,
    q: Any,
    k: Any,
    v: Any,
    o: Any,
    lse: Any,
    opts: Dict[str, Any],
    backend: str,
    d_lse: Any = None,
) -> Tuple[Any, Any, Any, Optional[List[float]]]:
    """The engine's backward on any tensors: ``(dq, dk, dv, dsinks)``.
    ``d_lse`` (torch, lse's shape): a gradient of ``lse`` too."""
    if d_lse is not None and bool((d_lse != 0).any()):
        return _backward_with_lse_grad(d_o, q, k, v, o, lse, d_lse, opts, backend)
    qh, kh, vh, oh, lh, dh = (host(t) for t in (q, k, v, o, lse, d_o))
    dq, dk, dv = empty(q.shape, qh), empty(k.shape, kh), empty(v.shape, vh)
    dsinks = _native.backward(
        raw(qh), raw(kh), raw(vh), raw(oh), raw(lh), raw(dh), raw(dq), raw(dk), raw(dv), opts, backend
    )
    return to_device(dq, q), to_device(dk, k), to_device(dv, v), dsinks


def _backward_with_lse_grad(d_o, q, k, v, o, lse, d_lse, opts, backend):
    """The backward of ``<dO, o> + <dlse, lse>``. ``d lse_i / d s_ij = P_ij``,
    so the lse term only shifts the backward's row term: ``dS = P ∘ (dP -
    (D - dlse))`` with ``D = rowsum(dO ∘ O)`` (sinks' gradient alike). The
    engine computes D from o and dO, so one more value column carries the
    shift: 0 in v (dP and o unchanged), ``-dlse`` in o and 1 in dO. q and k
    get a zero column too (scores unchanged, the scale kept that of q's own
    head dim), so the head dims keep their relation (backends that take no v
    head dim of its own take this one). In float32, so that ``-dlse`` is not
    rounded to a 16-bit dtype."""
    widest = max(q.shape[-1], v.shape[-1])
    if widest >= _native.max_head_dim():
        raise errors.error(
            "Unsupported",
            f"a gradient of softmax_lse takes one head-dim column more than q's or v's "
            f"({widest}), past the maximum {_native.max_head_dim()}",
            what="flash_attn_func backward",
            feature="softmax_lse gradient at the largest head dim",
        )
    dl = d_lse.float()
    # lse is (batch, heads, rows), packed (heads, total): to o's row layout.
    rows = dl.transpose(0, 1) if dl.ndim == 2 else dl.transpose(1, 2)

    def widen(t, column):
        t = t.float()
        extra = column if torch.is_tensor(column) else t.new_full(t.shape[:-1] + (1,), column)
        return torch.cat([t, extra.to(t.device)], dim=-1)

    opts = dict(opts)
    if opts["scale"] is None:
        opts["scale"] = 1.0 / math.sqrt(q.shape[-1])  # as the engine's default
    dq, dk, dv, dsinks = backward_host(
        widen(d_o, 1.0), widen(q, 0.0), widen(k, 0.0), widen(v, 0.0),
        widen(o, -rows.unsqueeze(-1)), lse, opts, backend,
    )  # fmt: skip
    grads = [g[..., :-1].to(t.dtype).contiguous() for g, t in ((dq, q), (dk, k), (dv, v))]
    return (*grads, dsinks)


if torch is not None:
    from torch import Tensor

    @torch.library.custom_op("flashattn::fwd", mutates_args=())
    def _fwd(
        q: Tensor,
        k: Tensor,
        v: Tensor,
        cu_seqlens_q: Optional[Tensor],
        cu_seqlens_k: Optional[Tensor],
        causal: bool,
        window_left: int,
        window_right: int,
        softcap: float,
        softmax_scale: Optional[float],
        alibi_slopes: Optional[Tensor],
        sinks: Optional[Tensor],
        block_mask: Optional[Tensor],
        block_m: int,
        block_n: int,
        backend: str,
        dropout_p: float,
        dropout_seed: int,
    ) -> Tuple[Tensor, Tensor]:
        opts = options(
            causal,
            (window_left, window_right),
            softcap,
            softmax_scale,
            alibi_slopes,
            sinks,
            block_mask,
            (block_m, block_n),
            cu_seqlens_q,
            cu_seqlens_k,
            dropout=_dropout_of(dropout_p, dropout_seed),
        )
        return forward_host(q, k, v, opts, backend)

    @_fwd.register_fake
    def _fwd_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, *_):
        o = q.new_empty(tuple(q.shape[:-1]) + (v.shape[-1],))
        lse = q.new_empty(_lse_shape(q, cu_seqlens_q is not None), dtype=torch.float32)
        return o, lse

    @torch.library.custom_op("flashattn::bwd", mutates_args=())
    def _bwd(
        d_o: Tensor,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        o: Tensor,
        lse: Tensor,
        cu_seqlens_q: Optional[Tensor],
        cu_seqlens_k: Optional[Tensor],
        causal: bool,
        window_left: int,
        window_right: int,
        softcap: float,
        softmax_scale: Optional[float],
        alibi_slopes: Optional[Tensor],
        sinks: Optional[Tensor],
        block_mask: Optional[Tensor],
        block_m: int,
        block_n: int,
        backend: str,
        dropout_p: float,
        dropout_seed: int,
        d_lse: Optional[Tensor] = None,
    ) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
        opts = options(
            causal,
            (window_left, window_right),
            softcap,
            softmax_scale,
            alibi_slopes,
            sinks,
            block_mask,
            (block_m, block_n),
            cu_seqlens_q,
            cu_seqlens_k,
            dropout=_dropout_of(dropout_p, dropout_seed),
        )
        dq, dk, dv, dsinks = backward_host(d_o, q, k, v, o, lse, opts, backend, d_lse)
        ds = torch.tensor(dsinks or [], dtype=torch.float32, device=q.device)
        return dq, dk, dv, ds

    @_bwd.register_fake
    def _bwd_fake(d_o, q, k, v, o, lse, cu_q, cu_k, causal, wl, wr, cap, scale, alibi, sinks, *_):
        heads = 0 if sinks is None else sinks.shape[0]
        return (
            torch.empty_like(q),
            torch.empty_like(k),
            torch.empty_like(v),
            q.new_empty((heads,), dtype=torch.float32),
        )

    def _setup(ctx, inputs, output):
        (q, k, v, cu_q, cu_k, causal, wl, wr, cap, scale, alibi, sinks, mask, bm, bn, be, p, seed) = (
            inputs
        )
        o, lse = output
        ctx.save_for_backward(q, k, v, o, lse, cu_q, cu_k, alibi, sinks, mask)
        ctx.args = (causal, wl, wr, cap, scale)
        # The backward draws the forward's dropout mask again from its seed.
        ctx.block = (bm, bn, be, p, seed)

    def _grad(ctx, d_o, d_lse):
        q, k, v, o, lse, cu_q, cu_k, alibi, sinks, mask = ctx.saved_tensors
        if d_o is None:
            d_o = torch.zeros_like(o)
        # softmax_lse (return_attn_probs) has a gradient too: flashattn::bwd
        # adds it where d_lse is nonzero (flash-attn drops it silently).
        dq, dk, dv, dsinks = torch.ops.flashattn.bwd(
            d_o.contiguous(), q, k, v, o, lse, cu_q, cu_k, *ctx.args, alibi, sinks, mask, *ctx.block,
            d_lse,
        )
        d_sinks = None if sinks is None else dsinks.to(sinks.dtype)
        # Gradients of q, k, v and the sinks; None for the other 14 inputs.
        return (dq, dk, dv, *(None,) * 8, d_sinks, *(None,) * 6)

    torch.library.register_autograd("flashattn::fwd", _grad, setup_context=_setup)

    def _no_double_backward(ctx, *grads):
        raise errors.error(
            "Unsupported",
            "flashattn's backward has no gradient of its own: a double backward through "
            "flash_attn_func (create_graph=True, as gradient penalties and Hessian-vector "
            "products use) is not supported",
            what="flashattn backward",
            feature="double backward",
        )

    # Without it torch's message would ask for an autograd formula to be registered.
    torch.library.register_autograd(
        "flashattn::bwd", _no_double_backward, setup_context=lambda ctx, inputs, output: None
    )


def _dropout_of(dropout_p: float, seed: int) -> Optional[Tuple[float, int, int]]:
    """The engine's dropout option: none at ``dropout_p == 0.0``."""
    return None if dropout_p == 0.0 else (dropout_p, seed, 0)


def _draw_seed(q: Any) -> int:
    """A dropout seed from the framework's global generator (as flash-attn
    draws its Philox state from torch's), so ``torch.manual_seed`` (or
    ``numpy.random.seed`` for numpy inputs) makes the mask repeatable."""
    if is_torch(q):
        return int(torch.randint(0, 2**62, (1,), dtype=torch.int64).item())
    import numpy as np

    return int(np.random.randint(0, 2**62, dtype=np.int64))


def _check_inputs(named: Sequence[Tuple[str, Any]], ranks: Sequence[int]) -> None:
    for name, t in named:
        check_float(t, name)
        check_rank(t, name, ranks)
    check_device(named[1:], named[0][1])


def _attention(
    q,
    k,
    v,
    dropout_p,
    softmax_scale,
    causal,
    window_size,
    softcap,
    alibi_slopes,
    return_attn_probs,
    sinks,
    block_mask,
    block_size,
    backend,
    precision,
    hadamard,
    dropout_seed,
    cu_seqlens_q=None,
    cu_seqlens_k=None,
):
    backend = backend or default_backend()
    dropout_p = float(dropout_p)
    if dropout_p != 0.0 and dropout_seed is None:
        dropout_seed = _draw_seed(q)
    seed = 0 if dropout_seed is None else int(dropout_seed)
    varlen = cu_seqlens_q is not None
    _check_inputs([("q", q), ("k", k), ("v", v)], (3,) if varlen else (4,))
    check_device(
        [
            ("cu_seqlens_q", cu_seqlens_q),
            ("cu_seqlens_k", cu_seqlens_k),
            ("alibi_slopes", alibi_slopes),
            ("sinks", sinks),
            ("block_mask", block_mask),
        ],
        q,
    )
    if precision not in (None, "fp8"):
        raise errors.error(
            "UnknownName",
            f"unknown precision `{precision}` (expected None or 'fp8')",
            what="precision",
            name=str(precision),
            expected="None or 'fp8'",
        )
    tracked = is_torch(q) and (
        torch.compiler.is_compiling()
        or (
            torch.is_grad_enabled()
            and any(t is not None and t.requires_grad for t in (q, k, v, sinks))
        )
    )
    if precision == "fp8" or not tracked:
        # No autograd to record (FP8 has no backward, numpy no autograd, or
        # nothing needs a gradient): the engine directly, without the
        # custom op's dispatch.
        opts = options(
            causal, window_size, softcap, softmax_scale, alibi_slopes, sinks,
            block_mask, block_size, cu_seqlens_q, cu_seqlens_k,
            dropout=_dropout_of(dropout_p, seed),
        )  # fmt: skip
        signs = None
        if hadamard:
            signs = HADAMARD_SEED if hadamard is True else int(hadamard)
        o, lse = forward_host(q, k, v, opts, backend, fp8=precision == "fp8", hadamard=signs)
    else:
        if block_mask is not None and block_size is None:
            options(block_mask=block_mask)  # raises the typed error
        bm, bn = (0, 0)
        if block_size is not None:
            bm, bn = (block_size, block_size) if isinstance(block_size, int) else block_size
        for name, t in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
            if t is not None and not is_torch(t):
                raise errors.error(
                    "DeviceMismatch",
                    f"{name} is a {type(t).__name__} but q is a torch tensor",
                    tensor=name,
                    device=type(t).__name__,
                    expected=str(q.device),
                )
            if t is not None and t.dtype != torch.int32:
                int32_list(t, name)  # raises the typed error
        o, lse = torch.ops.flashattn.fwd(
            q, k, v, cu_seqlens_q, cu_seqlens_k, bool(causal), int(window_size[0]),
            int(window_size[1]), float(softcap), softmax_scale, alibi_slopes, sinks,
            block_mask, int(bm), int(bn), backend, dropout_p, seed,
        )  # fmt: skip
    return (o, lse, None) if return_attn_probs else o


def flash_attn_func(
    q,
    k,
    v,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes=None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    *,
    sinks=None,
    block_mask=None,
    block_size: Union[int, Tuple[int, int], None] = None,
    backend: Optional[str] = None,
    precision: Optional[str] = None,
    hadamard: Union[bool, int] = False,
    dropout_seed: Optional[int] = None,
):
    """Exact attention, as ``flash_attn.flash_attn_func``.

    ``q`` is ``(batch, seqlen_q, heads_q, head_dim)``, ``k`` and ``v`` are
    ``(batch, seqlen_k, heads_kv, head_dim)`` (``heads_q`` a multiple of
    ``heads_kv``: MQA/GQA; ``v`` may have its own head dim). Returns ``o``
    in q's layout, or ``(o, softmax_lse, None)`` with
    ``return_attn_probs`` (``softmax_lse`` is ``(batch, heads_q,
    seqlen_q)`` float32, of the undropped scores; the third item, flash-attn's
    testing-only ``S_dmask``, is None).
    Causal and window masks are aligned to the bottom-right corner of the
    score matrix, as in flash-attn ≥ 2.1.

    The backward is always the engine's deterministic one (bit-identical
    gradients on a repeated call), whatever ``deterministic`` says.

    ``dropout_p`` in ``[0, 1)`` drops attention probabilities (kept ones
    scaled by ``1 / (1 - dropout_p)``) with a mask drawn from Philox by
    seed (docs/dropout.md); the backward draws the same mask again. The
    seed comes from torch's global generator (numpy's for numpy inputs),
    so ``torch.manual_seed`` repeats it, or from ``dropout_seed``. The CPU
    backend, wgpu and CUDA draw the same mask.

    Extras: ``sinks`` (one logit per query head, trained: it gets a
    gradient), ``block_mask`` ``(mb, mh, rows, cols)`` bool/uint8 with
    ``block_size`` (a block-sparse mask ANDed with the others), ``backend``
    (``"auto"``, ``"cpu"``, ``"wgpu"``, ``"cuda"``), and
    ``precision="fp8"`` (e4m3 forward, no gradient) with ``hadamard``
    (``True`` or a seed: incoherent processing of q and k), ``dropout_seed``
    (dropout's seed, instead of one drawn).
    """
    del deterministic  # always deterministic
    return _attention(
        q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
        return_attn_probs, sinks, block_mask, block_size, backend, precision, hadamard,
        dropout_seed,
    )  # fmt: skip


def flash_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes=None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    block_table=None,
    *,
    sinks=None,
    block_mask=None,
    block_size: Union[int, Tuple[int, int], None] = None,
    backend: Optional[str] = None,
    precision: Optional[str] = None,
    hadamard: Union[bool, int] = False,
    dropout_seed: Optional[int] = None,
):
    """Attention over a packed batch of sequences of their own lengths, as
    ``flash_attn.flash_attn_varlen_func``.

    ``q`` is ``(total_q, heads_q, head_dim)``, ``k``/``v`` ``(total_k,
    heads_kv, head_dim)``; sequence ``b`` owns rows ``cu_seqlens_q[b] :
    cu_seqlens_q[b+1]`` (int32, ``batch + 1`` entries, starting at 0).
    Sequences may be empty. ``max_seqlen_q``/``max_seqlen_k`` must be at
    least the longest sequence (they are checked, not trusted).
    ``softmax_lse`` is ``(heads_q, total_q)``. Other arguments as
    :func:`flash_attn_func`. ``block_table`` (a paged K/V) is not
    supported here: :func:`flash_attn_with_kvcache` takes paged caches.
    """
    del deterministic
    if block_table is not None:
        raise errors.error(
            "Unsupported",
            "flash_attn_varlen_func does not support block_table (paged K/V): "
            "flash_attn_with_kvcache takes paged caches",
            what="flash_attn_varlen_func",
            feature="block_table",
        )
    for name, cu, given in (
        ("cu_seqlens_q", cu_seqlens_q, max_seqlen_q),
        ("cu_seqlens_k", cu_seqlens_k, max_seqlen_k),
    ):
        if cu is None:
            raise errors.error(
                "UnsupportedDtype",
                f"{name} is None, expected an int32 tensor",
                tensor=name,
                dtype="None",
                expected="int32",
            )
        if is_torch(cu) and torch.compiler.is_compiling():
            continue  # values are not known while tracing
        values = int32_list(cu, name)
        longest = max((b - a for a, b in zip(values, values[1:])), default=0)
        if longest > int(given):
            field = "max_seqlen_q" if name.endswith("q") else "max_seqlen_k"
            raise errors.error(
                "MaxSeqlen",
                f"{field} is {given} but {name} has a sequence of {longest}",
                argument=field,
                value=int(given),
                longest=longest,
            )
    return _attention(
        q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
        return_attn_probs, sinks, block_mask, block_size, backend, precision, hadamard,
        dropout_seed, cu_seqlens_q, cu_seqlens_k,
    )  # fmt: skip


def flash_attn_with_kvcache(
    q,
    k_cache,
    v_cache=None,
    k=None,
    v=None,
    rotary_cos=None,
    rotary_sin=None,
    cache_seqlens=None,
    cache_batch_idx=None,
    cache_leftpad=None,
    block_table=None,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    rotary_interleaved: bool = True,
    alibi_slopes=None,
    num_splits: int = 0,
    return_softmax_lse: bool = False,
    *,
    sinks=None,
    backend: Optional[str] = None,
    cache_dtype=None,
    k_scales=None,
    v_scales=None,
    head_dim_v: Optional[int] = None,
):
    """Attention of new queries over a KV cache, as
    ``flash_attn.flash_attn_with_kvcache`` (no gradient).

    ``q`` is ``(batch, seqlen_q, heads_q, head_dim)``. A dense cache is
    ``(batch_cache, seqlen_cache, heads_kv, head_dim)`` (row
    ``cache_batch_idx[b]`` for sequence ``b``); with ``block_table``
    (``(batch, max_pages)`` int32) the cache is paged: ``(num_pages,
    page_size, heads_kv, head_dim)``. ``cache_seqlens`` (int32 ``(batch,)``
    or an int; default: the whole cache) says how many tokens each
    sequence holds. With ``k`` and ``v`` (``(batch, seqlen_new, heads_kv,
    head_dim)``) the new tokens are written into the caches in place at
    positions ``cache_seqlens[b]…`` first, then attended to. A call that
    raises leaves the caches untouched.

    The arguments are flash-attn's, in its order; ``rotary_cos``,
    ``rotary_sin`` and ``cache_leftpad`` raise ``Unsupported`` (apply rotary
    embeddings or left padding before the call), and ``rotary_interleaved``,
    which only shapes the rotary embedding, is accepted and unused.

    ``num_splits``: 0 lets the engine split the keys as it plans (split-KV,
    merged by LSE), 1 does not split, n splits n ways. Returns ``o`` or
    ``(o, softmax_lse)`` (``(batch, heads_q, seqlen_q)`` float32).

    ``cache_dtype="int8"`` or ``"fp8"`` (or ``torch.int8`` /
    ``torch.float8_e4m3fn``): the caches are quantized (docs/kv-quantization.md),
    int8 codes, or FP8's e4m3 bytes as uint8 or float8_e4m3fn, with float32
    block scales ``k_scales``/``v_scales`` of ``(blocks, heads_kv)`` (one per
    page, or per 16 tokens of a dense cache's row: :func:`quantize_kv_cache`
    makes them). Appends quantize in place, codes and scales both; q, k, v
    and o keep their float dtype. The CPU backend and the wgpu kernels
    decode them (the same codes, bit for bit).

    A latent cache (DeepSeek's MLA, docs/decoding.md): ``v_cache=None`` and
    ``head_dim_v`` (e.g. 512 of a 576-wide ``k_cache``). V is then the first
    ``head_dim_v`` columns of ``k_cache``'s head rows, read in place (one
    cache, never a copy); ``k`` alone appends (``v`` must be ``None``) and
    ``o`` has ``head_dim_v``. With ``cache_dtype``, ``k_cache`` holds the
    codes and ``k_scales`` their block scales; V reads both (no
    ``v_scales``).
    """
    del rotary_interleaved  # it shapes rotary embeddings only, which are not taken
    for name, value in (
        ("rotary_cos", rotary_cos),
        ("rotary_sin", rotary_sin),
        ("cache_leftpad", cache_leftpad),
    ):
        if value is not None:
            raise errors.error(
                "Unsupported",
                f"flash_attn_with_kvcache does not support {name}: apply rotary embeddings "
                "(or left padding) before the call",
                what="flash_attn_with_kvcache",
                feature=name,
            )
    backend = backend or default_backend()
    latent = v_cache is None
    if latent != (head_dim_v is not None):
        raise errors.error(
            "Unsupported",
            "a latent cache is v_cache=None with head_dim_v (V the first head_dim_v "
            "columns of k_cache); a cache with a V of its own takes no head_dim_v",
            what="flash_attn_with_kvcache",
            feature="v_cache with head_dim_v" if not latent else "v_cache=None without head_dim_v",
        )
    if latent and v is not None:
        raise errors.error(
            "LatentAppend",
            "a latent cache appends k alone: its V is a view of k_cache, so there is no v",
            reason="v given for a latent cache",
        )
    if not latent and (k is None) != (v is None):
        raise errors.error(
            "Unsupported",
            "k and v are appended together: pass both or neither",
            what="flash_attn_with_kvcache",
            feature="k without v",
        )
    quant = _cache_quant(cache_dtype)
    named = [("q", q), ("k_cache", k_cache)] + ([] if latent else [("v_cache", v_cache)])
    if quant is not None:
        coded = [("k_cache", k_cache)] + ([] if latent else [("v_cache", v_cache)])
        _check_codes(quant, coded, k_scales, v_scales, latent)
        named = [("q", q)]
        check_device(coded, q)
    if k is not None:
        named += [("k", k)] + ([] if latent else [("v", v)])
    _check_inputs(named, (4,))
    check_device(
        [
            ("cache_seqlens", None if isinstance(cache_seqlens, (int, np.integer)) else cache_seqlens),
            ("cache_batch_idx", cache_batch_idx),
            ("block_table", block_table),
            ("alibi_slopes", alibi_slopes),
            ("sinks", sinks),
        ],
        q,
    )
    batch = q.shape[0]
    paged = block_table is not None
    table = None
    if paged:
        check_rank(block_table, "block_table", (2,))
        table = (int32_list(block_table, "block_table"), int(block_table.shape[1]))
        capacity = block_table.shape[1] * k_cache.shape[1]
    else:
        capacity = k_cache.shape[1]
    if cache_seqlens is None:
        seqlens = [capacity] * batch
    elif isinstance(cache_seqlens, (int, np.integer)):
        seqlens = [int(cache_seqlens)] * batch
    else:
        seqlens = int32_list(cache_seqlens, "cache_seqlens")
    idx = int32_list(cache_batch_idx, "cache_batch_idx")
    opts = options(causal, window_size, softcap, softmax_scale, alibi_slopes, sinks)

    qh = host(q)
    kc = host(k_cache)
    vc = None if latent else host(v_cache)
    # The new rows' host copies stay referenced until the engine has read
    # them (``raw`` keeps only an address).
    new_rows = None if k is None else (host(k), None if latent else host(v))
    new_kv = None if new_rows is None else tuple(None if x is None else raw(x) for x in new_rows)
    dv = head_dim_v if latent else v_cache.shape[-1]
    o = empty(list(q.shape[:-1]) + [dv], qh)
    lse = empty([q.shape[0], q.shape[2], q.shape[1]], qh, float32=True)
    written = [(k_cache, kc)] + ([] if latent else [(v_cache, vc)])
    if quant is None:
        _native.decode(
            raw(qh), raw(kc), None if latent else raw(vc), paged, new_kv, seqlens, idx, table,
            raw(o), raw(lse), opts, backend, int(num_splits), head_dim_v if latent else None,
        )  # fmt: skip
    else:
        ks = host(k_scales)
        vs = None if latent else host(v_scales)
        written += [(k_scales, ks)] + ([] if latent else [(v_scales, vs)])
        _native.decode_quantized(
            raw(qh), raw_codes(kc), None if latent else raw_codes(vc), raw(ks),
            None if latent else raw(vs), quant, paged, new_kv, seqlens, idx, table, raw(o),
            raw(lse), opts, backend, int(num_splits), head_dim_v if latent else None,
        )  # fmt: skip
    if new_kv is not None:
        # A cache that is not contiguous host memory was copied: write back.
        for cache, copy in written:
            if copy is not cache and not _same_memory(cache, copy):
                if is_torch(cache):
                    cache.copy_(copy)
                else:
                    cache[...] = copy
    o, lse = to_device(o, q), to_device(lse, q)
    return (o, lse) if return_softmax_lse else o


def _cache_quant(cache_dtype: Any) -> Optional[str]:
    """``"int8"``, ``"fp8"`` or ``None`` for a ``cache_dtype`` argument."""
    if cache_dtype is None:
        return None
    names = {"int8": "int8", "fp8": "fp8", "float8_e4m3fn": "fp8"}
    name = names.get(str(cache_dtype).replace("torch.", ""))
    if name is None:
        raise errors.UnknownName(  # type: ignore[attr-defined]
            f"unknown cache precision `{cache_dtype}` (expected int8, fp8)",
            what="cache precision",
            name=str(cache_dtype),
            expected="int8, fp8",
        )
    return name


def _check_codes(quant: str, caches, k_scales, v_scales, latent: bool = False) -> None:
    """The caches hold ``quant``'s codes; both scales are given, float32 (a
    latent cache's ``k_scales`` alone: its V reads them)."""
    allowed = {"int8": ("int8",), "fp8": ("uint8", "float8_e4m3fn")}[quant]
    for name, cache in caches:
        check_rank(cache, name, (4,))
        got = dtype_name(cache)
        if got not in allowed:
            raise errors.error(
                "DtypeMismatch",
                f"{name} has dtype {got}; cache_dtype {quant} needs {' or '.join(allowed)} codes",
                tensor=name,
                dtype=got,
                like="cache_dtype",
                expected=" or ".join(allowed),
            )
    if latent and v_scales is not None:
        raise errors.error(
            "LatentAppend",
            "a latent cache's V reads k_cache's codes at k_scales: there are no v_scales",
            reason="v_scales given for a latent cache",
        )
    scales_of = [("k_scales", k_scales)] + ([] if latent else [("v_scales", v_scales)])
    for name, scales in scales_of:
        if scales is None:
            raise errors.error(
                "Unsupported",
                f"a quantized cache needs {name}: its block scales (quantize_kv_cache makes them)",
                what="flash_attn_with_kvcache",
                feature=f"cache_dtype without {name}",
            )
        if dtype_name(scales) != "float32":
            raise errors.error(
                "UnsupportedDtype",
                f"{name} has dtype {dtype_name(scales)}, expected float32",
                tensor=name,
                dtype=dtype_name(scales),
                expected="float32",
            )


def quantize_kv_cache(k_cache, v_cache, cache_dtype, paged: bool = False):
    """A float KV cache quantized for ``flash_attn_with_kvcache(...,
    cache_dtype=...)``: ``(k_codes, v_codes, k_scales, v_scales)`` on the
    caches' kind (torch or numpy). Codes are int8 for ``"int8"`` and uint8
    (e4m3 bytes) for ``"fp8"``; each block's scale comes from its largest
    magnitude (a page with ``paged=True``, else 16 tokens of a row). A cache
    of zeros gives the smallest scale, 2⁻¹⁰⁰: an empty cache to append to.
    A latent cache (``v_cache=None``) gives ``(k_codes, None, k_scales,
    None)``: its V reads K's codes and scales."""
    quant = _cache_quant(cache_dtype)
    latent = v_cache is None
    _check_inputs([("k_cache", k_cache)] + ([] if latent else [("v_cache", v_cache)]), (4,))
    kc = host(k_cache)
    vc = None if latent else host(v_cache)
    pages, page = k_cache.shape[0], k_cache.shape[1]
    blocks = pages * (1 if paged else -(-page // min(16, page)))
    heads = k_cache.shape[2]
    if is_torch(kc):
        code = torch.int8 if quant == "int8" else torch.uint8
        make = lambda shape, dt: torch.empty(tuple(shape), dtype=dt)  # noqa: E731
        f32 = torch.float32
    else:
        code = np.int8 if quant == "int8" else np.uint8
        make = lambda shape, dt: np.empty(tuple(shape), dtype=dt)  # noqa: E731
        f32 = np.float32
    out = (
        make(kc.shape, code),
        None if latent else make(vc.shape, code),
        make((blocks, heads), f32),
        None if latent else make((blocks, heads), f32),
    )
    opt = lambda x, f: None if x is None else f(x)  # noqa: E731
    _native.quantize_kv_cache(
        raw(kc), opt(vc, raw), quant, paged, raw_codes(out[0]), opt(out[1], raw_codes), raw(out[2]),
        opt(out[3], raw),
    )  # fmt: skip
    return tuple(opt(x, lambda t: to_device(t, k_cache)) for x in out)


def _same_memory(a: Any, b: Any) -> bool:
    if is_torch(a):
        return a.device.type == "cpu" and a.is_contiguous() and a.data_ptr() == b.data_ptr()
    return a.flags.c_contiguous and a.ctypes.data == b.ctypes.data


def flash_attn_qkvpacked_func(qkv, *args, **kwargs):
    """``flash_attn_func`` on ``qkv`` of ``(batch, seqlen, 3, heads, head_dim)``
    (as ``flash_attn.flash_attn_qkvpacked_func``; gradients flow into ``qkv``)."""
    check_rank(qkv, "qkv", (5,))
    q, k, v = (qkv[:, :, i] for i in range(3))
    return flash_attn_func(q, k, v, *args, **kwargs)


def flash_attn_kvpacked_func(q, kv, *args, **kwargs):
    """``flash_attn_func`` with ``kv`` of ``(batch, seqlen_k, 2, heads_kv, head_dim)``."""
    check_rank(kv, "kv", (5,))
    return flash_attn_func(q, kv[:, :, 0], kv[:, :, 1], *args, **kwargs)


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, *args, **kwargs):
    """``flash_attn_varlen_func`` on ``qkv`` of ``(total, 3, heads, head_dim)``."""
    check_rank(qkv, "qkv", (4,))
    q, k, v = (qkv[:, i] for i in range(3))
    return flash_attn_varlen_func(
        q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, *args, **kwargs
    )


def flash_attn_varlen_kvpacked_func(
    q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *args, **kwargs
):
    """``flash_attn_varlen_func`` with ``kv`` of ``(total_k, 2, heads_kv, head_dim)``."""
    check_rank(kv, "kv", (4,))
    return flash_attn_varlen_func(
        q, kv[:, 0], kv[:, 1], cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
        *args, **kwargs,
    )  # fmt: skip
