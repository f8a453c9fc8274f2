"""scripts/gpu-check where there is no GPU: it says so and exits 2; and the parts of it that need no GPU (reading
nvidia-smi's CSV with its [N/A], the plausibility and memory-identity checks) against made-up readings. The checks
that need a GPU run only there (docs/gpu-budget.md)."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

from support.fake_nvml import WITHOUT_NVIDIA_LIBRARY, FakeGpu, FakeNvml, GiB
from vllm_capacity.sources.nvml import NvmlSource

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
assert _spec is not None
assert _spec.loader is not None
gpu_check = importlib.util.module_from_spec(_spec)
sys.modules["gpu_check"] = gpu_check  # its dataclasses look their module up by name
_spec.loader.exec_module(gpu_check)


@WITHOUT_NVIDIA_LIBRARY
def test_without_a_gpu_it_says_so_and_exits_2() -> None:
    result = subprocess.run([str(ROOT / "scripts" / "gpu-check")], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "gpu-check: no usable NVIDIA GPU here (library_not_found)" in result.stdout


def test_without_nvidia_ml_py_it_says_it_cannot_run(tmp_path: Path) -> None:
    """No nvidia-ml-py (not installed, no .venv beside the script): one line and exit 4, "cannot run", not a
    traceback and exit 1 ("a check failed")."""
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "gpu_check.py", tmp_path / "scripts" / "gpu_check.py")
    (tmp_path / "agent").symlink_to(ROOT / "agent")
    # -S: no site-packages, so neither the installed pynvml nor one in a .venv beside the copy (there is none)
    result = subprocess.run(
        [sys.executable, "-S", str(tmp_path / "scripts" / "gpu_check.py")], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 4, result.stdout + result.stderr
    assert result.stdout.startswith("gpu-check: cannot run: nvidia-ml-py is not installed") and not result.stderr
    assert len(result.stdout.splitlines()) == 1


def test_nvidia_smi_values_not_available_are_none() -> None:
    csv = "GPU-a, 81559, 530, [N/A], 80500, [Not Supported], 41\nGPU-b, 24576, N/A, 300, 24000, 61.53, [N/A]\n"
    rows = gpu_check.smi_rows(lambda *a, **k: SimpleNamespace(stdout=csv))
    assert rows["GPU-a"]["memory.used"] is None and rows["GPU-a"]["memory.total"] == 81559
    assert rows["GPU-a"]["power.draw"] is None and rows["GPU-a"]["temperature.gpu"] == 41
    assert rows["GPU-b"]["memory.reserved"] is None and rows["GPU-b"]["power.draw"] == 61.53
    assert gpu_check.smi_rows(lambda *a, **k: (_ for _ in ()).throw(OSError("no nvidia-smi"))) == {}


def test_plausibility_and_the_memory_identity() -> None:
    (good,) = NvmlSource(loader=lambda: FakeNvml([FakeGpu(uuid="GPU-g", used=10 * GiB)]))._read_sync()
    assert gpu_check.plausible(good) == []
    assert gpu_check.identity(good)[0]
    hot = FakeGpu(uuid="GPU-h", temp=140, power_mw=900_000, limit_mw=300_000, sm_mhz=3000, sm_max_mhz=1710)
    (bad,) = NvmlSource(loader=lambda: FakeNvml([hot]))._read_sync()
    assert len(gpu_check.plausible(bad)) == 3
    (v1,) = NvmlSource(loader=lambda: FakeNvml([FakeGpu(uuid="GPU-1", used=GiB, supports_v2=False)]))._read_sync()
    ok, detail = gpu_check.identity(v1)
    assert ok and detail.startswith("v1")
