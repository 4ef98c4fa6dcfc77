# SPDX-License-Identifier: Apache-2.0
"""Python stand-in for vLLM 0.33.0's compiled ``vllm._C_stable_libtorch``.

The real module is a 92 MB shared object built against torch 2.14. It is not
copied to the GPU machine (only Python files and small wheels are) and would
not load on that machine's torch 2.11 anyway. ``vllm/platforms/cuda.py`` imports it
unconditionally, and a few layers look ops up at construction time
(``self.op = torch.ops._C.silu_and_mul``), so this module registers a small
set of ``torch.ops._C`` / ``torch.ops._C_cuda_utils`` ops with torch-native
implementations:

* ``weak_ref_tensor``: used by vLLM's CUDA-graph wrappers. Built as a tensor
  over a non-owning storage (``torch._C._construct_storage_from_data_pointer``),
  so, like the C++ op, it does not keep the original allocation alive.
* ``get_cuda_view_from_cpu_tensor``: Model Runner V2's UVA buffers. A pinned
  host tensor is mapped to its device pointer (``cudaHostGetDevicePointer``
  through cuda-bindings when present, else the UVA identity) and wrapped as a
  non-owning CUDA tensor.
* ``rms_norm``, ``fused_add_rms_norm``, ``silu_and_mul``, ``gelu_and_mul``,
  ``gelu_tanh_and_mul``, ``rotary_embedding``: torch-native fallbacks. The
  end-to-end driver selects vLLM's native paths (custom ops off, IR op
  priority "native"), so these exist mainly because some layers look the op
  up in ``__init__``; every call is counted in ``CALLS`` so the driver can
  report whether any of them ran.
* ``vocab_parallel_embedding``: the tensor-parallel embedding lookup
  (``VocabParallelEmbedding.forward`` through ``_custom_ops`` whenever
  TP > 1 on CUDA with unquantised weights). Not a fallback: at TP > 1 it is
  the only path, so it runs (and is captured) in every such run.
* ``_C_cuda_utils.get_device_attribute`` and
  ``get_max_shared_memory_per_block_device_attribute`` via torch's device
  properties / cuda-bindings.

Everything else from the real extension (cache ops for FlashAttention,
quantisation kernels, custom all-reduce, MoE, ...) is deliberately absent:
vLLM guards those lookups with ``hasattr`` or only reaches them on paths that
the end-to-end run does not take (Triton attention, no quantisation, custom
all-reduce disabled or missing its library at TP > 1).
"""

from __future__ import annotations

import collections

import torch
import torch.nn.functional as F

CALLS: collections.Counter = collections.Counter()

_libs: list[torch.library.Library] = []


def _lib(ns: str) -> torch.library.Library:
    lib = torch.library.Library(ns, "FRAGMENT")
    _libs.append(lib)  # keep alive
    return lib


def _has_op(ns: str, name: str) -> bool:
    try:
        return hasattr(getattr(torch.ops, ns), name)
    except Exception:
        return False


def _define(
    lib: torch.library.Library, ns: str, schema: str, fn, *, keys=("CompositeExplicitAutograd",)
):
    name = schema.split("(", 1)[0]
    if _has_op(ns, name):
        return  # a real extension already provides it

    def counted(*args, _fn=fn, _name=name):
        CALLS[f"{ns}::{_name}"] += 1
        return _fn(*args)

    lib.define(schema)
    for key in keys:
        lib.impl(name, counted, key)


# --------------------------------------------------------------------------
# non-owning tensors
# --------------------------------------------------------------------------


def _non_owning(t: torch.Tensor, data_ptr: int, device: torch.device) -> torch.Tensor:
    storage = t.untyped_storage()
    base = storage.data_ptr()
    nbytes = storage.nbytes()
    new_storage = torch._C._construct_storage_from_data_pointer(
        data_ptr - (t.data_ptr() - base), device, nbytes
    )
    out = torch.empty(0, dtype=t.dtype, device=device)
    out.set_(new_storage, t.storage_offset(), t.size(), t.stride())
    return out


def _weak_ref_tensor(t: torch.Tensor) -> torch.Tensor:
    return _non_owning(t, t.data_ptr(), t.device)


def _host_device_pointer(host_ptr: int) -> int:
    try:
        from cuda.bindings import runtime as cudart  # type: ignore

        err, dptr = cudart.cudaHostGetDevicePointer(host_ptr, 0)
        if int(err) == 0:
            return int(dptr)
    except Exception:  # pragma: no cover - cuda-bindings missing or too old
        pass
    return host_ptr  # UVA: pinned host memory has the same address on device


