"""Patch for ``vllm.model_executor.layers.attention.mla_attention`` (vLLM 0.33.0).

vLLM does: with decode context parallelism (DCP world size N > 1) an MLA
layer's decode (MQA) path gathers the query heads of every DCP rank, runs the
decode kernel over all N*H heads, and combines the partial outputs through
their log-sum-exps. Every buffer of that path is made per call and grows with
the tokens T that reach it. The memory profile runs the model without
attention metadata (``profile_run`` with attention skipped): ``forward_impl``
then reserves only the prefill context chunk's ``kv_b_proj`` output and the
backend's workspace, so none of these transients is in the peak that sizes the
KV cache, and the first long decode batch after start-up needs memory the KV
cache took.

The transients, per layer, in execution order (H heads per TP rank, L
``kv_lora_rank``, R ``qk_rope_head_dim``, D = L + R; e bytes per activation,
e_q per query element, fp8 where the query is quantized; LSE in float32):

- the absorbed query ``[T, H, L]`` (e), live to the end of the call, and the
  concatenated query ``[T, H, D]`` (e_q) the gather sends, dropped once the
  gather returns; with query replication both arrive with N*H heads and stay;
- query all-gather (vLLM's ``_gather_query``): the collective's output
  ``[N*T, H, D]`` and its head-major copy ``[T, N*H, D]`` (e_q), both live
  while the copy is made; the direct symmetric-memory gather returns a view of
  its persistent workspace up to its capacity M (``max_num_tokens``) and falls
  back to the all-gather above it; with query replication nothing is gathered;
- decode kernel outputs over all heads: ``[T, N*H, L]`` (e) and ``[T, N*H]``,
  over the backend's padded head count where it pads (CUTLASS: 128); on the
  sparse backends that support DCP, from the gathered query on (K the top-k
  buffer's width, P the FP8 kernel's head count, 64 or 128; Dq its query width):
  - ``FLASHMLA_SPARSE``: the DCP index conversion ``[T, K]`` int32, live through
    the kernel; where N*H < P the query padded to ``[T, P, Dq]`` (bf16, until the
    kernel returns); the kernel's ``[T, P, L]`` (bf16) and LSE ``[T, P]``, whose
    sliced view stays live; the empty-row mask ``[T, K]`` bool, dropped at once;
    where N*H < P the packed output ``[T, N*H, L]`` (e), after which the padded
    one goes; a query narrower than Dq (a NoPE layer on ``fp8_ds_mla``) first
    padded to ``[T, N*H, Dq]``;
  - ``FLASHINFER_MLA_SPARSE``: the index conversion ``[T, K]`` and its valid
    counts ``[T]`` (int32), live through the kernel; outputs unpadded; the
    empty-row mask ``[T, K]`` bool (not on a NoPE layer);
  - ``FLASH_ATTN_MLA_SPARSE_FA4``: FlashInfer's path for a batch with prefill
    tokens, then its LSE rescaled to base e ``[T, N*H]`` float32, replacing it;
- combine, by the backend vLLM selected (``dcp_comm_backend``):
  - ``ag_rs`` (``cp_lse_ag_out_rs``): the LSE all-gather ``[N*T, N*H]`` with
    the corrected LSE ``[T, N*H]`` (after a packed copy ``[T, N*H]`` float32 of
    ``FLASHMLA_SPARSE``'s transposed LSE); then the reduce-scatter's input copy
    ``[N*H, T, L]``, its output ``[H, T, L]`` and the result ``[T, H, L]`` (e);
  - ``a2a`` over NCCL (``dcp_a2a_lse_reduce``): send and receive buffers
    ``[N, T, H, L + p]`` each (e; p = 2 LSE columns packed into a 16-bit
    dtype, 1 into float32) and the result ``[T, H, L]``;
  - ``a2a`` through the direct symmetric-memory workspace: the result
    ``[T, H, L]`` alone up to its capacity M, the NCCL ``a2a`` above it.

T is the tokens the decode path can take in one call: the whole dummy batch
for sparse MLA (a prefill longer than the indexer's top-k goes through the
decode path with every token of the batch), the DCP workspaces' capacity M
(``get_dcp_workspace_max_num_tokens``) otherwise.

Not modelled, so not reserved: small per-token vectors (the empty-shard
mask's indices, a NoPE layer's ``[T]`` length masks); what a kernel makes inside
its own op or library (FlashMLA's split-KV accumulators, FlashInfer's and FA4's
workspaces, the split-KV partials FlashAttention's FA4 interface makes for an
all-decode batch, DeepGEMM's logits); prefill context parallelism with DCP (the
DeepSeek-V3.2 layer's, which gathers over the TP group); the sparse indexer's
decode logits upcast to float32 ``[R, max_model_len]`` (R at most
``min(max_num_batched_tokens, max_num_seqs * (1 + speculative tokens))``), live
through the top-K merge: DCP forces the upcast, but vLLM's default top-k
selection makes it with one rank too, and vLLM's indexer stands it in with its
``VLLM_SPARSE_INDEXER_MAX_LOGITS_MB`` reservation (512 MiB), which covers it
while ``R * max_model_len * 4`` bytes fit (raise that variable beyond); and the
model-specific MLA layers with their own DCP paths (Kimi K3's, GLM-5-next's
indexer, which imports vLLM's reservation by value).

This patch changes: in that profiling branch, during a runner's
``profile_run`` (:mod:`vllm_specgraph.patches._profile_run`) and never while a
graph is captured, when the layer has a DCP manager (N > 1), ``forward_impl``
first makes every transient above with its shape and dtype, in the order and
with the lifetimes listed, and drops them before vLLM's own reservation; the
profile's peak then holds the decode path's largest live set on top of what
the dummy run holds at the attention call. The largest reservation is recorded
per owner (target layers, draft layers: the owner whose lane is current) and
logged once per owner and size. It allocates without computing, so it costs
no start-up time and has no switch; with N = 1 nothing changes.

Why: KV-cache memory the first long decode batch needs is an out-of-memory
error in serving, long after start-up succeeded; the profile is where vLLM
looks for the memory the forward pass takes.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from vllm_specgraph.channels import stream_is_capturing
from vllm_specgraph.lanes import current_owner_name
from vllm_specgraph.patches._patching import PatchSet
from vllm_specgraph.patches._profile_run import in_profile_run

__all__ = [
    "Transient",
    "decode_transients",
    "install",
    "peak_bytes",
    "profiling",
    "reserve",
    "reserved_bytes",
]

logger = logging.getLogger("vllm.specgraph")

_MIB = 1 << 20

_reserved: dict[str, int] = {}


@dataclass(frozen=True)
class Transient:
    """One buffer of a path: made at its place in the sequence, live until ``drop``."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


