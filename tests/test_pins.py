"""The kit practises pinning: its own environment is exactly pinned, and labkit declares only ranges.

pyproject.toml declares the ranges where the APIs labkit calls exist (so that labkit can be added to an existing
environment without replacing its torch); requirements.lock pins every package of the kit's environment exactly;
environment.yml names the same exact versions for the packages pyproject.toml names."""
import re
import tomllib
from pathlib import Path

import yaml
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent


def _name(text: str) -> str:
    return text.lower().replace("_", "-")


def _pins(lines):
    pins = {}
    for line in lines:
        match = re.fullmatch(r"\s*([A-Za-z0-9_.\-\[\]]+)\s*==\s*([^\s;#]+)\s*", line)
        assert match, f"not an exact pin: {line!r}"
        pins[_name(match.group(1))] = match.group(2)
    return pins


def declared() -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = [r for group in project.get("optional-dependencies", {}).values() for r in group]
    return [Requirement(r) for r in project["dependencies"] + extras]


def lock() -> dict[str, str]:
    lines = [l for l in (ROOT / "requirements.lock").read_text().splitlines() if l.strip() and not l.startswith("#")]
    return _pins(lines)


def test_pyproject_declares_ranges_not_exact_pins():
    exact = [str(r) for r in declared() if any(s.operator in ("==", "===") for s in r.specifier)]
    assert not exact, f"exact pins in pyproject.toml would replace a user's packages: {exact}; pin in the lock"
    assert all(r.specifier for r in declared()), "every dependency needs a lower bound at least"


def test_the_lock_pins_every_declared_dependency_inside_its_range():
    pins = lock()
    for requirement in declared():
        version = pins.get(_name(requirement.name))
        assert version, f"{requirement.name} is declared in pyproject.toml but not pinned in requirements.lock"
        assert requirement.specifier.contains(version), f"lock pins {requirement.name}=={version}, outside {requirement}"


def test_environment_yml_pins_the_declared_packages_at_the_lock_versions():
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    pip_section = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict) and "pip" in d)
    expected = {_name(r.name): lock()[_name(r.name)] for r in declared()}
    assert _pins(pip_section) == expected


def test_torch_is_installed_alone_and_first_with_an_exact_pin():
    makefile = (ROOT / "Makefile").read_text()
    torch_line = makefile.index('pip install --quiet "torch==2.13.0"')
    assert torch_line < makefile.index("-c requirements.lock")
    assert f'torch=={lock()["torch"]}' in makefile


def floor() -> dict[str, str]:
    lines = [l for l in (ROOT / "requirements-floor.txt").read_text().splitlines() if l.strip() and not l.startswith("#")]
    return _pins(lines)


def lower_bound(requirement: Requirement) -> str:
    bounds = [s.version for s in requirement.specifier if s.operator == ">="]
    assert len(bounds) == 1, f"{requirement}: needs exactly one '>=' lower bound (the floor make test-floor tests)"
    return bounds[0]


def test_the_floor_pins_every_tested_dependency_at_its_declared_lower_bound():
    """requirements-floor.txt is what `make test-floor` installs: the runtime dependencies and the test extra, each at
    the lower bound pyproject.toml declares (so moving a floor means testing it), except torch (see the file)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    tested = [Requirement(r) for r in project["dependencies"] + project["optional-dependencies"]["test"]]
    pins = floor()
    assert pins.pop("torch") == lock()["torch"], "the floor venv keeps the lock's torch build (the one installable)"
    expected = {_name(r.name): Version(lower_bound(r)) for r in tested if _name(r.name) != "torch"}
    assert {name: Version(v) for name, v in pins.items()} == expected


def test_the_floor_venv_installs_torch_alone_and_first_too():
    makefile = (ROOT / "Makefile").read_text()
    target = makefile[makefile.index("$(FLOOR)/.installed:"):]
    assert target.index('pip install --quiet "torch==2.13.0"') < target.index("-c requirements-floor.txt")
