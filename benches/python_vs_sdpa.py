"""flashattn's Python package against torch SDPA on the CPU, and the cost of crossing into Rust.

Runs ``flashattn.flash_attn_func(backend="cpu")`` and
``torch.nn.functional.scaled_dot_product_attention`` on the same float32
inputs (batch 1, 8 heads, head dims 64 and 128, N 1024, 2048, 4096), forward
and forward + backward, and prints the median of several repeats with the
ratio ``sdpa / flashattn`` (above 1: flashattn is faster). SDPA gets its own
layout: the (batch, seqlen, heads, dim) inputs are copied to contiguous
(batch, heads, seqlen, dim) tensors outside the timed region, so the ratio
does not count a transpose against it. The two are timed alternately, one
call each per repeat, so a machine that slows down mid-run slows both.

The second table is the crossing: at N 128 the Python call
``flash_attn_func`` (no grad) against the seconds the engine's forward
takes inside Rust (reported by ``flashattn._native.forward``); the difference
is what the Python layer, the torch custom op and PyO3 cost per call. The
layers in between (the custom op, the host copy-and-allocate step, the bare
native call) are timed too, each on its own, so the differences between
consecutive lines say where that cost goes.

Run from the repository root with the built package on the path::

    PYTHONPATH=python python benches/python_vs_sdpa.py [--causal] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from typing import Callable, Dict, List

import torch
import torch.nn.functional as F

import flashattn
from flashattn import _native
from flashattn.functional import forward_host, options


def cpu_model() -> str:
    """The CPU's marketing name, where the OS says it."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_features() -> str:
    """The vector extensions both libraries pick kernels by (Linux only)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((l.split(":", 1)[1].split() for l in f if l.startswith("flags")), [])
    except OSError:
        return ""
    wanted = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile")
    return " ".join(x for x in wanted if x in flags)


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def alternate(fns: Dict[str, Callable[[], object]], warmup: int, repeats: int) -> Dict[str, float]:
    """The median seconds of each function, timed in turn within every repeat."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    samples: Dict[str, List[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            samples[name].append(timed(fn))
    return {name: statistics.median(s) for name, s in samples.items()}


def bench_row(n: int, d: int, causal: bool, backward: bool, warmup: int, repeats: int) -> dict:
    g = torch.Generator().manual_seed(n * 1000 + d)
    shape = (1, n, 8, d)  # (batch, seqlen, heads, head_dim): flash-attn's layout
    q, k, v, d_o = (torch.randn(shape, generator=g) for _ in range(4))
    qt, kt, vt, d_ot = (x.transpose(1, 2).contiguous() for x in (q, k, v, d_o))
    for x in (q, k, v, qt, kt, vt):
        x.requires_grad_(backward)

    def flash():
        o = flashattn.flash_attn_func(q, k, v, causal=causal, backend="cpu")
        if backward:
            return torch.autograd.grad(o, (q, k, v), d_o)
        return o

    def sdpa():
        o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
        if backward:
            return torch.autograd.grad(o, (qt, kt, vt), d_ot)
        return o

    with torch.no_grad():  # the two compute the same thing: their largest difference is shown
        o_flash = flashattn.flash_attn_func(q, k, v, causal=causal, backend="cpu")
        o_sdpa = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
        diff = (o_flash.transpose(1, 2) - o_sdpa).abs().max().item()
    with torch.set_grad_enabled(backward):
        times = alternate({"flashattn": flash, "sdpa": sdpa}, warmup, repeats)
    return {
        "n": n,
        "head_dim": d,
        "causal": causal,
        "pass": "forward+backward" if backward else "forward",
        "flashattn_s": times["flashattn"],
        "sdpa_s": times["sdpa"],
        "ratio": times["sdpa"] / times["flashattn"],
        "max_abs_diff_o": diff,
    }


