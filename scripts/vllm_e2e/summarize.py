# SPDX-License-Identifier: Apache-2.0
"""Print a short summary of the run_llm.py results (and vLLM's own log lines).

python3 summarize.py OUTDIR          # reads OUTDIR/{base,draft,ngram}.{json,log}
"""

from __future__ import annotations

import json
import os
import re
import sys

MiB = 1 << 20
CASES = ("base", "draft", "ngram")
LOG_PATTERNS = (
    r"CUDA graph pool memory: .*",
    r"Graph capturing finished in .*",
    r"Available KV cache memory: .*",
    r"GPU KV cache size: .*",
    r"Model loading took .*",
)


def mib(x) -> str:
    if x is None:
        return "-"
    return f"{x / MiB:.1f}"


def main(outdir: str) -> int:
    results = {}
    for case in CASES:
        p = os.path.join(outdir, f"{case}.json")
        if os.path.exists(p):
            with open(p) as f:
                results[case] = json.load(f)

    print("=" * 72)
    print("vLLM 0.33.0 end-to-end on the GPU (MRV2, FULL CUDA graphs, Triton attention)")
    print("=" * 72)
    for case in CASES:
        r = results.get(case)
        if r is None:
            print(f"[{case}] no result (timed out or not run)")
            continue
        if not r.get("ok"):
            err = (r.get("error") or "")[:400]
            print(f"[{case}] FAILED at stage {r.get('stage')}: {err}")
            tb = (r.get("traceback") or "").strip().splitlines()
            for line in tb[-6:]:
                print(f"    {line[:200]}")
            m = r.get("mem") or {}
            if m:
                print(
                    "    (before failing) graph memory MiB: "
                    f"estimate={mib(m.get('profile_estimate_bytes'))}"
                    f" actual={mib(m.get('capture_actual_bytes'))}"
                    f" left taken after profiling={mib(m.get('profile_driver_left_taken'))}"
                )
            continue
        m = r.get("mem", {})
        res = r.get("resolved", {})
        print(
            f"[{case}] ok  runner={res.get('runner_class', '?').rsplit('.', 1)[-1]}"
            f" spec={res.get('spec_method')} speculator={res.get('speculator_class')}"
            f" cg={res.get('cudagraph_mode')} sizes={res.get('capture_sizes')}"
            f" attn={res.get('attn_backend')}"
        )
        print(
            f"    graph memory MiB: estimate={mib(m.get('profile_estimate_bytes'))}"
            f" actual={mib(m.get('capture_actual_bytes'))}"
            f" | after profiling still taken (driver): {mib(m.get('profile_driver_left_taken'))}"
            f" (after empty_cache: {mib(m.get('profile_driver_left_taken_after_empty_cache'))})"
            f" | KV cache MiB: {mib(m.get('kv_cache_bytes'))}"
        )
        print(
            f"    timings s: import={r.get('import_s')} init={r.get('init_s')} "
            f"generate={r.get('generate_s')}"
            f" | shim ops called: {r.get('shim_calls')}"
        )
        if r.get("spec_metrics"):
            sm = {k: v for k, v in r["spec_metrics"].items() if v not in (None, [], 0)}
            print(f"    spec metrics: {json.dumps(sm, default=str)[:300]}")
        logp = os.path.join(outdir, f"{case}.log")
        if os.path.exists(logp):
            with open(logp, errors="replace") as f:
                text = f.read()
            for pat in LOG_PATTERNS:
                for mm in re.findall(pat, text):
                    print(f"    vllm: {mm.strip()[:160]}")

    base = results.get("base")
    if base and base.get("ok"):
        bt = base["tokens"]
        n = sum(len(t) for t in bt)
        print(f"baseline: {len(bt)} prompts, {n} tokens generated; first: {bt[0][:12]}")
        for case in ("draft", "ngram"):
            r = results.get(case)
            if r and r.get("ok"):
                same = r["tokens"] == bt
                diff = [i for i, (a, b) in enumerate(zip(bt, r["tokens"], strict=False)) if a != b]
                print(
                    f"TOKENS {case} == base: {same}"
                    + ("" if same else f" (prompts differing: {diff})")
                )
    ok = all(results.get(c, {}).get("ok") for c in CASES)
    eq = ok and all(results[c]["tokens"] == results["base"]["tokens"] for c in ("draft", "ngram"))
    print(f"SUMMARY: all cases ran={ok}, speculative outputs equal baseline={eq}")
    return 0 if eq else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
