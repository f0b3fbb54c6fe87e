"""Ring and zigzag attention over torch.distributed (gloo, spawned
processes): the gathered outputs, LSE and gradients pass the accuracy rule
against the f64 reference of the whole sequence and agree with the
single-process flash_attn_func; causal zigzag balances the computed tiles;
the bytes on the ring match the analytic count; ranks that disagree raise
instead of hanging. ring-flash-attn's own ring code runs on the engine
through flash-attn's interface and passes the same rule."""

import functools
import os
import tempfile
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from flashattn import flash_attn_func, testing
from flashattn.distributed import (
    RankMismatch,
    RingStats,
    count_tiles,
    ring_flash_attn_func,
    ring_shard,
    unshard,
    zigzag_ring_flash_attn_func,
    zigzag_shard,
)
from helpers import DTYPES, attention_f64, load_ring_flash_attn, options

BACKENDS = [b for b in os.environ.get("FLASHATTN_TEST_BACKENDS", "cpu,wgpu").split(",") if b]
FUNCS = {"ring": ring_flash_attn_func, "zigzag": zigzag_ring_flash_attn_func}
SHARD = {"ring": ring_shard, "zigzag": zigzag_shard}

# (kind, causal, window, seqlen, batch, heads_q, heads_kv, head_dim, dtype, backward)
# Seqlens are not multiples of 2 * world: ragged shards and chunks.
FULL = {
    2: [
        ("ring", True, (-1, -1), 37, 2, 4, 2, 32, "f32", True),
        ("zigzag", True, (-1, -1), 42, 1, 4, 1, 32, "bf16", True),
        ("ring", False, (6, 3), 45, 1, 2, 2, 16, "f32", True),
        ("zigzag", False, (-1, -1), 33, 1, 4, 2, 16, "f32", True),
    ],
    3: [
        ("ring", True, (-1, -1), 50, 1, 4, 2, 32, "f32", True),
        ("zigzag", True, (-1, -1), 47, 1, 4, 2, 32, "f32", True),
        ("zigzag", True, (10, -1), 53, 1, 2, 1, 16, "f16", True),
        ("ring", False, (-1, -1), 31, 1, 2, 2, 16, "f32", True),
    ],
    4: [
        ("zigzag", True, (-1, -1), 70, 1, 4, 2, 32, "f32", True),
        ("ring", True, (12, 0), 61, 1, 2, 1, 16, "f32", True),
        ("zigzag", False, (5, 9), 45, 1, 2, 2, 16, "bf16", True),
        # Balance and bytes: 512 positions, 8 chunks of 64 = 4 tiles each.
        ("zigzag", True, (-1, -1), 512, 1, 1, 1, 16, "f32", False),
        ("ring", True, (-1, -1), 512, 1, 1, 1, 16, "f32", False),
    ],
}
REDUCED = {2: [("zigzag", True, (-1, -1), 37, 1, 2, 1, 16, "f32", True)]}


def _inputs(case, seed):
    kind, causal, window, n, b, hq, hkv, d, dtype, grad = case
    g = torch.Generator().manual_seed(seed)
    dt = DTYPES[dtype]
    q = torch.randn(b, n, hq, d, generator=g).to(dt)
    k = torch.randn(b, n, hkv, d, generator=g).to(dt)
    v = torch.randn(b, n, hkv, d, generator=g).to(dt)
    d_o = torch.randn(b, n, hq, d, generator=g).to(dt)
    return q, k, v, d_o


def _init(rank, world, store):
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=world,
        timeout=timedelta(seconds=60),
    )  # fmt: skip


