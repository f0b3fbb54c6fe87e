#!/usr/bin/env python3
"""Outside baselines for `flashattn bench --impls ...,numpy,torch`.

Times one attention case on the CPU and prints one JSON object on stdout:
{"impl": ..., "pass": ..., "seconds": [...]} or {"impl": ..., "error": "..."}.

- numpy: naive float32 attention through numpy's BLAS (S and P
  materialized); the backward from the stored P (dV = P^T dO, dP = dO V^T,
  dS = P * (dP - rowsum(dP * P)), dQ = dS K, dK = dS^T Q).
- torch, --pass decode (`flashattn bench --decode --backends torch`): one
  decoding step, SDPA with enable_gqa against a --seqlen-key cache in --dtype.
- torch: torch.nn.functional.scaled_dot_product_attention on the CPU (or,
  with --device cuda, on the GPU in --dtype, synchronized around each run); the
  backward is torch.autograd.grad of the forward's graph (kept between
  repeats), so it times the backward alone, as flashattn's backward case does.

Inputs are seeded N(0, 1) float32 in (batch, heads, seqlen, head_dim).
One untimed warm-up, then --repeats timed runs. Nothing here is a
dependency of flashattn: torch is imported only when asked for.

--serve (examples/bench_paths.rs, the GPU checks' benchmark): torch is
imported once and the process answers one JSON request per stdin line —
{"pass", "batch", "heads", "seqlen", "head_dim", "causal", "repeats",
"device", "dtype"} — with one JSON line, the same as above; its first line
says whether torch imports ({"ready": true, "version", "device"} or
{"error"}). It keeps the last shape's inputs, so the forward and the
backward of a shape share one generation, and on the GPU times each run
by CUDA events.
"""

import argparse
import json
import sys
import time


def parse():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--impl", choices=["numpy", "torch"], required=True)
    p.add_argument("--pass", dest="pass_", choices=["forward", "backward", "decode"], required=True)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=1)
    # decode (torch only): --heads query heads on --heads-kv kv heads, one
    # query token against a cache of --seqlen keys.
    p.add_argument("--heads-kv", type=int, default=None)
    p.add_argument("--seqlen", type=int, required=True)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--causal", type=int, choices=[0, 1], default=0)
    p.add_argument("--repeats", type=int, default=3)
    # torch only: cuda (scripts/cuda-check.sh) runs SDPA on the GPU in --dtype.
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default="float32")
    return p.parse_args()


def timed(fn, repeats, sync=lambda: None):
    fn()
    sync()
    out = []
    for _ in range(max(1, repeats)):
        start = time.perf_counter()
        fn()
        sync()
        out.append(time.perf_counter() - start)
    return out


def numpy_case(a):
    import numpy as np

    rng = np.random.default_rng(a.seqlen * 31 + a.head_dim)
    shape = (a.batch, a.heads, a.seqlen, a.head_dim)
    q, k, v, do = (rng.standard_normal(shape, dtype=np.float32) for _ in range(4))
    scale = np.float32(1.0 / np.sqrt(a.head_dim))
    mask = np.triu(np.ones((a.seqlen, a.seqlen), dtype=bool), 1) if a.causal else None

    def forward():
        s = np.matmul(q, k.swapaxes(-1, -2)) * scale
        if mask is not None:
            s[..., mask] = -np.inf
        s -= s.max(axis=-1, keepdims=True)
        np.exp(s, out=s)
        s /= s.sum(axis=-1, keepdims=True)
        return np.matmul(s, v), s

    if a.pass_ == "forward":
        return timed(forward, a.repeats)
    _, p = forward()

    def backward():
        dv = np.matmul(p.swapaxes(-1, -2), do)
        dp = np.matmul(do, v.swapaxes(-1, -2))
        ds = p * (dp - (dp * p).sum(axis=-1, keepdims=True))
        dq = np.matmul(ds, k) * scale
        dk = np.matmul(ds.swapaxes(-1, -2), q) * scale
        return dq, dk, dv

    return timed(backward, a.repeats)


def torch_inputs(a):
    """Seeded q, k, v, do of the case's shape on its device and dtype."""
    import torch

    gen = torch.Generator().manual_seed(a.seqlen * 31 + a.head_dim)
    shape = (a.batch, a.heads, a.seqlen, a.head_dim)
    dtype = getattr(torch, a.dtype)
    return tuple(
        torch.randn(shape, generator=gen, dtype=torch.float32).to(a.device, dtype) for _ in range(4)
    )


def event_timed(fn, repeats):
    """timed(), by CUDA events recorded around each run on the stream."""
    import torch

    fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(max(1, repeats)):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end) / 1e3)
    return out


