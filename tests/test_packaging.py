"""What pip installs: qerl under names of its own only, beside Hugging Face's `kernels`; and what importing it does.

The wheel is built from a copy of the sources (pip, setuptools, no network, no build isolation) and installed by
unpacking it into a folder of its own, as pip lays a wheel out; the tests run it in a child interpreter whose path puts
that folder first, so the checkout's own qerl/ (and the venv's editable install) stay out of the way.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import tomllib
import zipfile
from pathlib import Path

import pytest

from tests.patience import patience

ROOT = Path(__file__).resolve().parent.parent
# The top-level folders pyproject.toml installs under qerl (folder -> package), read from where it says so.
MAPPED = {folder: package for package, folder in
          tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"].items()}


def child(code: str, pythonpath: list[Path], cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "OMP_WAIT_POLICY")}
    env["PYTHONPATH"] = os.pathsep.join(map(str, pythonpath))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=patience(300))


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """qerl's wheel, built from a copy of the files it is made of (the checkout gets no build/ or egg-info)."""
    # Offline, with this environment's setuptools (the pipeline extra brings a recent one; a bare GPU image may not)
    pytest.importorskip("setuptools", minversion="70.1", reason="building a wheel offline needs setuptools >= 70.1")
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for folder in ("qerl", *MAPPED):
        shutil.copytree(ROOT / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path_factory.mktemp("dist")
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                           "--quiet", "-w", str(out), str(src)], capture_output=True, text=True,
                          timeout=patience(300))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (found,) = out.glob("qerl-*.whl")
    return found


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> Path:
    """A folder holding qerl as pip installs it (a wheel is a zip laid out as site-packages)."""
    target = tmp_path_factory.mktemp("site")
    with zipfile.ZipFile(wheel) as z:
        z.extractall(target)
    return target


@pytest.fixture(scope="module")
def namesakes(tmp_path_factory) -> Path:
    """A site folder holding stand-ins for the public distributions named as our mapped folders (Hugging Face's
    `kernels`, PyPI's `tasks` and `flows`; none is installed here): regular top-level packages whose import says it
    is the one imported."""
    site = tmp_path_factory.mktemp("namesakes-site")
    for folder in MAPPED:
        (site / folder).mkdir()
        (site / folder / "__init__.py").write_text("STAND_IN = True\n\n\ndef get_kernel(repo_id):\n"
                                                   "    return repo_id\n")
    return site


