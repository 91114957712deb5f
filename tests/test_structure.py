"""The package's shape holds: the trainer's parts keep their own state (no attribute set through `self` in one trainer
file and read through `self` in another), core knows no trainer, and no function is too long to hold in mind."""

import ast
from collections import defaultdict
from pathlib import Path


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


def test_core_imports_no_trainer_and_no_function_passes_100_lines():
    long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text())
        if path.is_relative_to(PACKAGE / "core"):
            imported = [node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)]
            assert not any("trainers" in module or module.startswith("rloo_efficient") for module in imported), path
        long += [f"{path.name}:{node.name}" for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)
                 and node.end_lineno - node.lineno + 1 > 100]  # fmt: skip
    assert not long, long
