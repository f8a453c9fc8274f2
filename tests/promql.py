"""Helpers to check PromQL written by this project: which metric names an expression uses, and which exist."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from types import ModuleType

from vllm_capacity.metrics import SPECS

KEYWORDS = {
    "by", "on", "without", "ignoring", "group_left", "group_right", "and", "or", "unless", "bool", "offset",
    "inf", "nan", "le",
}  # fmt: skip
VLLM_METRIC_NAMES = Path(__file__).resolve().parent / "fixtures" / "vllm" / "metric-names.tsv"


def metric_names(expr: str) -> set[str]:
    """Metric names in a PromQL expression (label matchers, grouping labels and functions left out)."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # strings
    text = re.sub(r"\{[^}]*\}", "", text)  # label matchers
    text = re.sub(r"\b(?:by|on|without|ignoring|group_left|group_right)\s*\([^)]*\)", "", text)
    text = re.sub(r"\[[^\]]*\]", "", text)  # range selectors
    names = set()
    for m in re.finditer(r"(?<![\w:.])([a-zA-Z_:][a-zA-Z0-9_:]*)(?![\w:])(?!\s*\()", text):
        word = m.group(1)
        if word.lower() in KEYWORDS or re.fullmatch(r"\d+[smhdwy]", word):
            continue
        names.add(word)
    return names


def agent_names() -> set[str]:
    names = set()
    for s in SPECS:
        names.add(s.name)
    return names


def vllm_names() -> set[str]:
    """Every vllm: metric family vLLM has registered (fixtures/vllm/metric-names.tsv), with a histogram's
    _bucket/_sum/_count series."""
    names = set()
    for line in VLLM_METRIC_NAMES.read_text().splitlines():
        if line.startswith("#") or line.startswith("name\t"):
            continue
        name, kind = line.split("\t")[:2]
        names.add(name)
        if kind == "histogram":
            names |= {f"{name}_bucket", f"{name}_sum", f"{name}_count"}
    return names


def load_generator(folder: str) -> ModuleType:
    """alerts/generate.py or dashboards/generate.py, each under a name of its own."""
    path = Path(__file__).resolve().parents[1] / folder / "generate.py"
    spec = importlib.util.spec_from_file_location(f"{folder}_generate", path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
