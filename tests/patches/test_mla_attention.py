"""The DCP transient reservation of the memory profile, on vLLM 0.33.0's MLA layers, on the CPU.

Real: vLLM's ``VllmConfig``, its ``MLADCPManager`` (which selects the query
gather and the LSE combine from the config, as in serving), ``MLAAttention.forward_impl``
with its own profiling branch, ``DeepseekV32Attention._sparse_indexer_and_attn``'s
and the sparse indexer's profiling reservation. Faked, because they need GPUs
and several ranks: the DCP group (N ranks, this one rank 0), the layer's
construction (it selects a GPU attention backend: the layer is made with
``__new__`` and given the attributes vLLM's ``__init__`` sets), the direct
symmetric-memory workspaces (a stand-in with their capacity), and the forward
context of a dummy run. ``torch.empty`` is watched, so every buffer the
profile makes, and how long it lives, is seen.
"""

from __future__ import annotations

import functools
import weakref
from types import SimpleNamespace

import pytest
import torch

from vllm_specgraph.lanes import use_owner
from vllm_specgraph.patches._profile_run import wrap_profile_run

pytestmark = pytest.mark.vllm

H, L, R, NOPE, V = 4, 32, 8, 16, 16  # heads per rank, kv_lora_rank, rope, nope, v dims
D = L + R
BF16, F32 = 2, 4


class _Group:
    """A DCP group of ``world_size`` ranks; hashable by identity, as vLLM's is."""

    rank_in_group = 0

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size


class _Allocations:
    """Every ``torch.empty`` (shape, dtype) and the peak of the bytes live at once."""

    def __init__(self) -> None:
        self.made: list[tuple[tuple[int, ...], torch.dtype]] = []
        self.live = 0
        self.peak = 0

    def record(self, tensor: torch.Tensor) -> torch.Tensor:
        nbytes = tensor.numel() * tensor.element_size()
        self.made.append((tuple(tensor.shape), tensor.dtype))
        self.live += nbytes
        self.peak = max(self.peak, self.live)
        weakref.finalize(tensor, self._freed, nbytes)
        return tensor

    def _freed(self, nbytes: int) -> None:
        self.live -= nbytes


@pytest.fixture
def allocations(monkeypatch) -> _Allocations:
    seen = _Allocations()
    empty = torch.empty

    def watched(*args, **kwargs):
        return seen.record(empty(*args, **kwargs))

    monkeypatch.setattr(torch, "empty", watched)
    return seen


@pytest.fixture
def mla(install_patch, monkeypatch):
    import vllm.distributed.parallel_state as parallel_state
    import vllm.v1.attention.ops.dcp as dcp_ops
    from vllm.config import DeviceConfig, ParallelConfig, VllmConfig

    module = install_patch("vllm.model_executor.layers.attention.mla_attention")
    from vllm_specgraph.patches.model_executor.layers.attention import (
        mla_attention as patch,
    )

    monkeypatch.setattr(patch, "_reserved", {})

    def layer(world_size: int, *, backend: str = "ag_rs", sparse: bool = False, impl=None):
        group = _Group(world_size)
        monkeypatch.setattr(parallel_state, "_DCP", group)
        config = VllmConfig(
            device_config=DeviceConfig(device="cpu"),
            parallel_config=ParallelConfig(dcp_comm_backend=backend),
        )
        made = module.MLAAttention.__new__(module.MLAAttention)
        torch.nn.Module.__init__(made)
        made.__dict__.update(
            num_heads=H,
            kv_lora_rank=L,
            qk_rope_head_dim=R,
            qk_nope_head_dim=NOPE,
            v_head_dim=V,
            kv_cache_dtype="auto",
            _chunked_prefill_workspace_size=64,
            impl=impl
            or SimpleNamespace(
                is_sparse=sparse, supports_quant_query_input=False, reserve_workspace=lambda: None
            ),
            dcp_manager=None,
        )
        if world_size > 1:
            made.dcp_manager = dcp_ops.MLADCPManager(
                vllm_config=config,
                device=torch.device("cpu"),
                num_heads=H,
                query_head_dim=D,
                output_head_dim=L,
                query_dtype=torch.bfloat16,
                output_dtype=torch.bfloat16,
                padded_num_heads=None,
                is_lse_base_on_e=True,
                use_pcp=False,
            )
        return made

    def forward(made, tokens: int, **kwargs):
        q = torch.zeros(tokens, H, NOPE + R, dtype=torch.bfloat16)
        output = torch.zeros(tokens, H * V, dtype=torch.bfloat16)
        kv = torch.zeros(tokens, L, dtype=torch.bfloat16)
        pe = torch.zeros(tokens, 1, R, dtype=torch.bfloat16)
        return module.MLAAttention.forward_impl(made, q, kv, pe, None, None, output, **kwargs)

    def profile(made, tokens: int, **kwargs):
        """``forward_impl`` without metadata inside a runner's ``profile_run``."""
        return in_profile_run(forward, made, tokens, **kwargs)

    return SimpleNamespace(
        module=module, patch=patch, layer=layer, profile=profile, forward=forward
    )


