"""scripts/vllm_own_tests/compare.py: two JUnit reports of vLLM's own tests, without
and with the plugin, compared test by test (the reports here are written by hand)."""

from __future__ import annotations

import importlib.util
import os

from tests.e2e_fakes import SCRIPTS

_spec = importlib.util.spec_from_file_location(
    "vllm_own_tests_compare", os.path.join(SCRIPTS, "vllm_own_tests", "compare.py")
)
compare = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(compare)

OFF = """<testsuites><testsuite>
<testcase classname="tests.a" name="test_kept"/>
<testcase classname="tests.a" name="test_pinned"/>
<testcase classname="tests.a" name="test_cpu"><failure message="no accelerator"/></testcase>
<testcase classname="tests.a" name="test_gpu"><skipped message="needs a GPU"/></testcase>
</testsuite></testsuites>"""


def _report(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_a_test_broken_by_the_plugin_fails_the_comparison_unless_listed(tmp_path, capsys):
    on = OFF.replace(
        '<testcase classname="tests.a" name="test_pinned"/>',
        '<testcase classname="tests.a" name="test_pinned"><failure message="2 == 1"/></testcase>',
    ).replace(
        '<testcase classname="tests.a" name="test_cpu"><failure message="no accelerator"/>'
        "</testcase>",
        '<testcase classname="tests.a" name="test_cpu"/>',
    )
    off_path, on_path = _report(tmp_path, "off.xml", OFF), _report(tmp_path, "on.xml", on)
    assert compare.main(["compare", off_path, on_path]) == 1
    out = capsys.readouterr().out
    assert "passed -> failed: tests.a::test_pinned: 2 == 1" in out
    assert "failed -> passed: tests.a::test_cpu" in out
    assert "without the plugin: 1 failed, 2 passed, 1 skipped" in out
    listed = _report(tmp_path, "on_purpose.txt", "# why\ntests.a::test_pinned\tpins one lane\n")
    assert compare.main(["compare", off_path, on_path, listed]) == 0
    assert "on purpose: pins one lane" in capsys.readouterr().out
    assert compare.main(["compare", off_path, off_path]) == 0
    assert "listed as on purpose" not in capsys.readouterr().out
    assert compare.main(["compare", off_path, off_path, listed]) == 0
    assert "listed as on purpose but not broken by the plugin: tests.a::test_pinned" in (
        capsys.readouterr().out
    )
    skipped = OFF.replace(
        '<testcase classname="tests.a" name="test_kept"/>',
        '<testcase classname="tests.a" name="test_kept"><skipped message="x"/></testcase>',
    )
    assert compare.main(["compare", off_path, _report(tmp_path, "skip.xml", skipped)]) == 1
