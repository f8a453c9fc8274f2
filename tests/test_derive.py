"""Derivations: plain functions over plain data, checked against vLLM's own figures."""

import dataclasses
import math
import random
from collections.abc import Iterator, Mapping

import pytest

from support.files import fixture_text
from vllm_capacity import derive, sizing
from vllm_capacity.sizing import PlanInputs
from vllm_capacity.sources.model_config import parse_config
from vllm_capacity.sources.vllm_metrics.parse import parse_metrics
from vllm_capacity.sources.vllm_metrics.records import SCHEMA_V0, SCHEMA_V1, SCHEMA_V1_LEGACY

MML_GEMMA = derive.ServerFacts(max_model_len={"gemma-12b": 32768})  # /v1/models of the worked example's server
MML_8192 = derive.ServerFacts(flags=derive.ServerFlags(max_model_len=8192))  # --max-model-len, no /v1/models


def test_worked_example() -> None:
    """The worked example (a 22 GiB GPU, 4.31 GiB of KV cache): 208,625 tokens at max_model_len 32,768 is
    vLLM's 'Maximum concurrency ... 6.37x'."""
    (e,) = derive.derive_all(parse_metrics(fixture_text("v1-0.24-seed.prom")), MML_GEMMA)
    assert e.capacity_tokens == 208625
    assert round(e.max_concurrency, 2) == 6.37
    # "Real concurrency can be much higher": 208,625 / 4,000 and / 8,192
    assert e.concurrency_at(4000) == pytest.approx(52.16, abs=0.01)
    assert e.concurrency_at(8192) == pytest.approx(25.47, abs=0.01)
    assert e.used_tokens == pytest.approx(0.4 * 208625)
    assert e.free_tokens == pytest.approx(0.6 * 208625)
    assert e.mean_context_tokens == pytest.approx(0.4 * 208625 / 20)
    assert e.max_concurrency_observed == pytest.approx(50.0)
    assert e.concurrency_utilization == pytest.approx(20 / 6.366729736328125)
    assert e.concurrency_utilization_observed == pytest.approx(20 / 50)
    assert e.waiting_for_capacity == 4.0


def test_v0_formula_matches_vllm_log() -> None:
    """vLLM issue #12330: '# GPU blocks: 5691' and 'Maximum concurrency for 8192 tokens per request: 11.12x'."""
    (e,) = derive.derive_all(parse_metrics(fixture_text("v0-0.6.6-multiprocess.prom")), MML_8192)
    assert e.capacity_tokens == 5691 * 16
    assert f"{e.max_concurrency:.2f}" == "11.12"


def test_data_parallel_blocks_are_split_per_engine() -> None:
    """Qwen3-14B 0.10.2: 'GPU KV cache size: 42,656 tokens', 'Maximum concurrency for 32,768 ...: 1.30x'."""
    engines = derive.derive_all(
        parse_metrics(fixture_text("v1-0.10.2-dp2.prom")), derive.ServerFacts(max_model_len={"qwen3-14b": 32768})
    )
    assert [e.capacity_tokens for e in engines] == [42656, 42656]
    assert [f"{e.max_concurrency:.2f}" for e in engines] == ["1.30", "1.30"]
    assert engines[1].mean_context_tokens is None  # idle engine: unknown, not 0
    assert engines[1].max_concurrency_observed is None


def test_unknown_capacity_stays_unknown() -> None:
    (e,) = derive.derive_all(parse_metrics(fixture_text("v1-0.8.5-legacy.prom")))
    assert e.capacity_tokens is None
    assert e.used_tokens is None and e.free_tokens is None and e.max_concurrency is None
    assert e.max_model_len is None
    assert e.usage_ratio == 0.125  # what vLLM does report is still there


@pytest.mark.parametrize(
    ("schema", "blocks", "block_size", "max_model_len", "expected"),
    [
        (SCHEMA_V0, 1952, 16, 20000, 1.56),  # vLLM issue #10517: '# GPU blocks: 1952', '20000 ...: 1.56x'
        (SCHEMA_V1_LEGACY, 1381, 16, 2048, 10.79),  # vLLM PR #12569: '# GPU blocks: 1381', '2048 ...: 10.79x'
        (SCHEMA_V1, 2666, 16, 32768, 1.30),  # LMCache issue #1739
        (SCHEMA_V1, 100, 16, 1000, 1.59),  # ceil(1000/16) = 63 blocks a request: 100 / 63, not 1.60
    ],
)
def test_max_concurrency_formulas(schema: str, blocks: int, block_size: int, max_model_len: int, expected: float):
    rules = derive.sizing_rules(schema, None)  # /version unknown: the generation's rules
    got = derive.max_concurrency_at_max_model_len(
        reported=None, blocks=blocks, block_size=block_size, max_model_len=max_model_len, rules=rules
    )
    assert round(got, 2) == expected


