# SPDX-License-Identifier: Apache-2.0
"""Python stand-in for vLLM 0.33.0's compiled ``vllm._C_stable_libtorch`` (a 92 MB
shared object for torch 2.14, not carried; ``vllm/platforms/cuda.py`` imports it
unconditionally). It registers, with torch-native implementations, the ``torch.ops._C``
and ``_C_cuda_utils`` ops the end-to-end path needs or looks up at construction:

* ``weak_ref_tensor`` (CUDA-graph wrappers) and ``get_cuda_view_from_cpu_tensor``
  (Model Runner V2's UVA buffers): tensors over non-owning storage;
* ``vocab_parallel_embedding``: at TP > 1 the only path of the embedding lookup;
* device attributes, and the CUTLASS capability probes (all "not supported").

Every other name vLLM's Python refers to without a ``hasattr`` probe (the device
script lists them beside this file) is defined as an op that raises if called: the
layers that look up ``rms_norm``, ``silu_and_mul`` or ``rotary_embedding`` run their
native paths in these runs, so a call of one of those would be a bug of the setup.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

_libs: dict[str, torch.library.Library] = {}  # kept alive


def _has_op(ns: str, name: str) -> bool:
    try:
        return hasattr(getattr(torch.ops, ns), name)
    except Exception:
        return False


def _define(ns: str, schema: str, fn: Callable) -> None:
    """Define ``ns::schema`` with ``fn`` unless a real extension has it."""
    name = schema.split("(", 1)[0]
    if _has_op(ns, name):
        return
    lib = _libs.get(ns) or _libs.setdefault(ns, torch.library.Library(ns, "FRAGMENT"))
    lib.define(schema)
    lib.impl(name, fn, "CompositeExplicitAutograd")


def _non_owning(t: torch.Tensor, data_ptr: int, device: torch.device) -> torch.Tensor:
    """``t``'s view over a storage at ``data_ptr`` that does not keep it alive."""
    storage = t.untyped_storage()
    base = data_ptr - (t.data_ptr() - storage.data_ptr())
    new = torch._C._construct_storage_from_data_pointer(base, device, storage.nbytes())
    out = torch.empty(0, dtype=t.dtype, device=device)
    return out.set_(new, t.storage_offset(), t.size(), t.stride())


def _host_device_pointer(host_ptr: int) -> int:
    try:
        from cuda.bindings import runtime as cudart  # type: ignore

        err, dptr = cudart.cudaHostGetDevicePointer(host_ptr, 0)
        if int(err) == 0:
            return int(dptr)
    except Exception:  # pragma: no cover - cuda-bindings missing or too old
        pass
    return host_ptr  # UVA: pinned host memory has the same address on the device


def _get_cuda_view_from_cpu_tensor(cpu_tensor: torch.Tensor) -> torch.Tensor:
    if cpu_tensor.device.type != "cpu":
        raise ValueError("get_cuda_view_from_cpu_tensor expects a CPU tensor")
    if cpu_tensor.numel() == 0:
        return torch.empty(cpu_tensor.shape, dtype=cpu_tensor.dtype, device="cuda")
    if not cpu_tensor.is_pinned():
        raise ValueError("get_cuda_view_from_cpu_tensor expects pinned memory")
    device = torch.device("cuda", torch.cuda.current_device())
    return _non_owning(cpu_tensor, _host_device_pointer(cpu_tensor.data_ptr()), device)


def _vocab_parallel_embedding(
    out: torch.Tensor,
    input_ids: torch.Tensor,
    weight: torch.Tensor,
    org_start: int,
    org_end: int,
    num_org_padding: int,
    added_start: int,
    added_end: int,
) -> None:
    """This rank's rows of a vocabulary-sharded embedding, zero rows for ids it does not
    own. The shard holds the ids [org_start, org_end), then ``num_org_padding`` padding
    rows, then the ids [added_start, added_end). Into ``out`` without a host sync or a
    data-dependent shape, so that it can be captured."""
    ids = input_ids.reshape(-1).to(torch.int64)
    in_org = (ids >= org_start) & (ids < org_end)
    owned = in_org | ((ids >= added_start) & (ids < added_end))
    added_row = ids - added_start + (org_end - org_start) + num_org_padding
    row = torch.where(owned, torch.where(in_org, ids - org_start, added_row), 0)
    torch.index_select(weight, 0, row, out=out)
    out.masked_fill_(~owned.unsqueeze(-1), 0)


def _get_device_attribute(attribute: int, device: int) -> int:
    from cuda.bindings import runtime as cudart  # type: ignore

    err, value = cudart.cudaDeviceGetAttribute(cudart.cudaDeviceAttr(attribute), device)
    if int(err) != 0:
        raise RuntimeError(f"cudaDeviceGetAttribute({attribute}, {device}) failed: {err}")
    return int(value)


def _max_shared_memory_per_block(device: int) -> int:
    try:
        return _get_device_attribute(97, device)  # cudaDevAttrMaxSharedMemoryPerBlockOptin
    except Exception:
        props = torch.cuda.get_device_properties(device)
        return int(
            getattr(props, "shared_memory_per_block_optin", 0) or props.shared_memory_per_block
        )


CAPABILITY_QUERIES = (  # probed at import; no CUTLASS kernel is carried
    "cutlass_scaled_mm_supports_fp4",
    "cutlass_scaled_mm_supports_fp8",
    "cutlass_scaled_mm_supports_block_fp8",
    "cutlass_group_gemm_supported",
    "mxfp4_experts_quant_supported",
)
for _name in CAPABILITY_QUERIES:
    _define("_C", f"{_name}(int cuda_device_capability) -> bool", lambda capability: False)
for _schema, _fn in {
    "weak_ref_tensor(Tensor input) -> Tensor": lambda t: _non_owning(t, t.data_ptr(), t.device),
    "get_cuda_view_from_cpu_tensor(Tensor cpu_tensor) -> Tensor": _get_cuda_view_from_cpu_tensor,
    "vocab_parallel_embedding(Tensor(a!) out, Tensor input_ids, Tensor weight, int"
    " org_vocab_start_index, int org_vocab_end_index, int num_org_vocab_padding, int"
    " added_vocab_start_index, int added_vocab_end_index) -> ()": _vocab_parallel_embedding,
}.items():
    _define("_C", _schema, _fn)
_define(
    "_C_cuda_utils",
    "get_device_attribute(int attribute, int device_id) -> int",
    _get_device_attribute,
)
_define(
    "_C_cuda_utils",
    "get_max_shared_memory_per_block_device_attribute(int device_id) -> int",
    _max_shared_memory_per_block,
)

# Ops vLLM's Python names (often at import) but the runs must never execute: each raises.
PLACEHOLDERS: list[str] = []
_listed = os.path.join(os.path.dirname(__file__), "_C_stable_libtorch_placeholders.txt")
if os.path.exists(_listed):
    with open(_listed) as _f:
        for _line in filter(None, map(str.strip, _f)):
            _ns, _name = _line.split("::")
            if _has_op(_ns, _name):
                continue
            _lib = _libs.get(_ns) or _libs.setdefault(_ns, torch.library.Library(_ns, "FRAGMENT"))

            def _missing(*args: object, _q: str = _line) -> None:
                raise NotImplementedError(
                    f"{_q}: compiled vLLM kernel not carried (placeholder op)"
                )

            _lib.define(f"{_name}() -> ()")
            _lib.impl(_name, _missing, "CompositeExplicitAutograd")
            PLACEHOLDERS.append(_line)
IS_SHIM = True
