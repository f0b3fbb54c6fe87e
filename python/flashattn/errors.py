"""The engine's errors as Python exceptions.

Every variant of the Rust ``flashattn::Error`` has a class of the same name
here, and the fields of the typed error are attributes of the exception::

    try:
        flash_attn_func(q, k, v)
    except flashattn.HeadDimTooLarge as e:
        print(e.head_dim, e.max)

Bad input (shapes, dtypes, indices, options) raises subclasses of
``ValueError``; a feature the engine or a backend does not have (dropout
on CUDA, say) raises subclasses of ``NotImplementedError``;
everything that goes wrong on a device raises subclasses of
``RuntimeError``. All of them are ``FlashAttnError``\\ s.
"""

from __future__ import annotations

from typing import Any, Dict


class FlashAttnError(Exception):
    """Base of every flashattn exception: ``.fields`` holds the typed
    error's fields, each also an attribute."""

    def __init__(self, message: str, **fields: Any) -> None:
        super().__init__(message)
        self.message = message
        self.fields: Dict[str, Any] = dict(fields)
        for name, value in fields.items():
            setattr(self, name, value)


class InputError(FlashAttnError, ValueError):
    """The caller's input breaks a rule (shape, dtype, index, option)."""


class ConfigurationError(FlashAttnError, ValueError):
    """A tuning or plan override the device or kernel cannot take."""


class UnsupportedError(FlashAttnError, NotImplementedError):
    """A feature this backend or entry point does not implement (yet)."""


class HardwareError(FlashAttnError, RuntimeError):
    """The device or the build lacks what the call needs."""


class ExecutionError(FlashAttnError, RuntimeError):
    """The device failed while running the call."""


# Variant names of flashattn::Error, by who has to act (src/error.rs).
# tests/test_errors.py checks this table against src/error.rs.
_INPUT = """PositionTooLarge EmptyDim HeadDimTooLarge HeadsNotDivisible SizeOverflow DataLength Rank
DimMismatch ShapeMismatch DtypeMismatch NonFiniteScale NonFiniteInput InvalidSoftcap
UnknownName IndexLength NegativeIndex CacheOverflow PageOutOfRange AppendConflict
CacheIndex LatentViewTooWide LatentAppend CuSeqlensStart CuSeqlensDecrease CuSeqlensTotal PackedBatch AlibiSlopes
AlibiShape NonFinite BlockSize BlockMaskDim BufferTooSmall MisalignedBinding OverlappingBindings
EncodedCallSplit BindingOutsideBuffer BufferUsage InvalidDropout MissingDropoutSeed InvalidCacheScale
CacheFormat ForeignCache"""
_UNSUPPORTED = "Unsupported BackendNotBuilt"
_CONFIGURATION = """StorageOverride WorkgroupStorage WorkgroupTooLarge RegisterPressure
EmptyTile TileOverrideOnLanes RegisterOverrideElsewhere RowsPerThread LanesHeadDim
CoopHeadDim CoopTile ThreadsOverrideOnCoop"""
_HARDWARE = """LanesUnavailable SubgroupReduce IsaUnavailable NativeF16Unavailable
CoopMatrixUnavailable Fp8Unsupported BindingTooLarge GridTooLarge Overflow TooManySplits
CudaUnavailable CudaArch CudaArchUnfit NoAdapter LoopLimitTooLow HostMemory"""
_EXECUTION = """RequestDevice Device OutOfMemory Uncaptured Poll Map MapRange DeviceLost
LoopBudget CudaCompile CudaJit CudaDriver Poisoned VerificationFailed TuneCacheWrite"""

# Raised by the Python layer itself (tensors the engine never sees).
_PYTHON_ONLY = {
    "DeviceMismatch": (
        InputError,
        "Tensors of one call are on different devices (fields: tensor, device, expected).",
    ),
    "MaxSeqlen": (
        InputError,
        "max_seqlen_q or max_seqlen_k is shorter than a sequence of cu_seqlens "
        "(fields: argument, value, longest).",
    ),
    "UnsupportedDtype": (
        InputError,
        "A tensor's dtype is not float32, float16 or bfloat16, or an index tensor's not int32 "
        "(fields: tensor, dtype, expected).",
    ),
}

_BASES = {
    **{n: InputError for n in _INPUT.split()},
    **{n: UnsupportedError for n in _UNSUPPORTED.split()},
    **{n: ConfigurationError for n in _CONFIGURATION.split()},
    **{n: HardwareError for n in _HARDWARE.split()},
    **{n: ExecutionError for n in _EXECUTION.split()},
}

VARIANTS = tuple(_BASES)
"""The names of the engine's error variants, each a class here."""

for _name, _base in _BASES.items():
    globals()[_name] = type(
        _name,
        (_base,),
        {"__doc__": f"flashattn::Error::{_name}; its fields are attributes.", "__module__": __name__},
    )
for _name, (_base, _doc) in _PYTHON_ONLY.items():
    globals()[_name] = type(_name, (_base,), {"__doc__": _doc, "__module__": __name__})


def from_native(name: str, message: str, fields: Dict[str, Any]) -> FlashAttnError:
    """The exception for an engine error (called by the native module)."""
    cls = globals().get(name)
    if not (isinstance(cls, type) and issubclass(cls, FlashAttnError)):
        cls = ExecutionError
    return cls(message, **fields)


def error(name: str, message: str, **fields: Any) -> FlashAttnError:
    """An exception of class ``name`` raised by the Python layer."""
    return globals()[name](message, **fields)


__all__ = [
    "FlashAttnError",
    "InputError",
    "ConfigurationError",
    "UnsupportedError",
    "HardwareError",
    "ExecutionError",
    "VARIANTS",
    *VARIANTS,
    *_PYTHON_ONLY,
]
