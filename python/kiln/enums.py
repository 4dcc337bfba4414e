"""Enums of the public API: data, parallel and memory types."""

from __future__ import annotations

import enum


class DataType(enum.Enum):
    """Element type of a tensor or scalar."""

    Float = "Float"
    Double = "Double"
    Half = "Half"
    BFloat16 = "BFloat16"
    Int = "Int"
    Int32 = "Int32"
    Bool = "Bool"


class ParallelType(enum.Enum):
    """How a loop axis maps onto the GPU."""

    Serial = "Serial"
    BIDx = "BIDx"
    BIDy = "BIDy"
    BIDz = "BIDz"
    TIDx = "TIDx"
    TIDy = "TIDy"
    TIDz = "TIDz"
    Vectorize = "Vectorize"
    Unroll = "Unroll"
    Unswitch = "Unswitch"
    Bulk = "Bulk"
    #: Spread over the devices of the tensor's DeviceMesh (nvFuser's ``mesh_x``).
    DIDx = "DIDx"
    mesh_x = "DIDx"


class MemoryType(enum.Enum):
    """Where a tensor lives."""

    Global = "Global"
    Shared = "Shared"
    Local = "Local"
    #: Blackwell's Tensor memory (sm_100a; tcgen05): per-thread 32-bit cells, one lane per
    #: thread of a block of at most 128 threads. Kernels using it do not run on sm_90.
    Tensor = "Tensor"
