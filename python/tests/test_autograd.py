"""Gradients: the engine's deterministic backward through autograd,
against the f64 reference and torch SDPA's autograd, bit-identical on a
repeated call; torch.compile(fullgraph=True) traces the custom ops."""

import numpy as np
import pytest
import torch

import flashattn
from flashattn import flash_attn_func, flash_attn_varlen_func, testing
from helpers import DTYPES, attention_f64, band_mask, options, qkv, sdpa


def _grads(fn, inputs, d_o):
    for t in inputs:
        t.grad = None
    fn(*inputs).backward(d_o)
    return [t.grad.clone() for t in inputs]


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("causal", [False, True])
def test_gradients_match_sdpa_autograd(backend, dtype, causal):
    q, k, v = qkv(2, 29, 41, 4, 2, 32, DTYPES[dtype], grad=True)
    d_o = torch.randn(2, 29, 4, 32).to(q.dtype)
    ours = _grads(lambda *x: flash_attn_func(*x, causal=causal, backend=backend), (q, k, v), d_o)
    mask = band_mask(29, 41, causal, -1, -1)
    theirs = _grads(lambda *x: sdpa(*x, mask), (q, k, v), d_o)
    opts = options(causal=causal)
    mine = testing.check_backward(q, k, v, d_o, *ours, None, opts)
    testing.assert_passed(mine, f"flashattn gradients {dtype}")
    # SDPA's gradients pass the same rule against the same reference, so the
    # two differ by at most the sum of their errors.
    sdpa_checks = testing.check_backward(q, k, v, d_o, *theirs, None, opts)
    testing.assert_passed(sdpa_checks, f"SDPA gradients {dtype}")
    for a, b, c, s in zip(ours, theirs, mine, sdpa_checks):
        diff = (a.double() - b.double()).abs().max().item()
        assert diff <= c.max_error + s.max_error + 1e-12, (c.name, diff)
    # Deterministic: a repeated call gives the same bits.
    again = _grads(lambda *x: flash_attn_func(*x, causal=causal, backend=backend), (q, k, v), d_o)
    for a, b in zip(ours, again):
        assert torch.equal(a, b)


def test_sinks_get_gradients(backend):
    q, k, v = qkv(1, 24, 24, 4, 2, 32, torch.float32, grad=True)
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0], requires_grad=True)
    d_o = torch.randn(1, 24, 4, 32)
    o = flash_attn_func(q, k, v, causal=True, sinks=sinks, backend=backend)
    o.backward(d_o)
    assert sinks.grad is not None and sinks.grad.shape == (4,)
    checks = testing.check_backward(
        q, k, v, d_o, q.grad, k.grad, v.grad, sinks.grad, options(causal=True, sinks=sinks)
    )
    assert [c.name for c in checks] == ["dq", "dk", "dv", "dsinks"]
    testing.assert_passed(checks, "gradients with sinks")


def test_varlen_gradients(backend):
    lens = [5, 0, 13]
    cu = torch.tensor(np.cumsum([0] + lens), dtype=torch.int32)
    q = torch.randn(18, 2, 16, requires_grad=True)
    k = torch.randn(18, 1, 16, requires_grad=True)
    v = torch.randn(18, 1, 16, requires_grad=True)
    d_o = torch.randn(18, 2, 16)
    o = flash_attn_varlen_func(q, k, v, cu, cu, 13, 13, causal=True, backend=backend)
    o.backward(d_o)
    opts = options(causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu)
    checks = testing.check_backward(q, k, v, d_o, q.grad, k.grad, v.grad, None, opts)
    testing.assert_passed(checks, "varlen gradients")


