"""`vllm-capacity plan` on input a user gets wrong: every malformed config.json, and every option vLLM would refuse,
exits 2 with one line naming the file and the field (or the option); "does not fit" keeps its own status (1) and
"not modelled" its own (3), so that a script can tell the three apart."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from vllm_capacity import cli
from vllm_capacity.cli.options import PLAN_DOES_NOT_FIT, PLAN_NOT_MODELLED

TINY = Path(__file__).parent / "fixtures" / "models" / "tiny-llama" / "config.json"
GOOD: dict[str, Any] = json.loads(TINY.read_text())  # 2 layers, 4 heads, 2 KV heads, head_dim 32, bfloat16


def _with(**changes: Any) -> dict[str, Any]:
    """The tiny model's config with fields changed (None removes one)."""
    doc = {**GOOD, **changes}
    return {k: v for k, v in doc.items() if v is not None}


def _plan(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, list[str]]:
    code = cli.main(["plan", "--kv-cache-memory", "1GiB", "--max-model-len", "1024", *args], environ={})
    out, err = capsys.readouterr()
    return code, out, err.strip().splitlines()


# (what the user wrote, the field the one line names); each is a config.json vLLM itself could not load or serve
MALFORMED: dict[str, tuple[object, str]] = {
    "a field missing": (_with(num_hidden_layers=None), "num_hidden_layers: missing"),
    "a negative count": (_with(num_hidden_layers=-2), "num_hidden_layers: -2 is not a positive integer"),
    "a count as a string": (_with(num_attention_heads="4"), "num_attention_heads: '4' is not a positive integer"),
    "a count as a float": (_with(num_key_value_heads=1.5), "num_key_value_heads: 1.5 is not a positive integer"),
    "a count as a boolean": (_with(head_dim=True), "head_dim: True is not a positive integer"),
    "a count of zero": (_with(head_dim=0), "head_dim: 0 is not a positive integer"),
    "a list instead of an object": ([GOOD], "top level: a list, not a JSON object"),
    "a string instead of an object": ("LlamaForCausalLM", "top level: a str, not a JSON object"),
    "truncated JSON": (json.dumps(GOOD)[:100], "is not JSON: Unterminated string"),
    "an empty file": ("", "is not JSON: Expecting value"),
    "architectures as a string": (_with(architectures="Llama"), "architectures: 'Llama' is not a list of class names"),
    "architectures of a number": (_with(architectures=[7]), "architectures: [7] is not a list of class names"),
    "text_config as a list": (_with(text_config=[GOOD]), "text_config: [{"),
    "more KV heads than heads": (_with(num_key_value_heads=8), "num_key_value_heads: 8 does not divide"),
    "KV heads that do not divide the heads": (_with(num_key_value_heads=3), "num_key_value_heads: 3 does not divide"),
    "an unknown dtype": (_with(dtype="float17"), "dtype: 'float17' is not a dtype vLLM loads"),
    "a dtype of a number": (_with(dtype=16), "dtype: 16 is not a dtype vLLM loads"),
    "an unknown torch_dtype": (_with(dtype=None, torch_dtype="int4"), "torch_dtype: 'int4' is not a dtype vLLM"),
    "a compress ratio vLLM's compressor refuses": (
        _with(compress_ratios=[4, 16], sliding_window=128, index_head_dim=128),
        "compress_ratios[1]: 16: vLLM's compressor takes 4 or 128",
    ),
    "compress ratios for fewer layers": (_with(compress_ratios=[4]), "compress_ratios: expected a list of 2 ratios"),
    "compress ratios as a string": (_with(compress_ratios="4,128"), "compress_ratios: expected a list of 2 ratios"),
    # bounded in time and memory (each was a traceback, a MemoryError or 18 s and 1.5 GiB)
    "nested 100,000 deep": ("[" * 100_000 + "]" * 100_000, "nested deeper than the JSON reader follows"),
    "a 17 MiB file": (json.dumps({**GOOD, "pad": "x" * (17 * 2**20)}), "is larger than 16 MiB"),
    "1e30 layers": (_with(num_hidden_layers=1e30), "num_hidden_layers: 1e+30 is not a positive integer"),
    "2^40 layers": (_with(num_hidden_layers=2**40), "num_hidden_layers: 1,099,511,627,776 is more than any model's"),
    "10^8 layers": (_with(num_hidden_layers=10**8), "num_hidden_layers: 100,000,000 is more than any model's"),
    "a head_dim of 301 digits": (_with(head_dim=10**300), "head_dim: a number of 301 digits is more than any"),
    "2^40 MTP layers": (
        _with(num_nextn_predict_layers=2**40),
        "num_nextn_predict_layers: 1099511627776 is not a count",
    ),
}
RAW = ("truncated JSON", "an empty file", "nested 100,000 deep", "a 17 MiB file")


