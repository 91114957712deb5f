"""
Self-describing results files: the environment a file records ([`environment_info`], with [`git_commit`]) and the
atomic JSON write that puts it on disk ([`write_json_atomic`], of what [`json_ready`] makes of a payload).
"""

import functools
import json
import os
import platform
import re
import subprocess
from pathlib import Path

import torch

from .memory import device_description, is_accelerator, peak_rss_resettable


PACKAGE_DIR = Path(__file__).resolve().parent.parent  # rloo_efficient/


def git_commit(package_dir: Path = PACKAGE_DIR) -> str | None:
    """
    The commit of the rloo_efficient checkout holding `package_dir`, or `None`. Only a git work tree whose top level
    is the package's parent and holds rloo_efficient's own pyproject.toml counts: an installed copy (in a virtualenv
    inside some project's repository, say) would otherwise report that project's commit.
    """
    root = package_dir.parent
    try:
        pyproject = (root / "pyproject.toml").read_text()
    except OSError:
        return None
    # A line match rather than tomllib (Python >= 3.11): we support 3.10
    if not re.search(r'^name\s*=\s*"rloo_efficient"\s*$', pyproject, re.MULTILINE):
        return None

    def git(*args: str) -> str:
        out = subprocess.run(["git", *args], capture_output=True, text=True, check=True, cwd=package_dir)
        return out.stdout.strip()

    try:
        if Path(git("rev-parse", "--show-toplevel")).resolve() != root.resolve():
            return None
        return git("rev-parse", "HEAD")
    except (OSError, subprocess.CalledProcessError):
        return None


@functools.lru_cache(maxsize=None)
def environment_info(device: torch.device) -> dict:
    """Device, library versions and git commit: what a results file needs to describe itself."""
    import accelerate
    import transformers
    import trl

    from .. import __version__  # here: the package imports this module before it defines its version

    return {
        "device": device_description(device),
        "device_type": device.type,
        "python": platform.python_version(),
        "rloo_efficient": __version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "trl": trl.__version__,
        "accelerate": accelerate.__version__,
        "git_commit": git_commit(),
        "peak_rss_resettable": None if is_accelerator(device) else peak_rss_resettable(),
    }


def json_ready(value):
    """`value` as JSON takes it: a dict key other than a string, number, bool or None (transformers' `sequence_bias`
    keys are token tuples) as its `repr`, a tuple as a list, any other value JSON cannot hold as its `repr`."""
    if isinstance(value, dict):
        return {key if key is None or isinstance(key, (str, int, float, bool)) else repr(key): json_ready(item)
                for key, item in value.items()}  # fmt: skip
    if isinstance(value, (list, tuple)):
        return [json_ready(item) for item in value]
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return repr(value)


def write_json_atomic(path: str | os.PathLike, payload: dict) -> None:
    """Writes `payload` ([`json_ready`]) to `path` through a temporary file and a rename, so that a crash never leaves
    half a file, and a failed write leaves neither the temporary file nor a changed `path`."""
    path = Path(path)
    text = json.dumps(json_ready(payload), indent=2)  # before any file is opened
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
