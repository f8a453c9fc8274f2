"""What the tests share, imported as ``support.<module>`` (tests/ is on the path): fixture files and the real
captures, the exposition helpers, and the doubles of the edges that cannot run here (a loopback "vLLM", a clock that
moves when told, NVML without a GPU). ``tests/conftest.py`` holds only pytest's hooks and fixtures."""
