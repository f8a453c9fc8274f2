"""`python -m vllm_capacity` is the same as the `vllm-capacity` command."""

import sys

from vllm_capacity.cli import main

sys.exit(main())