def _worker(rank, world, store, out_dir, cases, backend):
    torch.set_num_threads(1)
    _init(rank, world, store)
    results = []
    for i, case in enumerate(cases):
        kind, causal, window, grad = case[0], case[1], case[2], case[-1]
        q, k, v, d_o = (SHARD[kind](t, rank, world) for t in _inputs(case, i))
        q, k, v = (t.clone().requires_grad_(grad) for t in (q, k, v))
        stats = RingStats()
        o, lse = FUNCS[kind](
            q, k, v, causal=causal, window_size=window, backend=backend,
            return_lse=True, stats=stats,
        )  # fmt: skip
        res = {"o": o.detach(), "lse": lse, "stats": stats, "len": q.shape[1]}
        if grad:
            o.backward(d_o)
            res.update(dq=q.grad, dk=k.grad, dv=v.grad)
        results.append(res)
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def _spawn(fn, world, args, timeout=150):
    """Run ``fn(rank, world, store, out_dir, *args)`` on ``world`` processes;
    a process still running after ``timeout`` seconds fails the test (no
    hang)."""
    out_dir = tempfile.mkdtemp(prefix="flashattn-ring-")
    store = os.path.join(out_dir, "store")
    ctx = mp.start_processes(
        fn, args=(world, store, out_dir, *args), nprocs=world, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + timeout
    while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            raise AssertionError(f"world {world}: processes still running after {timeout} s")
    load = lambda r: torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False)  # noqa
    return [load(r) for r in range(world)]


@functools.lru_cache(maxsize=None)
def _run(world, backend, reduced):
    cases = (REDUCED if reduced else FULL)[world]
    per_rank = _spawn(_worker, world, (cases, backend))
    return cases, [[per_rank[r][i] for r in range(world)] for i in range(len(cases))]


def _params():
    out = []
    for backend in BACKENDS:
        table = FULL if backend == "cpu" else REDUCED
        for world, cases in table.items():
            for i, case in enumerate(cases):
                if case[-1]:  # the accuracy cases (the others are for counts)
                    name = f"{backend}-w{world}-{i}-{case[0]}"
                    out.append(pytest.param(backend, world, i, id=name))
    return out


@pytest.mark.parametrize("backend,world,index", _params())
def test_matches_whole_sequence(backend, world, index):
    cases, results = _run(world, backend, backend != "cpu")
    case, ranks = cases[index], results[index]
    kind, causal, window = case[:3]
    zig = kind == "zigzag"
    q, k, v, d_o = _inputs(case, index)
    o = unshard([r["o"] for r in ranks], zig)
    lse = unshard([r["lse"] for r in ranks], zig, dim=2)
    opts = options(causal=causal, window_size=window)
    fwd = testing.check_forward(q, k, v, o, lse, opts)
    testing.assert_passed(fwd, f"{kind} world {world} forward")
    grads = [unshard([r[n] for r in ranks], zig) for n in ("dq", "dk", "dv")]
    bwd = testing.check_backward(q, k, v, d_o, *grads, None, opts)
    testing.assert_passed(bwd, f"{kind} world {world} backward")

    # The single-process call passes the same rule, so the two differ by at
    # most the sum of their errors against the reference.
    qs, ks, vs = (t.clone().requires_grad_(True) for t in (q, k, v))
    o1, lse1, _ = flash_attn_func(
        qs, ks, vs, causal=causal, window_size=window, backend=backend, return_attn_probs=True
    )
    o1.backward(d_o)
    single = [o1.detach(), lse1, qs.grad, ks.grad, vs.grad]
    single_checks = testing.check_forward(q, k, v, o1.detach(), lse1, opts)
    single_checks += testing.check_backward(q, k, v, d_o, *single[2:], None, opts)
    testing.assert_passed(single_checks, "single process")
    for ours, theirs, c_ours, c_theirs in zip([o, lse, *grads], single, fwd + bwd, single_checks):
        assert c_ours.name == c_theirs.name
        diff = (ours.double() - theirs.double()).abs().max().item()
        assert diff <= c_ours.max_error + c_theirs.max_error + 1e-12, (c_ours.name, diff)


