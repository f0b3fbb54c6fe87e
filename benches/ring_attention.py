"""Causal zigzag ring attention on 2 spawned processes (gloo, CPU backend,
one engine thread each) against one process doing the same global problem
with as many engine threads as the ranks together, forward and forward +
backward: the time ratio, and the time each rank spent blocked in
``wait()`` on the ring's requests.

    PYTHONPATH=python python benches/ring_attention.py [--seqlens 2048 4096] [--world 2]
"""

import argparse
import os
import platform
import statistics
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _inputs(n, heads, d):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(1, n, heads, d, generator=g) for _ in range(4)]


def _time(fn, repeats):
    fn()  # warm up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _single(rank, out, n, heads, d, repeats, threads):
    os.environ["RAYON_NUM_THREADS"] = str(threads)  # before the engine's first call
    torch.set_num_threads(threads)
    from flashattn import flash_attn_func

    q, k, v, d_o = _inputs(n, heads, d)

    def fwd():
        flash_attn_func(q, k, v, causal=True, backend="cpu")

    qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))

    def fwd_bwd():
        flash_attn_func(qg, kg, vg, causal=True, backend="cpu").backward(d_o)

    out.put({"fwd": _time(fwd, repeats), "fwd_bwd": _time(fwd_bwd, repeats)})


def _ranked(rank, world, store, out, n, heads, d, repeats):
    os.environ["RAYON_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    from flashattn.distributed import RingStats, zigzag_ring_flash_attn_func, zigzag_shard

    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=world,
        timeout=timedelta(seconds=300),
    )  # fmt: skip
    q, k, v, d_o = (zigzag_shard(t, rank, world) for t in _inputs(n, heads, d))
    qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))
    result = {}
    for name, grad in (("fwd", False), ("fwd_bwd", True)):
        times, waits = [], []
        for i in range(repeats + 1):
            stats = RingStats()
            dist.barrier()
            t0 = time.perf_counter()
            args = (qg, kg, vg) if grad else (q, k, v)
            o = zigzag_ring_flash_attn_func(*args, causal=True, backend="cpu", stats=stats)
            if grad:
                o.backward(d_o)
            elapsed = time.perf_counter() - t0
            if i:  # the first is a warm-up
                times.append(elapsed)
                waits.append(stats.wait_forward + stats.wait_backward)
        result[name] = statistics.median(times)
        result[name + "_wait"] = statistics.median(waits)
        result["tiles"] = stats.tiles_forward
    out.put((rank, result))
    dist.destroy_process_group()


def _cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--seqlens", type=int, nargs="+", default=[2048, 4096])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    ctx = mp.get_context("spawn")
    print(f"CPU: {_cpu_model()}, {os.cpu_count()} logical CPUs; torch {torch.__version__}")
    print(
        f"causal zigzag, batch 1, {args.heads} heads, head dim {args.head_dim}, float32, "
        f"median of {args.repeats}; one process with {args.world} engine threads against "
        f"{args.world} ranks (gloo) with 1 each"
    )
    print(
        f"{'N':>6} {'pass':>8} {'single s':>9} {'ring s':>8} {'ratio':>6} "
        f"{'wait s per rank':>18} {'tiles per rank':>16}"
    )
    for n in args.seqlens:
        q = ctx.SimpleQueue()
        proc = ctx.Process(target=_single, args=(0, q, n, args.heads, args.head_dim,
                                                  args.repeats, args.world))  # fmt: skip
        proc.start()
        single = q.get()
        proc.join()
        store = os.path.join(tempfile.mkdtemp(), "store")
        q = ctx.SimpleQueue()
        procs = [
            ctx.Process(target=_ranked, args=(r, args.world, store, q, n, args.heads,
                                              args.head_dim, args.repeats))  # fmt: skip
            for r in range(args.world)
        ]
        for pr in procs:
            pr.start()
        ranks = dict(q.get() for _ in procs)
        for pr in procs:
            pr.join()
        for name in ("fwd", "fwd_bwd"):
            ring = max(ranks[r][name] for r in ranks)
            waits = " ".join(f"{ranks[r][name + '_wait']:.3f}" for r in sorted(ranks))
            tiles = " ".join(str(ranks[r]["tiles"]) for r in sorted(ranks))
            print(
                f"{n:>6} {name:>8} {single[name]:>9.3f} {ring:>8.3f} "
                f"{ring / single[name]:>6.2f} {waits:>18} {tiles:>16}"
            )


if __name__ == "__main__":
    main()
