"""Random inputs to a build, through `Session.run` (what `specc run` and `specc generate` call) and
through the inference callable `specc serve` hands Triton.

Whatever the feeds (known and unknown names, every dtype numpy offers a client, 0 to 4 dims of 0
to 6 each, ids far outside the vocabulary, negative or huge, NaN and infinities in float
tensors, masks of any value, caches of any shape), `Session.run` either returns the graph's
outputs, all finite, or raises RunError with one line; the serve callable answers each request
with its outputs or a client refusal (one line), never a server error ("internal error", which
would mean a check let through what onnxruntime then refused). Feeds that pass the checks are
also run, so a check that passes a wrong input shows up as onnxruntime's error.

Bounded like the other fuzzers: SPECC_FUZZ_EXAMPLES (default 4) x 25 feeds per build and path,
derandomized; the tiny builds are made once per module.
"""
from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

import specc
from specc.runtime import RunError, Session
from specc.runtime.serve import REFUSAL, _infer_fn

pytestmark = pytest.mark.xdist_group("test_fuzz_inputs")  # one worker: the module's shared builds are made once

EXAMPLES = int(os.environ.get("SPECC_FUZZ_EXAMPLES", "4"))
COMMON = dict(deadline=None, derandomize=True, database=None, print_blob=True, max_examples=25 * EXAMPLES,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                     HealthCheck.function_scoped_fixture])
DTYPES = (np.int64, np.int32, np.int16, np.uint8, np.uint64, np.float32, np.float64, np.float16, np.bool_)


@pytest.fixture(scope="module")
def sessions(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz-inputs")
    return {name: Session(specc.build(name, root / name, progress=None).out_dir) for name in ("tiny-gpt2", "tiny-bert")}


def _values(dtype, shape):
    n = int(np.prod(shape)) if shape else 1
    if np.issubdtype(dtype, np.floating):
        elements = st.one_of(st.floats(allow_nan=True, allow_infinity=True, width=16 if dtype == np.float16 else 64),
                             st.sampled_from([0.0, 1.0, 2.5, -1.0]))
    elif dtype == np.bool_:
        elements = st.booleans()
    else:
        info = np.iinfo(dtype)
        elements = st.one_of(st.integers(max(-3, int(info.min)), min(1100, int(info.max))),
                             st.sampled_from([int(info.min), int(info.max), 0, 1]))
    return st.lists(elements, min_size=n, max_size=n).map(lambda xs: _array(xs, dtype, shape))


def _array(xs, dtype, shape):
    with np.errstate(over="ignore"):  # a float64 past the dtype's range becomes inf, on purpose
        return np.array(xs, dtype=np.float64 if np.issubdtype(dtype, np.floating) else object).astype(dtype).reshape(shape)


@st.composite
def tensors(draw, names):
    dtype = draw(st.sampled_from(DTYPES))
    shape = tuple(draw(st.lists(st.integers(0, 6), min_size=0, max_size=4)))
    return draw(st.sampled_from(names)), draw(_values(dtype, shape))


@st.composite
def feeds(draw, names):
    """Mostly well-formed ids with one or two inputs perturbed, sometimes anything at all."""
    out = {}
    if draw(st.booleans()):
        b, t = draw(st.integers(1, 3)), draw(st.integers(1, 6))
        out["input_ids"] = np.array(draw(st.lists(st.integers(0, 99), min_size=b * t, max_size=b * t)),
                                    dtype=np.int64).reshape(b, t)
    for _ in range(draw(st.integers(0, 3))):
        name, value = draw(tensors(names))
        out[name] = value
    return out


def _names(session: Session) -> list[str]:
    graph = session.graphs["model"]
    return sorted(set(graph.inputs) | {"input_ids", "bogus", "token_type_ids", "position_ids"})


def _check_run(session: Session, f: dict) -> None:
    try:
        out = session.run(**f)
    except RunError as exc:
        assert "\n" not in str(exc).strip() and str(exc), repr(exc)
        return
    for name, value in out.items():
        assert np.isfinite(value).all(), name


@pytest.mark.parametrize("name", ["tiny-gpt2", "tiny-bert"])
def test_run_refuses_or_answers(sessions, name):
    session = sessions[name]

    @settings(**COMMON)
    @given(feeds(_names(session)))
    def check(f):
        note({k: (v.dtype, v.shape) for k, v in f.items()})
        _check_run(session, f)

    check()


@pytest.mark.parametrize("name", ["tiny-gpt2", "tiny-bert"])
def test_the_serve_callable_answers_each_request_or_refuses_it_as_the_clients(sessions, name):
    session = sessions[name]
    infer = _infer_fn(session.graphs["model"], session.limits)

    @settings(**COMMON)
    @given(feeds(_names(session)))
    def check(f):
        note({k: (v.dtype, v.shape) for k, v in f.items()})
        (answer,) = infer([f])
        if REFUSAL in answer:
            kind, message = (bytes(x).decode() for x in answer[REFUSAL])
            assert kind == "client", message  # a server refusal: a check let a wrong input through
            assert message and "\n" not in message
        else:
            assert answer and all(np.isfinite(v).all() for v in answer.values())

    check()
