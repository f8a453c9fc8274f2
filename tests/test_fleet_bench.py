"""bench/fleet.py at a small scale, so that it keeps working: the history it writes imports into a real TSDB, the
recording-rule series it computes equal the shipped rules' expressions on its raw series (the script stops
otherwise), and every dashboard query and rule is timed. The figures at full scale are in docs/fleet.md."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_the_fleet_benchmark_runs_and_times_every_query(tmp_path: Path) -> None:
    result = subprocess.run(
        [
            *(sys.executable, str(ROOT / "bench" / "fleet.py"), "--pods", "24", "--models", "5", "--clusters", "2"),
            *("--days", "0.5", "--raw-hours", "2", "--watched", "2", "--work", str(tmp_path)),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert re.search(r"History: 24 pods of \d+ series, 2 clusters, 5 models", out), out[:2000]
    assert re.search(r"equal the rules' own expressions .* \(\d+ series compared\)", out), out[:2000]
    for group in ("vllm-capacity", "vllm-capacity-fleet"):
        assert re.search(rf"^\| `{group}` \| \d+ \| [\d.]+ \| ok", out, re.MULTILINE), group
    queries = 0
    for name in ("vllm-capacity.json", "vllm-capacity-fleet.json"):
        d = json.loads((ROOT / "dashboards" / name).read_text())
        queries += sum(len(p["targets"]) for p in d["panels"] if p["type"] != "row")
        queries += sum(1 for v in d["templating"]["list"] if v["type"] == "query")
    rows = re.findall(r"^\| vllm-capacity(?:-fleet)? \| .+ \| [\d.]+ \| [\d.]+ \| \d+ \|$", out, re.MULTILINE)
    assert len(rows) == queries, (len(rows), queries)
    assert "target <= 1 s: met" in out