@pytest.mark.parametrize(
    ("schema", "version", "expected"),
    [
        (SCHEMA_V0, "0.6.6", ("v0", (0, 6, 6))),
        (SCHEMA_V1_LEGACY, "0.9.1", ("v1", (0, 9, 1))),  # /version settles what the generation leaves open
        (SCHEMA_V1_LEGACY, None, ("v1", (0, 7, 3))),
        (SCHEMA_V1, "0.10.2+cu128", ("v1", (0, 10, 2))),
        (SCHEMA_V1, "not a version", ("v1", (0, 9, 2))),
    ],
)
def test_sizing_rules_follow_vllms_version(schema: str, version: str | None, expected: tuple) -> None:
    assert derive.sizing_rules(schema, version) == expected


@pytest.mark.parametrize(
    ("engine", "version"), [("v0", (0, 6, 6)), ("v1", (0, 8, 5)), ("v1", (0, 9, 1)), ("v1", (0, 32, 0))]
)
@pytest.mark.parametrize("max_model_len", [1000, 1024, 32768])
def test_live_and_plan_agree_on_the_same_cache(engine: str, version: tuple, max_model_len: int) -> None:
    """The planner's blocks fed to the live derivation give the planner's own maximum concurrency: one formula."""
    geometry = parse_config(
        {
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "torch_dtype": "bfloat16",
        }
    )
    plan = sizing.plan(
        geometry,
        PlanInputs(
            kv_cache_memory_bytes=9 * 2**30,
            max_model_len=max_model_len,
            block_size=16,
            engine_version=engine,
            version=version,
        ),
    )
    live = derive.max_concurrency_at_max_model_len(
        reported=None,
        blocks=plan.num_gpu_blocks,
        block_size=16,
        max_model_len=max_model_len,
        rules=sizing.SizingRules(engine, version),
    )
    assert live == plan.max_concurrency


def test_reported_concurrency_wins() -> None:
    got = derive.max_concurrency_at_max_model_len(
        reported=4.0, blocks=10, block_size=16, max_model_len=1000, rules=sizing.SizingRules("v1", (0, 24, 0))
    )
    assert got == 4.0


def test_blocks_per_engine() -> None:
    assert derive.blocks_per_engine(5332, 2, SCHEMA_V1) == 2666
    assert derive.blocks_per_engine(5691, 1, SCHEMA_V0) == 5691
    assert derive.blocks_per_engine(None, 2, SCHEMA_V1) is None


def test_usage_is_clamped_to_capacity() -> None:
    assert derive.used_tokens(1.02, 1000) == 1000
    assert derive.used_tokens(-0.1, 1000) == 0


def test_bytes_per_token_from_fixed_kv_budget() -> None:
    # the tiny model: 2 layers x 2 KV heads x 32 head_dim x 2 (K, V) x 2 bytes = 512 B per token, 1 GiB budget
    assert derive.kv_bytes_per_token(2**30, 2**21, blocks_overridden=False) == 512
    assert derive.kv_bytes_per_token(2**30, 4096, blocks_overridden=True) is None
    assert derive.kv_bytes_per_token(None, 4096, blocks_overridden=False) is None


def test_max_model_len_from_cache_config() -> None:
    m = parse_metrics(fixture_text("v1-0.32.0-cpu-idle.prom"))
    assert derive.max_model_len_from_cache_config(m.engines[0]) == 1024
    (e,) = derive.derive_all(m)
    assert e.max_model_len == 1024


@pytest.mark.parametrize(
    ("total", "previous", "raw", "restarted", "expected"),
    [
        (None, None, 44.0, False, 44.0),  # first reading: vLLM's own value
        (44.0, 44.0, 50.0, False, 50.0),
        (50.0, 50.0, 3.0, False, 53.0),  # counter went down: reset, all 3 are new
        (50.0, 50.0, 60.0, True, 110.0),  # restart seen otherwise: the whole reading is new
    ],
)
def test_counter_carried_across_restarts(total, previous, raw, restarted, expected) -> None:
    assert derive.accumulate_counter(total, previous, raw, restarted) == expected


