"""flashattn as a Transformers attention backend, on tiny random models.

How the bounds are derived: docs/semantics.md's accuracy rule judges a
result by its distance to an f64 reference against the distance of a naive
baseline in the same precision. Here the function under test is a whole
model, so the reference is the same model (same weights, same input) run in
float64 with eager attention, and the baseline is the float32 model with
the attention Transformers itself uses for it (sdpa, or eager where the model
has no sdpa: Gemma 2's softcap, gpt-oss's sinks). Everything but attention
is the same float32 code in both runs, so the rule carries over::

    max|x − ref| ≤ R · max|baseline − ref| + 2·ulp(max|ref|)

with R = 3, the rule's largest (forward with a softcap, and gradients). The
rule's third term, 1e-5 · max(1, max|ref|), is left out: it is a floor for
one attention call, and next to the errors of these runs (~1e-7 on logits,
~1e-8 on gradients) it would dwarf everything, so the bound would tell nothing.
(The direct tests of one attention call at the end keep the whole rule.)
The reference keeps the float32 casts Transformers' code makes inside a
float64 model (RMSNorm, RoPE, eager softmax); both runs under test are
measured against the same reference, so those casts weigh on both alike.
Logits are checked on every position, gradients per parameter. For a padded
batch the reference is each sequence alone, unpadded, in float64.
Every model test also asserts that the flashattn function actually ran.
"""

from __future__ import annotations

import copy
import os

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers import AttentionInterface, AutoModelForCausalLM  # noqa: E402

import flashattn  # noqa: E402
from flashattn.integrations import transformers as fa_tf  # noqa: E402

BACKEND = os.environ.get("FLASHATTN_BACKEND", "cpu")
R = 3.0
TINY = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=None,
)


def _llama():
    return transformers.LlamaConfig(**TINY)


def _mistral():
    return transformers.MistralConfig(**TINY, sliding_window=5)


def _gemma2():
    # Larger weights make scores reach the softcap (1.5) instead of staying near 0.
    return transformers.Gemma2Config(
        **TINY,
        head_dim=16,
        sliding_window=5,
        attn_logit_softcapping=1.5,
        final_logit_softcapping=None,
        query_pre_attn_scalar=24,
        initializer_range=0.1,
    )


def _gpt_oss():
    # Eager experts: grouped_mm has no float64. The default max positions keep
    # YaRN's factor consistent.
    cfg = {k: v for k, v in TINY.items() if k != "max_position_embeddings"}
    return transformers.GptOssConfig(
        **dict(cfg, intermediate_size=64),
        experts_implementation="eager",
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=5,
        layer_types=["sliding_attention", "full_attention"],
    )


# (config, the attention Transformers uses for the model in float32)
MODELS = {
    "llama": (_llama, "sdpa"),
    "mistral": (_mistral, "sdpa"),
    "gemma2": (_gemma2, "eager"),
    "gpt_oss": (_gpt_oss, "eager"),
}


@pytest.fixture(scope="module")
def name():
    """The registered name, its function wrapped to count calls."""
    registered = fa_tf.register(backend=BACKEND)
    inner = AttentionInterface._global_mapping[registered]
    calls = []

    def counting(*args, **kwargs):
        calls.append(args[4] is None)
        return inner(*args, **kwargs)

    AttentionInterface.register(registered, counting)
    counting.calls = calls
    yield registered
    AttentionInterface.register(registered, inner)


def _calls(name):
    return AttentionInterface._global_mapping[name].calls


class Trio:
    """The model under test, the float32 baseline and the float64 reference,
    with the same weights (each with its own config: Transformers writes the
    attention implementation into the config object)."""

    def __init__(self, model: str, name: str):
        make, self.base_impl = MODELS[model]
        cfg = make()
        torch.manual_seed(0)
        self.ours = AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation=name)
        state = self.ours.state_dict()
        self.base = AutoModelForCausalLM.from_config(
            copy.deepcopy(cfg), attn_implementation=self.base_impl
        )
        self.base.load_state_dict(state)
        self.ref = AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation="eager")
        self.ref.load_state_dict(state)
        self.ref.double()
        assert self.ours.config._attn_implementation == name
        for m in (self.ours, self.base, self.ref):
            m.eval()


def _bound(base_err: float, ref: torch.Tensor, r: float = R, floor: bool = False) -> float:
    top = float(ref.abs().max()) if ref.numel() else 0.0
    bound = r * base_err + 2 * float(np.spacing(np.float32(top)))
    return bound + (1e-5 * max(1.0, top) if floor else 0.0)


def _check(what: str, ours, base, ref, r: float = R, floor: bool = False) -> None:
    ref = ref.double()
    err = float((ours.double() - ref).abs().max())
    base_err = float((base.double() - ref).abs().max())
    bound = _bound(base_err, ref, r, floor)
    assert np.isfinite(err) and err <= bound, (
        f"{what}: max|ours - f64| = {err:.3e} > bound {bound:.3e} (baseline error {base_err:.3e})"
    )


def _ids(batch: int, seqlen: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 128, (batch, seqlen), generator=g)


