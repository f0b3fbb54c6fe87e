"""Context parallelism on ``torch.distributed``: ring attention and its
zigzag variant, built on :mod:`flashattn.partial`.

Every rank of a process group holds a slice of one long sequence (q, k and
v of one length). Its K/V shard travels the ring (rank ``r`` sends to
``r + 1``) while each rank attends its queries to the shard it holds, with
the masks of the whole sequence (:func:`~flashattn.partial.forward_partial`
at global positions); the partial results merge exactly by their LSE in
float32. The next shard is sent while the current one is computed. In the
backward, each shard's dK/dV accumulator (float32) travels with it and
ends at its owner; dQ accumulates locally in float32.

``ring_flash_attn_func``: rank ``r`` holds the ``r``-th contiguous slice
(ring-flash-attn's convention; slices may have different lengths).
``zigzag_ring_flash_attn_func``: the sequence is cut into ``2 * world``
chunks and rank ``r`` holds chunks ``r`` and ``2 * world - 1 - r``
concatenated, which balances causal work. A rank of local length ``L``
holds a first chunk of ``ceil(L / 2)`` and a second of ``floor(L / 2)``
(:func:`zigzag_shard` cuts a global tensor that way).

The group's backend carries the tensors: gloo CPU tensors, NCCL CUDA
tensors (what to run on NVIDIA machines). Before any ring communication the
ranks exchange a small int64 record of their shapes, dtypes and options; a
disagreement raises :class:`RankMismatch` on every rank instead of hanging.
"""

from __future__ import annotations

import math
import time
import zlib
from dataclasses import dataclass, field
from typing import Any, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from . import errors
from .functional import default_backend
from .partial import backward_partial, forward_partial, merge_partials

#: The tile the work counts are in: ``TILE`` query rows by ``TILE`` keys.
TILE = 16


class RankMismatch(errors.InputError):
    """The ranks of one ring call disagree (shapes other than the local
    sequence length, dtypes, options, group size) or one rank's input is
    malformed; raised on every rank. Fields: ``what`` (the field),
    ``rank`` (the first rank that differs), ``value`` (its value),
    ``expected`` (rank 0's), ``values`` (every rank's)."""


@dataclass
class RingStats:
    """What one call did on this rank, filled when passed as ``stats=``.

    ``tiles_forward``/``tiles_backward``: computed 16x16 tiles (a tile of a
    partial call with at least one allowed (row, key) pair; shard pairs
    that are fully masked are skipped and cost nothing). ``calls_*``: the
    partial calls made. ``bytes_forward``/``bytes_backward``: bytes this
    rank sent at each ring step. ``wait_forward``/``wait_backward``:
    seconds blocked in ``wait()`` on the communication requests.
    """

    tiles_forward: int = 0
    tiles_backward: int = 0
    calls_forward: int = 0
    calls_backward: int = 0
    bytes_forward: List[int] = field(default_factory=list)
    bytes_backward: List[int] = field(default_factory=list)
    wait_forward: float = 0.0
    wait_backward: float = 0.0


def count_tiles(q_offset, q_len, k_offset, k_len, causal, window_size, tile=TILE) -> int:
    """Tiles of a ``q_len x k_len`` partial call at global positions with at
    least one allowed pair: key ``j`` is allowed for row ``i`` iff
    ``i - left <= j <= i + right`` (causal: ``right = 0``; -1: unbounded)."""
    left, right = window_size
    if causal:
        right = 0 if right < 0 else min(right, 0)
    total = 0
    for t0 in range(0, q_len, tile):
        a = q_offset + t0
        b = q_offset + min(t0 + tile, q_len) - 1  # last row of the tile
        lo = -math.inf if left < 0 else a - left
        hi = math.inf if right < 0 else b + right
        lo = max(lo, k_offset) - k_offset  # the band's keys, local to the call
        hi = min(hi, k_offset + k_len - 1) - k_offset
        if hi >= lo:
            total += int(hi) // tile - int(lo) // tile + 1
    return total


# ---------------------------------------------------------------- layouts


