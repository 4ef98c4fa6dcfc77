# SPDX-License-Identifier: Apache-2.0
"""Apply the stand-ins that let vLLM 0.33.0's Python tree import on a machine
without its compiled extensions (see docs/vllm-e2e.md, "Obstacles").

    python3 apply_shims.py /path/to/unpacked/tree     # the dir holding vllm/

Each edit is an exact-text replacement that must match once; anything else
is an error, so a different vLLM version fails loudly instead of silently.
"""

from __future__ import annotations

import os
import re
import shutil
import sys

HERE = os.path.dirname(os.path.abspath(__file__))

# (relative path, exact old text, new text, why)
EDITS = [
    (
        "vllm/vllm_flash_attn/__init__.py",
        "if not (FA2_AVAILABLE or FA3_AVAILABLE):\n    raise ImportError(\n",
        "if not (FA2_AVAILABLE or FA3_AVAILABLE):\n"
        "    import warnings as _w  # vllm-e2e shim: no FA .so carried\n    _w.warn(\n",
        "FA2/FA3 .so files are not carried (300+ MB); the package raised on import, "
        "which breaks the model loader through fa_utils. Now it warns and the "
        "Triton attention backend is used.",
    ),
]


NAMESPACES = ("_C", "_C_cache_ops", "_C_cuda_utils", "_C_custom_ar")
_REF = re.compile(r"torch\.ops\.(" + "|".join(NAMESPACES) + r")\.([A-Za-z_0-9]+)")
_HASATTR = re.compile(
    r"hasattr\(\s*torch\.ops\.(" + "|".join(NAMESPACES) + r")\s*,\s*[\"']([A-Za-z_0-9]+)[\"']"
)


def placeholder_names(tree: str) -> list[str]:
    """Every ``torch.ops.<ns>.<name>`` that vLLM's Python refers to, minus the
    names it probes with ``hasattr`` (defining those would flip a guard and
    send vLLM down a compiled-kernel path). The shim defines the rest as ops
    that raise when called: several modules look them up at import time
    (``torch.ops._C.static_scaled_fp8_quant.default`` in the fusion passes,
    ``self.op = torch.ops._C.silu_and_mul`` in layer constructors)."""
    refs: set[tuple[str, str]] = set()
    probed: set[tuple[str, str]] = set()
    for dirpath, _, files in os.walk(os.path.join(tree, "vllm")):
        for fn in files:
            if not fn.endswith(".py"):
                continue
            with open(os.path.join(dirpath, fn), encoding="utf-8") as f:
                text = f.read()
            refs.update(_REF.findall(text))
            probed.update(_HASATTR.findall(text))
    return sorted(f"{ns}::{name}" for ns, name in refs - probed)


def main(tree: str) -> None:
    dst = os.path.join(tree, "vllm", "_C_stable_libtorch.py")
    shutil.copyfile(os.path.join(HERE, "_C_stable_libtorch.py"), dst)
    print(f"shim: {dst}")
    names = placeholder_names(tree)
    with open(os.path.join(tree, "vllm", "_C_stable_libtorch_placeholders.txt"), "w") as f:
        f.write("\n".join(names) + "\n")
    print(f"placeholders: {len(names)} op names referenced without a hasattr probe")
    for rel, old, new, why in EDITS:
        path = os.path.join(tree, rel)
        with open(path) as f:
            text = f.read()
        n = text.count(old)
        if n != 1:
            raise SystemExit(f"{rel}: expected 1 match, found {n}")
        with open(path, "w") as f:
            f.write(text.replace(old, new))
        print(f"edit: {rel}: {why}")


if __name__ == "__main__":
    main(sys.argv[1])