@pytest.mark.parametrize("model", list(MODELS))
def test_logits_match_the_model(model, name):
    trio = Trio(model, name)
    ids = _ids(2, 16)
    before = len(_calls(name))
    with torch.no_grad():
        logits = [m(ids).logits for m in (trio.ours, trio.base, trio.ref)]
    assert len(_calls(name)) - before == 2  # one call per layer
    _check(f"{model} logits", *logits)


def test_the_features_change_the_logits():
    """The checks above can fail: without its softcap, window or sinks the f64
    model moves far past the bounds, so a backend that dropped one would too."""
    ids = _ids(2, 16)

    def logits(cfg, sinks=True):
        torch.manual_seed(0)  # the same weights: the tweaks change no shapes
        m = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").double().eval()
        if not sinks:
            for layer in m.model.layers:
                layer.self_attn.sinks.data.fill_(-torch.inf)  # exp(-inf) = 0: no sink
        with torch.no_grad():
            return m(ids).logits

    def without(make, **changes):
        cfg = make()
        for k, v in changes.items():
            setattr(cfg, k, v)
        return cfg

    cases = {
        "gemma2 softcap": (_gemma2(), without(_gemma2, attn_logit_softcapping=None)),
        "gemma2 window": (_gemma2(), without(_gemma2, sliding_window=4096)),
        "mistral window": (_mistral(), without(_mistral, sliding_window=4096)),
    }
    for what, (cfg, changed) in cases.items():
        assert float((logits(cfg) - logits(changed)).abs().max()) > 1e-3, what
    gap = float((logits(_gpt_oss()) - logits(_gpt_oss(), sinks=False)).abs().max())
    assert gap > 1e-3, "gpt_oss sinks"


@pytest.mark.parametrize("model", list(MODELS))
def test_gradients_of_one_training_step_match(model, name):
    trio = Trio(model, name)
    ids = _ids(2, 12, seed=2)
    before = len(_calls(name))
    grads = []
    for m in (trio.ours, trio.base, trio.ref):
        m.train()
        m.zero_grad()
        m(ids, labels=ids).loss.backward()
        grads.append({n: p.grad for n, p in m.named_parameters() if p.grad is not None})
    ours, base, ref = grads
    assert len(_calls(name)) - before == 2
    assert ours.keys() == ref.keys() == base.keys()
    if model == "gpt_oss":
        assert any(n.endswith("sinks") for n in ours)  # dsinks reaches the parameter
    for n in ref:
        _check(f"{model} d{n}", ours[n], base[n], ref[n])


@pytest.mark.parametrize("model", list(MODELS))
def test_generate_gives_the_same_tokens(model, name):
    trio = Trio(model, name)
    ids = _ids(2, 6, seed=3)
    mask = torch.ones_like(ids)
    ids[1, :2], mask[1, :2] = 0, 0  # left padding
    before = len(_calls(name))
    out = [
        m.generate(ids, attention_mask=mask, max_new_tokens=32, do_sample=False)
        for m in (trio.ours, trio.base)
    ]
    assert len(_calls(name)) - before == 2 * 32  # prefill and 31 decoding steps, 2 layers
    assert out[0].shape == (2, 6 + 32)
    assert torch.equal(out[0], out[1])


@pytest.mark.parametrize("padded", [False, True])
def test_generate_with_a_static_cache(name, padded):
    """A static cache hands over keys past the tokens: without padding the
    prefill gets no mask (sdpa's top-left causal rule), with it a mask."""
    trio = Trio("llama", name)
    ids = _ids(2, 5, seed=4)
    mask = torch.ones_like(ids)
    if padded:
        ids[0, :1], mask[0, :1] = 0, 0
    kw = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, cache_implementation="static")
    before = len(_calls(name))
    assert torch.equal(trio.ours.generate(ids, **kw), trio.base.generate(ids, **kw))
    assert _calls(name)[before] is not padded  # the prefill's mask: None without padding


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("model", list(MODELS))
def test_padded_batch_matches_on_valid_positions(model, side, name):
    """The reference is each sequence alone, unpadded, at the same positions.
    (An f64 eager run of the padded batch is no reference: eager softmaxes in
    float32, where the fully masked rows of padding tokens become NaN.)"""
    trio = Trio(model, name)
    ids = _ids(3, 14, seed=5)
    mask = torch.ones_like(ids)
    for row, pad in ((1, 4), (2, 9)):
        cols = slice(0, pad) if side == "left" else slice(14 - pad, 14)
        ids[row, cols], mask[row, cols] = 0, 0
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    valid = mask.bool()
    before = len(_calls(name))
    with torch.no_grad():
        ours, base = (
            m(ids, attention_mask=mask, position_ids=pos).logits[valid]
            for m in (trio.ours, trio.base)
        )
        ref = torch.cat([trio.ref(ids[r, valid[r]][None]).logits[0] for r in range(3)])
    assert _calls(name)[before:] == [False, False]  # a padded batch hands over a mask
    _check(f"{model} {side}-padded logits", ours, base, ref)


