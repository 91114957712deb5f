"""The package's shape holds: the trainer's parts keep their own state (no attribute set through `self` in one trainer
file and read through `self` in another), core knows no trainer, and no function is too long to hold in mind."""

import ast
from collections import defaultdict
from pathlib import Path

import pytest


PACKAGE = Path(__file__).resolve().parent.parent / "rloo_efficient"


def _self_attributes(path: Path) -> tuple[set[str], set[str]]:
    """`(defined, read)`: the attributes `path`'s code sets on `self` (or defines in a class body), and reads on it."""
    defined, read = set(), set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
                    defined.add(item.name)
                targets = item.targets if isinstance(item, ast.Assign) else [getattr(item, "target", None)]
                defined.update(target.id for target in targets if isinstance(target, ast.Name))
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
            (defined if isinstance(node.ctx, ast.Store) else read).add(node.attr)
    return defined, read


def test_no_trainer_file_reads_another_files_state_through_self():
    """Five mixins once shared one `self` (27 attributes set in one file, read in another); the mixin now delegates to
    objects, each reading only its own attributes (the trainer's own, TRL's, are set in TRL)."""
    owners, readers = defaultdict(set), defaultdict(set)
    for path in sorted((PACKAGE / "trainers").glob("*.py")):
        defined, read = _self_attributes(path)
        for name in defined:
            owners[name].add(path.name)
        for name in read - defined:
            readers[name].add(path.name)
    shared = {name: (sorted(owners[name]), sorted(files)) for name, files in readers.items() if owners.get(name)}
    assert not shared, shared


def _too_long(source: str, in_trainers: bool) -> list[str]:
    """The functions in `source` over 80 lines, and with `in_trainers` its classes over 200: too long to hold in
    mind."""
    long = []
    for node in ast.walk(ast.parse(source)):
        lines = getattr(node, "end_lineno", 0) - getattr(node, "lineno", 0) + 1
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and lines > 80:
            long.append(f"{node.name} ({lines} lines)")
        if in_trainers and isinstance(node, ast.ClassDef) and lines > 200:
            long.append(f"class {node.name} ({lines} lines)")
    return long


def test_core_imports_no_trainer_and_nothing_is_too_long():
    """Core imports no trainer; no function in the package is over 80 lines, no trainers/ class over 200."""
    long = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text())
        if path.is_relative_to(PACKAGE / "core"):
            imported = [node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)]
            assert not any("trainers" in module or module.startswith("rloo_efficient") for module in imported), path
        if found := _too_long(path.read_text(), path.parent.name == "trainers"):
            long[str(path.relative_to(PACKAGE))] = found
    assert not long, long


@pytest.mark.parametrize("source, in_trainers, found", [
    ("def f():\n" + "    x = 1\n" * 79, False, []),
    ("def f():\n" + "    x = 1\n" * 80, False, ["f (81 lines)"]),
    ("class C:\n" + "    x = 1\n" * 200, True, ["class C (201 lines)"]),
    ("class C:\n" + "    x = 1\n" * 200, False, []),  # a long class outside trainers/ (a config's fields)
])  # fmt: skip
def test_the_length_check_sees_each_long_function_and_class(source, in_trainers, found):
    assert _too_long(source, in_trainers) == found