def _lengths(n, world):
    return [n // world + (r < n % world) for r in range(world)]


def test_zigzag_balances_causal_tiles():
    """Causal zigzag at seqlen 512 on 4 ranks: every rank computes the same
    number of 16x16 tiles (132 = 16·7 + 2·10); plain ring does not."""
    cases, results = _run(4, "cpu", False)
    tiles = {}
    for (kind, causal, _, n, *_rest), ranks in zip(cases, results):
        if n == 512:
            tiles[kind] = [r["stats"].tiles_forward for r in ranks]
    zig, ring = tiles["zigzag"], tiles["ring"]
    mean = sum(zig) / len(zig)
    assert all(abs(t - mean) <= 0.1 * mean for t in zig), zig
    assert zig == [132] * 4, zig
    # Plain ring: rank r computes 64·r + 36 tiles (its diagonal block and r
    # full blocks before it), far from balanced.
    assert ring == [36, 100, 164, 228], ring
    mean = sum(ring) / len(ring)
    assert max(abs(t - mean) for t in ring) > 0.5 * mean
    # The total is the whole causal problem's tile count either way.
    assert sum(zig) == sum(ring) == count_tiles(0, 512, 0, 512, True, (-1, -1))


@pytest.mark.parametrize("world", [2, 3, 4])
def test_bytes_per_step_match_the_count(world):
    """Forward: world-1 steps, each sending the K/V shard held (storage
    dtype). Backward: the same K/V plus the shard's dK/dV accumulator in
    float32, and one last step sending only the accumulator home."""
    cases, results = _run(world, "cpu", False)
    for case, ranks in zip(cases, results):
        kind, _, _, n, b, hq, hkv, d, dtype, grad = case
        lens = [r["len"] for r in ranks]
        assert lens == _lengths(n, world)
        esize = torch.tensor([], dtype=DTYPES[dtype]).element_size()
        for rank, r in enumerate(ranks):
            held = [lens[(rank - s) % world] for s in range(world)]
            kv = [b * L * hkv * 2 * d * esize for L in held]
            assert r["stats"].bytes_forward == kv[: world - 1], (case, rank)
            if grad:
                dkv = [b * L * hkv * 2 * d * 4 for L in held]
                expect = [kv[s] + dkv[s] for s in range(world - 1)] + [dkv[-1]]
                assert r["stats"].bytes_backward == expect, (case, rank)


def test_count_tiles_against_a_mask():
    """The analytic tile count equals counting 16x16 blocks of the band."""
    n = 75
    for causal, window in [(True, (-1, -1)), (False, (7, 20)), (True, (30, 5)), (False, (-1, -1))]:
        left, right = window
        if causal:
            right = 0 if right < 0 else min(right, 0)
        i = torch.arange(n)[:, None]
        j = torch.arange(n)[None, :]
        allowed = torch.ones(n, n, dtype=torch.bool)
        if left >= 0:
            allowed &= j >= i - left
        if right >= 0:
            allowed &= j <= i + right
        for qo, qn, ko, kn in [(0, 75, 0, 75), (20, 33, 5, 40), (50, 25, 0, 17), (3, 1, 60, 15)]:
            block = allowed[qo : qo + qn, ko : ko + kn]
            expect = sum(
                bool(block[a : a + 16, c : c + 16].any())
                for a in range(0, qn, 16)
                for c in range(0, kn, 16)
            )
            assert count_tiles(qo, qn, ko, kn, causal, window) == expect


def _mismatch_worker(rank, world, store, out_dir, what):
    torch.set_num_threads(1)
    _init(rank, world, store)
    d = 32 if (what == "head_dim" and rank == 1) else 16
    dtype = torch.float16 if (what == "dtype" and rank == 1) else torch.float32
    causal = not (what == "causal" and rank == 1)
    q = torch.randn(1, 8, 2, d).to(dtype)
    k = torch.randn(1, 8 if what != "seqlen" or rank != 0 else 7, 1, d).to(dtype)
    v = torch.randn(1, 8, 1, d).to(dtype)
    window = (-1, -1)
    if rank == 1 and what == "numpy":
        q = q.numpy()
    if rank == 1 and what == "window":
        window = None
    try:
        zigzag_ring_flash_attn_func(q, k, v, causal=causal, window_size=window, backend="cpu")
        outcome = None
    except RankMismatch as e:
        outcome = (type(e).__name__, e.what, e.rank)
    torch.save(outcome, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


@pytest.mark.parametrize(
    "what,field",
    [("head_dim", "head_dim"), ("dtype", "dtype"), ("causal", "options_hash"),
     ("seqlen", "local_error"), ("numpy", "local_error"), ("window", "local_error")],
)  # fmt: skip
def test_mismatch_raises_on_every_rank(what, field):
    # (numpy, window: input only one rank cannot take, a numpy array or a
    # window_size that is no pair, raised there before the agreement and
    # left the other ranks waiting in it.)
    outcomes = _spawn(_mismatch_worker, 2, (what,), timeout=90)
    bad_rank = 0 if what == "seqlen" else 1
    assert outcomes == [("RankMismatch", field, bad_rank)] * 2, outcomes


def _empty_rank_worker(rank, world, store, out_dir, kind):
    torch.set_num_threads(1)
    _init(rank, world, store)
    # Two positions on three ranks: rank 2 holds none. 3 query heads on 2
    # KV heads is an engine error, raised by the ranks that compute.
    q, k, v = (SHARD[kind](torch.randn(1, 2, h, 8), rank, world) for h in (3, 2, 2))
    try:
        FUNCS[kind](q, k, v, causal=True, backend="cpu")
        outcome = None
    except Exception as e:  # noqa: BLE001 (the outcome is the test's)
        outcome = type(e).__name__
    torch.save(outcome, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


@pytest.mark.parametrize("kind", ["ring", "zigzag"])
def test_engine_errors_raise_on_a_rank_without_positions(kind):
    """A rank of local length 0 makes no partial call; it raises the
    engine's error with the others instead of waiting on the ring."""
    outcomes = _spawn(_empty_rank_worker, 3, (kind,), timeout=90)
    assert outcomes == ["HeadsNotDivisible"] * 3, outcomes


def _lse_grad_inputs(n, hq, hkv):
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, n, h, 16, generator=g) for h in (hq, hkv, hkv))
    return q, k, v, torch.randn(1, n, hq, 16, generator=g), torch.randn(1, hq, n, generator=g)


def _lse_grad_worker(rank, world, store, out_dir, kind, n):
    torch.set_num_threads(1)
    _init(rank, world, store)
    q, k, v, d_o, d_lse = _lse_grad_inputs(n, 4, 2)
    q, k, v, d_o = (SHARD[kind](t, rank, world).clone() for t in (q, k, v, d_o))
    d_lse = SHARD[kind](d_lse, rank, world, dim=2)
    for t in (q, k, v):
        t.requires_grad_(True)
    o, lse = FUNCS[kind](q, k, v, causal=True, backend="cpu", return_lse=True)
    torch.autograd.backward([o, lse], [d_o, d_lse])
    torch.save([q.grad, k.grad, v.grad], os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


@pytest.mark.parametrize("kind,world", [("ring", 2), ("zigzag", 3)])
def test_returned_lse_gets_its_gradient(kind, world):
    """return_lse's lse is differentiable: a loss reading it gets d lse_i /
    d s_ij = P_ij in every rank's gradients (f64 reference of the whole
    sequence, written out in helpers.attention_f64)."""
    n = 23
    per_rank = _spawn(_lse_grad_worker, world, (kind, n))
    grads = [unshard([per_rank[r][i] for r in range(world)], kind == "zigzag") for i in range(3)]
    q, k, v, d_o, d_lse = _lse_grad_inputs(n, 4, 2)
    ref_in = [t.double().requires_grad_(True) for t in (q, k, v)]
    o, lse = attention_f64(*ref_in, causal=True)
    torch.autograd.backward([o, lse], [d_o.double(), d_lse.double()])
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref_in):
        err = (g.double() - r.grad).abs().max().item()
        assert err <= 1e-4 * max(1.0, r.grad.abs().max().item()), (name, err)


def _subgroup_worker(rank, world, store, out_dir):
    torch.set_num_threads(1)
    _init(rank, world, store)
    group = dist.new_group([1, 2])  # every rank takes part in creating it
    result = None
    if rank in (1, 2):
        case = ("zigzag", True, (-1, -1), 29, 1, 2, 1, 16, "f32", True)
        g_rank = dist.get_rank(group)
        q, k, v, d_o = (zigzag_shard(t, g_rank, 2) for t in _inputs(case, 0))
        q, k, v = (t.clone().requires_grad_(True) for t in (q, k, v))
        o, lse = zigzag_ring_flash_attn_func(
            q, k, v, causal=True, group=group, backend="cpu", return_lse=True
        )
        o.backward(d_o)
        result = [o.detach(), lse, q.grad, k.grad, v.grad]
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def test_sub_group():
    """A ring over ranks 1 and 2 of a world of 3: group ranks, global peers."""
    out = _spawn(_subgroup_worker, 3, ())
    assert out[0] is None
    case = ("zigzag", True, (-1, -1), 29, 1, 2, 1, 16, "f32", True)
    q, k, v, d_o = _inputs(case, 0)
    o, lse, dq, dk, dv = (unshard([out[1][i], out[2][i]], True, dim=2 if i == 1 else 1)
                          for i in range(5))  # fmt: skip
    opts = options(causal=True)
    testing.assert_passed(testing.check_forward(q, k, v, o, lse, opts), "sub-group forward")
    checks = testing.check_backward(q, k, v, d_o, dq, dk, dv, None, opts)
    testing.assert_passed(checks, "sub-group backward")


# ring-flash-attn's conventions: seqlens that 2 * world divides, no windows
# (it passes a window to each shard pair in the pair's own positions), and
# flash-attn's dtypes (its float32 backward would alias the first step's
# gradient buffer: `.to(torch.float32)` of a float32 tensor is no copy).
# (kind, causal, seqlen, heads_q, heads_kv, head_dim, dtype)
RING_FLASH_ATTN = {
    2: [("zigzag", True, 48, 4, 2, 32, "bf16"), ("ring", False, 40, 2, 2, 16, "f16")],
    3: [("zigzag", True, 54, 2, 1, 16, "f16"), ("ring", True, 45, 4, 2, 32, "bf16")],
}


def _ring_flash_attn_worker(rank, world, store, out_dir, backend):
    torch.set_num_threads(1)
    os.environ["FLASHATTN_BACKEND"] = backend  # flash-attn's interface takes no backend
    funcs = load_ring_flash_attn()
    _init(rank, world, store)
    results = []
    for i, (kind, causal, n, hq, hkv, d, dtype) in enumerate(RING_FLASH_ATTN[world]):
        case = (kind, causal, (-1, -1), n, 1, hq, hkv, d, dtype, True)
        q, k, v, d_o = (SHARD[kind](t, rank, world) for t in _inputs(case, 100 + i))
        q, k, v = (t.clone().requires_grad_(True) for t in (q, k, v))
        o, lse, _ = funcs[kind](q, k, v, causal=causal, return_attn_probs=True)
        o.backward(d_o)
        results.append([o.detach(), lse.detach(), q.grad, k.grad, v.grad])
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("world", sorted(RING_FLASH_ATTN))
def test_ring_flash_attn_runs_on_the_engine(backend, world):
    """ring-flash-attn (the reference implementation of these conventions),
    its flash-attn calls served by flashattn.integrations.flash_attn_interface:
    the gathered results pass the accuracy rule against the whole sequence's
    f64 reference, as ours do (benches/ring_accuracy.py compares the two)."""
    per_rank = _spawn(_ring_flash_attn_worker, world, (backend,))
    for i, (kind, causal, n, hq, hkv, d, dtype) in enumerate(RING_FLASH_ATTN[world]):
        case = (kind, causal, (-1, -1), n, 1, hq, hkv, d, dtype, True)
        q, k, v, d_o = _inputs(case, 100 + i)
        o, lse, dq, dk, dv = (
            unshard([per_rank[r][i][j] for r in range(world)], kind == "zigzag", dim=2 if j == 1 else 1)
            for j in range(5)
        )
        opts = options(causal=causal)
        what = f"ring-flash-attn {kind} world {world}"
        testing.assert_passed(testing.check_forward(q, k, v, o, lse, opts), f"{what} forward")
        checks = testing.check_backward(q, k, v, d_o, dq, dk, dv, None, opts)
        testing.assert_passed(checks, f"{what} backward")
