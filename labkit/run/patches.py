"""Whether this process has changed, since its warm process was forked from it, anything a rank would run: a
function, method or constant of labkit, torch or transformers (or of your own modules) replaced by a cell or a test.

    baseline = Baseline.now()               # in the launching process, just before it forks the warm process
    digests = baseline.changed()            # at a launch: {module: {attribute: description}} that may differ now
    differences(digests)                    # in the warm process: ["labkit.training.loop.optimizer_step", ...]
    baseline.accept(digests)                # none differed: the present state is the baseline for the next launch

A rank forked from this process sees every such patch; a rank forked from the warm process sees the warm process's
modules, which are as they were at the fork. So the launcher forks from the warm process only when `differences` is
empty (run/warm.py), and from this process otherwise.

What is compared. For a module this process had at the fork: the attributes (and its own classes' attributes) that
now hold another object than then, by object identity, which is cheap; only those are described (a function by its
defining file, line and name, a class by its name, a constant by its value) and compared with the warm process's
copy. That copy may differ for reasons of its own (importing torch._dynamo wraps torch.manual_seed) without a
difference being reported, unless this process replaced the same attribute too. For a module imported here since:
every function, class and method, and (for labkit and your own modules) every constant, against the warm
process's copy, which it imports if it has not. Watched: labkit, torch, transformers, and modules from outside the
Python installation (your own code; one imported here after the fork is reported as a difference, since a rank of
the warm process would import it afresh). Not seen: a change inside an object (an attribute of an instance, a list
appended to), an attribute added where there was none, and C-level switches, which run/inherit.py carries instead.
"""
from __future__ import annotations

import importlib
import re
import sys
import sysconfig
import types
import warnings
from dataclasses import dataclass, field
from typing import Any

LIBRARIES = ("labkit", "torch", "transformers")
CONSTANT = re.compile(r"^[A-Z][A-Z0-9_]*$")   # module constants by convention; lower-case globals are state
SIMPLE = (int, float, complex, str, bytes, bool, type(None))
_INSTALLED = tuple(p for p in {sysconfig.get_paths().get(k) for k in ("stdlib", "platstdlib", "purelib", "platlib")}
                   if p)


def watched(name: str, module: Any) -> bool:
    """labkit, torch and transformers modules, and modules whose file is outside the Python installation."""
    if name.split(".")[0] in LIBRARIES:
        return True
    if name in ("__main__", "__mp_main__") or not isinstance(module, types.ModuleType):
        return False
    path = getattr(module, "__file__", None)
    return isinstance(path, str) and not path.startswith(_INSTALLED)


def library(name: str) -> bool:
    """A module the warm process may import to compare (a library's); your own modules it never imports."""
    return name.split(".")[0] in LIBRARIES


def identities(module: types.ModuleType) -> dict[str, int]:
    """{attribute: id of its object} for the module and, as "Class.attr", its own classes (cheap: no descriptions)."""
    space = vars(module)
    out = dict(zip(space.keys(), map(id, list(space.values()))))
    for name, value in list(space.items()):
        if isinstance(value, type) and _defined_in(value, module.__name__):
            out.update({f"{name}.{attr}": id(member) for attr, member in list(vars(value).items())})
    return out


def digest(module: types.ModuleType, only: set[str] | None = None, constants: bool = True) -> dict[str, tuple]:
    """{attribute: what it is} for the module's functions, classes and (with `constants`) constants, and its own
    classes' methods ("Class.method"); `only`: just these names."""
    out: dict[str, tuple] = {}
    for name, value in list(vars(module).items()):
        if name.startswith("__") or isinstance(value, types.ModuleType):
            continue
        try:
            described = _describe_value(name, value, constants)
            if described is not None and isinstance(value, type) and _defined_in(value, module.__name__):
                out.update({f"{name}.{attr}": method for attr, member in list(vars(value).items())
                            if (attr == "__init__" or not attr.startswith("__"))
                            and (method := _describe_member(member)) is not None})
        except Exception:  # noqa: BLE001 - an object that refuses to be looked at: described by its type alone
            described = ("unreadable", type(value).__qualname__)
        if described is not None:
            out[name] = described
    return out if only is None else {k: v for k, v in out.items() if k in only}


