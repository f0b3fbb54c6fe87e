"""Tensors crossing into the engine: torch tensors and numpy arrays in
float32, float16 and bfloat16 become ``(address, shape, dtype)`` of
contiguous host memory, without a copy where they already are (a CPU
tensor or array in row-major order); anything else (a non-contiguous view,
a tensor on a GPU) is copied to a contiguous host tensor first, and
outputs go back to the inputs' device."""

from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple

import numpy as np

from . import errors

try:
    import torch
except ImportError:  # numpy alone works; autograd and devices need torch
    torch = None  # type: ignore[assignment]

_NUMPY_DTYPES = {np.dtype(np.float32): "float32", np.dtype(np.float16): "float16"}
_TORCH_DTYPES = {}
if torch is not None:
    _TORCH_DTYPES = {
        torch.float32: "float32",
        torch.float16: "float16",
        torch.bfloat16: "bfloat16",
    }

Raw = Tuple[int, List[int], str]


def is_torch(x: Any) -> bool:
    return torch is not None and isinstance(x, torch.Tensor)


def dtype_name(x: Any) -> str:
    return str(x.dtype).replace("torch.", "")


def device_of(x: Any) -> str:
    return str(x.device) if is_torch(x) else "cpu"


def check_float(x: Any, name: str) -> str:
    """The engine's name for ``x``'s dtype, or ``UnsupportedDtype``."""
    if is_torch(x):
        name_ = _TORCH_DTYPES.get(x.dtype)
    elif isinstance(x, np.ndarray):
        name_ = _NUMPY_DTYPES.get(x.dtype)
    else:
        raise errors.error(
            "UnsupportedDtype",
            f"{name} is a {type(x).__name__}, expected a torch tensor or a numpy array",
            tensor=name,
            dtype=type(x).__name__,
            expected="torch.Tensor or numpy.ndarray",
        )
    if name_ is None:
        raise errors.error(
            "UnsupportedDtype",
            f"{name} has dtype {dtype_name(x)}, expected float32, float16 or bfloat16",
            tensor=name,
            dtype=dtype_name(x),
            expected="float32, float16 or bfloat16",
        )
    return name_


def check_rank(x: Any, name: str, ranks: Sequence[int]) -> None:
    if x.ndim not in ranks:
        shape = list(x.shape)
        expected = ranks[0]
        raise errors.error(
            "Rank",
            f"{name} has rank {x.ndim} (shape {shape}); expected {expected} dims",
            tensor=name,
            shape=shape,
            rank=x.ndim,
            expected=expected,
        )


def check_device(tensors: Sequence[Tuple[str, Any]], like: Any) -> None:
    want = device_of(like)
    for name, t in tensors:
        if t is None:
            continue
        got = device_of(t)
        if got != want or is_torch(t) != is_torch(like):
            kind = "a torch tensor" if is_torch(like) else "a numpy array"
            raise errors.error(
                "DeviceMismatch",
                f"{name} is on {got} ({type(t).__name__}) but q is {kind} on {want}",
                tensor=name,
                device=got,
                expected=want,
            )


def host(x: Any) -> Any:
    """``x`` as contiguous host memory (the same object where it already is)."""
    if is_torch(x):
        x = x.detach()
        if x.device.type != "cpu":
            x = x.to("cpu")
        return x.contiguous()
    return np.ascontiguousarray(x)


def raw(x: Any) -> Raw:
    """The engine's view of a contiguous host tensor ``x`` (keep ``x`` alive)."""
    if is_torch(x):
        return (x.data_ptr(), list(x.shape), _TORCH_DTYPES[x.dtype])
    return (x.ctypes.data, list(x.shape), _NUMPY_DTYPES[x.dtype])


def raw_codes(x: Any) -> Raw:
    """The engine's view of a contiguous host tensor of one-byte codes
    (int8, uint8, float8_e4m3fn)."""
    if is_torch(x):
        return (x.data_ptr(), list(x.shape), dtype_name(x))
    return (x.ctypes.data, list(x.shape), str(x.dtype))


def empty(shape: Sequence[int], like: Any, float32: bool = False) -> Any:
    """A host tensor of ``like``'s kind, in its dtype (or float32)."""
    if is_torch(like):
        return torch.empty(tuple(shape), dtype=torch.float32 if float32 else like.dtype)
    return np.empty(tuple(shape), dtype=np.float32 if float32 else like.dtype)


def to_device(x: Any, like: Any) -> Any:
    """``x`` (host) on ``like``'s device."""
    if is_torch(like) and like.device.type != "cpu":
        return x.to(like.device)
    return x


def int32_list(x: Any, name: str) -> Optional[List[int]]:
    """An int32 index tensor's values (``None`` stays ``None``)."""
    if x is None:
        return None
    ok = (is_torch(x) and x.dtype == torch.int32) or (
        isinstance(x, np.ndarray) and x.dtype == np.int32
    )
    if not ok:
        got = dtype_name(x) if hasattr(x, "dtype") else type(x).__name__
        raise errors.error(
            "UnsupportedDtype",
            f"{name} has dtype {got}, expected int32",
            tensor=name,
            dtype=got,
            expected="int32",
        )
    if is_torch(x):
        return x.detach().reshape(-1).cpu().tolist()
    return x.reshape(-1).tolist()


def float_list(x: Any) -> Optional[List[float]]:
    if x is None:
        return None
    if is_torch(x):
        return x.detach().reshape(-1).to("cpu", torch.float32).tolist()
    return np.asarray(x, dtype=np.float32).reshape(-1).tolist()


def as_bytes(x: Any) -> bytes:
    if is_torch(x):
        return x.detach().to("cpu", torch.uint8).contiguous().numpy().tobytes()
    return np.ascontiguousarray(x).astype(np.uint8).tobytes()