def _get_cuda_view_from_cpu_tensor(cpu_tensor: torch.Tensor) -> torch.Tensor:
    if cpu_tensor.device.type != "cpu":
        raise ValueError("get_cuda_view_from_cpu_tensor expects a CPU tensor")
    if cpu_tensor.numel() == 0:
        return torch.empty(cpu_tensor.shape, dtype=cpu_tensor.dtype, device="cuda")
    if not cpu_tensor.is_pinned():
        raise ValueError("get_cuda_view_from_cpu_tensor expects pinned memory")
    device = torch.device("cuda", torch.cuda.current_device())
    return _non_owning(cpu_tensor, _host_device_pointer(cpu_tensor.data_ptr()), device)


# --------------------------------------------------------------------------
# torch-native kernels (fallbacks)
# --------------------------------------------------------------------------


def _rms(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    y = y.to(x.dtype)
    if weight is not None:
        y = y * weight
    return y


def _rms_norm(out, x, weight, eps):
    out.copy_(_rms(x, weight, eps))


def _fused_add_rms_norm(x, residual, weight, eps):
    s = x + residual
    residual.copy_(s)
    x.copy_(_rms(s, weight, eps))


def _silu_and_mul(out, x):
    d = x.shape[-1] // 2
    out.copy_(F.silu(x[..., :d]) * x[..., d:])


def _gelu_and_mul(out, x):
    d = x.shape[-1] // 2
    out.copy_(F.gelu(x[..., :d]) * x[..., d:])


def _gelu_tanh_and_mul(out, x):
    d = x.shape[-1] // 2
    out.copy_(F.gelu(x[..., :d], approximate="tanh") * x[..., d:])


def _rope_one(x, positions, head_size, cos_sin_cache, is_neox, offset, inverse):
    if x is None:
        return
    rot_dim = cos_sin_cache.shape[-1]
    n = positions.numel()
    xv = x.view(n, -1, head_size)
    cs = cos_sin_cache.index_select(0, positions.reshape(-1)).to(x.dtype)
    cos, sin = cs.chunk(2, dim=-1)
    if inverse:
        sin = -sin
    cos = cos.unsqueeze(1)
    sin = sin.unsqueeze(1)
    part = xv[..., offset : offset + rot_dim]
    if is_neox:
        x1, x2 = part.chunk(2, dim=-1)
        rot = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    else:
        x1 = part[..., 0::2]
        x2 = part[..., 1::2]
        rot = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    part.copy_(rot)


def _rotary_embedding(
    positions, query, key, head_size, cos_sin_cache, is_neox, rope_dim_offset=0, inverse=False
):
    _rope_one(query, positions, head_size, cos_sin_cache, is_neox, rope_dim_offset, inverse)
    _rope_one(key, positions, head_size, cos_sin_cache, is_neox, rope_dim_offset, inverse)


def _vocab_parallel_embedding(
    out: torch.Tensor,
    input_ids: torch.Tensor,
    weight: torch.Tensor,
    org_vocab_start_index: int,
    org_vocab_end_index: int,
    num_org_vocab_padding: int,
    added_vocab_start_index: int,
    added_vocab_end_index: int,
) -> None:
    """This rank's rows of a vocabulary-sharded embedding, zero rows elsewhere.

    The shard holds the ids [org_start, org_end) in its first rows, then
    ``num_org_vocab_padding`` padding rows, then the ids [added_start,
    added_end). An id outside both ranges (another rank's, a negative padding
    id) gives a zero row, so summing the ranks' outputs gives the full lookup.
    Written into ``out`` ([num_tokens, embedding_dim]) without a host sync or a
    data-dependent shape, so it can be captured in a CUDA graph."""
    ids = input_ids.reshape(-1).to(torch.int64)
    in_org = (ids >= org_vocab_start_index) & (ids < org_vocab_end_index)
    in_added = (ids >= added_vocab_start_index) & (ids < added_vocab_end_index)
    added_first_row = (org_vocab_end_index - org_vocab_start_index) + num_org_vocab_padding
    row = torch.where(
        in_org,
        ids - org_vocab_start_index,
        ids - added_vocab_start_index + added_first_row,
    )
    owned = in_org | in_added
    row = torch.where(owned, row, torch.zeros_like(row))  # any valid row; zeroed below
    torch.index_select(weight, 0, row, out=out)
    out.masked_fill_(~owned.unsqueeze(-1), 0)


# --------------------------------------------------------------------------
# device attributes
# --------------------------------------------------------------------------


def _get_device_attribute(attribute: int, device: int) -> int:
    from cuda.bindings import runtime as cudart  # type: ignore

    err, value = cudart.cudaDeviceGetAttribute(cudart.cudaDeviceAttr(attribute), device)
    if int(err) != 0:
        raise RuntimeError(f"cudaDeviceGetAttribute({attribute}, {device}) failed: {err}")
    return int(value)


def _get_max_shared_memory_per_block_device_attribute(device: int) -> int:
    # cudaDevAttrMaxSharedMemoryPerBlockOptin == 97
    try:
        return _get_device_attribute(97, device)
    except Exception:
        props = torch.cuda.get_device_properties(device)
        return int(
            getattr(props, "shared_memory_per_block_optin", 0) or props.shared_memory_per_block
        )


_CAPABILITY_QUERIES = (
    # module-level / construction-time capability probes in vLLM's Python
    # (e.g. w8a8_utils.CUTLASS_BLOCK_FP8_SUPPORTED at import). No CUTLASS
    # kernels are carried, so every answer is "not supported".
    "cutlass_scaled_mm_supports_fp4",
    "cutlass_scaled_mm_supports_fp8",
    "cutlass_scaled_mm_supports_block_fp8",
    "cutlass_group_gemm_supported",
    "mxfp4_experts_quant_supported",
)


def _unsupported(_capability: int) -> bool:
    return False


def _register() -> None:
    c = _lib("_C")
    for name in _CAPABILITY_QUERIES:
        _define(c, "_C", f"{name}(int cuda_device_capability) -> bool", _unsupported)
    _define(c, "_C", "weak_ref_tensor(Tensor input) -> Tensor", _weak_ref_tensor)
    _define(
        c,
        "_C",
        "get_cuda_view_from_cpu_tensor(Tensor cpu_tensor) -> Tensor",
        _get_cuda_view_from_cpu_tensor,
    )
    _define(
        c,
        "_C",
        "rms_norm(Tensor(a!) result, Tensor input, Tensor? weight, float epsilon) -> ()",
        _rms_norm,
    )
    _define(
        c,
        "_C",
        "fused_add_rms_norm(Tensor(a!) input, Tensor(b!) residual, Tensor? weight, "
        "float epsilon) -> ()",
        _fused_add_rms_norm,
    )
    _define(c, "_C", "silu_and_mul(Tensor(a!) result, Tensor input) -> ()", _silu_and_mul)
    _define(c, "_C", "gelu_and_mul(Tensor(a!) result, Tensor input) -> ()", _gelu_and_mul)
    _define(c, "_C", "gelu_tanh_and_mul(Tensor(a!) result, Tensor input) -> ()", _gelu_tanh_and_mul)
    _define(
        c,
        "_C",
        "rotary_embedding(Tensor positions, Tensor(a!) query, Tensor(b!)? key, int head_size, "
        "Tensor cos_sin_cache, bool is_neox, int rope_dim_offset=0, bool inverse=False) -> ()",
        _rotary_embedding,
    )
    _define(
        c,
        "_C",
        "vocab_parallel_embedding(Tensor(a!) out, Tensor input_ids, Tensor weight, "
        "int org_vocab_start_index, int org_vocab_end_index, int num_org_vocab_padding, "
        "int added_vocab_start_index, int added_vocab_end_index) -> ()",
        _vocab_parallel_embedding,
    )
    u = _lib("_C_cuda_utils")
    _define(
        u,
        "_C_cuda_utils",
        "get_device_attribute(int attribute, int device_id) -> int",
        _get_device_attribute,
    )
    _define(
        u,
        "_C_cuda_utils",
        "get_max_shared_memory_per_block_device_attribute(int device_id) -> int",
        _get_max_shared_memory_per_block_device_attribute,
    )


PLACEHOLDERS: list[str] = []


def _register_placeholders() -> None:
    """Ops vLLM's Python names (often at import time) but this run must never
    execute. apply_shims.py lists them next to this file; each raises."""
    import os

    path = os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "_C_stable_libtorch_placeholders.txt"
    )
    if not os.path.exists(path):
        return
    libs: dict[str, torch.library.Library] = {}
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            ns, name = line.split("::")
            if _has_op(ns, name):
                continue
            lib = libs.get(ns) or libs.setdefault(ns, _lib(ns))

            def _missing(*args, _q=line):
                raise NotImplementedError(
                    f"{_q}: compiled vLLM kernel not carried (vllm-e2e placeholder op)"
                )

            lib.define(f"{name}() -> ()")
            lib.impl(name, _missing, "CompositeExplicitAutograd")
            PLACEHOLDERS.append(line)


_register()
_register_placeholders()
IS_SHIM = True
