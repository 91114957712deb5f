"""`python -m rloo_efficient.doctor`, the first command for a GPU user: it runs here too (on the CPU, saying what it
skips), and its exit status says when a kernel fails."""

import subprocess
import sys

from rloo_efficient import doctor
from rloo_efficient.core.attention import checks as kernel_checks


DENSE_USES = [use for use in doctor.USES if not use[0].startswith("varlen")]  # the CPU has no variable-length kernel


def test_the_doctor_runs_on_a_machine_without_a_gpu_and_passes():
    done = subprocess.run([sys.executable, "-m", "rloo_efficient.doctor"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout
    assert "torch " in out and "trl " in out and "transformers " in out
    assert "no CUDA device, so the GPU kernels' checks and the bf16 run are skipped" in out
    # Every dtype, head layout and use of the CPU kernel checked; the float32 run equals stock's
    checked = [line for line in out.splitlines() if line.startswith("cpu_flash on cpu")]
    assert len(checked) == 4 * len(doctor.HEAD_LAYOUTS) * len(DENSE_USES)
    assert all(line.endswith(": ok") or "causal window): no windowed kernel" in line for line in checked)
    assert sum(line.endswith(": ok") for line in checked) == 4 * len(doctor.HEAD_LAYOUTS) * (len(DENSE_USES) - 1)
    # No variable-length kernel on a CPU: the packed forward's length buckets
    varlen = [line for line in out.splitlines() if "varlen" in line]
    assert len(varlen) == 4 * len(doctor.HEAD_LAYOUTS) * (len(doctor.USES) - len(DENSE_USES))
    assert all(line.startswith("no kernel on cpu") and "no variable-length kernel" in line for line in varlen)
    assert "float32: same completions and metrics as stock" in out and out.rstrip().endswith("all checks passed")
    # One row per micro-batch: each prompt held across its group's micro-batches, and still stock's numbers
    assert "float32, 1 row per micro-batch: same completions and metrics as stock" in out
    assert "float32, 1 row per micro-batch: prompts held across micro-batches:" in out and "none held" not in out


def test_a_kernel_that_fails_its_check_makes_the_doctor_fail(monkeypatch, capsys):
    def check(config):
        return "did not match the float64 reference: output off by 1e+00" if config[2] == doctor.torch.float16 else None

    monkeypatch.setattr(kernel_checks, "check_kernel", check)
    assert doctor.main(["--skip_runs"]) == 1
    out = capsys.readouterr().out
    assert "(float16, 32/8 heads, head_dim 64, causal): FAILED: did not match" in out
    assert "(float16, 16/8 heads, head_dim 128, prefix, masked by query): FAILED" in out
    assert out.rstrip().endswith(f"{len(doctor.HEAD_LAYOUTS) * (len(DENSE_USES) - 1)} check(s) FAILED")