@pytest.mark.parametrize(
    ("state", "limit"),
    [
        ({"waiting": 0}, "none"),
        ({"waiting": 3, "waiting_for_capacity": 3, "usage": 0.97}, "kv_cache"),
        # "capacity" alone, on a cache with room: a scheduling limit the agent cannot name (the token budget, say)
        ({"waiting": 3, "waiting_for_capacity": 3, "usage": 0.4}, None),
        ({"waiting": 0, "preempted": True}, "kv_cache"),  # preempted since the last read
        ({"waiting": 2, "waiting_for_capacity": None, "usage": 0.95}, "kv_cache"),  # before vLLM said why
        # at --max-num-seqs vLLM counts the queue as waiting for "capacity" too, with the cache half free
        ({"waiting": 13, "running": 16, "max_num_seqs": 16, "usage": 0.58, "waiting_for_capacity": 13}, "max_num_seqs"),
        ({"waiting": 13, "running": 16, "max_num_seqs": 16, "preempted": True}, "kv_cache"),
        ({"waiting": 0, "running": 12, "slo_max_concurrency": 8}, "slo"),  # over the objective, queue or not
        ({"waiting": 0, "running": 8, "slo_max_concurrency": 8}, "none"),
        ({"waiting": 4, "waiting_for_capacity": 0, "running": 5}, None),  # deferred, say: no name for it
        # deferred for an adapter without a slot: the LoRA slots, unless the cache is full anyway
        ({"waiting": 4, "waiting_for_capacity": 0, "running": 5, "lora_blocked": True}, "lora_slots"),
        ({"waiting": 4, "usage": 0.97, "lora_blocked": True}, "kv_cache"),
        ({"waiting": None}, None),
        # the step's token budget: requests wait for capacity on a cache with room while the steps are about as
        # large as --max-num-batched-tokens allows
        ({"waiting": 12, "waiting_for_capacity": 12, "usage": 0.01, "budget_fill": 0.98}, "token_budget"),
        ({"waiting": 12, "waiting_for_capacity": 12, "usage": 0.01, "budget_fill": 0.2}, None),  # small steps
        ({"waiting": 0, "budget_fill": 0.98}, "none"),  # full steps, nothing waits: no limit binds
        ({"waiting": 12, "waiting_for_capacity": 12, "usage": 0.97, "budget_fill": 0.98}, "kv_cache"),
    ],
)
def test_what_limits_concurrency_now(state: dict, limit: str | None) -> None:
    args = {"running": 4, "waiting": 0, "waiting_for_capacity": 0, "preempted": False, "usage": 0.5, **state}
    bounds = {k: args.pop(k) for k in list(args) if k in derive.Bounds.__dataclass_fields__}
    assert derive.concurrency_limit(**args, bounds=derive.Bounds(**bounds)) == limit


@pytest.mark.parametrize(
    ("running", "bounds", "queue", "preempted", "expected"),
    [
        # vLLM 0.32's saturated capture: 16 run, 8 wait for capacity, the cache half used after preemptions: the
        # observed-context model promises 31, vLLM's queue says it is 8 short
        (16, {"observed_context": 31.0}, 8, True, (-8, "queue")),
        (16, {"observed_context": 31.0}, 8, False, (-8, "queue")),
        (16, {"observed_context": 31.0}, 0, True, (0.0, "preemption")),  # preempted, nothing waits: none left
        (16, {"observed_context": 12.0}, 0, True, (-4.0, "preemption")),  # below zero when the model says lower
        (16, {}, 0, True, (0.0, "preemption")),
        (10, {"observed_context": 31.0, "slo": 12.0, "sustained": 16.0}, 0, False, (2.0, "slo")),  # calm
        (10, {"observed_context": 31.0, "slo": None, "sustained": 16.0}, 0, False, (6.0, "sustained")),
        (10, {"observed_context": None}, 0, False, (None, None)),
        (None, {"observed_context": 31.0}, 8, False, (None, None)),
    ],
)
def test_headroom_takes_vllms_evidence_first(running, bounds, queue, preempted, expected) -> None:
    assert derive.headroom(running, bounds, queue=queue, preempted=preempted) == expected


