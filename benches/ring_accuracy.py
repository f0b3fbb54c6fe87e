"""Ring attention's accuracy: ``flashattn.distributed`` against
ring-flash-attn's own ring and zigzag code, both on this engine (the
package's flash-attn calls served by
``flashattn.integrations.flash_attn_interface``), on spawned gloo ranks.
Each output's max |error| against the f64 reference of the whole sequence,
and the accuracy rule's bound for it (docs/semantics.md): the rings
differ only in how they accumulate partial results.

    pip install --no-deps ring-flash-attn
    PYTHONPATH=python python benches/ring_accuracy.py [--seqlen 2048] [--worlds 2 4]
"""

import argparse
import os
import sys
import tempfile
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python", "tests"))
from helpers import load_ring_flash_attn  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16}
# (kind, causal)
KINDS = [("zigzag", True), ("ring", True), ("ring", False)]
OUTPUTS = ("o", "lse", "dq", "dk", "dv")


def _inputs(n, heads_q, heads_kv, d, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    shapes = [(1, n, heads_q, d), (1, n, heads_kv, d), (1, n, heads_kv, d), (1, n, heads_q, d)]
    return [torch.randn(*s, generator=g).to(dtype) for s in shapes]


def _worker(rank, world, store, out_dir, cases):
    torch.set_num_threads(1)
    os.environ["FLASHATTN_BACKEND"] = "cpu"
    os.environ["RAYON_NUM_THREADS"] = "1"
    from flashattn.distributed import (
        ring_flash_attn_func,
        ring_shard,
        zigzag_ring_flash_attn_func,
        zigzag_shard,
    )

    theirs = load_ring_flash_attn()
    ours = {"ring": ring_flash_attn_func, "zigzag": zigzag_ring_flash_attn_func}
    shard = {"ring": ring_shard, "zigzag": zigzag_shard}
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=world,
        timeout=timedelta(seconds=300),
    )  # fmt: skip
    results = []
    for seed, (kind, causal, n, hq, hkv, d, dtype) in enumerate(cases):
        q, k, v, d_o = (shard[kind](t, rank, world) for t in _inputs(n, hq, hkv, d, DTYPES[dtype], seed))
        row = {}
        for who in ("flashattn", "ring-flash-attn"):
            qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))
            if who == "flashattn":
                o, lse = ours[kind](qg, kg, vg, causal=causal, backend="cpu", return_lse=True)
            else:
                o, lse, _ = theirs[kind](qg, kg, vg, causal=causal, return_attn_probs=True)
            o.backward(d_o)
            row[who] = [o.detach(), lse.detach(), qg.grad, kg.grad, vg.grad]
        results.append(row)
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--seqlen", type=int, default=2048)
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    p.add_argument("--heads", type=int, nargs=2, default=[8, 2], metavar=("Q", "KV"))
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtypes", nargs="+", default=["bf16", "f16"], choices=list(DTYPES))
    args = p.parse_args()
    from flashattn import testing
    from flashattn.distributed import unshard
    from flashattn.functional import options

    hq, hkv = args.heads
    print(
        f"seqlen {args.seqlen}, batch 1, {hq} query heads on {hkv} kv heads, head dim "
        f"{args.head_dim}, CPU backend; max |error| against the f64 reference (bound: the accuracy rule's)"
    )
    print(f"{'world':>5} {'kind':>6} {'causal':>6} {'dtype':>5} {'output':>6} "
          f"{'flashattn':>10} {'ring-flash-attn':>15} {'bound':>10}")  # fmt: skip
    for world in args.worlds:
        if args.seqlen % (2 * world):
            raise SystemExit(f"ring-flash-attn needs a seqlen divisible by 2·world ({2 * world})")
        cases = [(kind, causal, args.seqlen, hq, hkv, args.head_dim, dt)
                 for dt in args.dtypes for kind, causal in KINDS]  # fmt: skip
        out_dir = tempfile.mkdtemp(prefix="flashattn-ring-accuracy-")
        store = os.path.join(out_dir, "store")
        mp.start_processes(_worker, args=(world, store, out_dir, cases), nprocs=world, start_method="spawn")
        ranks = [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(world)]
        for seed, case in enumerate(cases):
            kind, causal, n, _, _, d, dtype = case
            q, k, v, d_o = _inputs(n, hq, hkv, d, DTYPES[dtype], seed)
            opts = options(causal=causal)
            errors = {}
            for who in ("flashattn", "ring-flash-attn"):
                parts = [ranks[r][seed][who] for r in range(world)]
                o, lse, dq, dk, dv = (
                    unshard([p[i] for p in parts], kind == "zigzag", dim=2 if i == 1 else 1) for i in range(5)
                )
                checks = testing.check_forward(q, k, v, o, lse, opts)
                checks += testing.check_backward(q, k, v, d_o, dq, dk, dv, None, opts)
                errors[who] = {c.name: c for c in checks}
            for name in OUTPUTS:
                ours, theirs = errors["flashattn"][name], errors["ring-flash-attn"][name]
                print(
                    f"{world:>5} {kind:>6} {str(causal):>6} {dtype:>5} {name:>6} "
                    f"{ours.max_error:>10.3g} {theirs.max_error:>15.3g} {ours.bound:>10.3g}"
                )


if __name__ == "__main__":
    main()
