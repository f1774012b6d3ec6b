"""labkit as a user gets it: a wheel built from this checkout, installed into a fresh virtual environment, with its
licence, one version, the right dependencies, and a command line that answers --help and --version without torch.

No network: the wheel is built with the kit's own setuptools (--no-build-isolation) and installed alone
(--no-deps --no-index). The fresh environment therefore has no torch at all (about 1 GB that pip would otherwise
download), which is the first check: `labkit --version` and every --help must work there (labkit/__init__.py leaves
torch for after the command line's arguments are parsed). `import labkit` needs the dependencies: a .pth file then
appends the kit's site-packages to the fresh environment's path, after its own site-packages, so labkit itself still
comes from the wheel (the kit's editable install is a finder started by a .pth file of the kit's site-packages,
which a path appended this way does not run); the test checks labkit.__file__.
"""
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
VERSION = re.search(r'^__version__ = "([^"]+)"', (ROOT / "labkit" / "__init__.py").read_text(), re.M).group(1)
COMMANDS = (["--help"], ["run", "--help"], ["show", "--help"], ["summary", "--help"], ["compare", "--help"])


def clean_env() -> dict[str, str]:
    """This environment without what would make a child import labkit from elsewhere (PYTHONPATH: a checkout)."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP")}


def build_offline_problem() -> str | None:
    """Why this interpreter cannot build labkit's wheel offline, or None."""
    try:
        import setuptools
        from packaging.version import Version
    except ImportError as exc:
        return f"no {exc.name} here to build the wheel without network (pip wheel --no-build-isolation)"
    if Version(setuptools.__version__) < Version("77"):
        return f"setuptools {setuptools.__version__} here; building offline needs pyproject.toml's setuptools>=77"
    if subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True).returncode != 0:
        return "no pip in this interpreter"
    return None


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """labkit's wheel, built from a copy of what it is made of (a build in place would leave build/ and
    labkit.egg-info in the checkout)."""
    problem = build_offline_problem()
    if problem:
        pytest.skip(problem)
    src, out = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("wheels")
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "labkit", src / "labkit", ignore=shutil.ignore_patterns("__pycache__"))
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation",
                            "--no-index", "-q", "-w", str(out)], capture_output=True, text=True, timeout=120,
                           env=clean_env())
    assert built.returncode == 0, built.stdout[-2000:] + built.stderr[-3000:]
    return next(out.glob("labkit-*.whl"))


def test_the_wheel_carries_the_licence_one_version_and_dependencies_where_they_are_used(wheel):
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        info = f"labkit-{VERSION}.dist-info"
        metadata = zf.read(f"{info}/METADATA").decode()
        entry_points = zf.read(f"{info}/entry_points.txt").decode()
        assert zf.read(f"{info}/licenses/LICENSE") == (ROOT / "LICENSE").read_bytes()
    assert wheel.name.startswith(f"labkit-{VERSION}-")
    assert "License-Expression: MIT" in metadata and "License-File: LICENSE" in metadata
    assert re.search(rf"^Version: {re.escape(VERSION)}$", metadata, re.M)
    assert "labkit = labkit.cli:main" in entry_points
    assert not [n for n in names if not n.startswith(("labkit/", f"{info}/"))], "only the package goes in the wheel"
    requires = re.findall(r"^Requires-Dist: (.*)$", metadata, re.M)
    unconditional = {re.split(r"[<>=!~ ;\[]", r)[0] for r in requires if "extra ==" not in r}
    assert "torch" in unconditional and not unconditional & {"ipykernel", "ipywidgets", "py-spy", "jupyterlab"}
    for name in ("ipykernel", "ipywidgets", "py-spy"):
        assert any(r.startswith(name) and 'extra == "lab"' in r for r in requires), f"{name} not in the lab extra"


def test_the_wheel_in_a_fresh_venv_answers_without_torch_then_imports_with_the_kits_packages(wheel, tmp_path):
    venv, here = tmp_path / "venv", tmp_path / "cwd"
    here.mkdir()
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=60)
    python = venv / "bin" / "python"
    installed = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps",
                                "--no-index", "-q", str(wheel)], capture_output=True, text=True, timeout=120,
                               env=clean_env())
    assert installed.returncode == 0, installed.stderr[-3000:]

    def run(*cmd):
        done = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=120, cwd=here,
                              env=clean_env())
        assert done.returncode == 0, (cmd, done.stdout[-2000:], done.stderr[-3000:])
        return done.stdout

    assert run(python, "-c", "import importlib.util; print(importlib.util.find_spec('torch'))").strip() == "None"
    assert run(venv / "bin" / "labkit", "--version").strip() == f"labkit {VERSION}"
    assert run(python, "-m", "labkit", "--version").strip() == f"labkit {VERSION}"
    for args in COMMANDS:
        shown = run(venv / "bin" / "labkit", *args)
        assert shown.startswith("usage: labkit") and "`" not in shown, (args, shown)

    site = Path(run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])").strip())
    kit = {sysconfig.get_paths()[k] for k in ("purelib", "platlib")}
    (site / "kit_packages.pth").write_text("".join(f"{p}\n" for p in sorted(kit)))
    out = run(python, "-c", "import sys, labkit; print(labkit.__file__); print(labkit.__version__); "
                            "print('labkit.run.cuda_guard' in sys.modules)").split()
    assert out == [str(site / "labkit" / "__init__.py"), VERSION, "True"], out


@pytest.mark.parametrize("args", [["--version"], *COMMANDS], ids=" ".join)
def test_help_and_version_import_no_torch_and_print_no_markdown(args):
    """`python -X importtime` names every module a process imports: --help and --version import neither torch nor
    pandas (the whole answer takes about 0.2 s instead of 3), and a terminal shows no `code` backticks."""
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "labkit", *args], capture_output=True, text=True,
                          timeout=60, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    heavy = re.findall(r"\|\s+(torch|pandas|numpy|matplotlib)$", done.stderr, re.M)
    assert not heavy, f"`python -m labkit {' '.join(args)}` imported {sorted(set(heavy))}"
    assert "`" not in done.stdout
    assert done.stdout.startswith("usage: labkit") or done.stdout.strip() == f"labkit {VERSION}"


def test_torchao_installed_adds_no_noise_to_a_process_that_builds_a_model():
    """transformers imports torchao (the fp8 extra) with its modeling code, so every rank would log torchao's GPU
    kernels that cannot load on a CPU-only host and torch's note on two of its Enums; labkit's filter drops exactly
    those two messages (labkit/__init__.py) and nothing else on the same loggers."""
    import importlib.util
    if importlib.util.find_spec("torchao") is None:
        pytest.skip("torchao is not installed (pip install -e '.[fp8]')")
    code = ("import logging, labkit, torch\nfrom transformers import GPT2LMHeadModel\nimport sys\n"
            "assert 'torchao' in sys.modules\n"
            "logging.getLogger('torchao').warning('Failed to load /x/torchao/_C_demo.so: gone')\n"
            "logging.getLogger('torchao').warning('a torchao warning that matters')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Failed to load" not in done.stderr and "Enum subclass" not in done.stderr, done.stderr[-3000:]
    assert "a torchao warning that matters" in done.stderr