def test_masks_it_cannot_express_raise(name):
    trio = Trio("llama", name)
    ids = _ids(2, 8, seed=6)
    holes = torch.ones_like(ids)
    holes[0, 3] = 0  # a gap in the middle: no key range expresses it
    with torch.no_grad(), pytest.raises(flashattn.Unsupported, match="attention mask"):
        trio.ours(ids, attention_mask=holes)
    packed = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3]] * 2)  # two sequences in one row
    with torch.no_grad(), pytest.raises(flashattn.Unsupported, match="attention mask"):
        trio.ours(ids, position_ids=packed, use_cache=False)


def test_dropout_trains_where_the_backend_has_it(name):
    cfg = _llama()
    cfg.attention_dropout = 0.3
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=name)
    ids = _ids(2, 9)
    with torch.no_grad():
        plain = model.eval()(ids).logits
    model.train()
    runs = []
    for _ in range(2):
        torch.manual_seed(7)  # the mask's seed comes from torch's generator
        out = model(ids, labels=ids)
        out.loss.backward()
        runs.append((out.logits.detach(), model.model.layers[0].self_attn.q_proj.weight.grad.clone()))
        model.zero_grad()
    if BACKEND == "cuda":
        return  # the backend's own refusal is tested below
    assert (runs[0][0] - plain).abs().max() > 1e-3, "dropout changed nothing"
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])


def test_dropout_trains_on_wgpu():
    cfg = _llama()
    cfg.attention_dropout = 0.1
    wgpu = fa_tf.register("portable_attention_wgpu", backend="wgpu")
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=wgpu).train()
    torch.manual_seed(3)
    first = model(_ids(1, 4)).logits
    torch.manual_seed(3)
    assert torch.equal(model(_ids(1, 4)).logits, first)


def test_register_refuses_names_transformers_routes_to_flash_attn():
    with pytest.raises(ValueError, match="flash"):
        fa_tf.register("flashattn")
    assert fa_tf.register("portable_attention_check") == "portable_attention_check"
    assert "portable_attention_check" in AttentionInterface._global_mapping


class _Attention(torch.nn.Module):
    def __init__(self, causal: bool):
        super().__init__()
        self.is_causal = causal
        self.num_key_value_groups = 2


def _direct(causal, lq, lk, padding, q_offset=0, window=None, seed=7):
    """attention_forward on random q, k, v (GQA 4:2) with the mask Transformers'
    sdpa_mask builds, next to naive float32 and float64 attention on that mask."""
    from transformers import masking_utils as mu

    if causal:
        fn = mu.causal_mask_function
        if window is not None:
            fn = mu.sliding_window_causal_mask_function(window)
    else:
        fn = mu.bidirectional_mask_function
        if window is not None:
            fn = mu.sliding_window_bidirectional_mask_function(window)
    mask = mu.sdpa_mask(
        batch_size=2, q_length=lq, kv_length=lk, q_offset=q_offset, mask_function=fn,
        attention_mask=padding.bool(), allow_is_causal_skip=False,
    )  # fmt: skip
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 4, lq, 16, generator=g)
    k, v = (torch.randn(2, 2, lk, 16, generator=g) for _ in range(2))
    out, _ = fa_tf.attention_forward(
        _Attention(causal), q, k, v, mask, scaling=0.3, sliding_window=window,
        flashattn_backend=BACKEND,
    )  # fmt: skip

    def naive(dtype):
        kk, vv = (t.repeat_interleave(2, 1).to(dtype) for t in (k, v))
        o = torch.nn.functional.scaled_dot_product_attention(
            q.to(dtype), kk, vv, attn_mask=mask, scale=0.3
        )
        return o.transpose(1, 2)

    return out, naive(torch.float32), naive(torch.float64)


@pytest.mark.parametrize("window", [None, 3])
def test_direct_chunked_prefill_over_a_padded_cache(window):
    """Three new rows over ten cached keys (q_offset 7), one sequence left-padded:
    the row offset is read from the mask. The library's rule for o: R = 2, floor kept."""
    padding = torch.ones(2, 10, dtype=torch.long)
    padding[1, :4] = 0
    ours, base, ref = _direct(True, 3, 10, padding, q_offset=7, window=window)
    _check("chunked prefill o", ours, base, ref, r=2.0, floor=True)


@pytest.mark.parametrize("side, window", [("left", None), ("right", None), ("left", 2)])
def test_direct_bidirectional_with_padded_keys(side, window):
    """Non-causal (an encoder): every query row is computed over its valid keys."""
    padding = torch.ones(2, 9, dtype=torch.long)
    padding[1, :3] = 0 if side == "left" else 1
    padding[1, 6:] = 0 if side == "right" else 1
    ours, base, ref = _direct(False, 9, 9, padding, window=window)
    _check(f"bidirectional {side}-padded o", ours, base, ref, r=2.0, floor=True)


def test_direct_bidirectional_window_with_right_padding_raises():
    """The engine aligns windows bottom-right within a sequence's keys; a
    bidirectional window over right-padded keys is aligned top-left: refused."""
    padding = torch.ones(2, 9, dtype=torch.long)
    padding[1, 6:] = 0
    with pytest.raises(flashattn.Unsupported, match="window"):
        _direct(False, 9, 9, padding, window=2)
