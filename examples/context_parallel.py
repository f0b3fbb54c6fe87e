"""Context parallelism end to end: a small random-weight language model
(embedding, 2 attention blocks calling zigzag_ring_flash_attn_func, LM
head) trained for a few steps with the sequence split over the ranks, and
the same model trained in one process on the whole sequence. The losses
agree to float32 rounding.

    torchrun --nproc_per_node 2 examples/context_parallel.py

(gloo on CPU tensors; on NVIDIA machines use NCCL with CUDA tensors:
``--backend nccl`` and a CUDA build of the engine.)
"""

import argparse
import os
import tempfile

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from flashattn import flash_attn_func
from flashattn.distributed import zigzag_ring_flash_attn_func, zigzag_shard


class Block(nn.Module):
    def __init__(self, dim, heads, kv_heads):
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, kv_heads, dim // heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, (heads + 2 * kv_heads) * self.hd)
        self.proj = nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x, attend):
        b, n, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(
            [self.heads * self.hd, self.kv_heads * self.hd, self.kv_heads * self.hd], dim=-1
        )
        q = q.view(b, n, self.heads, self.hd)
        k = k.view(b, n, self.kv_heads, self.hd)
        v = v.view(b, n, self.kv_heads, self.hd)
        x = x + self.proj(attend(q, k, v).reshape(b, n, -1))
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    def __init__(self, vocab, dim, heads, kv_heads, max_len):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(max_len, dim)
        self.blocks = nn.ModuleList([Block(dim, heads, kv_heads) for _ in range(2)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens, positions, attend):
        x = self.tok(tokens) + self.pos(positions)
        for blk in self.blocks:
            x = blk(x, attend)
        return self.head(self.norm(x))


def train(model, tokens, targets, positions, attend, steps, lr, total, parallel):
    """Summed token loss over ``total`` tokens, SGD; ``parallel``: each
    rank holds a share of the tokens, so gradients and losses are summed
    over the ranks."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        logits = model(tokens, positions, attend)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum") / total
        loss.backward()
        loss = loss.detach().clone()
        if parallel:
            for prm in model.parameters():
                dist.all_reduce(prm.grad)
            dist.all_reduce(loss)
        opt.step()
        losses.append(loss.item())
    return losses


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--seqlen", type=int, default=250)  # not a multiple of 2 * world: ragged
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--backend", default="gloo", help="gloo (CPU tensors) or nccl (CUDA tensors)")
    args = p.parse_args()
    if "RANK" not in os.environ:  # plain `python`: a world of one
        store = os.path.join(tempfile.mkdtemp(), "store")
        dist.init_process_group(args.backend, init_method=f"file://{store}", rank=0, world_size=1)
    else:
        dist.init_process_group(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    nccl = args.backend == "nccl"
    device = torch.device("cuda", rank % torch.cuda.device_count()) if nccl else "cpu"
    cfg = dict(vocab=64, dim=64, heads=4, kv_heads=2, max_len=args.seqlen)

    torch.manual_seed(0)  # the same weights and data on every rank
    tokens = torch.randint(0, cfg["vocab"], (2, args.seqlen + 1))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    positions = torch.arange(args.seqlen).expand(2, -1)
    init = TinyLM(**cfg).state_dict()

    model = TinyLM(**cfg).to(device)
    model.load_state_dict(init)
    shard = lambda t: zigzag_shard(t, rank, world).to(device)  # noqa: E731
    ring = lambda q, k, v: zigzag_ring_flash_attn_func(q, k, v, causal=True)  # noqa: E731
    total = inputs.numel()
    losses = train(model, shard(inputs), shard(targets), shard(positions), ring, args.steps,
                   0.5, total, True)  # fmt: skip

    if rank == 0:
        ref = TinyLM(**cfg).to(device)
        ref.load_state_dict(init)
        whole = lambda q, k, v: flash_attn_func(q, k, v, causal=True)  # noqa: E731
        dev = lambda t: t.to(device)  # noqa: E731
        ref_losses = train(ref, dev(inputs), dev(targets), dev(positions), whole, args.steps,
                           0.5, total, False)  # fmt: skip
        lengths = [zigzag_shard(inputs, r, world).shape[1] for r in range(world)]
        print(f"world {world}, seqlen {args.seqlen} (local lengths {lengths}), zigzag, causal")
        print("step  context-parallel  single-process  |diff|")
        for i, (a, b) in enumerate(zip(losses, ref_losses)):
            print(f"{i:4d}  {a:16.8f}  {b:14.8f}  {abs(a - b):.2e}")
        print(f"max |loss diff| = {max(abs(a - b) for a, b in zip(losses, ref_losses)):.3e}")
        params = max(
            (x - y).abs().max().item()
            for x, y in zip(model.state_dict().values(), ref.state_dict().values())
        )
        print(f"max |weight diff| after {args.steps} steps = {params:.3e}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
