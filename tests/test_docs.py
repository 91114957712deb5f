"""The docs cannot drift from the code: every config field, every family, every doctor check is documented, and
every link between the pages resolves."""

import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

from rloo_efficient import doctor
from rloo_efficient.core.layers.families import MODEL_TYPES
from rloo_efficient.core.layers.vision import VISION_FAMILIES
from rloo_efficient.trainers.config import OUR_FIELDS


ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def page(name: str) -> str:
    return (ROOT / name).read_text()


@pytest.mark.parametrize("field", OUR_FIELDS)
def test_every_config_field_is_in_the_readme_and_the_configuration_page(field):
    assert f"| `{field}` |" in page("docs/configuration.md")
    assert f"| `{field}` |" in page("README.md")


@pytest.mark.parametrize("name", ["docs/configuration.md", "README.md"])
def test_every_documented_default_is_the_configs(name):
    """Each field's row in the page's table gives the default the config has (`None`, `True`, `"auto"`, ...), and
    the page counts the fields there are."""
    from dataclasses import fields

    from rloo_efficient.trainers.config import SharingArguments

    text = page(name)
    defaults = {spec.name: spec.default for spec in fields(SharingArguments)}
    for field, default in defaults.items():
        row = re.search(rf"^\| `{field}` \| `([^`]*)` \|", text, re.MULTILINE)
        assert row is not None, field
        assert row.group(1) == repr(default).replace("'", '"'), (field, row.group(1), default)
    numbers = {11: "eleven", 12: "twelve", 13: "thirteen", 14: "fourteen", 15: "fifteen"}
    counted = re.search(r"(\w+) fields", text)
    assert counted is not None and counted.group(1) == numbers[len(defaults)], counted


def test_every_script_the_pages_cite_is_in_the_scripts_page():
    scripts = page("docs/scripts.md")
    cited = {name for path in PAGES for name in re.findall(r"experiments/\w+\.(?:py|sh|ipynb)", path.read_text())}
    cited |= {f"experiments/{path.name}" for path in (ROOT / "experiments").glob("*.py")
              if path.name not in ("bench_common.py",)}  # fmt: skip
    missing = sorted(name for name in cited if f"`{name}`" not in scripts)
    assert not missing, missing


def test_every_family_is_in_the_families_page():
    families = page("docs/families.md")
    missing = [name for name in (*MODEL_TYPES, *VISION_FAMILIES) if f"`{name}`" not in families]
    assert not missing, f"docs/families.md does not name {missing}"


def test_every_doctor_check_is_in_the_gpu_page():
    gpu = page("docs/gpu.md")
    missing = [use for use, masked in doctor.USES if f"`{use}`" not in gpu or (masked and f"`{masked}`" not in gpu)]
    assert not missing and "one row per micro-batch" in gpu, missing


@pytest.mark.parametrize("path", PAGES, ids=lambda path: path.name)
def test_every_link_resolves(path):
    """Relative links (to a page, a result or a file) name something that exists; anchors name a heading of it."""
    for target in re.findall(r"\]\(([^)\s]+)\)", path.read_text()):
        if re.match(r"[a-z]+://", target):
            continue
        file, _, anchor = target.partition("#")
        resolved = (path.parent / file).resolve() if file else path
        assert resolved.exists(), f"{path.name} links to {target}, which does not exist"
        if anchor and resolved.suffix == ".md":
            headings = {re.sub(r"[^a-z0-9 -]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
                        for line in resolved.read_text().splitlines() if line.startswith("#")}  # fmt: skip
            assert anchor in headings, f"{path.name} links to {target}: no such heading"


def test_the_readme_is_a_front_door():
    readme = page("README.md")
    assert len(readme.splitlines()) < 250
    assert readme.index("./run_improved.sh") < readme.index("##")  # the two commands lead
    assert ".venv/bin/python -m pytest tests" in readme.split("##")[0]


# Every module the previous release's docs named (README.md and docs/ at 0.2.0, before the demo workload moved on
# 2026-11-29): each still imports. Those that moved import for one more release, as their new module, with one
# DeprecationWarning naming it
PREVIOUS_RELEASE_MODULES = (
    "rloo_efficient.cli", "rloo_efficient.doctor", "rloo_efficient.transformers_review", "rloo_efficient.profiling",
    "rloo_efficient.core.tree.rows", "rloo_efficient.core.tree.radix", "rloo_efficient.core.tree.layout",
    "rloo_efficient.core.tree.holds", "rloo_efficient.core.attention.backend", "rloo_efficient.core.attention.tree",
    "rloo_efficient.core.attention.kernels", "rloo_efficient.core.attention.varlen",
    "rloo_efficient.core.attention.checks", "rloo_efficient.core.attention.windows", "rloo_efficient.core.attention.held",
    "rloo_efficient.core.layers.recurrent", "rloo_efficient.core.layers.recurrent_checks",
    "rloo_efficient.core.layers.moe", "rloo_efficient.core.layers.vision", "rloo_efficient.core.layers.families",
    "rloo_efficient.core.layers.install", "rloo_efficient.core.forward.packing", "rloo_efficient.core.forward.reward",
    "rloo_efficient.core.forward.scope", "rloo_efficient.core.forward.sharded", "rloo_efficient.core.generation.generate",
    "rloo_efficient.core.generation.tree_prefill", "rloo_efficient.core.generation.prompt_cache",
    "rloo_efficient.core.generation.turn_cache", "rloo_efficient.trainers.mixin", "rloo_efficient.trainers.held_prefix",
    "rloo_efficient.trainers.rewards", "rloo_efficient.trainers.hydra", "rloo_efficient.trainers.config",
    "rloo_efficient.trainers.memory_profiling", "rloo_efficient.trainers.rloo", "rloo_efficient.trainers.grpo",
)  # fmt: skip
MOVED = {"rloo_efficient.workload": "rloo_efficient.demo.workload",
         "rloo_efficient.tiny_models": "rloo_efficient.demo.tiny_models"}  # fmt: skip


@pytest.mark.parametrize("name", PREVIOUS_RELEASE_MODULES)
def test_every_module_the_previous_release_named_imports(name):
    importlib.import_module(name)


@pytest.mark.parametrize("old", list(MOVED))
def test_a_moved_module_imports_as_its_new_one_with_one_deprecation_warning(old):
    """As a user's script imports it, in a fresh interpreter: Python's default filters show the warning there."""
    code = f"import {old} as moved; print(moved.__name__)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == MOVED[old]
    warned = [line for line in done.stderr.splitlines() if "DeprecationWarning" in line]
    assert len(warned) == 1 and warned[0].startswith("<string>:1:") and f"import {MOVED[old]} instead" in warned[0]