def crossing(n: int, warmup: int, repeats: int) -> dict:
    """The Python call against the Rust call alone, at a size where the crossing shows."""
    g = torch.Generator().manual_seed(n)
    q, k, v = (torch.randn((1, n, 8, 64), generator=g) for _ in range(3))
    o = torch.empty_like(q)
    lse = torch.empty((1, 8, n), dtype=torch.float32)
    opts = options()
    raw = [(t.data_ptr(), list(t.shape), "float32") for t in (q, k, v, o, lse)]
    inside: List[float] = []

    def python_call():
        return flashattn.flash_attn_func(q, k, v, backend="cpu")

    def custom_op():
        # cu_seqlens q/k, causal, window, softcap, scale, alibi, sinks,
        # block mask and size, backend, dropout p and seed: the op's schema.
        args = (None, None, False, -1, -1, 0.0, None, None, None, None, 0, 0, "cpu", 0.0, 0)
        return torch.ops.flashattn.fwd(q, k, v, *args)

    def host_call():
        return forward_host(q, k, v, options(), "cpu")

    def native_call():
        _, seconds = _native.forward(*raw, opts, "cpu", False, None)
        inside.append(seconds)

    # Each layer of the call, outermost first, to say where the overhead goes.
    layers = {"python": python_call, "op": custom_op, "host": host_call, "native": native_call}
    with torch.no_grad():
        times = alternate(layers, warmup, repeats)
        torch.testing.assert_close(o, python_call(), rtol=0, atol=0)  # the same computation
    rust = statistics.median(inside[warmup:])
    return {
        "n": n,
        "batch": 1,
        "heads": 8,
        "head_dim": 64,
        "python_call_us": times["python"] * 1e6,
        "custom_op_us": times["op"] * 1e6,
        "forward_host_us": times["host"] * 1e6,
        "native_call_us": times["native"] * 1e6,
        "rust_us": rust * 1e6,
        "overhead_us": (times["python"] - rust) * 1e6,
        "repeats": repeats,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--causal", action="store_true", help="causal masks (default: none)")
    ap.add_argument("--seqlens", default="1024,2048,4096", help="comma-separated N")
    ap.add_argument("--head-dims", default="64,128", help="comma-separated head dims")
    ap.add_argument("--repeats", type=int, default=5, help="timed repeats per row (median)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed calls per row first")
    ap.add_argument("--crossing-repeats", type=int, default=2000)
    ap.add_argument("--json", metavar="PATH", help="also write the results here")
    args = ap.parse_args()

    info = flashattn.backend_info("cpu")
    machine = {
        "cpu": cpu_model(),
        "cpu_features": cpu_features(),
        "logical_cpus": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "flashattn": flashattn.__version__,
        "flashattn_backend": info["name"],
        "python": platform.python_version(),
        # Other work on the machine moves the times: the 1-minute load before the run.
        "load_average": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    }
    print(
        f"CPU: {machine['cpu']} ({machine['logical_cpus']} logical CPUs; "
        f"{machine['cpu_features'] or 'flags unknown'})"
    )
    print(
        f"torch {machine['torch']}, {machine['torch_threads']} threads; flashattn "
        f"{machine['flashattn']} on {machine['flashattn_backend']}; Python {machine['python']}"
    )
    if machine["load_average"] is not None:
        print(f"load average (1 min) before the run: {machine['load_average']:.2f}")
    print(
        f"batch 1, 8 heads, float32, causal={args.causal}; median of {args.repeats} "
        f"after {args.warmup} warm-up; ratio = sdpa / flashattn"
    )
    print()
    header = (
        f"{'N':>5} {'d':>4}  {'pass':<17} {'flashattn':>11} {'sdpa':>11} {'ratio':>6} "
        f"{'max|Δo|':>8}"
    )
    print(header)
    print("-" * len(header))
    rows = []
    for n in (int(x) for x in args.seqlens.split(",")):
        for d in (int(x) for x in args.head_dims.split(",")):
            for backward in (False, True):
                r = bench_row(n, d, args.causal, backward, args.warmup, args.repeats)
                rows.append(r)
                print(
                    f"{n:>5} {d:>4}  {r['pass']:<17} {r['flashattn_s'] * 1e3:>8.1f} ms "
                    f"{r['sdpa_s'] * 1e3:>8.1f} ms {r['ratio']:>6.2f} {r['max_abs_diff_o']:>8.1e}",
                    flush=True,
                )
    print()
    c = crossing(128, warmup=50, repeats=args.crossing_repeats)
    print(
        f"Crossing into Rust at N {c['n']} (b 1, h 8, d 64), no grad, median of {c['repeats']}; "
        "each inner layer called on its own:"
    )
    for label, key in (
        ("flash_attn_func (Python call)", "python_call_us"),
        ("  the custom op flashattn::fwd alone", "custom_op_us"),
        ("  functional.forward_host alone", "forward_host_us"),
        ("  _native.forward alone", "native_call_us"),
        ("inside Rust", "rust_us"),
        ("overhead (Python call - Rust)", "overhead_us"),
    ):
        print(f"  {label:<36} {c[key]:>9.1f} us")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine, "causal": args.causal, "rows": rows, "crossing": c},
                      f, indent=2)  # fmt: skip
            f.write("\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    sys.exit(main())
