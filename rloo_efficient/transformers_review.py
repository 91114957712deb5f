"""
Which of the transformers files rloo_efficient relies on changed since the releases we read:
`python -m rloo_efficient.transformers_review`.

rloo_efficient reads private transformers internals (caches, masks, attention dispatch, the recurrent kernels' wrappers)
and every listed family's modeling and processing code. [`REVIEWED`] holds, per release we read line by line, the
SHA-256 of each of those files. For the installed transformers, each family and each internal is reported as one we
read (and in which release), or as changed since the newest release we read: the files to read before moving the pin in
pyproject.toml. Exit status 1 when any file changed. `--record` adds the installed release's digests (after reading
its diff).
"""

import argparse
import hashlib
import json
import sys
from pathlib import Path

from .core.layers.families import MODEL_TYPES
from .core.layers.vision import VISION_FAMILIES


REVIEWED = Path(__file__).with_name("transformers_reviewed.json")
# The internals read beside the families' code (paths inside the transformers package)
INTERNALS = ("cache_utils.py", "masking_utils.py", "modeling_utils.py", "generation/utils.py",
             "integrations/hub_kernels.py", "integrations/sdpa_attention.py", "integrations/flash_attention.py",
             "integrations/accelerate.py", "modeling_flash_attention_utils.py", "utils/generic.py",
             "models/mixtral/modeling_mixtral.py")  # fmt: skip
# A text model type's folder, where it is not its own (a multimodal checkpoint's language model)
FOLDER = {"gemma3_text": "gemma3", "gemma4_text": "gemma4", "qwen2_vl_text": "qwen2_vl",
          "qwen2_5_vl_text": "qwen2_5_vl", "qwen3_5_text": "qwen3_5", "qwen3_5_moe_text": "qwen3_5_moe"}  # fmt: skip


def family_files(root: Path) -> dict[str, list[str]]:
    """Per family (its folder under `models/`), the modeling and processing files of it that exist under `root`."""
    folders = sorted({FOLDER.get(model_type, model_type) for model_type in MODEL_TYPES} | set(VISION_FAMILIES))
    files = {}
    for folder in folders:
        found = sorted(path.relative_to(root).as_posix() for pattern in ("modeling_*.py", "*processing_*.py")
                       for path in (root / "models" / folder).glob(pattern))  # fmt: skip
        files[folder] = found
    return files


def digests(root: Path) -> dict[str, str]:
    """SHA-256 of every file rloo_efficient relies on, by its path inside the transformers package at `root`."""
    paths = [*INTERNALS, *(path for paths in family_files(root).values() for path in paths)]
    return {path: hashlib.sha256((root / path).read_bytes()).hexdigest() for path in paths if (root / path).exists()}


def review(root: Path, reviewed: dict[str, dict[str, str]]) -> tuple[list[str], int]:
    """`(lines, changed)`: each family and internal as read (in which release) or changed since the newest read."""
    installed = digests(root)
    newest = max(reviewed, key=lambda release: tuple(int(part) for part in release.split(".")[:3]))

    def status(paths: list[str]) -> tuple[str, bool]:
        for release in sorted(reviewed, reverse=True, key=lambda r: tuple(int(p) for p in r.split(".")[:3])):
            if all(reviewed[release].get(path) == installed.get(path) for path in paths):
                return f"as read in {release}", False
        changed = [path for path in paths if reviewed[newest].get(path) != installed.get(path)]
        return f"CHANGED since {newest}: {', '.join(changed)}", True

    lines, count = [], 0
    for name, paths in [*((f"family {folder}", files) for folder, files in family_files(root).items()),
                        *((f"internal {path}", [path]) for path in INTERNALS)]:  # fmt: skip
        text, changed = status(paths)
        count += changed
        lines.append(f"{name}: {text}")
    return lines, count


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rloo_efficient.transformers_review", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--record", action="store_true", help="Add the installed release's digests as read.")
    args = parser.parse_args(argv)
    import transformers

    root = Path(transformers.__file__).parent
    reviewed = json.loads(REVIEWED.read_text())
    if args.record:
        reviewed[transformers.__version__] = digests(root)
        REVIEWED.write_text(json.dumps(reviewed, indent=1, sort_keys=True) + "\n")
    lines, changed = review(root, reviewed)
    print(f"transformers {transformers.__version__}; read: {', '.join(sorted(reviewed))}")
    print("\n".join(lines))
    print(f"\n{changed} file group(s) changed since the newest release read" if changed else "\nnothing changed")
    return 1 if changed else 0


if __name__ == "__main__":
    sys.exit(main())