def torch_case(a, inputs=None):
    import torch

    q, k, v, do = inputs or torch_inputs(a)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    causal = bool(a.causal)
    if a.device == "cuda" and inputs is not None:
        time_it = event_timed
    else:
        sync = torch.cuda.synchronize if a.device == "cuda" else (lambda: None)
        time_it = lambda fn, repeats: timed(fn, repeats, sync)  # noqa: E731
    if a.pass_ == "forward":
        def forward():
            with torch.no_grad():
                return sdpa(q, k, v, is_causal=causal)

        return time_it(forward, a.repeats)
    q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
    o = sdpa(q, k, v, is_causal=causal)

    def backward():
        return torch.autograd.grad(o, (q, k, v), do, retain_graph=True)

    return time_it(backward, a.repeats)


def torch_decode(a):
    """One decoding step: SDPA of one query token per sequence against a
    cache of a.seqlen keys, GQA by enable_gqa (no repeat of K and V), in
    a.dtype, the cache in torch's contiguous (batch, heads_kv, seqlen, d)."""
    import torch

    gen = torch.Generator().manual_seed(a.seqlen * 31 + a.head_dim)
    dtype = getattr(torch, a.dtype)
    heads_kv = a.heads_kv or a.heads

    def randn(*shape):
        return torch.randn(shape, generator=gen, dtype=torch.float32).to(dtype)

    q = randn(a.batch, a.heads, 1, a.head_dim)
    k, v = (randn(a.batch, heads_kv, a.seqlen, a.head_dim) for _ in range(2))
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def step():
        with torch.no_grad():
            return sdpa(q, k, v, enable_gqa=heads_kv != a.heads)

    return timed(step, a.repeats)


def request(line):
    """One --serve request as the argument namespace parse() makes."""
    r = json.loads(line)
    a = argparse.Namespace(impl="torch", pass_=r["pass"], batch=int(r["batch"]), heads=int(r["heads"]),
                           seqlen=int(r["seqlen"]), head_dim=int(r["head_dim"]), causal=int(bool(r["causal"])),
                           repeats=int(r.get("repeats", 3)), device=r.get("device", "cuda"),
                           dtype=r.get("dtype", "float32"))
    if a.pass_ not in ("forward", "backward") or a.device not in ("cpu", "cuda"):
        raise ValueError(f"bad request: {line.strip()}")
    if a.dtype not in ("float32", "float16", "bfloat16"):
        raise ValueError(f"bad dtype: {a.dtype}")
    return a


def serve():
    """--serve: import torch once, then one reply per request line."""
    try:
        import torch

        device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu only"
        print(json.dumps({"ready": True, "version": torch.__version__, "device": device}), flush=True)
    except ImportError as e:
        torch = None
        print(json.dumps({"error": f"torch is not importable by {sys.executable}: {e}"}), flush=True)
    kept = (None, None)  # (shape key, inputs)
    for line in sys.stdin:
        if not line.strip():
            continue
        result = {"impl": "torch"}
        try:
            a = request(line)
            result["pass"] = a.pass_
            if torch is None:
                raise ImportError("torch is not importable")
            key = (a.batch, a.heads, a.seqlen, a.head_dim, a.device, a.dtype)
            if kept[0] != key:
                kept = (None, None)  # free the last shape's tensors first
                kept = (key, torch_inputs(a))
            result["seconds"] = torch_case(a, kept[1])
            result["version"] = torch.__version__
            result["threads"] = torch.get_num_threads()
        except Exception as e:  # a failed case is a reply too
            result["error"] = f"{type(e).__name__}: {e}"
        print(json.dumps(result), flush=True)


def main():
    if sys.argv[1:] == ["--serve"]:
        return serve()
    a = parse()
    result = {"impl": a.impl, "pass": a.pass_}
    try:
        if a.pass_ == "decode" and a.impl != "torch":
            raise ValueError("the decode pass is torch's only")
        run = {"numpy": numpy_case, "torch": torch_decode if a.pass_ == "decode" else torch_case}[a.impl]
        result["seconds"] = run(a)
        if a.impl == "torch":
            import torch

            result["version"] = torch.__version__
            result["threads"] = torch.get_num_threads()
        else:
            import numpy

            result["version"] = numpy.__version__
    except ImportError as e:
        result["error"] = f"{a.impl} is not importable by {sys.executable}: {e}"
    except Exception as e:  # a failed baseline is a result too
        result["error"] = f"{type(e).__name__}: {e}"
    print(json.dumps(result))


if __name__ == "__main__":
    main()
