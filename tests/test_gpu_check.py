"""scripts/gpu-check where there is no GPU: it says so and exits 2; and the parts of it that need no GPU (reading
nvidia-smi's CSV with its [N/A], the plausibility and memory-identity checks) against made-up readings. The checks
that need a GPU run only there (docs/gpu-budget.md)."""

from __future__ import annotations

import importlib.util
import json
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


def test_each_row_is_printed_as_its_check_completes() -> None:
    """A check that hangs (a cuInit that never returns, say) leaves the rows before it on the screen."""
    import io

    out = io.StringIO()
    report = gpu_check.Report(out=out)
    report.add("driver", None, "550.54.15")
    assert out.getvalue().split() == ["driver", "info", "550.54.15"]
    report.add("first read", False, "9.1 s")
    assert out.getvalue().splitlines()[1].split()[:3] == ["first", "read", "FAIL"] and report.failed()


def test_the_budget_adds_up_with_the_allocators_own_figures() -> None:
    """The first allocator taken as vLLM, its allocation as the weights, no KV cache: its CUDA context is vLLM's
    runtime, and the components add up to the total. Without those figures (as before) vLLM's own memory was in no
    component, and on a real GPU the row failed every time."""
    ctx = 300 * 2**20
    gpu = FakeGpu(uuid="GPU-c", used=3 * GiB + 2 * ctx, processes=[(4242, GiB + ctx), (5151, 2 * GiB + ctx)])
    (reading,) = NvmlSource(loader=lambda: FakeNvml([gpu]))._read_sync()
    ok, detail = gpu_check.budget_sum(reading, 4242, GiB)
    assert ok, detail
    assert "weights" in detail and "vllm_runtime" in detail
    from vllm_capacity.derive.budget import gpu_budget

    short = (reading.memory_total_bytes or 0) - sum(gpu_budget(reading, vllm_pids={4242}).components.values())
    assert short == GiB + ctx  # the old row: vLLM's own memory in no component


def test_an_allocator_that_prints_nothing_is_given_up_on() -> None:
    with subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)"], stdout=subprocess.PIPE, text=True
    ) as proc:
        assert gpu_check.read_line(proc, 0.3) == "nothing within 0.3 s"
        assert proc.wait(10) != 0  # killed, not left behind


def test_a_run_over_the_test_double_ends_ok_row_by_row(capsys) -> None:
    """scripts/gpu-check's main over the NVML double: two allocator processes (real processes that hold nothing,
    each entered in the double's process list with its allocation and a context, as the driver would list it), the
    readers of another namespace answering as the driver does there. Every row is printed as it completes, none
    fails, and it ends OK well inside the wrapper's 90 s."""
    import os
    import time

    ctx = 300 * 2**20
    gpu = FakeGpu(uuid="GPU-d", used=0, processes=[])
    nvml = FakeNvml([gpu])
    children: list[subprocess.Popen[str]] = []

    def allocator(index: int, size: int) -> tuple[subprocess.Popen[str], int]:
        assert index == 0
        proc = subprocess.Popen(
            [sys.executable, "-c", "import os, sys; print(os.getpid(), flush=True); sys.stdin.read()"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        children.append(proc)
        pid = int(gpu_check.read_line(proc, 30))
        gpu.processes.append((pid, size + ctx))
        gpu.used += size + ctx
        return proc, pid

    def reader(index: str, prefix: list[str]) -> tuple[list[list[int]], str]:
        return [[pid, used] for pid, used in gpu.processes], ""  # as root, sharing the host's namespace

    def shared(index: str, size: int) -> tuple[dict, str]:
        # the allocator and the reader in one namespace: the driver lists the allocator by the PID the reader sees
        listed = [p for p, _ in gpu.processes]
        return {"pid": listed[0], "listed": listed, "components": ["free", "vllm_runtime", "weights"]}, ""

    t0 = time.monotonic()
    try:
        code = gpu_check.main(nvml=nvml, allocator=allocator, reader=reader, shared=shared)
    finally:
        for proc in children:
            if proc.poll() is None:
                proc.kill()
            proc.wait(10)
            if proc.stdout:
                proc.stdout.close()
            if proc.stdin:
                proc.stdin.close()
    out = capsys.readouterr().out.splitlines()
    assert code == 0, "\n".join(out)
    assert out[-1] == "gpu-check: OK" and time.monotonic() - t0 < 90
    status = {line[:34].strip(): line[34:].split()[0] for line in out[:-1]}
    assert not [row for row, s in status.items() if s == "FAIL"], out
    for row in ("driver", "function table", "first read", "GPU 0 memory identity", "budget adds up"):
        assert row in status, (row, out)
    assert status["budget adds up"] == "ok" and sum(row.startswith("process ") for row in status) == 2
    assert status["one PID namespace, UID 65532"] == "ok"
    assert os.getpid() not in {pid for pid, _ in gpu.processes}


def test_the_shared_namespace_row_fails_when_vllm_is_not_listed_or_has_no_share() -> None:
    assert gpu_check.shared_row(None, "not measured: needs root")[0] is None
    assert gpu_check.shared_row({"error": "the allocator said error cuInit 100"}, "")[0] is False
    hidden = {"pid": 7, "listed": [], "components": ["free"]}  # the driver hid it: nothing of vLLM's in the budget
    assert gpu_check.shared_row(hidden, "")[0] is False
    ok = {"pid": 7, "listed": [7], "components": ["free", "other_processes", "system", "vllm_runtime", "weights"]}
    assert gpu_check.shared_row(ok, "") == (True, "the allocator listed as PID 7 (of [7]); budget components "
                                                  "free, other_processes, system, vllm_runtime, weights")  # fmt: skip


def test_the_namespace_readers_get_the_agents_paths_then_their_arguments() -> None:
    script = "import json, sys; print(json.dumps(sys.argv[1:]))"
    argv, error = gpu_check.run_python([], script, ["0", "1024"], 30)
    assert error == "" and argv[1:] == ["0", "1024"] and str(ROOT / "agent") in json.loads(argv[0])
    failed, why = gpu_check.run_python([], "raise SystemExit('no GPU here')", [], 30)
    assert failed is None and why == "no GPU here"