def test_the_wheel_holds_qerl_only_and_every_module_of_it(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    outside = sorted({top for top in (n.split("/")[0] for n in names)
                      if top != "qerl" and not (top.startswith("qerl-") and top.endswith(".dist-info"))})
    assert not outside, f"the wheel installs top-level names other than qerl: {outside}"
    expected = {str(p.relative_to(ROOT)) for p in (ROOT / "qerl").rglob("*.py")}
    for folder, package in MAPPED.items():
        expected |= {str(Path(*package.split("."), p.relative_to(ROOT / folder)))
                     for p in (ROOT / folder).rglob("*.py")}
    missing = sorted(expected - set(names))
    assert not missing, f"modules left out of the wheel (a package missing from pyproject.toml's list?): {missing}"


def test_installed_qerl_and_huggingface_kernels_both_import(installed, namesakes, tmp_path):
    """Before, qerl's wheel installed kernels/ as a top-level package: the two overwrote each other in site-packages,
    and whichever came first on the path was `kernels` for both."""
    code = f"""
        import importlib.util, sys
        from pathlib import Path
        import qerl.kernels, qerl.flows
        from qerl.kernels.nvfp4_ops import nvfp4_quantize
        import kernels
        assert kernels.STAND_IN and kernels.get_kernel("kernels-community/activation")
        assert Path(kernels.__file__).is_relative_to({str(namesakes)!r}), kernels.__file__
        for where in (*qerl.kernels.__path__, *qerl.flows.__path__, importlib.util.find_spec("qerl.tasks.data").origin,
                      sys.modules[nvfp4_quantize.__module__].__file__):
            assert Path(where).is_relative_to({str(installed / "qerl")!r}), where
        assert sys.modules["kernels"] is kernels
        print("both import")
    """
    proc = child(code, [installed, namesakes], cwd=tmp_path)
    assert proc.returncode == 0 and "both import" in proc.stdout, proc.stdout + proc.stderr


def test_a_source_checkout_finds_the_top_level_folders_as_qerl_packages(tmp_path):
    """The GPU machines run the tree (PYTHONPATH=$PWD, nothing installed): the same names, the checkout's folders."""
    code = f"""
        import importlib.util
        from pathlib import Path
        for name, folder in [("qerl.kernels", "kernels"), ("qerl.tasks", "tasks"), ("qerl.flows", "flows"),
                             ("qerl.flows.train", "flows"), ("qerl.data", "qerl/data")]:
            spec = importlib.util.find_spec(name)  # a package says where it is by its search path, a module by its file
            where = [Path(p) for p in spec.submodule_search_locations or [Path(spec.origin).parent]]
            assert where == [Path({str(ROOT)!r}) / folder], (name, where)
        for other in ("tests", "benchmarks", "scripts", "runs", "docs"):  # folders of the checkout, not of qerl
            assert importlib.util.find_spec(f"qerl.{{other}}") is None, other
        print("from the checkout")
    """
    proc = child(code, [ROOT], cwd=tmp_path)
    assert proc.returncode == 0 and "from the checkout" in proc.stdout, proc.stdout + proc.stderr


def test_a_checkout_on_the_path_leaves_kernels_tasks_and_flows_to_their_public_namesakes(namesakes, tmp_path):
    """Run from the checkout's root (PYTHONPATH=$PWD, `python -m qerl.cli`), the root comes first on the path. Before,
    kernels/, tasks/ and flows/ were regular packages there, and Python's path finder takes a regular package from
    any path entry before a namespace one: a bare `import kernels` (transformers' hub kernels) got qerl's folder, not
    Hugging Face's installed `kernels`. As namespace portions, the installed namesakes win and qerl's still resolve
    under qerl."""
    first_module = {folder: min(p.stem for p in (ROOT / folder).glob("*.py") if p.stem != "__init__")
                    for folder in MAPPED}
    code = f"""
        import importlib, importlib.util
        from pathlib import Path
        root, site, first_module = Path({str(ROOT)!r}), Path({str(namesakes)!r}), {first_module!r}
        for folder, package in {MAPPED!r}.items():
            public = importlib.import_module(folder)
            assert getattr(public, "STAND_IN", False), f"import {{folder}} gave qerl's {{public.__path__}}"
            assert Path(public.__file__) == site / folder / "__init__.py", public.__file__
            ours = importlib.import_module(package)
            assert [Path(p) for p in ours.__path__] == [root / folder], (package, ours.__path__)
            module = importlib.util.find_spec(f"{{package}}.{{first_module[folder]}}")
            assert Path(module.origin).parent == root / folder, module.origin
        print("namesakes win")
    """
    proc = child(code, [ROOT, namesakes], cwd=tmp_path)
    assert proc.returncode == 0 and "namesakes win" in proc.stdout, proc.stdout + proc.stderr


def test_importing_qerl_changes_no_process_wide_setting(tmp_path):
    """Every module of the core and of kernels/ imported after torch (which sets its own): the environment is as it
    was. flows/ and tasks/ are left out: their processes start there (qerl.flows.startup makes its settings, before
    Prefect loads)."""
    core = sorted(".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
                  for p in (ROOT / "qerl").rglob("*.py") if p.name != "__main__.py")
    core += [f"qerl.kernels.{p.stem}" for p in (ROOT / "kernels").glob("*.py") if p.stem != "__init__"]
    code = f"""
        import importlib, os, torch
        before = dict(os.environ)
        for name in {core!r}:
            importlib.import_module(name)
        changed = sorted(k for k in before.keys() | os.environ.keys() if before.get(k) != os.environ.get(k))
        assert not changed, f"importing qerl changed: {{changed}}"
        print("unchanged")
    """
    proc = child(code, [ROOT], cwd=tmp_path)
    assert proc.returncode == 0 and "unchanged" in proc.stdout, proc.stdout + proc.stderr


def test_a_process_qerl_starts_waits_on_openmp_passively_unless_told_otherwise(tmp_path):
    """What qerl/__init__.py did at import, the `qerl` command now does first (qerl.cli.prepare_process)."""
    code = """
        import os, sys
        from qerl.cli import main
        assert "OMP_WAIT_POLICY" not in os.environ and "torch" not in sys.modules  # set before torch loads
        def start():  # the command's first act, before its arguments are read (these fail at once)
            try:
                main(["--no-such-option"])
            except SystemExit as stop:
                assert stop.code == 2
        start()
        assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE", os.environ["OMP_WAIT_POLICY"]
        os.environ["OMP_WAIT_POLICY"] = "ACTIVE"
        start()
        assert os.environ["OMP_WAIT_POLICY"] == "ACTIVE"  # a user's own value is kept
        print("passive")
    """
    proc = child(code, [ROOT], cwd=tmp_path)
    assert proc.returncode == 0 and "passive" in proc.stdout, proc.stdout + proc.stderr