class Block(torch.nn.Module):
    def __init__(self, dim=32, heads=2):
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.out = torch.nn.Linear(dim, dim)

    def forward(self, x):
        b, s, dim = x.shape
        q, k, v = self.qkv(x).reshape(b, s, 3, self.heads, dim // self.heads).unbind(2)
        return self.out(flash_attn_func(q, k, v, causal=True, backend="cpu").reshape(b, s, dim))


def test_torch_compile_fullgraph_forward_and_backward():
    model = Block()
    x = torch.randn(2, 17, 32)
    eager = model(x)
    eager.sum().backward()
    eager_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    compiled = torch.compile(model, fullgraph=True)
    out = compiled(x)
    out.sum().backward()
    # The same custom ops run in both; inductor's own kernels for the
    # linear layers round differently, within torch's float32 tolerances.
    torch.testing.assert_close(out, eager)
    for p, g in zip(model.parameters(), eager_grads):
        torch.testing.assert_close(p.grad, g)


@pytest.mark.parametrize("dtype", ["f32", "f16"])
@pytest.mark.parametrize("causal", [False, True])
def test_dropout_forward_and_gradients_match_the_reference(backend, dtype, causal):
    q, k, v = qkv(2, 29, 41, 4, 2, 32, DTYPES[dtype], grad=True)
    d_o = torch.randn(2, 29, 4, 32).to(q.dtype)
    call = lambda *x: flash_attn_func(  # noqa: E731
        *x, dropout_p=0.2, dropout_seed=11, causal=causal, backend=backend, return_attn_probs=True
    )
    o, lse, _ = call(q, k, v)
    opts = options(causal=causal, dropout=(0.2, 11, 0))
    testing.assert_passed(testing.check_forward(q, k, v, o, lse, opts), f"dropout forward {dtype}")
    # The LSE is that of the undropped scores.
    _, plain_lse, _ = flash_attn_func(q, k, v, causal=causal, backend=backend, return_attn_probs=True)
    assert torch.equal(lse, plain_lse)
    grads = _grads(lambda *x: call(*x)[0], (q, k, v), d_o)
    checks = testing.check_backward(q, k, v, d_o, *grads, None, opts)
    testing.assert_passed(checks, f"dropout gradients {dtype}")
    again = _grads(lambda *x: call(*x)[0], (q, k, v), d_o)
    for a, b in zip(grads, again):
        assert torch.equal(a, b)


def test_dropout_seeds_come_from_torch_generator():
    q, k, v = qkv(1, 16, 16, 2, 2, 16, torch.float32)
    run = lambda: flash_attn_func(q, k, v, dropout_p=0.5, backend="cpu")  # noqa: E731
    torch.manual_seed(5)
    first = run()
    second = run()  # the generator moved on: another mask
    torch.manual_seed(5)
    assert torch.equal(run(), first)
    assert not torch.equal(first, second)
    # p = 0 is no dropout, bit for bit.
    assert torch.equal(
        flash_attn_func(q, k, v, dropout_p=0.0, backend="cpu"), flash_attn_func(q, k, v, backend="cpu")
    )


def _loss_grads(q, k, v, o, lse, d_o, d_lse, extra=()):
    """Gradients of ``<d_o, o> + <d_lse, lse>`` (lse's empty rows, -inf,
    left out) for q, k, v and ``extra``."""
    finite = torch.isfinite(lse)
    loss = (o.double() * d_o.double()).sum() + (
        torch.where(finite, lse.double(), 0.0) * d_lse.double()
    ).sum()
    return torch.autograd.grad(loss, (q, k, v, *extra), retain_graph=True)


def _close(ours, ref, rel, what):
    for name, a, r in zip(("dq", "dk", "dv", "dsinks"), ours, ref):
        err = (a.double() - r).abs().max().item()
        bound = rel * max(1.0, r.abs().max().item())
        assert err <= bound, f"{what} {name}: max |error| {err} > {bound}"


@pytest.mark.parametrize(
    "dtype,causal,sq,sk,window",
    [
        ("f32", True, 9, 13, (-1, -1)),
        ("f32", True, 11, 4, (-1, -1)),  # sq > sk: rows with no key (lse -inf)
        ("f32", False, 10, 10, (2, 1)),
        ("bf16", True, 9, 13, (-1, -1)),
    ],
)
def test_softmax_lse_gets_its_gradient(backend, dtype, causal, sq, sk, window):
    # return_attn_probs returns softmax_lse as a differentiable output (ring
    # attention merges partial results through it): a loss that reads it
    # gets d lse_i / d s_ij = P_ij, not silently nothing.
    q, k, v = qkv(2, sq, sk, 4, 2, 16, DTYPES[dtype], grad=True)
    o, lse, _ = flash_attn_func(
        q, k, v, causal=causal, window_size=window, return_attn_probs=True, backend=backend
    )
    d_o, d_lse = torch.randn(o.shape), torch.randn(lse.shape)
    ours = _loss_grads(q, k, v, o, lse, d_o, d_lse)
    ref_in = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ro, rl = attention_f64(*ref_in, causal=causal, window=window)
    ref = _loss_grads(*ref_in, ro, rl, d_o, d_lse)
    _close(ours, ref, 1e-4 if dtype == "f32" else 3e-2, f"{dtype} causal={causal}")
    # The lse alone: dv is zero, dq and dk are not.
    ours = _loss_grads(q, k, v, o, lse, torch.zeros(o.shape), d_lse)
    ref = _loss_grads(*ref_in, ro, rl, torch.zeros(o.shape), d_lse)
    assert ours[0].abs().max() > 0 and ours[2].abs().max() == 0
    _close(ours, ref, 1e-4 if dtype == "f32" else 3e-2, f"{dtype} lse alone")


def test_softmax_lse_gradient_with_sinks_varlen_and_dropout(backend):
    # Sinks: d lse / d sink = exp(sink - lse).
    q, k, v = qkv(1, 12, 12, 4, 2, 16, torch.float32, grad=True)
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0], requires_grad=True)
    o, lse, _ = flash_attn_func(q, k, v, causal=True, sinks=sinks, return_attn_probs=True, backend=backend)
    d_o, d_lse = torch.randn(o.shape), torch.randn(lse.shape)
    ours = _loss_grads(q, k, v, o, lse, d_o, d_lse, (sinks,))
    ref_in = [t.detach().double().requires_grad_() for t in (q, k, v, sinks)]
    ro, rl = attention_f64(*ref_in[:3], causal=True, sinks=ref_in[3])
    ref = _loss_grads(*ref_in[:3], ro, rl, d_o, d_lse, ref_in[3:])
    _close(ours, ref, 1e-4, "sinks")
    # Packed sequences: lse is (heads, total).
    lens = [5, 0, 7]
    cu = torch.tensor(np.cumsum([0] + lens), dtype=torch.int32)
    qp, kp, vp = (t.detach()[0].requires_grad_() for t in (q, k, v))
    o, lse, _ = flash_attn_varlen_func(qp, kp, vp, cu, cu, 7, 7, causal=True, return_attn_probs=True, backend=backend)
    d_o, d_lse = torch.randn(o.shape), torch.randn(lse.shape)
    ours = _loss_grads(qp, kp, vp, o, lse, d_o, d_lse)
    ref_in = [t.detach().double().requires_grad_() for t in (qp, kp, vp)]
    loss = 0.0
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        if b > a:
            ro, rl = attention_f64(*(t[a:b][None] for t in ref_in), causal=True)
            loss = loss + (ro[0] * d_o[a:b].double()).sum() + (rl[0] * d_lse[:, a:b].double()).sum()
    ref = torch.autograd.grad(loss, ref_in)
    _close(ours, ref, 1e-4, "varlen")
    # Dropout: lse is that of the undropped scores, so its gradient is too.
    o, lse, _ = flash_attn_func(
        q, k, v, dropout_p=0.3, dropout_seed=3, return_attn_probs=True, backend=backend
    )
    ours = _loss_grads(q, k, v, o, lse, torch.zeros(o.shape), d_lse := torch.randn(lse.shape))
    ref_in = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ro, rl = attention_f64(*ref_in)
    ref = _loss_grads(*ref_in, ro, rl, torch.zeros(o.shape), d_lse)
    _close(ours, ref, 1e-4, "dropout, lse alone")