def test_the_sustained_concurrency_is_what_vllm_holds_under_pressure() -> None:
    """Calm reads give a lower bound (the most seen running); the first pressed read replaces it with the level
    vLLM holds; later pressed reads average in, older ones weighing half per half-life."""
    s = derive.NO_SUSTAINED
    s = derive.learn_sustained(s, 0, pressed=False, now=0, half_life=100)
    assert s.level is None  # nothing ran: no bound at all
    for running in (3, 9, 5):
        s = derive.learn_sustained(s, running, pressed=False, now=1, half_life=100)
    assert (s.level, s.observed) == (9, False)
    s = derive.learn_sustained(s, 6, pressed=True, now=10, half_life=100)
    assert (s.level, s.observed) == (6, True)  # the lower bound is not an observation: it does not average in
    s = derive.learn_sustained(s, 30, pressed=False, now=20, half_life=100)
    assert s.level == 6  # a calm read, however high, says nothing of the limit once one was seen
    s = derive.learn_sustained(s, 12, pressed=True, now=110, half_life=100)
    assert s.level == pytest.approx((6 * 0.5 + 12) / 1.5)  # the read of 100 s ago weighs half
    assert derive.learn_sustained(s, None, pressed=True, now=120, half_life=100) == s
    # nothing running under pressure is an instant, not a level: it teaches nothing, first read or later
    assert derive.learn_sustained(s, 0, pressed=True, now=130, half_life=100) == s
    assert derive.learn_sustained(derive.NO_SUSTAINED, 0, pressed=True, now=0, half_life=100) == derive.NO_SUSTAINED


def test_how_full_the_steps_were_against_the_token_budget() -> None:
    """The steps' mean size over the budget, from vllm:iteration_tokens_total's sum and count. Under chunked prefill
    (vLLM 0.32, budget 64, 700-token prompts, 2 running) every step computes 64 tokens, yet vLLM observes each
    prompt at once when its prefill ends: of 12 steps, 11 look like 1 token (the one request decoding) and one
    like 701. By the buckets 1 step in 12 is over half the budget (what the agent read before, on the real server:
    0.125, naming nothing); by the mean the steps are full."""
    window = ((1.0, 22.0), (8.0, 22.0), (512.0, 22.0), (1024.0, 24.0), (math.inf, 24.0))  # two prompts read
    assert derive.budget_fill(window, 22 * 1 + 2 * 701, 64) == pytest.approx(1424 / 24 / 64)
    assert derive.budget_fill(window, 48.0, 64) == pytest.approx(2 / 64)  # decode steps of 2 tokens: room left
    assert derive.budget_fill(window, 5000.0, 64) == 1.0  # steps with no output (a prefill alone) are not counted
    assert derive.budget_fill(window, None, 64) is None  # no sum read
    assert derive.budget_fill(window, 712.0, None) is None  # no budget known
    assert derive.budget_fill(((1.0, 1.0), (math.inf, 19.0)), 19.0, 256) is None  # too few steps to say
    assert derive.budget_fill((), 0.0, 256) is None