def _ring_segments(lengths: Sequence[int]) -> List[List[Tuple[int, int]]]:
    starts = [sum(lengths[:r]) for r in range(len(lengths))]
    return [[(s, n)] for s, n in zip(starts, lengths)]


def _zigzag_chunks(lengths: Sequence[int]) -> List[int]:
    world = len(lengths)
    sizes = [0] * (2 * world)
    for r, n in enumerate(lengths):
        sizes[r], sizes[2 * world - 1 - r] = (n + 1) // 2, n // 2
    return sizes


def _zigzag_segments(lengths: Sequence[int]) -> List[List[Tuple[int, int]]]:
    world = len(lengths)
    sizes = _zigzag_chunks(lengths)
    starts = [sum(sizes[:c]) for c in range(2 * world)]
    return [
        [(starts[r], sizes[r]), (starts[2 * world - 1 - r], sizes[2 * world - 1 - r])]
        for r in range(world)
    ]


def _split_lengths(seqlen: int, world: int) -> List[int]:
    return [seqlen // world + (r < seqlen % world) for r in range(world)]


def ring_shard(x, rank: int, world: int, dim: int = 1):
    """Rank ``rank``'s contiguous slice of a global tensor (the first
    ``seqlen % world`` ranks get one more position)."""
    [(start, n)] = _ring_segments(_split_lengths(x.shape[dim], world))[rank]
    return x.narrow(dim, start, n)


def zigzag_shard(x, rank: int, world: int, dim: int = 1):
    """Rank ``rank``'s zigzag slice of a global tensor: chunks ``rank`` and
    ``2 * world - 1 - rank`` concatenated (local lengths as
    :func:`ring_shard`'s, each cut ``ceil(L/2)``, ``floor(L/2)``)."""
    segs = _zigzag_segments(_split_lengths(x.shape[dim], world))[rank]
    return torch.cat([x.narrow(dim, s, n) for s, n in segs], dim=dim)


def unshard(parts: Sequence[Any], zigzag: bool, dim: int = 1):
    """The global tensor from every rank's local slice (in rank order)."""
    lengths = [p.shape[dim] for p in parts]
    if not zigzag:
        return torch.cat(list(parts), dim=dim)
    world = len(parts)
    pieces = [None] * (2 * world)
    for r, p in enumerate(parts):
        first = (lengths[r] + 1) // 2
        pieces[r] = p.narrow(dim, 0, first)
        pieces[2 * world - 1 - r] = p.narrow(dim, first, lengths[r] - first)
    return torch.cat(pieces, dim=dim)


# --------------------------------------------------------- agreement check

_DTYPES = {torch.float32: 1, torch.float16: 2, torch.bfloat16: 3}
_FIELDS = (
    "version", "kind", "world", "rank", "batch", "heads_q", "heads_kv", "head_dim",
    "head_dim_v", "dtype", "options_hash", "requires_grad", "device_type", "seqlen_q",
    "seqlen_k", "seqlen_v", "local_error",
)  # fmt: skip
_PER_RANK = {"rank", "seqlen_q", "seqlen_k", "seqlen_v", "local_error"}
_LOCAL_ERRORS = {
    1: "q, k and v must be 4-D (batch, seqlen, heads, head_dim)",
    2: "q, k and v must share batch, k and v their heads",
    3: "q, k and v of one rank must have one local seqlen (self-attention over one sequence)",
    4: "q, k and v must be float32, float16 or bfloat16, and share one dtype",
    5: "q, k and v must be torch tensors",
    6: "window_size must be a pair of ints and softmax_scale a number or None",
}


def _crc(text: str) -> int:
    return zlib.crc32(text.encode())


def _metadata(kind, q, k, v, opts_repr, rank, world, needs_grad) -> List[int]:
    if not all(isinstance(t, torch.Tensor) for t in (q, k, v)):
        # Not tensors on this rank only: still a record, so every rank raises.
        return [1, kind, world, rank] + [-1] * (len(_FIELDS) - 5) + [5]
    local_error = 0
    if not all(t.dim() == 4 for t in (q, k, v)):
        local_error = 1
    elif q.shape[0] != k.shape[0] or k.shape[0] != v.shape[0] or k.shape[2] != v.shape[2]:
        local_error = 2
    elif not (q.shape[1] == k.shape[1] == v.shape[1]):
        local_error = 3
    elif q.dtype not in _DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        local_error = 4
    elif opts_repr is None:
        local_error = 6
    shape = lambda t, i: int(t.shape[i]) if t.dim() > i else -1  # noqa: E731
    return [
        1, kind, world, rank, shape(q, 0), shape(q, 2), shape(k, 2), shape(q, 3), shape(v, 3),
        _DTYPES.get(q.dtype, 0), _crc(opts_repr or ""), int(needs_grad), _crc(q.device.type),
        shape(q, 1), shape(k, 1), shape(v, 1), local_error,
    ]  # fmt: skip


def _agree(mine: List[int], group, comm_device) -> List[List[int]]:
    """Every rank's record; raises :class:`RankMismatch` on every rank when
    they disagree (they all see the same records, so all raise)."""
    world = dist.get_world_size(group)
    local = torch.tensor(mine, dtype=torch.int64, device=comm_device)
    gathered = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(gathered, local, group=group)
    rows = [g.tolist() for g in gathered]
    # A rank's malformed input first: the fields it then differs in follow from it.
    order = sorted(range(len(_FIELDS)), key=lambda i: _FIELDS[i] != "local_error")
    for i in order:
        name = _FIELDS[i]
        values = [row[i] for row in rows]
        if name == "local_error":
            bad = next((r for r, e in enumerate(values) if e), None)
            if bad is not None:
                raise RankMismatch(
                    f"rank {bad}: {_LOCAL_ERRORS[values[bad]]}",
                    what=name, rank=bad, value=values[bad], expected=0, values=values,
                )  # fmt: skip
        elif name == "rank":
            if values != list(range(world)):
                raise RankMismatch(
                    f"ranks are {values}, expected 0..{world - 1}",
                    what=name, rank=0, value=values, expected=list(range(world)), values=values,
                )  # fmt: skip
        elif name not in _PER_RANK:
            bad = next((r for r, x in enumerate(values) if x != values[0]), None)
            if bad is not None:
                raise RankMismatch(
                    f"ranks disagree on {name}: rank {bad} has {values[bad]}, rank 0 "
                    f"{values[0]} (every rank: {values})",
                    what=name, rank=bad, value=values[bad], expected=values[0], values=values,
                )  # fmt: skip
    return rows


# ------------------------------------------------------------------ ring


class _Ring:
    """Point-to-point traffic to the next rank and from the previous one,
    timing the waits."""

    def __init__(self, group, comm_device):
        self.group = group
        self.device = comm_device
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        # P2POp's peer is a global rank.
        peer = lambda r: r if group is None else dist.get_global_rank(group, r)  # noqa: E731
        self.next = peer((self.rank + 1) % self.world)
        self.prev = peer((self.rank - 1) % self.world)
        self.waited = 0.0

    def exchange(self, send: Sequence[torch.Tensor], recv_shapes, dtype, tag: int):
        """Post sends of ``send`` and receives of ``recv_shapes``; returns
        ``(requests, received buffers, bytes sent)``. Empty tensors travel
        as nothing (both sides know the sizes)."""
        ops, bufs, sent = [], [], 0
        for i, t in enumerate(send):
            if t.numel():
                ops.append(dist.P2POp(dist.isend, t.contiguous(), self.next, self.group, tag + i))
                sent += t.numel() * t.element_size()
        for i, shape in enumerate(recv_shapes):
            b = torch.empty(shape, dtype=dtype, device=self.device)
            if b.numel():
                ops.append(dist.P2POp(dist.irecv, b, self.prev, self.group, tag + i))
            bufs.append(b)
        reqs = dist.batch_isend_irecv(ops) if ops else []
        return reqs, bufs, sent

    def wait(self, reqs):
        t0 = time.perf_counter()
        for r in reqs:
            r.wait()
        self.waited += time.perf_counter() - t0


_KV_TAG, _DKV_TAG = 100, 200


def _opts_repr(kind, causal, window_size, softmax_scale) -> Optional[str]:
    """The options as text to hash; ``None`` where they are malformed (a
    local error, raised on every rank after the agreement)."""
    try:
        scale = None if softmax_scale is None else float(softmax_scale).hex()
        return repr((kind, bool(causal), int(window_size[0]), int(window_size[1]), scale))
    except (TypeError, ValueError, IndexError):
        return None


def _comm_device(group, like: torch.Tensor) -> torch.device:
    if dist.get_backend(group) == "nccl":
        device = getattr(like, "device", None)
        return device if device is not None and device.type == "cuda" else torch.device("cuda")
    return torch.device("cpu")


def _forward(kind, q, k, v, causal, window_size, softmax_scale, group, backend, needs_grad, stats):
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    comm = _comm_device(group, q)
    rows = _agree(
        _metadata(
            kind, q, k, v, _opts_repr(kind, causal, window_size, softmax_scale), rank, world,
            needs_grad,
        ),
        group, comm,
    )  # fmt: skip
    lengths = [row[_FIELDS.index("seqlen_q")] for row in rows]
    segments = (_zigzag_segments if kind == 2 else _ring_segments)(lengths)
    ring = _Ring(group, comm)
    b, _, hkv, d = k.shape
    dv = v.shape[-1]
    kv_shape = lambda r, dim: (b, lengths[r], hkv, dim)  # noqa: E731
    kw = dict(causal=causal, window_size=window_size, softmax_scale=softmax_scale, backend=backend)
    if q.shape[1] == 0:
        # A rank without positions makes no partial call, so the engine never
        # checks its problem, while every other rank raises at its first call
        # (the diagonal's, at step 0) and leaves the ring: check it on one
        # row, so that this rank raises the same error instead of waiting.
        one = lambda t: t.new_zeros((t.shape[0], 1) + tuple(t.shape[2:]))  # noqa: E731
        forward_partial(one(q), one(k), one(v), 0, 0, **kw)
    my_segs = segments[rank]
    q_starts = [sum(n for _, n in my_segs[:i]) for i in range(len(my_segs))]
    parts: List[List[Tuple[Any, Any]]] = [[] for _ in my_segs]
    cur_k, cur_v = k.to(comm), v.to(comm)
    for step in range(world):
        src = (rank - step) % world
        reqs, bufs = [], None
        if step < world - 1:
            nxt = (src - 1) % world
            reqs, bufs, sent = ring.exchange(
                [cur_k, cur_v], [kv_shape(nxt, d), kv_shape(nxt, dv)], k.dtype, _KV_TAG
            )
            if stats is not None:
                stats.bytes_forward.append(sent)
        k_starts = [sum(n for _, n in segments[src][:i]) for i in range(len(segments[src]))]
        for (qo, qn), qs, out in zip(my_segs, q_starts, parts):
            for (ko, kn), ks in zip(segments[src], k_starts):
                tiles = count_tiles(qo, qn, ko, kn, causal, window_size) if qn and kn else 0
                if not tiles:
                    continue
                o_p, lse_p = forward_partial(
                    q.narrow(1, qs, qn),
                    cur_k.narrow(1, ks, kn).to(q.device),
                    cur_v.narrow(1, ks, kn).to(q.device),
                    qo, ko, **kw,
                )  # fmt: skip
                out.append((o_p, lse_p))
                if stats is not None:
                    stats.tiles_forward += tiles
                    stats.calls_forward += 1
        if reqs or bufs is not None:
            ring.wait(reqs)
            cur_k, cur_v = bufs
    if stats is not None:
        stats.wait_forward += ring.waited
    outs, lses = [], []
    hq = q.shape[2]
    for (_, qn), out in zip(my_segs, parts):
        if out:
            o_s, lse_s = merge_partials(out)
        else:  # an empty segment, or rows that see no key at all
            o_s = torch.zeros(b, qn, hq, dv, dtype=torch.float32, device=q.device)
            lse_s = torch.full((b, hq, qn), float("-inf"), dtype=torch.float32, device=q.device)
        outs.append(o_s)
        lses.append(lse_s)
    o = torch.cat(outs, dim=1).to(q.dtype)
    lse = torch.cat(lses, dim=2)
    return o, lse, (lengths, segments, comm, kw)


def _backward(d_o, d_lse, q, k, v, o, lse, rank, world, lengths, segments, comm, kw, group, stats):
    ring = _Ring(group, comm) if world > 1 else None
    b, _, hkv, d = k.shape
    dv_dim = v.shape[-1]
    my_segs = segments[rank]
    q_starts = [sum(n for _, n in my_segs[:i]) for i in range(len(my_segs))]
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    d_o = d_o.contiguous()
    cur_k, cur_v = k.to(comm), v.to(comm)
    acc_reqs, acc_bufs = [], None
    for step in range(world):
        src = (rank - step) % world
        kv_reqs, kv_bufs = [], None
        if step < world - 1:
            nxt = (src - 1) % world
            kv_reqs, kv_bufs, sent = ring.exchange(
                [cur_k, cur_v], [(b, lengths[nxt], hkv, d), (b, lengths[nxt], hkv, dv_dim)],
                k.dtype, _KV_TAG,
            )  # fmt: skip
        else:
            sent = 0
        dk_part = torch.zeros(b, lengths[src], hkv, d, dtype=torch.float32, device=q.device)
        dv_part = torch.zeros(b, lengths[src], hkv, dv_dim, dtype=torch.float32, device=q.device)
        k_starts = [sum(n for _, n in segments[src][:i]) for i in range(len(segments[src]))]
        for (qo, qn), qs in zip(my_segs, q_starts):
            for (ko, kn), ks in zip(segments[src], k_starts):
                band = (kw["causal"], kw["window_size"])
                tiles = count_tiles(qo, qn, ko, kn, *band) if qn and kn else 0
                if not tiles:
                    continue
                dq_p, dk_p, dv_p = backward_partial(
                    d_o.narrow(1, qs, qn), q.narrow(1, qs, qn),
                    cur_k.narrow(1, ks, kn).to(q.device), cur_v.narrow(1, ks, kn).to(q.device),
                    o.narrow(1, qs, qn), lse.narrow(2, qs, qn), qo, ko, **kw,
                    d_lse=None if d_lse is None else d_lse.narrow(2, qs, qn),
                )  # fmt: skip
                dq.narrow(1, qs, qn).add_(dq_p.float())
                dk_part.narrow(1, ks, kn).add_(dk_p.float())
                dv_part.narrow(1, ks, kn).add_(dv_p.float())
                if stats is not None:
                    stats.tiles_backward += tiles
                    stats.calls_backward += 1
        # The accumulator of the shard held now arrived (from the previous
        # rank's step) while this step computed; add and pass it on.
        if acc_bufs is not None:
            ring.wait(acc_reqs)
            dk_part += acc_bufs[0].to(q.device)
            dv_part += acc_bufs[1].to(q.device)
        if world == 1:
            return dq.to(q.dtype), dk_part.to(k.dtype), dv_part.to(v.dtype)
        nxt = (src - 1) % world
        acc_reqs, acc_bufs, acc_sent = ring.exchange(
            [dk_part.to(comm), dv_part.to(comm)],
            [(b, lengths[nxt], hkv, d), (b, lengths[nxt], hkv, dv_dim)],
            torch.float32, _DKV_TAG,
        )  # fmt: skip
        if stats is not None:
            stats.bytes_backward.append(sent + acc_sent)
        if kv_bufs is not None:
            ring.wait(kv_reqs)
            cur_k, cur_v = kv_bufs
    ring.wait(acc_reqs)  # this rank's own dK/dV, home after a full turn
    dk, dv = acc_bufs
    if stats is not None:
        stats.wait_backward += ring.waited
    return dq.to(q.dtype), dk.to(k.device, k.dtype), dv.to(v.device, v.dtype)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, q, k, v, kind, causal, window_size, softmax_scale, group, backend, grad, stats
    ):
        o, lse, plan = _forward(
            kind, q, k, v, causal, window_size, softmax_scale, group, backend, grad, stats
        )
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.plan, ctx.group, ctx.stats = plan, group, stats
        return o, lse

    @staticmethod
    def backward(ctx, d_o, d_lse):
        q, k, v, o, lse = ctx.saved_tensors
        lengths, segments, comm, kw = ctx.plan
        group = ctx.group
        if d_o is None:
            d_o = torch.zeros_like(o)
        # The lse's gradient (return_lse) joins each pair's backward where it
        # is nonzero on this rank: no collective depends on it.
        dq, dk, dv = _backward(
            d_o.to(q.dtype), d_lse, q, k, v, o, lse, dist.get_rank(group), dist.get_world_size(group),
            lengths, segments, comm, kw, group, ctx.stats,
        )  # fmt: skip
        return dq, dk, dv, None, None, None, None, None, None, None, None