Step = tuple[str, Transient | str]
"""``("make", transient)`` or ``("drop", name)``."""


def peak_bytes(steps: Sequence[Step]) -> int:
    """The largest sum of live transients over ``steps``."""
    live: dict[str, int] = {}
    peak = 0
    for action, item in steps:
        if action == "make":
            assert isinstance(item, Transient)
            live[item.name] = item.nbytes
            peak = max(peak, sum(live.values()))
        else:
            live.pop(item)  # type: ignore[arg-type]
    return peak


def _combine_kind(manager: Any) -> tuple[str, int | None]:
    """The combine vLLM's ``MLADCPManager`` selected, and a direct workspace's capacity."""
    from vllm.v1.attention.ops import dcp

    combine = manager.combine
    func = getattr(combine, "func", combine)
    if getattr(func, "__func__", None) is dcp.MLADCPManager._direct_workspace_combine:
        return "direct_a2a", combine.args[0].max_num_tokens
    for kind, fn in (
        ("ag_rs", dcp.cp_lse_ag_out_rs),
        ("ag_ar", dcp.cp_lse_ag_out_ar),
        ("a2a", dcp.dcp_a2a_lse_reduce),
    ):
        if func is fn:
            return kind, None
    raise RuntimeError(
        f"vllm-specgraph cannot size the DCP combine {func!r}: vLLM 0.33.0's MLADCPManager "
        "selects cp_lse_ag_out_rs, cp_lse_ag_out_ar, dcp_a2a_lse_reduce or its direct "
        "workspace; set VLLM_SPECGRAPH=0 for a vLLM that adds another"
    )


def _gathers_query(manager: Any, num_tokens: int) -> bool:
    """Whether the query gather makes new buffers for ``num_tokens`` (a direct
    workspace returns a view of itself up to its capacity)."""
    gather = manager.query_gather
    if gather is None:
        return True  # prefill context parallelism gathers over the TP group
    direct = getattr(gather, "args", ())
    return not direct or num_tokens > direct[0].max_num_tokens