def test_double_backward_raises_a_clear_error():
    q, k, v = qkv(1, 6, 6, 2, 1, 8, torch.float32, grad=True)
    o = flash_attn_func(q, k, v, causal=True, backend="cpu")
    (dq,) = torch.autograd.grad(o.sum(), q, create_graph=True)
    with pytest.raises(flashattn.Unsupported, match="double backward"):
        dq.sum().backward()


@pytest.mark.parametrize(
    "kw",
    [
        dict(causal=True),
        dict(window_size=(2, 1), softcap=1.5),
        dict(alibi_slopes=torch.tensor([0.3, 0.1, 0.2, 0.05]), causal=True),
    ],
    ids=["causal", "window_softcap", "alibi"],
)
def test_gradients_match_finite_differences(kw):
    # gradcheck's idea in float32: the directional derivative of
    # <w, o> + <u, lse> along random directions, by central differences,
    # against the analytic gradients (sq > sk: rows with no key included).
    q, k, v = qkv(1, 7, 5, 4, 2, 8, torch.float32, grad=True)
    o, lse, _ = flash_attn_func(q, k, v, return_attn_probs=True, backend="cpu", **kw)
    w, u = torch.randn(o.shape), torch.randn(lse.shape)
    finite = torch.isfinite(lse)

    def f(*x):
        o, lse, _ = flash_attn_func(*x, return_attn_probs=True, backend="cpu", **kw)
        return float((o.double() * w).sum() + torch.where(finite, lse.double(), 0.0).mul(u).sum())

    loss = (o * w).sum() + torch.where(finite, lse, 0.0).mul(u).sum()
    grads = torch.autograd.grad(loss, (q, k, v))
    eps = 1e-2
    for _ in range(3):
        dirs = [torch.randn(t.shape) for t in (q, k, v)]
        with torch.no_grad():
            plus = f(*(t + eps * d for t, d in zip((q, k, v), dirs)))
            minus = f(*(t - eps * d for t, d in zip((q, k, v), dirs)))
        numeric = (plus - minus) / (2 * eps)
        analytic = sum(float((g.double() * d).sum()) for g, d in zip(grads, dirs))
        assert abs(numeric - analytic) <= 2e-3 * max(1.0, abs(analytic)), (numeric, analytic)


def test_softmax_lse_gradient_at_the_largest_head_dim_says_why():
    q = torch.randn(1, 3, 1, 16, requires_grad=True)
    v = torch.randn(1, 3, 1, flashattn.max_head_dim())
    o, lse, _ = flash_attn_func(q, q.detach(), v, return_attn_probs=True, backend="cpu")
    o.sum().backward(retain_graph=True)  # without lse's gradient: the usual backward
    with pytest.raises(flashattn.Unsupported, match="softmax_lse"):
        torch.autograd.grad(lse.sum(), q)
