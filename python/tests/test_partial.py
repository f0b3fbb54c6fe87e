"""flashattn.partial: shards through causal diagonals and windows, merged
by LSE, are the attention of the whole sequence; shard pairs' gradients
given the whole o and lse sum to its gradients (f64 reference of the whole
problem, docs/semantics.md's accuracy rule)."""

import numpy as np
import pytest
import torch

import flashattn
from flashattn import testing
from flashattn.partial import backward_partial, forward_partial, merge_partials
from helpers import options

MASKS = {
    "causal": dict(causal=True),
    "window": dict(window_size=(6, 2)),
    "causal_alibi": dict(causal=True, alibi_slopes=torch.tensor([0.5, 0.25, 0.125, 0.0625])),
}
CUTS = [0, 11, 26, 37]


def _shards():
    return [(a, b) for a, b in zip(CUTS, CUTS[1:])]


@pytest.mark.parametrize("mask", MASKS)
def test_shards_merge_into_the_whole_sequence(backend, mask):
    kw = MASKS[mask]
    q = torch.randn(2, 37, 4, 16)
    k = torch.randn(2, 37, 2, 16)
    v = torch.randn(2, 37, 2, 16)
    d_o = torch.randn(2, 37, 4, 16)
    o = torch.empty_like(q)
    lse = torch.empty(2, 4, 37)
    for qa, qb in _shards():
        parts = [
            forward_partial(q[:, qa:qb], k[:, ka:kb], v[:, ka:kb], qa, ka, backend=backend, **kw)
            for ka, kb in _shards()
        ]
        o[:, qa:qb], lse[:, :, qa:qb] = merge_partials(parts)
    opts = options(**kw)
    testing.assert_passed(testing.check_forward(q, k, v, o, lse, opts), f"merged {mask}")
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for qa, qb in _shards():
        for ka, kb in _shards():
            gq, gk, gv = backward_partial(
                d_o[:, qa:qb], q[:, qa:qb], k[:, ka:kb], v[:, ka:kb], o[:, qa:qb],
                lse[:, :, qa:qb].contiguous(), qa, ka, backend=backend, **kw,
            )  # fmt: skip
            dq[:, qa:qb] += gq
            dk[:, ka:kb] += gk
            dv[:, ka:kb] += gv
    checks = testing.check_backward(q, k, v, d_o, dq, dk, dv, None, opts)
    testing.assert_passed(checks, f"summed shard gradients {mask}")


def test_merge_of_empty_rows_and_numpy():
    o1 = np.random.randn(1, 3, 2, 4).astype(np.float32)
    lse1 = np.array([[[0.5, -np.inf, 1.0], [2.0, -np.inf, 0.0]]], dtype=np.float32)
    o2 = np.random.randn(1, 3, 2, 4).astype(np.float32)
    lse2 = np.array([[[-np.inf, -np.inf, 1.0], [0.0, -np.inf, 3.0]]], dtype=np.float32)
    o, lse = merge_partials([(o1, lse1), (o2, lse2)])
    assert np.all(o[0, 1] == 0) and np.all(lse[0, :, 1] == -np.inf)
    np.testing.assert_array_equal(o[0, 0, 0], o1[0, 0, 0])  # the only part with keys
    assert lse[0, 0, 2] == pytest.approx(1.0 + np.log(2.0))
    ot, lset = merge_partials([(torch.from_numpy(o1), torch.from_numpy(lse1)),
                               (torch.from_numpy(o2), torch.from_numpy(lse2))])  # fmt: skip
    np.testing.assert_allclose(ot.numpy(), o, rtol=1e-6)
    np.testing.assert_array_equal(lset.numpy(), lse)


def test_negative_and_huge_positions_raise():
    x = torch.randn(1, 4, 2, 8)
    with pytest.raises(flashattn.NegativeIndex) as e:
        forward_partial(x, x, x, -1, 0, backend="cpu")
    assert (e.value.tensor, e.value.value) == ("q_offset", -1)
    with pytest.raises(flashattn.PositionTooLarge) as e:
        forward_partial(x, x, x, 0, 1 << 40, backend="cpu")
    assert (e.value.which, e.value.position) == ("k_offset", 1 << 40)
