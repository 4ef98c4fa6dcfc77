"""PatchSet and the deferred install of patches, on throwaway modules."""

import importlib
import inspect
import sys
import types

import pytest

from vllm_specgraph.patches._patching import PatchSet, cancel_pending, when_imported


@pytest.fixture
def package(tmp_path, monkeypatch):
    """A package ``specgraph_probe`` with a module ``late`` that is not imported yet."""
    root = tmp_path / "specgraph_probe"
    root.mkdir()
    (root / "__init__.py").write_text("")
    (root / "late.py").write_text(
        "ORDER = []\n\ndef answer(x):\n    return x\n\nORDER.append('body')\n"
    )
    (root / "user.py").write_text("from specgraph_probe.late import answer\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "specgraph_probe"
    for name in [n for n in sys.modules if n.startswith("specgraph_probe")]:
        del sys.modules[name]


def test_when_imported_runs_after_the_body_before_importers_bind_names(package):
    patches = PatchSet()

    def install(module):
        module.ORDER.append("patch")
        patches.replace(module, "answer", lambda x: x + 1, parameters=("x",))

    when_imported(f"{package}.late", install)
    assert f"{package}.late" not in sys.modules
    user = __import__(f"{package}.user", fromlist=["answer"])
    late = sys.modules[f"{package}.late"]
    assert late.ORDER == ["body", "patch"]
    assert user.answer(1) == 2, "a by-value import made after the body sees the patch"
    assert "return x" in inspect.getsource(late), "the real loader still serves the source"
    patches.undo()
    assert late.answer(1) == 1


def test_cancel_pending_forgets_callbacks_of_modules_not_imported_yet(package):
    seen = []
    when_imported(f"{package}.late", seen.append)
    cancel_pending()
    importlib.import_module(f"{package}.late")
    assert seen == []


def test_when_imported_already_imported_installs_at_once(package):
    late = __import__(f"{package}.late", fromlist=["ORDER"])
    seen = []
    when_imported(f"{package}.late", seen.append)
    assert seen == [late]


def test_replace_missing_name_or_changed_signature_refused_naming_the_fix():
    module = types.ModuleType("probe")
    module.f = lambda a: a
    patches = PatchSet()
    with pytest.raises(RuntimeError, match=r"probe\.g: it does not exist.*VLLM_SPECGRAPH=0"):
        patches.replace(module, "g", len)
    with pytest.raises(RuntimeError, match=r"probe\.f: its signature lacks \['b'\]"):
        patches.replace(module, "f", len, parameters=("a", "b"))
    assert patches.names == () and module.f(3) == 3


def test_wrap_hands_the_checked_original_to_the_wrapper_and_undo_restores_it():
    module = types.ModuleType("probe")
    module.f = original = lambda a: a
    made: list = []

    def make_wrapper(wrapped):
        made.append(wrapped)
        return lambda a: wrapped(a) + 1

    patches = PatchSet()
    with pytest.raises(RuntimeError, match=r"probe\.g: it does not exist"):
        patches.wrap(module, "g", make_wrapper)
    assert made == [], "the wrapper is made only for a target that passed the checks"
    assert patches.wrap(module, "f", make_wrapper, parameters=("a",)) is original
    assert made == [original] and module.f(3) == 4
    patches.undo()
    assert module.f is original


def test_when_imported_failed_install_patches_again_on_the_next_import(package):
    attempts = []

    def install(module):
        attempts.append(module.__name__)
        if len(attempts) == 1:
            raise RuntimeError("first install fails")
        module.patched = True

    when_imported(f"{package}.late", install)
    with pytest.raises(RuntimeError, match="first install fails"):
        __import__(f"{package}.late")
    assert f"{package}.late" not in sys.modules
    late = __import__(f"{package}.late", fromlist=["ORDER"])
    assert late.patched and len(attempts) == 2