def _reaches(source: str, parts: bool = True) -> list[str]:
    """What `source` reaches in another object: `self.trainer`, a trainer's private attribute (`trainer._x`, or by
    `getattr(trainer, "_x")`), and with `parts` (the trainer's parts: trainers/, profiling/) a part's private attribute
    (`self.part._x`). Core's code stamps and reads attributes of the models it installs on: not a reach between
    parts."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute):
            value = node.value
            if node.attr == "trainer" and isinstance(value, ast.Name) and value.id == "self":
                found.append(f"{node.lineno}: self.trainer")
            private = node.attr.startswith("_") and not node.attr.startswith("__")
            on_trainer = isinstance(value, ast.Name) and value.id == "trainer"
            on_part = parts and isinstance(value, ast.Attribute) and isinstance(value.value, ast.Name) and (
                value.value.id == "self")  # fmt: skip
            if private and (on_trainer or on_part):
                found.append(f"{node.lineno}: {ast.unparse(node)}")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "setattr"):
            target, name = (node.args + [None, None])[:2]
            if (isinstance(name, ast.Constant) and isinstance(name.value, str) and name.value.startswith("_")
                    and not name.value.startswith("__") and isinstance(target, ast.Name) and target.id == "trainer"):
                found.append(f"{node.lineno}: {ast.unparse(node)}")  # fmt: skip
    return found


def _imports_trainers(source: str, relative_root: int) -> list[str]:
    """Every way `source` (a module `relative_root` packages below rloo_efficient) imports rloo_efficient.trainers:
    `import rloo_efficient.trainers...`, `from rloo_efficient(.trainers...) import ...`, relative imports reaching it,
    and a module named in a string (`importlib.import_module("rloo_efficient.trainers")`)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names if alias.name.startswith("rloo_efficient.trainers")]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:  # relative: resolved against the package
                if node.level > relative_root:
                    module = ".".join(filter(None, ["rloo_efficient", module]))
                else:
                    continue  # inside core
            if not module.startswith("rloo_efficient"):
                continue
            names = [alias.name for alias in node.names]
            if module.startswith("rloo_efficient.trainers") or (module == "rloo_efficient" and (
                    "trainers" in names or any(name[0].isupper() for name in names))):  # fmt: skip
                found.append(f"{node.lineno}: from {'.' * node.level}{node.module or ''} import {', '.join(names)}")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and "rloo_efficient.trainers" in node.value:
            if " " not in node.value:  # a module name, not prose
                found.append(f"{node.lineno}: {node.value!r}")
    return found


# A diagnostic that runs any trainer, stock TRL's included, and reads the completions TRL keeps only there
REACH_EXCEPTIONS = {"doctor.py": ["trainer._logs"]}


def test_no_part_reaches_into_another_object():
    """Outside the mixin (which owns the parts), no code reads `self.trainer` or a trainer's private attributes, and no
    part reads another part's private attributes."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        name = str(path.relative_to(PACKAGE))
        if path == PACKAGE / "trainers" / "mixin.py":
            continue
        parts = path.parent.name in ("trainers", "profiling")
        reaches = [r for r in _reaches(path.read_text(), parts)
                   if not any(r.endswith(allowed) for allowed in REACH_EXCEPTIONS.get(name, []))]  # fmt: skip
        if reaches:
            found[name] = reaches
    assert not found, found


def test_core_imports_no_trainer_in_any_form():
    found = {}
    for path in sorted((PACKAGE / "core").rglob("*.py")):
        depth = len(path.relative_to(PACKAGE).parts) - 1  # packages below rloo_efficient
        imports = _imports_trainers(path.read_text(), depth)
        if imports:
            found[str(path.relative_to(PACKAGE))] = imports
    assert not found, found


@pytest.mark.parametrize("source, reached", [
    ("self.trainer.log({})", True),
    ("trainer._profiler.step()", True),
    ("self.held._train_scope = None", True),
    ("getattr(trainer, '_switches', None)", True),
    ("self._switches.prefix and self.held.close()", False),
    ("getattr(self, '_cache', None)", False),
    ("getattr(model, '_rloo_graph_failed', None)", False),
])  # fmt: skip
def test_the_reach_check_sees_each_reach(source, reached):
    """Each of the reaches the package test refuses, as a one-line mutation would add it, is seen."""
    assert bool(_reaches(source)) == reached


@pytest.mark.parametrize("source, depth, imported", [
    ("import rloo_efficient.trainers.mixin", 2, True),
    ("from rloo_efficient.trainers import held_prefix", 2, True),
    ("from rloo_efficient import trainers", 2, True),
    ("from rloo_efficient import RLOOTrainer", 2, True),
    ("from ...trainers.switches import Switches", 2, True),
    ("from ... import trainers", 2, True),
    ("importlib.import_module('rloo_efficient.trainers.packed')", 2, True),
    ("from ..tree.holds import plan_holds", 2, False),
    ("from .passes import ChunkPlan", 2, False),
])  # fmt: skip
def test_the_import_check_sees_each_form(source, depth, imported):
    assert bool(_imports_trainers(source, depth)) == imported
