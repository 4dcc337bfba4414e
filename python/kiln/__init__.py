"""kiln: a fusion compiler for NVIDIA GPUs."""

from ._errors import KilnAttributeError, KilnError, KilnInternalError, KilnTypeError
from .enums import DataType, MemoryType, ParallelType
from .fusion import FusionDefinition, Scalar, Tensor
from .multidevice import DeviceMesh
from .schedule import IterDomain

__version__ = "0.1.0"

__all__ = [
    "DataType",
    "DeviceMesh",
    "FusionDefinition",
    "IterDomain",
    "KilnAttributeError",
    "KilnError",
    "KilnInternalError",
    "KilnTypeError",
    "MemoryType",
    "ParallelType",
    "Scalar",
    "Tensor",
    "__version__",
]
