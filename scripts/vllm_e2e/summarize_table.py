# SPDX-License-Identifier: Apache-2.0
"""The Markdown of ``bench/results/vllm_graph_memory.md``: one row per (size
group, case) with the plugin off, on and, where it ran, without an estimate
(``noest``).

Rows of older invocations (schema 1) lack the newer fields; their cells say "-".
"""

from __future__ import annotations

from typing import Any

from results_files import markdown_grid

MiB = 1 << 20

__all__ = ["COLUMNS", "markdown", "row_cells"]

COLUMNS = (
    "size",
    "capture sizes",
    "case",
    "graph estimate upstream (off) / plugin (on) / none (noest) MiB",
    "plugin budget (on) MiB",
    "actual off / on MiB",
    "error upstream / plugin % (MiB)",
    "retained after profile off / on MiB",
    "budget - (retained + actual) off / on / noest MiB",
    "over budget at rest off / on / noest MiB",
    "KV tokens off / on / noest",
    "start-up s off / on",
    "profile / capture s off; on",
    "tokens on = off (noest = off)",
    "per owner est. / actual (on) MiB",
    "measured (UTC), commit",
    "check",
)


def mib(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x / MiB:.{digits}f}"


def fmt_err(err: float | None, p: float | None) -> str:
    if err is None:
        return "-"
    return f"{p:+.1f} % ({err / MiB:+.1f})" if p is not None else f"({err / MiB:+.1f})"


def fmt_values(values: list[Any], f: Any = str) -> str:
    """``a / b [/ c]``; a trailing missing value is left out (a row without noest)."""
    while len(values) > 2 and values[-1] is None:
        values = values[:-1]
    return " / ".join("-" if v is None else f(v) for v in values)


def fmt_owners(owners: dict[str, dict[str, float | None]] | None) -> str:
    if not owners:
        return "-"
    return "; ".join(
        f"{name} {mib(v.get('estimate'))} / {mib(v.get('actual'))}" for name, v in owners.items()
    )


def _walls(row: dict, side: str) -> str:
    prof, cap = row.get(f"profile_wall_{side}_s"), row.get(f"capture_wall_{side}_s")
    return fmt_values([prof, cap], lambda x: f"{x:.1f}")


def row_cells(row: dict) -> list[str]:
    g = row.get
    triple = ("off", "on", "noest")
    n = g("num_capture_sizes")
    tokens = "-" if g("tokens_equal_on_off") is None else str(g("tokens_equal_on_off"))
    if g("tokens_equal_noest_off") is not None:
        tokens += f" ({g('tokens_equal_noest_off')})"
    return [
        row["size"],
        f"{g('capture', 'default')}" + ("" if n is None else f" ({n})"),
        row["case"]
        + ("" if g("off_switch", "off") == "off" else f" (off={row['off_switch']})")
        + (f" [rank {row['worst_rank']} of {row['tp']}]" if "worst_rank" in row else ""),
        fmt_values(
            [
                g("upstream_estimate_bytes"),
                g("plugin_estimate_bytes"),
                g("noest_estimate_applied_bytes"),
            ],
            mib,
        ),
        mib(g("plugin_budget_bytes")),
        fmt_values([g("actual_off_bytes"), g("actual_on_bytes")], mib),
        fmt_values(
            [
                fmt_err(g("upstream_error_bytes"), g("upstream_error_pct")),
                fmt_err(g("plugin_error_bytes"), g("plugin_error_pct")),
            ]
        ),
        fmt_values([g("retained_off_bytes"), g("retained_on_bytes")], mib),
        fmt_values([g(f"budget_minus_taken_{s}_bytes") for s in triple], mib),
        fmt_values([g(f"over_budget_{s}_bytes") for s in triple], mib),
        fmt_values([g(f"kv_tokens_{s}") for s in triple], lambda x: f"{x:,}"),
        fmt_values([g("startup_off_s"), g("startup_on_s")], lambda x: f"{x:.1f}"),
        f"{_walls(row, 'off')}; {_walls(row, 'on')}",
        tokens,
        fmt_owners(g("owners_on")),
        f"{g('measured_utc') or '-'}, {g('commit') or '-'}",
        row["status"],
    ]


