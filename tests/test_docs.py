"""The docs cannot drift from the code: every config field, every family, every doctor check is documented, and
every link between the pages resolves."""

import re
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
