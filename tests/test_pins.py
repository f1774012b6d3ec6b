"""The kit practises pinning: one set of exact versions, named alike in every file that installs it."""
import re
import tomllib
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent


def _pins(lines):
    pins = {}
    for line in lines:
        match = re.fullmatch(r"\s*([A-Za-z0-9_.\-\[\]]+)\s*==\s*([^\s;#]+)\s*", line)
        assert match, f"not an exact pin: {line!r}"
        pins[match.group(1).lower().replace("_", "-")] = match.group(2)
    return pins


def pyproject_pins():
    return _pins(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"])


def test_environment_yml_names_the_same_packages_and_versions_as_pyproject():
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    pip_section = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict) and "pip" in d)
    assert _pins(pip_section) == pyproject_pins()


def test_the_lock_pins_every_direct_dependency_at_the_same_version():
    lines = [l for l in (ROOT / "requirements.lock").read_text().splitlines() if l.strip() and not l.startswith("#")]
    lock = _pins(lines)
    for name, version in pyproject_pins().items():
        assert lock.get(name) == version, f"{name}: pyproject {version}, lock {lock.get(name)}"


def test_torch_is_installed_alone_and_first_with_an_exact_pin():
    makefile = (ROOT / "Makefile").read_text()
    torch_line = makefile.index('pip install --quiet "torch==2.13.0"')
    assert torch_line < makefile.index("-c requirements.lock")
