# SPDX-License-Identifier: Apache-2.0
"""Compare two JUnit XML reports of the same tests: vLLM 0.33.0's own tests run
without the plugin and with it armed.

    python3 compare.py OFF.xml ON.xml [ON_PURPOSE.txt]

Prints the counts per outcome for each run and every test whose outcome differs,
with the plugin-on run's message; exits 1 when a test that passed without the
plugin does not pass with it (fails, errors, skips or is gone), unless
ON_PURPOSE.txt lists it (a test id, a tab, why: the behaviour it pins is one the
plugin changes on purpose), and names listed tests the plugin no longer breaks."""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET


def outcomes(path: str) -> dict[str, tuple[str, str]]:
    """Test id -> (outcome, first line of the failure or skip message)."""
    out = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                message = (node.get("message") or node.text or "").strip().splitlines()[:1]
                message = message[0][:200] if message else ""
                break
        out[name] = (outcome, message)
    return out


def on_purpose(path: str | None) -> dict[str, str]:
    """Test id -> why the plugin changes what it pins."""
    if path is None:
        return {}
    with open(path) as f:
        rows = [line.rstrip("\n").split("\t", 1) for line in f if not line.startswith("#")]
    return {row[0]: row[1] for row in rows if len(row) == 2}


def main(argv: list[str]) -> int:
    off, on = outcomes(argv[1]), outcomes(argv[2])
    expected = on_purpose(argv[3] if len(argv) > 3 else None)
    for label, run in (("without the plugin", off), ("with the plugin", on)):
        counts: dict[str, int] = {}
        for outcome, _ in run.values():
            counts[outcome] = counts.get(outcome, 0) + 1
        print(f"{label}: " + ", ".join(f"{n} {k}" for k, n in sorted(counts.items())))
    broken = 0
    for name in sorted(set(off) | set(on)):
        before, after = off.get(name, ("absent", "")), on.get(name, ("absent", ""))
        if before[0] != after[0]:
            print(f"{before[0]} -> {after[0]}: {name}: {after[1]}")
            if before[0] == "passed":
                if name in expected:
                    print(f"    on purpose: {expected[name]}")
                else:
                    broken += 1
    for name in sorted(expected):
        if on.get(name, ("absent",))[0] == "passed" or off.get(name, ("absent",))[0] != "passed":
            print(f"listed as on purpose but not broken by the plugin: {name}")
    print(f"{broken} passed without the plugin and not with it, beyond those on purpose")
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