def _group_lines(doc: dict) -> list[str]:
    out = []
    for size, meta in doc["sizes"].items():
        st = meta.get("settings") or {}
        parts = [
            f"{label}{st[key]}"
            for key, label in (
                ("model", ""),
                ("dtype", ""),
                ("max_num_seqs", "max_num_seqs "),
                ("max_model_len", "max_model_len "),
                ("max_num_batched_tokens", "max_num_batched_tokens "),
                ("gpu_memory_utilization", "gpu_memory_utilization "),
                ("num_capture_sizes", "capture sizes: "),
                ("tensor_parallel_size", "tensor_parallel_size "),
                ("allocator", "allocator: "),
            )
            if st.get(key) is not None
        ]
        where = meta.get("nvidia_smi") or meta.get("gpu") or "an unrecorded GPU"
        out.append(
            f"* `{size}` ({', '.join(parts)}): last measured {meta.get('measured_utc')} UTC "
            f"on {where}, torch {meta.get('torch')}, vLLM {meta.get('vllm')}."
        )
    return out


NOTES = (
    "Upstream estimate: the return of `GPUModelRunner.profile_cudagraph_memory`. "
    "Plugin estimate: the graph bytes of the plugin's report; plugin budget: what "
    "the plugin returns to vLLM, the graphs plus what the profile left with the "
    "process (one-time state, such as kernels loaded by the first capture, that a "
    "second pass showed is not taken again). None: the `noest` run, plugin off and "
    "`VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=0`, so vLLM subtracts nothing for "
    "graphs. Actual: the return of `capture_model` for the production capture "
    "(driver-level free memory before minus after). Errors are estimate minus "
    "actual, in % of actual (MiB). Retained: driver-level bytes still taken when "
    "the profile returned; the check allows the plugin's one-time bytes, which its "
    "budget holds. Budget - (retained + actual): what vLLM subtracted for graphs "
    "from the KV-cache budget, minus what the profile left taken and the "
    "production capture then took; negative means the KV cache was sized too "
    "large by that much. Over budget at rest: what the started instance held "
    "(driver level, allocator cache emptied) beyond vLLM's limit minus its "
    "activation headroom (`gpu_memory_utilization * total - headroom`, counted "
    "from vLLM's start-up snapshot); positive bytes come out of the headroom the "
    "first full step needs. KV tokens: `num_gpu_blocks * block_size`. Start-up: "
    "the `LLM(...)` constructor. Profile / capture: the profile call and the "
    "production `capture_model` call, in seconds. Per owner: the plugin's own "
    "report (`runner.specgraph_profile`). Capture sizes: the set (`default`: the "
    "size's own, vLLM's default for 1b; `small`: 1, 2, 4, 8, 16, 32) and the "
    "number of sizes vLLM resolved."
)


def markdown(doc: dict) -> str:
    out = ["# vLLM 0.33.0 CUDA-graph memory: vllm-specgraph off and on", ""]
    out.append(
        "Real vLLM 0.33.0 (Model Runner V2, Triton attention, dummy weights) through "
        "`scripts/device-vllm-e2e.sh`; every run in its own process. Size groups ending in "
        "`-compile`: vLLM's default graph mode (torch.compile, FULL_AND_PIECEWISE graphs); "
        "the others: compilation off, FULL graphs. "
        "Off: the plugin is loaded with `VLLM_SPECGRAPH=0` (patches nothing), so the "
        "estimate is upstream's. On: `VLLM_PLUGINS=specgraph`."
    )
    out.append("")
    out += _group_lines(doc)
    out.append("")
    out += markdown_grid(COLUMNS, (row_cells(row) for row in doc["rows"]), text_columns=3)
    out.append("")
    if doc.get("skipped"):
        out.append(f"Not run (the script's time budget ran out): {', '.join(doc['skipped'])}.")
        out.append("")
    t = doc["targets"]
    out.append(
        f"Check (plugin on): |estimate - actual| <= max({t['estimate_tolerance_fraction']:.0%}"
        f" of actual, {t['estimate_tolerance_bytes'] / MiB:.0f} MiB); driver-level memory "
        f"still taken after the profile returned <= {t['retained_max_bytes'] / MiB:.0f} MiB; "
        "greedy tokens equal to the plugin-off run."
    )
    out.append("")
    out.append(NOTES)
    return "\n".join(out) + "\n"