def _call(kind, q, k, v, causal, window_size, softmax_scale, group, backend, return_lse, stats):
    if not dist.is_initialized():
        raise errors.error(
            "Unsupported",
            "ring attention needs torch.distributed initialised (dist.init_process_group)",
            what="flashattn.distributed",
            feature="ring attention without a process group",
        )
    backend = backend or default_backend()
    if _opts_repr(kind, causal, window_size, softmax_scale) is not None:
        window_size = (int(window_size[0]), int(window_size[1]))
    # Inside the Function's forward grad mode is off: decide here whether a
    # backward (collective over the ring) will follow, so that ranks agree.
    grad = torch.is_grad_enabled() and any(
        getattr(t, "requires_grad", False) for t in (q, k, v)
    )
    o, lse = _RingAttention.apply(
        q, k, v, kind, bool(causal), window_size, softmax_scale, group, backend, grad, stats
    )
    return (o, lse) if return_lse else o


def ring_flash_attn_func(
    q,
    k,
    v,
    causal: bool = False,
    window_size: Tuple[int, int] = (-1, -1),
    softmax_scale: Optional[float] = None,
    group=None,
    backend: Optional[str] = None,
    *,
    return_lse: bool = False,
    stats: Optional[RingStats] = None,
):
    """Attention over a sequence cut into contiguous slices, rank ``r`` of
    ``group`` holding the ``r``-th (any lengths, each rank's q, k and v of
    one length). ``q`` is ``(batch, local_seqlen, heads_q, head_dim)``,
    ``k``/``v`` ``(batch, local_seqlen, heads_kv, head_dim)``. Returns the
    local slice of the global output (and its ``lse``, ``(batch, heads_q,
    local_seqlen)`` float32, with ``return_lse``); gradients are the local
    slices of the global gradients. ``stats``: a :class:`RingStats` to
    fill."""
    return _call(1, q, k, v, causal, window_size, softmax_scale, group, backend, return_lse, stats)


def zigzag_ring_flash_attn_func(
    q,
    k,
    v,
    causal: bool = False,
    window_size: Tuple[int, int] = (-1, -1),
    softmax_scale: Optional[float] = None,
    group=None,
    backend: Optional[str] = None,
    *,
    return_lse: bool = False,
    stats: Optional[RingStats] = None,
):
    """As :func:`ring_flash_attn_func`, rank ``r`` holding chunks ``r`` and
    ``2 * world - 1 - r`` of the sequence cut into ``2 * world``, the first
    ``ceil(L / 2)`` positions of its local length ``L`` being chunk ``r``
    (:func:`zigzag_shard`). Under a causal mask every rank then computes
    about the same number of tiles."""
    return _call(2, q, k, v, causal, window_size, softmax_scale, group, backend, return_lse, stats)


__all__ = [
    "RankMismatch",
    "RingStats",
    "TILE",
    "count_tiles",
    "ring_flash_attn_func",
    "ring_shard",
    "unshard",
    "zigzag_ring_flash_attn_func",
    "zigzag_shard",
]
