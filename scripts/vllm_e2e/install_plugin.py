# SPDX-License-Identifier: Apache-2.0
"""Install this repository's package into a ``--target`` site dir and check that
its ``vllm.general_plugins`` entry point resolves to that copy.

    python3 install_plugin.py REPO SITE

Runs on the GPU machine (no package index there). The package is built from a
clean staged copy (pyproject.toml, README.md, docs/package.md, LICENSE files, the package dirs),
so no ``build/`` or ``*.egg-info`` left in the repository can leak into it, with
``pip install --no-index --no-deps --no-build-isolation --target SITE``. If pip
cannot build it (for instance a setuptools older than pyproject.toml asks for),
the package is copied and a dist-info with its entry points is written from
pyproject.toml instead, and the script says so.

The check runs in a fresh interpreter whose only extra path is SITE and whose
working directory is outside the repository: exactly one ``specgraph`` entry
point, its distribution under SITE, its module resolving under SITE (found, not
run), and every installed ``.py`` file byte-identical to the repository's.
"""

from __future__ import annotations

import filecmp
import glob
import os
import shutil
import subprocess
import sys
import tempfile
import tomllib

GROUP = "vllm.general_plugins"
NAME = "specgraph"
PACKAGE = "vllm_specgraph"
STAGED_FILES = (
    "pyproject.toml",
    "setup.cfg",
    "setup.py",
    "MANIFEST.in",
    "README.md",
    "docs/package.md",  # pyproject.toml's readme: the package description
)


def stage(repo: str, dst: str) -> None:
    for name in STAGED_FILES:
        if os.path.exists(os.path.join(repo, name)):
            os.makedirs(os.path.dirname(os.path.join(dst, name)), exist_ok=True)
            shutil.copy2(os.path.join(repo, name), os.path.join(dst, name))
    for path in glob.glob(os.path.join(repo, "LICEN[CS]E*")):
        shutil.copy2(path, dst)
    shutil.copytree(
        os.path.join(repo, PACKAGE),
        os.path.join(dst, PACKAGE),
        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"),
    )


def pip_install(src: str, site: str) -> bool:
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "-q",
        "--no-index",
        "--no-deps",
        "--no-build-isolation",
        "--no-compile",
        "--no-cache-dir",
        "--disable-pip-version-check",
        "--target",
        site,
        src,
    ]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        print(f"pip install failed (rc={r.returncode}):")
        print((r.stdout + r.stderr).strip()[-3000:])
    return r.returncode == 0


def copy_install(src: str, site: str) -> None:
    """Fallback: the package and a minimal dist-info (METADATA, entry_points.txt)."""
    with open(os.path.join(src, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    dst = os.path.join(site, PACKAGE)
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(os.path.join(src, PACKAGE), dst)
    dist_name = project["name"].replace("-", "_")
    info = os.path.join(site, f"{dist_name}-{project['version']}.dist-info")
    shutil.rmtree(info, ignore_errors=True)
    os.makedirs(info)
    with open(os.path.join(info, "METADATA"), "w") as f:
        f.write(f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: {project['version']}\n")
    with open(os.path.join(info, "entry_points.txt"), "w") as f:
        for group, eps in project.get("entry-points", {}).items():
            f.write(f"[{group}]\n")
            for key, value in eps.items():
                f.write(f"{key} = {value}\n")
            f.write("\n")
    with open(os.path.join(info, "INSTALLER"), "w") as f:
        f.write("vllm-e2e copy\n")


# Resolves the module without running it: the package may import vLLM at the
# top, and vLLM's tree is not on this interpreter's path.
CHECK = f"""
import sys
from importlib.metadata import entry_points
from importlib.util import find_spec
site = sys.argv[1]
eps = [ep for ep in entry_points(group={GROUP!r}) if ep.name == {NAME!r}]
assert len(eps) == 1, f"expected one {NAME!r} entry point, found {{eps}}"
ep = eps[0]
loc = str(ep.dist.locate_file(""))
assert loc.startswith(site), f"entry point's distribution is at {{loc}}, not under {{site}}"
origin = find_spec(ep.module).origin
assert origin.startswith(site), f"{{ep.module}} would be imported from {{origin}}"
dist = f"{{ep.dist.name}} {{ep.dist.version}}"
print(f"entry point {{ep.name}} = {{ep.value}} ({{dist}}) -> {{origin}}")
"""


def check(repo: str, site: str) -> bool:
    env = dict(os.environ, PYTHONPATH=site, PYTHONDONTWRITEBYTECODE="1")
    with tempfile.TemporaryDirectory() as cwd:
        r = subprocess.run(
            [sys.executable, "-c", CHECK, site], cwd=cwd, env=env, capture_output=True, text=True
        )
    print((r.stdout + r.stderr).strip())
    if r.returncode != 0:
        return False
    src_root = os.path.join(repo, PACKAGE)
    dst_root = os.path.join(site, PACKAGE)
    files = sorted(
        os.path.relpath(p, src_root)
        for p in glob.glob(os.path.join(src_root, "**", "*.py"), recursive=True)
    )
    differ = [
        f
        for f in files
        if not os.path.exists(os.path.join(dst_root, f))
        or not filecmp.cmp(os.path.join(src_root, f), os.path.join(dst_root, f), shallow=False)
    ]
    if differ:
        print(f"installed copy differs from the repository in: {differ}")
        return False
    print(f"{len(files)} .py files installed, identical to the repository's")
    return True


def main(repo: str, site: str) -> int:
    repo = os.path.abspath(repo)
    site = os.path.abspath(site)
    os.makedirs(site, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "src")
        os.makedirs(src)
        stage(repo, src)
        how = "pip"
        if not pip_install(src, site):
            copy_install(src, site)
            how = "copy (pip could not build it; dist-info written from pyproject.toml)"
    print(f"plugin installed into {site} by {how}")
    return 0 if check(repo, site) else 1


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    sys.exit(main(sys.argv[1], sys.argv[2]))
