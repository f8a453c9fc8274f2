"""A simulated vLLM for the sweep's tests: ``/v1/completions`` streamed a token at a time, admission by a KV cache
of ``capacity_tokens`` and by a batch of ``max_running``, and a ``/metrics`` that says so in vLLM 0.32's own format
(the real capture, its values set from the simulation). A fake at the edge the real CPU vLLM cannot show in a test
of seconds: a KV-bound, a batch-bound and a budget-bound server on demand."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from aiohttp import web

from support.files import fixture_text

IDLE = fixture_text("v1-0.32.0-cpu-idle.prom")
BLOCK = 128  # the capture's block size (num_gpu_blocks 32: 4,096 tokens)


@dataclass
class SimVllm:
    capacity_tokens: int = 4096
    max_running: int = 256  # vLLM's --max-num-seqs, or any batch limit
    token_delay: float = 0.002  # seconds a token takes with one request running; more running, slower
    step_fill: float = 0.2  # each step's tokens as a share of the budget (iteration_tokens' sum / count)
    budget: int = 2048
    max_model_len: int = 1024
    model: str = "tiny-llama"
    preempt_when_full: bool = False
    vocab_size: int | None = None  # a prompt token past it ends the request at once, nothing generated (vLLM 0.32)
    running: dict[int, int] = field(default_factory=dict)  # request -> its tokens in the cache
    waiting: int = 0
    preemptions: int = 0
    steps: int = 0
    served: int = 0
    _admitted: asyncio.Condition = field(default_factory=asyncio.Condition)

    def used(self) -> int:
        return sum(self.running.values())

    def metrics(self) -> str:
        text = IDLE.replace('num_gpu_blocks="32"', f'num_gpu_blocks="{self.capacity_tokens // BLOCK}"')
        engine = '{engine="0",model_name="tiny-llama"}'
        values = {
            "vllm:num_requests_running": len(self.running),
            "vllm:num_requests_waiting": self.waiting,
            "vllm:kv_cache_usage_perc": min(self.used() / self.capacity_tokens, 1.0),
            "vllm:num_preemptions_total": 82 + self.preemptions,
            "vllm:iteration_tokens_total_count": 80820 + self.steps,
            "vllm:iteration_tokens_total_sum": 157442 + self.steps * self.step_fill * self.budget,
        }
        for family, value in values.items():
            text = re.sub(rf"^{re.escape(family + engine)} \S+$", f"{family}{engine} {float(value)}", text, flags=re.M)
        capacity = r'^(vllm:num_requests_waiting_by_reason\{engine="0",model_name="tiny-llama",reason="capacity"\})'
        text = re.sub(capacity + r" \S+$", rf"\g<1> {float(self.waiting)}", text, flags=re.M)
        return re.sub(
            r"^(vllm:iteration_tokens_total_bucket\{[^}]*\}) \S+$", rf"\g<1> {80820.0 + self.steps}", text, flags=re.M
        )

    async def complete(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        need = len(body["prompt"]) + int(body["max_tokens"])
        if body.get("model") != self.model:
            return web.json_response({"error": "no such model"}, status=404)
        number = self.served
        self.served += 1
        if self.vocab_size is not None and max(body["prompt"]) >= self.vocab_size:
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": 0}
            await resp.write(b"data: " + json.dumps({"choices": [], "usage": usage}).encode() + b"\n\ndata: [DONE]\n\n")
            return resp
        async with self._admitted:
            self.waiting += 1
            while len(self.running) >= self.max_running or self.used() + need > self.capacity_tokens:
                if self.preempt_when_full and self.running:
                    self.preemptions += 1
                await self._admitted.wait()
            self.waiting -= 1
            self.running[number] = need
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        try:
            for _ in range(int(body["max_tokens"])):
                await asyncio.sleep(self.token_delay * (1 + len(self.running) / 4))
                self.steps += 1
                await resp.write(b"data: " + json.dumps({"choices": [{"index": 0, "text": "x"}]}).encode() + b"\n\n")
            usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": int(body["max_tokens"])}
            await resp.write(b"data: " + json.dumps({"choices": [], "usage": usage}).encode() + b"\n\ndata: [DONE]\n\n")
        finally:
            async with self._admitted:
                self.running.pop(number, None)
                self._admitted.notify_all()
        return resp


@asynccontextmanager
async def serving(sim: SimVllm) -> AsyncIterator[tuple[str, web.AppRunner]]:
    """The simulation on a loopback port: its base URL, and its runner (a test stops it to play vLLM dying)."""

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(text=sim.metrics(), content_type="text/plain")

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": sim.model, "max_model_len": sim.max_model_len}]})

    async def version(_: web.Request) -> web.Response:
        return web.json_response({"version": "0.32.0"})

    app = web.Application()
    app.add_routes([web.get("/metrics", metrics), web.get("/v1/models", models), web.get("/version", version),
                    web.post("/v1/completions", sim.complete)])  # fmt: skip
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield f"http://127.0.0.1:{port}", runner
    finally:
        await runner.cleanup()
