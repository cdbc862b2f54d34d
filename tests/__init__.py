"""specc's tests, a package: every folder below is one too, so that a test imports its helpers as
`tests.helpers.NAME` (and the benchmarks it checks as `benchmarks.NAME`) with nothing added to
sys.path. pytest, run from the repository root (`make test`: `python -m pytest`), puts that root
first on sys.path, as it does for any package of tests (its default import mode, prepend);
tests/test_house_rules.py refuses a test that changes sys.path itself."""
