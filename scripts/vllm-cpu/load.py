"""Bursts of load on a loopback vLLM until stopped: round after round of PARALLEL requests of MAX_TOKENS tokens.

usage: load.py URL [--parallel 24] [--max-tokens 512] [--prompt-words 40] [--rounds N] [--first 0] [--model NAME ...]
(N = 0: until SIGTERM or SIGINT; the requests take the models in turn, tiny-llama by default)
Prints one JSON line per round. The e2e test runs it under `nice`, beside vLLM, so that the monitoring stack under
test keeps its CPU on a 2-core machine as it would in a real pod.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys

import lab


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("url")
    ap.add_argument("--parallel", type=int, default=24)
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--prompt-words", type=int, default=40, help="words of each prompt (about 1.3 tokens each)")
    ap.add_argument("--rounds", type=int, default=0)
    ap.add_argument("--first", type=int, default=0, help="number of the first request (it begins its prompt)")
    ap.add_argument("--model", action="append", dest="models", help="a served model or LoRA adapter; repeatable")
    args = ap.parse_args()
    stopping = False

    def stop(*_: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    done = 0
    while not stopping and (args.rounds == 0 or done < args.rounds):
        result = lab.drive_load(
            args.url,
            parallel=args.parallel,
            max_tokens=args.max_tokens,
            prompt_words=args.prompt_words,
            models=args.models or (lab.MODEL_NAME,),
            first=args.first + done * args.parallel,  # prompts of their own: none from the prefix cache of a past round
        )
        print(
            json.dumps({k: v for k, v in result.items() if k != "errors"} | {"errors": len(result["errors"])}),
            flush=True,
        )
        done += 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
