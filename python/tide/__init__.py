"""TIDE: zero-copy collectives for PyTorch FSDP2.

The C++ core (``tide._tide``) plans and runs TIDE-AG / TIDE-RS; this package is the thin layer
PyTorch users touch. Pointers are passed as ints (``tensor.data_ptr()``), streams as ints.
"""

from ._tide import (  # noqa: F401
    Bootstrap,
    BucketLayout,
    CallbackBootstrap,
    Collective,
    DesyncError,
    Delivery,
    DType,
    FileBootstrap,
    HostAddressRange,
    HostExecutor,
    HostWindow,
    NcclComm,
    AcrossNodesOptions,
    ParamLayout,
    ParamSpec,
    Program,
    ReduceKind,
    ReduceOptions,
    Topology,
    cuda_built,
    cuda_device_available,
    cuda_device_count,
    default_delivery,
    default_timeout_ms,
    dtype_size,
    nccl_path,
    nccl_version,
    parse_dtype,
    plan_all_gather,
    plan_reduce_scatter,
    verify_programs,
)

if cuda_built:
    from ._tide import (  # noqa: F401
        CudaAddressRange, CudaExecutor, CudaMemory, CudaWindowScope, CudaStats, CudaWindow)

__version__ = "0.1.0"
