"""flashattn.integrations.flash_attn_interface: flash-attn's low-level
functions (signatures, return values, writes into the caller's buffers)
against the f64 reference, dense and packed, with dropout carried by
rng_state; and install() making ``flash_attn.flash_attn_interface``
importable without making Transformers believe flash-attn is installed."""

import subprocess
import sys
import textwrap

import pytest
import torch

from flashattn import errors, testing
from flashattn.integrations import flash_attn_interface as fi
from helpers import DTYPES, options, qkv


@pytest.fixture
def engine(backend, monkeypatch):
    """The interface takes no backend argument: it runs on the default one."""
    monkeypatch.setenv("FLASHATTN_BACKEND", backend)
    return backend


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("causal,window", [(True, (-1, -1)), (False, (5, 3))])
def test_forward_and_backward_into_views(engine, dtype, causal, window):
    q, k, v = qkv(2, 29, 41, 4, 2, 32, DTYPES[dtype])
    d_o = torch.randn(2, 29, 4, 32).to(DTYPES[dtype])
    out, lse, s_dmask, rng_state = fi._flash_attn_forward(
        q, k, v, 0.0, None, causal, window[0], window[1], 0.0, None, False
    )
    assert out.dtype == q.dtype and lse.dtype == torch.float32 and lse.shape == (2, 4, 29)
    assert s_dmask is None and rng_state.dtype == torch.int64
    opts = options(causal=causal, window_size=window)
    testing.assert_passed(testing.check_forward(q, k, v, out, lse, opts), "forward")

    # ring-flash-attn hands in views of larger buffers: only they are written.
    bufs = [torch.full((2, 50, h, 32), 7.0).to(q.dtype) for h in (4, 2, 2)]
    dq, dk, dv = bufs[0][:, :29], bufs[1][:, :41], bufs[2][:, :41]
    softmax_d = fi._flash_attn_backward(
        d_o, q, k, v, out, lse, dq, dk, dv, 0.0, None, causal, window[0], window[1], 0.0, None,
        False, rng_state,
    )  # fmt: skip
    checks = testing.check_backward(q, k, v, d_o, dq, dk, dv, None, opts)
    testing.assert_passed(checks, "backward")
    assert (bufs[0][:, 29:] == 7).all() and (bufs[1][:, 41:] == 7).all() and (bufs[2][:, 41:] == 7).all()
    expect = (d_o.double() * out.double()).sum(-1).transpose(1, 2)
    assert softmax_d.shape == lse.shape and softmax_d.dtype == torch.float32
    assert torch.allclose(softmax_d.double(), expect, rtol=1e-5, atol=1e-5)


def test_packed_sequences(engine):
    cu_q = torch.tensor([0, 5, 22, 30], dtype=torch.int32)
    cu_k = torch.tensor([0, 9, 20, 41], dtype=torch.int32)
    q = torch.randn(30, 4, 16)
    k, v = torch.randn(41, 2, 16), torch.randn(41, 2, 16)
    d_o = torch.randn(30, 4, 16)
    out, lse, _, rng_state = fi._flash_attn_varlen_forward(
        q, k, v, cu_q, cu_k, 17, 21, 0.0, None, True, -1, -1, 0.0, None, False
    )
    assert lse.shape == (4, 30)
    opts = options(causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    testing.assert_passed(testing.check_forward(q, k, v, out, lse, opts), "varlen forward")
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    softmax_d = fi._flash_attn_varlen_backward(
        d_o, q, k, v, out, lse, dq, dk, dv, cu_q, cu_k, 17, 21, 0.0, None, True, -1, -1, 0.0,
        None, False, rng_state,
    )  # fmt: skip
    testing.assert_passed(testing.check_backward(q, k, v, d_o, dq, dk, dv, None, opts), "varlen backward")
    assert torch.allclose(softmax_d.double(), (d_o.double() * out.double()).sum(-1).T, atol=1e-5)
    with pytest.raises(errors.Unsupported) as e:
        fi._flash_attn_varlen_forward(q, k, v, cu_q, cu_k, 17, 21, 0.0, None, True, seqused_k=cu_k)
    assert e.value.feature == "seqused_k"


def test_dropout_travels_in_rng_state(engine):
    q, k, v = qkv(1, 23, 23, 2, 2, 16, torch.float32)
    d_o = torch.randn(1, 23, 2, 16)
    torch.manual_seed(5)
    out, lse, _, rng_state = fi._flash_attn_forward(q, k, v, 0.3, None, True, -1, -1, 0.0, None, False)
    seed, offset = rng_state.tolist()
    opts = options(causal=True, dropout=(0.3, seed, offset))
    testing.assert_passed(testing.check_forward(q, k, v, out, lse, opts), "dropout forward")
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    fi._flash_attn_backward(
        d_o, q, k, v, out, lse, dq, dk, dv, 0.3, None, True, -1, -1, 0.0, None, False, rng_state
    )
    checks = testing.check_backward(q, k, v, d_o, dq, dk, dv, None, opts)
    testing.assert_passed(checks, "dropout backward (the forward's mask)")
    # torch's generator decides the seed, as it decides flash-attn's.
    torch.manual_seed(5)
    again = fi._flash_attn_forward(q, k, v, 0.3, None, True, -1, -1, 0.0, None, False)
    assert torch.equal(again[3], rng_state) and torch.equal(again[0], out)
    torch.manual_seed(6)
    other = fi._flash_attn_forward(q, k, v, 0.3, None, True, -1, -1, 0.0, None, False)
    assert not torch.equal(other[3], rng_state) and not torch.equal(other[0], out)
    with pytest.raises(errors.Unsupported):
        fi._flash_attn_backward(d_o, q, k, v, out, lse, dq, dk, dv, 0.3, None, True, -1, -1, 0.0, None, False)


def test_install_serves_flash_attn_imports():
    """In a fresh interpreter: the imports resolve to this module, the
    public names to flashattn's drop-ins, Transformers still finds no
    flash-attn, and a second install is a no-op."""
    script = textwrap.dedent(
        """
        import importlib.util
        from flashattn.integrations import flash_attn_interface as fi
        import flashattn
        assert fi.install() is True
        from flash_attn.flash_attn_interface import _flash_attn_forward, _flash_attn_varlen_backward
        from flash_attn import flash_attn_func, flash_attn_with_kvcache
        assert _flash_attn_forward is fi._flash_attn_forward
        assert flash_attn_func is flashattn.flash_attn_func
        assert importlib.util.find_spec("flash_attn") is not None
        assert fi.install() is False
        from transformers.utils import is_flash_attn_2_available
        assert not is_flash_attn_2_available()
        print("ok")
        """
    )
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stderr