def differences(digests: dict[str, dict[str, tuple]]) -> list[str]:
    """The attributes whose description here differs from `digests` (another process's): "module.attr", sorted.
    A library module not imported here is imported first; your own module not imported here is named whole."""
    out = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name, theirs in digests.items():
            module = sys.modules.get(name)
            if module is None and library(name):
                try:
                    module = importlib.import_module(name)
                except Exception:  # noqa: BLE001 - some modules exist only where they were made (torch.ops.*)
                    continue
            if module is None:
                out.append(f"{name} (imported there after the warm process started)")
                continue
            ours = digest(module, set(theirs))
            out += [f"{name}.{attr}" for attr in sorted(theirs.keys() & ours.keys()) if theirs[attr] != ours[attr]]
    return sorted(out)


@dataclass
class Baseline:
    """Every watched module's attribute identities at the fork, moved forward as launches find them unchanged."""

    ids: dict[str, dict[str, int]] = field(default_factory=dict)

    @classmethod
    def now(cls) -> "Baseline":
        return cls(_all_identities())

    def changed(self) -> dict[str, dict[str, tuple]]:
        """Descriptions of what may differ from the warm process: each known module's replaced attributes, and
        each new module whole (constants only where a library could not make them differ by itself)."""
        out = {}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for name, module in list(sys.modules.items()):
                if module is None or not watched(name, module):
                    continue
                try:
                    then = self.ids.get(name)
                    if then is None:
                        out[name] = digest(module, constants=name.split(".")[0] not in ("torch", "transformers"))
                        continue
                    moved = {k for k, v in identities(module).items() if then.get(k, v) != v}
                    if moved:
                        out[name] = digest(module, moved)
                except Exception:  # noqa: BLE001 - an odd module object: compared whole
                    out[name] = {}
        return out

    def accept(self, names: Any) -> None:
        """These modules were found equal in the warm process: their present state is the new baseline."""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for name in names:
                module = sys.modules.get(name)
                if module is not None:
                    self.ids[name] = identities(module)


def _all_identities() -> dict[str, dict[str, int]]:
    out = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # some modules warn when their deprecated attributes are looked at
        for name, module in list(sys.modules.items()):
            unfinished = getattr(getattr(module, "__spec__", None), "_initializing", False) and name != "labkit"
            if module is not None and watched(name, module) and not unfinished:  # unfinished: new at the launch
                try:
                    out[name] = identities(module)
                except Exception:  # noqa: BLE001 - left out: it will be compared whole at the first launch
                    continue
    return out


def _defined_in(cls: type, module_name: str) -> bool:
    try:
        return cls.__module__ == module_name
    except Exception:  # noqa: BLE001 - a class whose __module__ is a property that raises
        return False


def _describe_value(name: str, value: Any, constants: bool = True) -> tuple | None:
    if isinstance(value, type):
        return ("class", getattr(value, "__module__", None), getattr(value, "__qualname__", None))
    if callable(value):
        return _describe_callable(value)
    if constants and CONSTANT.match(name) and isinstance(value, SIMPLE):
        return ("value", repr(value)[:500])
    return None


def _describe_member(member: Any) -> tuple | None:
    if isinstance(member, (staticmethod, classmethod)):
        member = member.__func__
    elif isinstance(member, property):
        member = member.fget
    return _describe_callable(member) if callable(member) else None


def _describe_callable(value: Any) -> tuple:
    code = getattr(value, "__code__", None)
    if isinstance(code, types.CodeType):
        return ("function", getattr(value, "__module__", None), getattr(value, "__qualname__", None),
                code.co_filename, code.co_firstlineno)
    return ("callable", type(value).__qualname__, getattr(value, "__module__", None),
            getattr(value, "__qualname__", None))
