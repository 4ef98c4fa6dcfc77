"""The patch set for vLLM 0.33: one module per vLLM module it patches, at the same path.

:func:`arm` registers every patch to be installed when vLLM imports its
module (at once if it already has). :data:`PATCHES` is the table of what is
patched and why; each patch module's docstring says what vLLM does, what the
patch changes and why.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from vllm_specgraph.patches._patching import PatchSet, when_imported

__all__ = ["PATCHES", "Patch", "arm"]


@dataclass(frozen=True)
class Patch:
    vllm_module: str
    symbols: tuple[str, ...]
    reason: str

    @property
    def patch_module(self) -> str:
        return "vllm_specgraph.patches." + self.vllm_module.removeprefix("vllm.")


PATCHES: tuple[Patch, ...] = (
    Patch(
        "vllm.v1.worker.workspace",
        ("WorkspaceManager", "use_workspace_lane"),
        "one lane workspace (the core's): growth retires instead of freeing, "
        "and is refused during a capture instead of landing in the graph's pool",
    ),
    Patch(
        "vllm.v1.worker.gpu_worker",
        (
            "_num_workspace_lanes",
            "Worker._start_weight_update",
            "Worker.update_weights",
            "Worker.finish_weight_update",
            "Worker.compile_or_warm_up_model",
        ),
        "two lanes for every speculative method; draft weight updates in the draft lane; "
        "under capture-once, the KV cache backed after the production capture",
    ),
    Patch(
        "vllm.v1.worker.gpu.ubatch_utils",
        ("threading.Thread",),
        "micro-batch threads keep the lane of the code that starts them",
    ),
    Patch(
        "vllm.v1.worker.gpu.attn_utils",
        ("allocate_kv_cache",),
        "under capture-once, the KV cache over a reserved range, backed where warm-up and "
        "capture write",
    ),
    Patch(
        "vllm.v1.engine.core",
        ("EngineCore._initialize_kv_caches",),
        "under capture-once, the scheduler gets the blocks the workers backed",
    ),
    Patch(
        "vllm.v1.worker.gpu.cudagraph_utils",
        ("profile_cudagraph_memory",),
        "exact disposable profile of every graph, per owner, nothing left taken; "
        "or, under capture-once, none",
    ),
    Patch(
        "vllm.distributed.elastic_ep.elastic_execute",
        ("ElasticEPScalingExecutor._release_cuda_graphs",),
        "the workspace frees its retired buffers once elastic EP has dropped every graph",
    ),
    Patch(
        "vllm.distributed.parallel_state",
        ("GroupCoordinator.graph_capture",),
        "each graph capture (target, draft, profiling) binds a channel of its own of the "
        "peer all-reduce, made before the capture begins",
    ),
    Patch(
        "vllm.distributed.device_communicators.cuda_communicator",
        ("CudaCommunicator._log_all_reduce_backend_selection", "CudaCommunicator.all_reduce"),
        "the TP group's all-reduce is the core's peer all-reduce (no multicast, a channel "
        "per capture) where vLLM has no fast path, or always on request",
    ),
    Patch(
        "vllm.distributed.device_communicators.custom_all_reduce",
        ("CustomAllreduce.capture", "CustomAllreduce._all_reduce_chunk"),
        "graphs captured by the disposable profile leave no graph-buffer registration "
        "(no rank-data slot, no peer IPC mapping); every rank takes the same branch",
    ),
    Patch(
        "vllm.distributed.device_communicators.flashinfer_pcie_ipc_all_reduce",
        ("FlashInferPcieIpcAllReduce.setup",),
        "the profile budgets the PCIe IPC workspace that kernel warm-up makes after the "
        "KV cache is sized; set-up logs what it took against that budget",
    ),
    Patch(
        "vllm.v1.attention.ops.dcp",
        (
            "get_direct_dcp_a2a_workspace",
            "get_direct_dcp_q_gather_workspace",
            "get_direct_dcp_kv_gather_workspace",
        ),
        "one direct DCP workspace per owner lane (target, draft) instead of one shared; "
        "those the disposable profile made are let go with it",
    ),
    Patch(
        "vllm.model_executor.layers.attention.mla_attention",
        ("MLAAttention.forward_impl",),
        "the memory profile holds the MLA decode path's DCP transients (query gather, "
        "all-head outputs, LSE combine), per owner",
    ),
    Patch(
        "vllm.model_executor.layers.sparse_attn_indexer",
        ("_reserve_row_shard_exchange_transient",),
        "the memory profile holds the sparse indexer's DCP top-K merge transients",
    ),
    Patch(
        "vllm.models.deepseek_v32.attention",
        ("DeepseekV32Attention._sparse_indexer_and_attn",),
        "the memory profile holds the DeepSeek-V3.2 sparse decode path's DCP transients",
    ),
    Patch(
        "vllm.v1.worker.gpu_model_runner",
        ("GPUModelRunner.profile_cudagraph_memory", "GPUModelRunner.profile_run"),
        "the V1 runner's throwaway profiling captures leave no peer all-reduce channel behind; "
        "its memory profile's dummy run is marked as such",
    ),
    Patch(
        "vllm.v1.worker.gpu.model_runner",
        (
            "GPUModelRunner.__init__",
            "GPUModelRunner.profile_run",
            "GPUModelRunner.capture_model",
            "init_speculator",
            "refresh_quantized_lm_heads",
            "use_workspace_lane",
            "_profile_cudagraph_memory",
        ),
        "every speculator phase in the draft lane; the exact profile; "
        "production capture measured per owner against the estimate",
    ),
)


def arm(patches: PatchSet) -> None:
    """Install each patch into ``patches`` when vLLM imports its module.

    The order of :data:`PATCHES` is the order of vLLM's own imports
    (``model_runner`` imports ``cudagraph_utils`` and ``workspace``).
    """
    for patch in PATCHES:
        install = importlib.import_module(patch.patch_module).install
        when_imported(patch.vllm_module, lambda module, install=install: install(patches, module))