def test_the_planned_layout_beside_vllms_own_capacity() -> None:
    """With --model-config the agent lays out vLLM's groups for vLLM's own budget (cache_config_info's
    kv_cache_memory_bytes, block size, dtype, Mamba mode): the blocks a max_model_len request holds by layer kind
    (why a Gemma 3 serves only ~2 requests of 32K), and whether vLLM's capacity agrees within a block per group."""
    from vllm_capacity.sources.vllm_metrics.records import CacheConfig

    gemma = parse_config(
        {"num_hidden_layers": 62, "num_attention_heads": 32, "num_key_value_heads": 16, "head_dim": 128,
         "sliding_window": 1024, "sliding_window_pattern": 6, "torch_dtype": "bfloat16"}
    )  # fmt: skip
    memory = 21 * 2**30
    plan = sizing.plan(
        gemma, PlanInputs(kv_cache_memory_bytes=memory, max_model_len=32768, max_num_batched_tokens=8192)
    )
    cc = CacheConfig({"block_size": "16", "cache_dtype": "auto", "kv_cache_memory_bytes": str(memory)})
    v033 = sizing.SizingRules("v1", (0, 33, 0))

    def pool(capacity_tokens: int | None, device: str | None, pool_bytes: int = memory) -> derive.EnginePool:
        return derive.EnginePool(32768, pool_bytes, capacity_tokens, device)

    gemma_8192 = derive.ServerFacts(
        model=derive.ServedModel(gemma), flags=derive.ServerFlags(max_num_batched_tokens=8192)
    )
    layout = derive.planned_layout(cc, gemma_8192, pool(plan.kv_cache_tokens, "GPU"), v033)
    assert layout is not None and layout.mismatch is False
    assert layout.groups == {"sliding": 6, "full": 1}
    assert layout.blocks_per_request == {"sliding": 6 * (-(-(1023 + 16384) // 16) + 1), "full": 2048}
    assert sum(layout.blocks_per_request.values()) == round(plan.num_gpu_blocks / plan.max_concurrency)
    # vLLM's capacity off by more than a block per group (7 groups x 16 tokens): flagged, with what was assumed
    gemma_alone = derive.ServerFacts(
        model=derive.ServedModel(gemma)
    )  # no max_num_batched_tokens in the log: 2048 assumed
    off = derive.planned_layout(cc, gemma_alone, pool(plan.kv_cache_tokens + 7 * 16 + 1, "CPU"), v033)
    assert off is not None and off.mismatch is True
    assert off.assumed == "max_num_batched_tokens 2048 (assumed), async scheduling off (CPU backend)"
    within = derive.planned_layout(cc, gemma_8192, pool(plan.kv_cache_tokens + 7 * 16, "GPU"), v033)
    assert within is not None and within.mismatch is False
    # a dense model: one group; nothing without a config, a budget, or where the planner refuses
    llama = parse_config({"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                          "head_dim": 128, "torch_dtype": "bfloat16"})  # fmt: skip
    dense = derive.planned_layout(cc, derive.ServerFacts(model=derive.ServedModel(llama)), pool(None, None), v033)
    assert dense is not None and (dense.groups, dense.blocks_per_request, dense.mismatch) == (
        {"full": 1}, {"full": 2048}, None)  # fmt: skip
    assert derive.planned_layout(cc, derive.NO_FACTS, pool(1, None), v033) is None
    # one request of 32K does not fit in 1 MiB: the planner refuses, no layout
    assert (
        derive.planned_layout(
            cc, derive.ServerFacts(model=derive.ServedModel(llama)), pool(1, None, pool_bytes=2**20), v033
        )
        is None
    )


def test_the_live_layout_plans_the_drafter_vllm_logged_or_gives_none() -> None:
    """A drafter shares the pool: the layout plans it from the engine's logged speculative config (an EAGLE head
    assumed one layer of the model's shape, and said so); a server that speculates in a way the agent cannot size
    gets no layout, never a false disagreement."""
    from vllm_capacity.sizing import Speculation
    from vllm_capacity.sources.vllm_metrics.records import CacheConfig

    llama = parse_config({"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                          "head_dim": 128, "torch_dtype": "bfloat16"})  # fmt: skip
    memory = 40 * 2**30
    eagle = sizing.plan(
        llama, PlanInputs(kv_cache_memory_bytes=memory, max_model_len=32768, speculation=Speculation("eagle", 2))
    )
    cc = CacheConfig({"block_size": "16", "cache_dtype": "auto", "kv_cache_memory_bytes": str(memory)})
    v032 = sizing.SizingRules("v1", (0, 32, 0))
    gpu = derive.EnginePool(32768, memory, eagle.kv_cache_tokens, "GPU")
    counting = dataclasses.replace(gpu, counting=True)  # vLLM counts drafts

    def logged(speculation: tuple[str, int] | None) -> derive.ServerFacts:
        return derive.ServerFacts(model=derive.ServedModel(llama), speculation=speculation)

    told = derive.planned_layout(cc, logged(("eagle", 2)), counting, v032)
    assert told is not None and told.mismatch is False and "eagle speculation of 2 tokens" in told.assumed
    # the same server without the log: it counts drafts, so the agent knows it speculates but not how
    assert derive.planned_layout(cc, logged(None), counting, v032) is None
    # before, the agent planned the model alone and flagged vLLM's capacity (33 layers, not 32) as a disagreement
    alone = derive.planned_layout(cc, logged(None), gpu, v032)
    assert alone is not None and alone.mismatch is True
    # bytes per token from the model: the head's layer counts too where the log names it (vLLM's figure has it)
    per_layer = 2 * 8 * 128 * 2
    model = derive.ServedModel(llama)
    assert derive.planned_bytes_per_token(model, cc, told) == 33 * per_layer == eagle.kv_bytes_per_token
    assert derive.planned_bytes_per_token(model, cc, alone) == 32 * per_layer
    assert derive.planned_bytes_per_token(model, cc, None) == 32 * per_layer  # no layout: the geometry's
    # methods: n-gram family without layers, MTP of the model's own kind, a separate draft model not sized
    assert derive.live_speculation(derive.LiveSpeculation(("suffix", 4)))[0] == Speculation("ngram", 4)
    assert derive.live_speculation(derive.LiveSpeculation(("deepseek_mtp", 1)))[0] == Speculation("mtp", 1)
    assert derive.planned_layout(cc, logged(("draft_model", 2)), gpu, v032) is None


def test_lora_slots_from_vllms_series() -> None:
    """The server's one LoRA series. Under V1 (0.32, as its real server shows) both lists name the adapters in the
    batch, and a request waiting for a slot is one vLLM defers while every slot is in use; V0's lists are its
    running and waiting queues. Lists recorded at a step before the server went idle count for nothing; several engines
    share one series: none."""
    from vllm_capacity.sources.vllm_metrics.records import SCHEMA_V0, SCHEMA_V1_CAPACITY, EngineMetrics, LoraRequests

    v1 = LoraRequests(max_loras=1, running=("sql",), waiting=("sql",))
    deferred = EngineMetrics("m", "0", running=4, waiting=4, waiting_by_reason={"capacity": 0, "deferred": 4})
    busy = derive.lora_slots(v1, deferred, 1, SCHEMA_V1_CAPACITY)
    assert busy == derive.LoraSlots(1, ("sql",), blocked=True)
    room = derive.lora_slots(LoraRequests(2, ("sql",), ("sql",)), deferred, 1, SCHEMA_V1_CAPACITY)
    assert room is not None and room.blocked is False  # a slot is free: the deferral is something else's
    flowing = EngineMetrics("m", "0", running=4, waiting=0, waiting_by_reason={"capacity": 0, "deferred": 0})
    assert derive.lora_slots(v1, flowing, 1, SCHEMA_V1_CAPACITY).blocked is False
    no_reasons = derive.lora_slots(v1, EngineMetrics("m", "0", running=4, waiting=4), 1, SCHEMA_V1_CAPACITY)
    assert no_reasons is not None and no_reasons.blocked is None  # V1 without reasons: its lists cannot tell
    idle = derive.lora_slots(v1, EngineMetrics("m", "0", running=0, waiting=0), 1, SCHEMA_V1_CAPACITY)
    assert idle == derive.LoraSlots(1, (), blocked=False)
    v0 = LoraRequests(max_loras=2, running=("sql", "chat"), waiting=("code", "sql"))
    queued = EngineMetrics("m", "0", running=5, waiting=3)
    assert derive.lora_slots(v0, queued, 1, SCHEMA_V0).blocked is True  # code waits, both slots held by others
    assert derive.lora_slots(LoraRequests(3, ("sql", "chat"), ("code",)), queued, 1, SCHEMA_V0).blocked is False
    assert derive.lora_slots(v1, deferred, 2, SCHEMA_V1_CAPACITY) is None  # data parallel: vLLM's one series misleads
    assert derive.lora_slots(None, deferred, 1, SCHEMA_V1_CAPACITY) is None


def _numbers(value: object, where: str = "") -> Iterator[tuple[str, float]]:
    """Every float or int inside a derived record (dataclasses, mappings, tuples), with where it sits."""
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return
    if isinstance(value, int | float):
        yield where, float(value)
    elif dataclasses.is_dataclass(value):
        for f in dataclasses.fields(value):
            yield from _numbers(getattr(value, f.name), f"{where}.{f.name}")
    elif isinstance(value, Mapping):
        for k, v in value.items():
            yield from _numbers(v, f"{where}[{k!r}]")
    elif isinstance(value, tuple | list):
        for i, v in enumerate(value):
            yield from _numbers(v, f"{where}[{i}]")


def test_no_derived_value_is_ever_non_finite() -> None:
    """A property over derive_engine: whatever plausible values vLLM reports (denormal numbers, zeros, 2^53, a
    usage of 1e-320 once made max_concurrency{basis=observed_context} and the headroom +Inf), every number derived
    is finite. 3,000 engines drawn from the extremes and ordinary values, with and without the agent's history."""
    from vllm_capacity.sources.vllm_metrics.records import SCHEMA_V1_CAPACITY, CacheConfig, EngineMetrics

    rng = random.Random(27)
    extremes = [0.0, 5e-324, 1e-320, 1e-300, 1e-9, 0.5, 1.0, 3.0, 1e6, 1e15, 2.0**53]

    def draw(low: float = 0.0, high: float = 2.0**53) -> float:
        x = rng.choice(extremes) if rng.random() < 0.6 else rng.uniform(0, 1e5)
        return min(max(x, low), high)

    for _ in range(3000):
        labels = {
            "block_size": str(rng.choice([1, 16, 128])),
            "num_gpu_blocks": str(int(draw(0, 2**40))),
            "kv_cache_max_concurrency": repr(draw()),
            "kv_cache_memory_bytes": str(int(draw(0, 2**50))),
        }
        if rng.random() < 0.5:
            labels["kv_cache_size_tokens"] = str(int(draw(0, 2**50)))
        m = EngineMetrics(
            "m",
            "0",
            kv_cache_usage=draw(0, 1),
            running=draw(),
            waiting=draw(),
            waiting_by_reason={"capacity": draw()},
            preemptions_total=draw(),
            cache_config=CacheConfig(labels),
        )
        history = derive.Sustained(level=draw(), observed=rng.random() < 0.5, weight=1.0, at=0.0)
        inputs = derive.EngineInputs(
            schema=SCHEMA_V1_CAPACITY,
            max_model_len=rng.choice([None, 1, 1024, 131072]),
            preempted=rng.random() < 0.3,
            sustained=history,
            latency=derive.LatencyView(step_tokens=((128.0, draw()), (math.inf, draw()))),
        )
        facts = derive.ServerFacts(
            flags=derive.ServerFlags(
                max_num_seqs=rng.choice([None, 1, 256]), max_num_batched_tokens=rng.choice([None, 256])
            )
        )
        e = derive.derive_engine(m, inputs, facts)
        # the latency view is the learner's, passed through (its buckets end at +Inf)
        bad = [(w, v) for w, v in _numbers(e) if not math.isfinite(v) and not w.startswith(".latency.")]
        assert not bad, (bad, m, inputs)


def test_impossible_inputs_give_no_figure_rather_than_an_impossible_one() -> None:
    """running 0.001 made a mean context of 2.1 M tokens in a cache of 4,096; a cache of 0 tokens with 16 running a
    mean of 0; a max_model_len of 10^30 was exported as it came; a p90 context interpolated past max_model_len inside
    vLLM's last bucket made max_concurrency{basis="p90_context"} 2.91 under the max_model_len basis's 4.00."""
    assert derive.mean_context_tokens(0.5 * 4096, 0.001) is None
    assert derive.mean_context_tokens(0.0, 16) is None  # no KV cache held by 16 running requests: not a reading
    assert derive.mean_context_tokens(2048.0, 2) == 1024.0
    seed = fixture_text("v1-0.24-seed.prom")
    odd = seed.replace('vllm:num_requests_running{engine="0",model_name="gemma-12b"} 20.0',
                       'vllm:num_requests_running{engine="0",model_name="gemma-12b"} 0.001')  # fmt: skip
    (e,) = derive.derive_all(parse_metrics(odd), MML_GEMMA)
    assert e.mean_context_tokens is None and e.max_concurrency_observed is None
    (e,) = derive.derive_all(parse_metrics(seed), derive.ServerFacts(max_model_len={"gemma-12b": 10**30}))
    assert e.max_model_len != 10**30
    (m,) = parse_metrics(seed).engines
    past = derive.EngineInputs(
        schema=SCHEMA_V1, max_model_len=32768, latency=derive.LatencyView(context_p90_tokens=45000)
    )
    e = derive.derive_engine(m, past)
    assert e.max_concurrency_p90_context == pytest.approx(e.max_concurrency)  # capped at max_model_len, never below
