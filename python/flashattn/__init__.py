"""flashattn: FlashAttention (exact, IO-aware attention) on any GPU or the CPU.

A drop-in for flash-attn's functions, with autograd::

    from flashattn import flash_attn_func
    o = flash_attn_func(q, k, v, causal=True)   # torch tensors or numpy arrays

The engine runs its WGSL kernels through wgpu (Vulkan, Metal, DX12), its
CUDA kernels in a build with CUDA, or its multi-threaded CPU backend;
``backend_info()`` says which one ``"auto"`` takes here, and why.
Errors are typed: see :mod:`flashattn.errors`.
"""

from . import errors
from ._native import max_head_dim, version
from .errors import *  # noqa: F401,F403  (the exception classes)
from .functional import (
    HADAMARD_SEED,
    backend_info,
    default_backend,
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
    flash_attn_with_kvcache,
    quantize_kv_cache,
)

__version__ = version()

__all__ = [
    "HADAMARD_SEED",
    "backend_info",
    "default_backend",
    "errors",
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_with_kvcache",
    "max_head_dim",
    "quantize_kv_cache",
    *errors.__all__,
]