@pytest.mark.parametrize("case", MALFORMED)
def test_a_malformed_config_exits_2_naming_the_file_and_field(
    case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    doc, said = MALFORMED[case]
    path = tmp_path / "config.json"
    path.write_text(doc if isinstance(doc, str) and case in RAW else json.dumps(doc))
    code, out, err = _plan(capsys, "--model-config", str(path))
    assert code == 2 and out == "", (case, code, err)
    assert len(err) == 1, err
    assert err[0].startswith(f"vllm-capacity plan: model config: {path}: "), err
    assert said in err[0], err


def test_a_malformed_config_in_a_model_directory_or_a_drafter_names_that_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps(_with(num_attention_heads=None)))
    code, _, err = _plan(capsys, "--model-dir", str(tmp_path / "model"))
    assert code == 2 and err == [
        f"vllm-capacity plan: model config: {tmp_path / 'model' / 'config.json'}: num_attention_heads: missing from "
        "config.json"
    ], err
    draft = tmp_path / "draft.json"
    draft.write_text(json.dumps(_with(architectures="LlamaForCausalLM")))
    spec = ("--speculative-method", "draft_model", "--num-speculative-tokens", "2", "--draft-model-config", str(draft))
    code, _, err = _plan(capsys, "--model-config", str(TINY), *spec)
    assert code == 2 and len(err) == 1 and f"{draft}: architectures: 'LlamaForCausalLM'" in err[0], err