def in_profile_run(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` as inside a runner's ``profile_run`` the plugin wrapped."""
    return wrap_profile_run(lambda _runner: fn(*args, **kwargs))(None)


def _direct(capacity: int) -> SimpleNamespace:
    """A direct symmetric-memory workspace: on the GPU it is symmetric memory."""
    return SimpleNamespace(max_num_tokens=capacity)


def ag_rs_peak(t: int, n: int) -> int:
    """The reduce-scatter stage: absorbed query, gathered query, all-head outputs and
    LSE, corrected LSE, the reduce-scatter's input, output and result."""
    return (
        t * H * (BF16 * L + BF16 * n * D + BF16 * n * L + F32 * n * 2 + BF16 * n * L + 2 * BF16 * L)
    )


def test_ag_rs_reserves_the_decode_path_largest_live_set_then_vllms_own(mla, allocations):
    layer = mla.layer(4)
    m = layer.dcp_manager.max_num_tokens
    assert layer.dcp_manager.combine.func.__name__ == "cp_lse_ag_out_rs"
    mla.profile(layer, 2 * m)  # dense: the decode path takes at most M tokens
    made = dict.fromkeys(allocations.made)
    assert ((m, 4 * H, D), torch.bfloat16) in made, "the gathered query"
    assert ((4 * m, 4 * H), torch.float32) in made, "the LSE all-gather"
    assert ((4 * H, m, L), torch.bfloat16) in made, "the reduce-scatter's input copy"
    assert ((64, H, NOPE + V), torch.bfloat16) in made, "vLLM's own reservation still runs"
    assert mla.patch.reserved_bytes() == {"target": ag_rs_peak(m, 4)}
    # Each buffer dropped where the path drops it, all before vLLM's own reservation:
    # the peak of what lived at once is the model's, not a sum.
    assert allocations.peak == ag_rs_peak(m, 4)


def test_nothing_reserved_with_one_dcp_rank(mla, allocations):
    layer = mla.layer(1)
    mla.profile(layer, 256)
    assert dict.fromkeys(allocations.made) == {((64, H, NOPE + V), torch.bfloat16): None}
    assert mla.patch.reserved_bytes() == {}


def test_nothing_reserved_outside_the_profile_run_or_while_capturing(mla, allocations, monkeypatch):
    layer = mla.layer(4)
    vllms_own = {((64, H, NOPE + V), torch.bfloat16): None}
    mla.forward(layer, 256)  # a V1 warm-up or an idle data-parallel rank's dummy batch
    assert dict.fromkeys(allocations.made) == vllms_own
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    mla.profile(layer, 256)
    assert dict.fromkeys(allocations.made) == vllms_own
    assert mla.patch.reserved_bytes() == {}
    assert mla.patch.decode_transients(layer, 0, torch.bfloat16) == []


def test_a2a_over_nccl_reserves_send_and_receive_buffers(mla):
    layer = mla.layer(2, backend="a2a")
    assert layer.dcp_manager.combine.func.__name__ == "dcp_a2a_lse_reduce"
    t = layer.dcp_manager.max_num_tokens
    mla.profile(layer, t)
    pack = 2  # two LSE columns packed into a 16-bit output
    expected = t * H * BF16 * (L + 2 * D + 2 * L + 2 * 2 * (L + pack) + L) + t * 2 * H * F32
    assert mla.patch.reserved_bytes()["target"] == expected


def test_direct_workspaces_reserve_only_the_result_up_to_their_capacity(mla):
    layer = mla.layer(2, backend="a2a")
    manager = layer.dcp_manager
    t = manager.max_num_tokens
    manager.combine = functools.partial(manager._direct_workspace_combine, _direct(t))
    manager.query_gather = functools.partial(manager._direct_workspace_query_gather, _direct(t))
    steps = mla.patch.decode_transients(layer, t, torch.bfloat16)
    made = [s[1].name for s in steps if s[0] == "make"]
    assert made == ["ql_nope", "query", "attn_out", "lse", "combined"]
    assert mla.patch.peak_bytes(steps) == t * H * (BF16 * (L + 2 * L + L) + F32 * 2)
    # Above the capacity both fall back to NCCL: gather and send/receive buffers.
    manager.combine = functools.partial(manager._direct_workspace_combine, _direct(t // 2))
    manager.query_gather = functools.partial(
        manager._direct_workspace_query_gather, _direct(t // 2)
    )
    names = [s[1] for s in mla.patch.decode_transients(layer, t, torch.bfloat16)]
    assert {"gathered_query", "a2a_send", "a2a_recv"} <= {getattr(n, "name", n) for n in names}


def test_replicated_query_is_not_gathered_but_arrives_with_every_rank_heads(mla):
    layer = mla.layer(4)
    t = layer.dcp_manager.max_num_tokens
    steps = mla.patch.decode_transients(layer, t, torch.bfloat16, replicated_query=True)
    ql_nope, query = steps[0][1], steps[1][1]
    assert (ql_nope.shape, query.shape) == ((t, 4 * H, L), (t, 4 * H, D))
    assert "gathered_query" not in [getattr(s[1], "name", s[1]) for s in steps]
    mla.profile(layer, t, q_dcp_replicated=torch.zeros(t, 4 * H, NOPE + R))
    assert mla.patch.reserved_bytes()["target"] == mla.patch.peak_bytes(steps)


def test_sparse_layers_reserve_for_every_token_of_the_batch(mla):
    dense, sparse = mla.layer(2), mla.layer(2, sparse=True)
    m = dense.dcp_manager.max_num_tokens
    big = 8 * m
    assert mla.patch.decode_transients(dense, big, torch.bfloat16)[0][1].shape[0] == m
    assert mla.patch.decode_transients(sparse, big, torch.bfloat16)[0][1].shape[0] == big


def test_each_owner_keeps_its_own_largest_reservation(mla):
    target, draft = mla.layer(4), mla.layer(2)  # the draft's smaller one is still its own
    t = target.dcp_manager.max_num_tokens
    mla.profile(target, t)
    with use_owner("draft"):
        mla.profile(draft, t)
        mla.profile(draft, t // 2)
    assert mla.patch.reserved_bytes() == {"target": ag_rs_peak(t, 4), "draft": ag_rs_peak(t, 2)}


def test_indexer_merge_reserved_with_several_dcp_ranks_only(
    install_patch, monkeypatch, allocations
):
    import vllm.distributed.parallel_state as parallel_state

    indexer = install_patch("vllm.model_executor.layers.sparse_attn_indexer")
    from vllm_specgraph.patches.model_executor.layers.attention import mla_attention as patch

    monkeypatch.setattr(patch, "_reserved", {})
    buffer = torch.zeros(64, 16, dtype=torch.int32)
    made = len(allocations.made)
    monkeypatch.setattr(parallel_state, "_DCP", _Group(1))
    reserve = indexer._reserve_row_shard_exchange_transient
    in_profile_run(reserve, buffer, torch.device("cpu"))
    assert allocations.made[made:] == [] and patch.reserved_bytes() == {}
    monkeypatch.setattr(parallel_state, "_DCP", _Group(4))
    reserve(buffer, torch.device("cpu"))  # outside the profile run: nothing
    assert allocations.made[made:] == [] and patch.reserved_bytes() == {}
    in_profile_run(reserve, buffer, torch.device("cpu"))
    assert ((4 * 64, 16, 2), torch.float32) in allocations.made[made:]
    assert ((64, 4 * 16, 2), torch.float32) in allocations.made[made:]
    assert patch.reserved_bytes() == {"target": 64 * 16 * 2 * F32 * (1 + 2 * 4)}


def test_deepseek_v32_sparse_layer_reserves_in_the_dummy_run(mla, install_patch, monkeypatch):
    """vLLM's own body runs to its profiling return (no attention metadata), the
    indexer skipped as for a layer that reuses another's top-k."""
    import vllm.forward_context as forward_context

    attention = install_patch("vllm.models.deepseek_v32.attention")
    layer = mla.layer(2, sparse=True)
    layer.__class__ = attention.DeepseekV32Attention
    layer.__dict__.update(indexer=None, skip_topk=True, layer_name="layers.0.attn", kv_cache=None)
    layer.impl.record_logical_topk_ready = lambda: None
    context = SimpleNamespace(
        attn_metadata=None, no_compile_layers={"layers.0.attn": layer}, slot_mapping={}
    )
    monkeypatch.setattr(forward_context, "_forward_context", context)
    tokens = 8 * layer.dcp_manager.max_num_tokens
    q_c = torch.zeros(tokens, 24, dtype=torch.bfloat16)
    output = torch.ones(tokens, H * V, dtype=torch.bfloat16)
    nones = [None] * 7
    in_profile_run(layer._sparse_indexer_and_attn, None, q_c, None, None, *nones, output)
    assert not output.any(), "vLLM's profiling return ran"
    steps = mla.patch.decode_transients(layer, tokens, torch.bfloat16, with_ql_nope=False)
    assert steps[0][1].name == "query", "the layer computed its absorbed query already"
    assert steps[0][1].shape[0] == tokens, "every token of the batch"
    assert mla.patch.reserved_bytes() == {"target": mla.patch.peak_bytes(steps)}


def test_padded_heads_and_prefill_context_parallelism(mla):
    layer = mla.layer(2)
    t = layer.dcp_manager.max_num_tokens
    layer.dcp_manager.padded_num_heads = 128  # CUTLASS MLA pads the decode heads
    steps = mla.patch.decode_transients(layer, t, torch.bfloat16)
    shapes = {s[1].name: s[1].shape for s in steps if s[0] == "make"}
    assert shapes["attn_out"] == (t, 128, L) and shapes["lse"] == (t, 128)
    layer.dcp_manager.query_gather = None  # prefill context parallelism: not modelled
    assert mla.patch.decode_transients(layer, t, torch.bfloat16) == []


K = 16  # the top-k buffer's width


def _sparse_impl(cls, top_k=K, **attributes):
    """A vLLM sparse MLA impl without its ``__init__``, which needs a GPU (the
    attributes it sets that the decode path reads are given)."""
    impl = cls.__new__(cls)
    impl.__dict__.update(reserve_workspace=lambda: None, **attributes)
    impl.init_topk_indices_buffer(None, torch.zeros(8, top_k, dtype=torch.int32))
    return impl


def _flashmla_sparse(padded_heads: int = 64):
    from vllm.v1.attention.backends.mla.flashmla_sparse import FlashMLASparseImpl

    return _sparse_impl(FlashMLASparseImpl, fp8_decode_padded_heads=padded_heads, q_head_size=D)


def test_flashmla_sparse_pads_the_gathered_heads_and_copies_the_output_back(mla, allocations):
    layer = mla.layer(2, impl=_flashmla_sparse())
    t = 3 * layer.dcp_manager.max_num_tokens  # sparse: every token of the batch
    mla.profile(layer, t)
    made = dict.fromkeys(allocations.made)
    assert ((t, K), torch.int32) in made, "the DCP index conversion"
    assert ((t, 64, D), torch.bfloat16) in made, "the query padded to the kernel's 64 heads"
    assert ((t, 64, L), torch.bfloat16) in made and ((t, 64), torch.float32) in made
    assert ((t, 2 * H, L), torch.bfloat16) in made, "the packed copy of the output"
    # The LSE copied out of its transposed view for the gather, and the corrected one.
    assert allocations.made.count(((t, 2 * H), torch.float32)) == 2
    # The peak: absorbed and gathered query, conversion, padded query, padded output, LSE.
    peak = t * (BF16 * H * L + BF16 * 2 * H * D + 4 * K + BF16 * 64 * (D + L) + F32 * 64)
    assert mla.patch.reserved_bytes() == {"target": peak}
    assert allocations.peak == peak


def test_flashmla_sparse_with_every_kernel_head_gathered_copies_nothing(mla):
    layer = mla.layer(4, impl=_flashmla_sparse(padded_heads=4 * H))
    t = layer.dcp_manager.max_num_tokens
    steps = mla.patch.decode_transients(layer, t, torch.bfloat16)
    names = [s[1].name for s in steps if s[0] == "make"]
    assert "query_heads_padded" not in names and "attn_out_padded" not in names
    assert {s[1].name: s[1].shape for s in steps if s[0] == "make"}["attn_out"] == (t, 4 * H, L)


def test_flashinfer_sparse_converts_indices_and_masks_empty_rows(mla, allocations):
    from vllm.v1.attention.backends.mla.flashinfer_mla_sparse import FlashInferMLASparseImpl

    k = 256  # wide enough that the index conversion's moment is the peak
    layer = mla.layer(2, impl=_sparse_impl(FlashInferMLASparseImpl, top_k=k))
    t = 2 * layer.dcp_manager.max_num_tokens
    mla.profile(layer, t)
    made = dict.fromkeys(allocations.made)
    assert ((t, k), torch.int32) in made and ((t,), torch.int32) in made
    assert ((t, k), torch.bool) in made, "the empty-row mask"
    assert ((t, 2 * H, L), torch.bfloat16) in made, "no head padding"
    assert not any(shape[1:2] == (64,) for shape, _ in made)
    # Absorbed and gathered query, conversion and counts, outputs and LSE, the mask.
    peak = t * (BF16 * H * L + BF16 * 2 * H * D + 5 * k + 4 + BF16 * 2 * H * L + F32 * 2 * H)
    assert mla.patch.reserved_bytes() == {"target": peak}
    assert allocations.peak == peak


def test_fa4_sparse_rescales_the_lse_of_a_batch_with_prefill_tokens(mla):
    from vllm.v1.attention.backends.mla.flashinfer_mla_sparse import FlashInferMLASparseImpl

    # vLLM's FA4 impl subclasses FlashInfer's; its module needs vLLM's CUDA
    # flash-attention extension to import, so a class of the same name stands in.
    fa4 = type("FlashAttnMLASparseFA4Impl", (FlashInferMLASparseImpl,), {})
    layer = mla.layer(2, impl=_sparse_impl(fa4))
    t = layer.dcp_manager.max_num_tokens
    steps = mla.patch.decode_transients(layer, t, torch.bfloat16)
    assert ("make", mla.patch.Transient("lse_base_e", (t, 2 * H), torch.float32)) in steps
    assert steps.index(("drop", "lse")) > [s[1] for s in steps].index(
        mla.patch.Transient("lse_base_e", (t, 2 * H), torch.float32)
    )


def test_sparse_backends_reserve_nothing_with_one_dcp_rank(mla, allocations):
    layer = mla.layer(1, impl=_flashmla_sparse())
    mla.profile(layer, 256)
    assert dict.fromkeys(allocations.made) == {((64, H, NOPE + V), torch.bfloat16): None}
    assert mla.patch.reserved_bytes() == {}


def test_flashmla_sparse_pads_a_query_narrower_than_the_cache_rows(mla):
    """A NoPE layer on fp8_ds_mla reads 576-wide rows: its gathered query is padded."""
    layer = mla.layer(2, impl=_flashmla_sparse())
    layer.impl.q_head_size = D + 24
    t = layer.dcp_manager.max_num_tokens
    shapes = {
        s[1].name: s[1].shape
        for s in mla.patch.decode_transients(layer, t, torch.bfloat16)
        if s[0] == "make"
    }
    assert shapes["query_padded"] == (t, 2 * H, D + 24)
    assert shapes["query_heads_padded"] == (t, 64, D + 24)