def decode_transients(
    layer: Any,
    num_tokens: int,
    dtype: torch.dtype,
    *,
    replicated_query: bool = False,
    with_ql_nope: bool = True,
) -> list[Step]:
    """The decode path's transients of ``layer`` for ``num_tokens`` tokens of
    activation ``dtype``, in order (see the module docstring); empty without a
    DCP manager or with prefill context parallelism. ``with_ql_nope``: the
    layer makes the absorbed query itself (DeepSeek-V3.2's has it already)."""
    manager = getattr(layer, "dcp_manager", None)
    if manager is None or manager.query_gather is None or num_tokens <= 0:
        return []
    n, h = manager.group.world_size, layer.num_heads
    lora, rope = layer.kv_lora_rank, layer.qk_rope_head_dim
    t = num_tokens if layer.impl.is_sparse else min(num_tokens, manager.max_num_tokens)
    query = _query_dtype(layer, dtype)
    heads = n * h if replicated_query else h
    kernel_heads = max(n * h, manager.padded_num_heads or 0)
    steps: list[Step] = []

    def make(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        steps.append(("make", Transient(name, shape, dtype)))

    def drop(*names: str) -> None:
        steps.extend(("drop", name) for name in names)

    if with_ql_nope:
        make("ql_nope", (t, heads, lora), dtype)
    make("query", (t, heads, lora + rope), query)
    if not replicated_query:
        if _gathers_query(manager, t):
            make("gather_out", (n * t, h, lora + rope), query)
            make("gathered_query", (t, n * h, lora + rope), query)
            drop("gather_out")
        drop("query")  # the gather's result replaces it
    kernel = _sparse_kernel(layer.impl)
    if kernel is None:
        make("attn_out", (t, kernel_heads, lora), dtype)
        make("lse", (t, kernel_heads), torch.float32)
    else:
        _sparse_kernel_transients(kernel, layer, t, n * h, dtype, make, drop)
    kind, capacity = _combine_kind(manager)
    if kind == "direct_a2a" and capacity is not None and t > capacity:
        kind = "a2a"
    if kind in ("ag_rs", "ag_ar"):
        packs_lse = kernel == "flashmla"  # its LSE is a transposed view, copied to gather
        if packs_lse:
            make("lse_packed", (t, n * h), torch.float32)
        make("lse_gathered", (n * t, n * h), torch.float32)
        make("lse_corrected", (t, n * h), torch.float32)
        drop("lse_gathered", *["lse_packed"] * packs_lse)
        if kind == "ag_rs":
            make("rs_in", (n * h, t, lora), dtype)
            make("rs_out", (h, t, lora), dtype)
            make("combined", (t, h, lora), dtype)
        else:
            make("combined", (t, n * h, lora), dtype)
    elif kind == "a2a":
        pack = 2 if torch.finfo(dtype).bits == 16 else 1
        make("a2a_send", (n, t, h, lora + pack), dtype)
        make("a2a_recv", (n, t, h, lora + pack), dtype)
        make("combined", (t, h, lora), dtype)
    else:
        make("combined", (t, h, lora), dtype)
    return steps


def _sparse_kernel(impl: Any) -> str | None:
    """Which of vLLM's sparse MLA decode paths with DCP support ``impl`` takes:
    ``flashmla``, ``flashinfer``, ``fa4`` (FlashInfer's, then the LSE rescaled),
    or None for the others (dense MLA; sparse backends without DCP)."""
    if not getattr(impl, "is_sparse", False):
        return None
    from vllm.v1.attention.backends.mla.flashinfer_mla_sparse import FlashInferMLASparseImpl
    from vllm.v1.attention.backends.mla.flashmla_sparse import FlashMLASparseImpl

    if isinstance(impl, FlashMLASparseImpl):
        return "flashmla"
    if isinstance(impl, FlashInferMLASparseImpl):
        # FA4's module needs vLLM's flash-attention extension to import, so it is
        # told apart by name rather than imported.
        names = {cls.__name__ for cls in type(impl).__mro__}
        return "fa4" if "FlashAttnMLASparseFA4Impl" in names else "flashinfer"
    return None


def _sparse_kernel_transients(
    kernel: str,
    layer: Any,
    t: int,
    heads: int,
    dtype: torch.dtype,
    make: Callable[[str, tuple[int, ...], torch.dtype], None],
    drop: Callable[..., None],
) -> None:
    """From the gathered query to the kernel's output and LSE (``attn_out``, ``lse``,
    left live for the combine) on a sparse backend, for ``t`` tokens over ``heads``
    (every DCP rank's) heads, through :func:`decode_transients`' ``make`` and
    ``drop``; the index conversion's ``[t, K]`` and the empty-row mask are DCP's own
    (with one rank the conversion writes persistent buffers)."""
    impl, lora = layer.impl, layer.kv_lora_rank
    top_k = impl.topk_indices_buffer.shape[1]
    if kernel == "flashmla":
        padded, width = max(heads, impl.fp8_decode_padded_heads), impl.q_head_size
        # A NoPE layer on fp8_ds_mla gathers a query narrower than the cache rows.
        nope = lora + layer.qk_rope_head_dim < width
        if nope:
            make("query_padded", (t, heads, width), torch.bfloat16)
        make("topk_physical", (t, top_k), torch.int32)
        if heads < padded:
            make("query_heads_padded", (t, padded, width), torch.bfloat16)
        out = "attn_out_padded" if heads < padded else "attn_out"
        make(out, (t, padded, lora), torch.bfloat16)
        make("lse", (t, padded), torch.float32)  # a view of it is returned
        drop(*["query_heads_padded"] * (heads < padded))
        make("empty_rows", (t, top_k), torch.bool)
        drop("empty_rows")
        if heads < padded:
            make("attn_out", (t, heads, lora), dtype)  # the packed copy the combine needs
            drop("attn_out_padded")
        drop("topk_physical", *["query_padded"] * nope)
        return
    make("topk_physical", (t, top_k), torch.int32)
    make("valid_counts", (t,), torch.int32)
    make("attn_out", (t, heads, lora), dtype)
    make("lse", (t, heads), torch.float32)
    if layer.qk_rope_head_dim:  # a NoPE layer masks by sequence length instead
        make("empty_rows", (t, top_k), torch.bool)
        drop("empty_rows")
    if kernel == "fa4":  # a batch with prefill tokens: the LSE rescaled to base e
        make("lse_base_e", (t, heads), torch.float32)
        drop("lse")
    drop("topk_physical", "valid_counts")


def reserve(steps: Sequence[Step], device: torch.device, what: str) -> int:
    """Make ``steps``' buffers on ``device`` and drop them; returns their peak
    and records it for the current owner."""
    if not steps:
        return 0
    live: dict[str, torch.Tensor] = {}
    for action, item in steps:
        if action == "make":
            assert isinstance(item, Transient)
            live[item.name] = torch.empty(item.shape, dtype=item.dtype, device=device)
        else:
            del live[item]  # type: ignore[arg-type]
    live.clear()
    peak = peak_bytes(steps)
    owner = current_owner_name()
    if peak > _reserved.get(owner, 0):
        _reserved[owner] = peak
        logger.info(
            "vllm-specgraph: the memory profile holds %s's DCP transients for %s: %.1f MiB",
            owner,
            what,
            peak / _MIB,
        )
    return peak


def reserved_bytes() -> dict[str, int]:
    """The largest DCP transient reservation per owner so far."""
    return dict(_reserved)


def profiling(attn_metadata: object = None) -> bool:
    """Whether a forward without ``attn_metadata`` is the memory profile's dummy run."""
    return attn_metadata is None and in_profile_run() and not stream_is_capturing()


def _wrap_forward_impl(original: Callable) -> Callable:
    @functools.wraps(original)
    def forward_impl(self, q, k_c_normed, k_pe, kv_cache, attn_metadata, output, *args, **kwargs):
        if self.dcp_manager is not None and profiling(attn_metadata):
            replicated = kwargs.get("q_dcp_replicated") is not None
            steps = decode_transients(self, q.size(0), q.dtype, replicated_query=replicated)
            reserve(steps, q.device, "the MLA decode path")
        return original(self, q, k_c_normed, k_pe, kv_cache, attn_metadata, output, *args, **kwargs)

    return forward_impl


def _query_dtype(layer: Any, dtype: torch.dtype) -> torch.dtype:
    """The query dtype ``MLAAttention.__init__`` gives its DCP manager."""
    from vllm.model_executor.layers.attention import mla_attention as mla

    quantized = (
        mla.is_quantized_kv_cache(layer.kv_cache_dtype)
        and layer.kv_cache_dtype != "fp8_ds_mla"
        and layer.impl.supports_quant_query_input
    )
    return mla.current_platform.fp8_dtype() if quantized else dtype


def install(patches: PatchSet, mla_attention: ModuleType) -> None:
    patches.wrap(
        mla_attention.MLAAttention,
        "forward_impl",
        _wrap_forward_impl,
        parameters=(
            "q",
            "k_c_normed",
            "k_pe",
            "kv_cache",
            "attn_metadata",
            "output",
            "q_dcp_replicated",
        ),
    )