@pytest.mark.parametrize(
    ("header", "said"),
    [
        (b"[" * 100_000 + b"]" * 100_000, "header nested deeper than the JSON reader follows"),
        (b"[1, 2]", "header is not a JSON object of tensors"),
        (b'{"w": 7}', "unknown tensor dtype None"),
        (b'{"w": {"dtype": "BF16", "shape": "4x4"}}', "shape '4x4' is not a list of sizes"),
        (b'{"w": {"dtype": "BF16", "shape": [4, -1]}}', "shape [4, -1] is not a list of sizes"),
    ],
)
def test_a_malformed_safetensors_header_exits_2_naming_the_file(
    header: bytes, said: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--model-dir reads the weights from each safetensors header: a header no checkpoint has is one line, exit 2."""
    import struct

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(TINY.read_text())
    (model / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)
    code = cli.main(["plan", "--model-dir", str(model), "--gpu-memory", "16GiB", "--max-model-len", "1024"], environ={})
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and err.count("\n") == 1 and said in err, err


@pytest.mark.parametrize(
    ("heads", "kv_heads", "tp", "refused"),
    [
        (32, 8, 3, "Total number of attention heads (32) must be divisible by tensor parallel size (3)"),
        (48, 8, 12, "8 KV heads cannot be replicated evenly over tensor parallel size 12"),  # the heads split
        (24, 3, 4, "3 KV heads cannot be replicated evenly over tensor parallel size 4"),
        (24, 6, 4, "6 KV heads cannot be split evenly over tensor parallel size 4"),
        (32, 8, 4, None),  # split: 2 KV heads a rank
        (32, 2, 8, None),  # replicated: each KV head on 4 ranks
        (32, 1, 8, None),  # multi-query: the one head on every rank
    ],
)
def test_tp_that_vllm_cannot_shard_over_is_refused_in_its_words(
    heads: int, kv_heads: int, tp: int, refused: str | None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(_with(num_attention_heads=heads, num_key_value_heads=kv_heads)))
    code, out, err = _plan(capsys, "--model-config", str(path), "--tp", str(tp))
    if refused is None:
        assert code == 0 and "Plan for LlamaForCausalLM: TP " + str(tp) in out, err
    else:
        assert code == 2 and err == [f"vllm-capacity plan: error: --tp {tp}: vLLM refuses it for {path}: {refused}"]


def test_mla_shards_its_heads_and_holds_its_one_latent_head_on_every_rank(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """DeepSeek's MLA: the query heads divide by TP as for any model; the latent KV is one head that each rank holds,
    so no KV-head rule applies (a config's num_key_value_heads, which DeepSeek-V3's carries as 128, is not read)."""
    mla = {
        **GOOD, "kv_lora_rank": 64, "qk_rope_head_dim": 16, "num_attention_heads": 16, "num_key_value_heads": 16,
    }  # fmt: skip
    path = tmp_path / "config.json"
    path.write_text(json.dumps(mla))
    assert _plan(capsys, "--model-config", str(path), "--tp", "8")[0] == 0
    code, _, err = _plan(capsys, "--model-config", str(path), "--tp", "6")
    assert code == 2 and "Total number of attention heads (16) must be divisible by tensor parallel size (6)" in err[0]


def test_the_exit_statuses_tell_a_plan_a_refusal_and_the_unmodelled_apart(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fits = _plan(capsys, "--model-config", str(TINY))
    assert fits[0] == 0 and fits[2] == []
    code, out, err = _plan(capsys, "--model-config", str(TINY), "--kv-cache-memory", "1KiB")
    assert code == PLAN_DOES_NOT_FIT == 1 and out == "" and len(err) == 1 and "does not fit" in err[0], err
    qwen_next = _with(layer_types=None, full_attention_interval=2)  # Gated DeltaNet without its state fields
    path = tmp_path / "config.json"
    path.write_text(json.dumps(qwen_next))
    code, out, err = _plan(capsys, "--model-config", str(path))
    assert code == PLAN_NOT_MODELLED == 3 and out == "" and len(err) == 1 and "not modelled" in err[0], err
    code, _, err = _plan(capsys, "--model-config", str(TINY), "--kv-cache-dtype", "fp4")
    assert code == 2 and len(err) == 1, err


def test_a_narrower_refusal_keeps_its_exit_status(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The status follows the kind of error, not its exact class: a subclass of "does not fit" (a rule added later
    with its own error) still exits 1, not the 2 of bad input."""
    from vllm_capacity import sizing

    class WindowTooSmall(sizing.ImpossiblePlan):
        pass

    def refuse(*_: object) -> None:
        raise WindowTooSmall("a window of 0 tokens")

    monkeypatch.setattr(sizing, "plan", refuse)
    code, out, err = _plan(capsys, "--model-config", str(TINY))
    assert code == PLAN_DOES_NOT_FIT and out == "" and err == ["vllm-capacity plan: does not fit: a window of 0 tokens"]


PROFILE_NOTES = {  # the start of each note the plan gives about a figure of vLLM's profile nobody gave
    "estimated": "Activation peak not given: estimated",
    "activation as 0": "Activation peak not given and not estimated",
    "graphs as 0": "CUDA graphs taken as 0",
    "graphs outside": "CUDA graphs: this vLLM captures them after sizing the KV cache",
}


@pytest.mark.parametrize(
    ("given", "said"),
    [
        ([], {"estimated", "graphs as 0"}),
        (["--activation-memory", "1.2GiB"], {"graphs as 0"}),
        (["--cuda-graph-memory", "0.5GiB"], {"estimated"}),
        (["--activation-memory", "1.2GiB", "--cuda-graph-memory", "0.5GiB"], set()),
        (["--vllm-version", "0.11.0"], {"estimated", "graphs outside"}),
        (["--vllm-version", "0.7.2"], {"activation as 0", "graphs outside"}),  # V0's profile: not estimated
    ],
)
def test_a_budget_says_which_profile_figures_it_estimated_or_took_as_zero(
    capsys: pytest.CaptureFixture[str], given: list[str], said: set[str]
) -> None:
    """--gpu-memory without --activation-memory or --cuda-graph-memory once took both as 0, which overstates the KV
    cache (Llama-3.1-8B on 24 GiB by ~35 % with the docs' example figures), and subtracted graphs that vLLM before
    0.20 never took from the cache. The plan now estimates V1's activation peak, takes graphs not given as 0 where
    they are in the budget, says each, with the start-up line that gives the figure; a measured KV figure needs
    none of it."""
    base = ["plan", "--model-config", str(TINY), "--gpu-memory", "24GiB", "--weights-memory", "14.99GiB"]
    code = cli.main([*base, *given, "--format", "json"], environ={})
    notes = json.loads(capsys.readouterr().out)["notes"]
    assert code == 0
    assert {name for name, start in PROFILE_NOTES.items() if any(n.startswith(start) for n in notes)} == said, notes
    for note in notes:
        if note.startswith(PROFILE_NOTES["graphs as 0"]):
            # the line of the release planned for: 0.34's extensible cache measures the graphs it captured
            line = (
                "'Graph capturing finished in N secs, took X GiB'"
                if "--vllm-version" not in given
                else ("'Estimated CUDA graph memory: X GiB total'")
            )
            assert line in note and "--cuda-graph-memory" in note
        if note.startswith((PROFILE_NOTES["estimated"], PROFILE_NOTES["activation as 0"])):
            assert "'PyTorch activation peak memory takes X GiB'" in note and "--activation-memory" in note
    assert cli.main(["plan", "--model-config", str(TINY), "--kv-cache-memory", "4GiB"], environ={}) == 0
    out = capsys.readouterr().out
    assert not [start for start in PROFILE_NOTES.values() if start in out]  # the measured figure has them outside


def test_plan_help_lists_the_exit_statuses(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stop:
        cli.main(["plan", "--help"], environ={})
    assert stop.value.code == 0
    help_text = capsys.readouterr().out
    listed = help_text[help_text.index("exit status:") :]
    for code in ("0  the plan", "1  does not fit", "2  invalid input", "3  not modelled"):
        assert code in listed, listed
