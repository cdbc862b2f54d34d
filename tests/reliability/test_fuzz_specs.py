"""Generated specs across every kind of the language, at tiny dimensions.

Each generated spec either loads (and then must resolve, compile into a torch module, export to
ONNX and pass verification against torch), or is rejected by validation with every issue located
at FILE:LINE:COLUMN and a key. Anything else -- a crash, a build failure of a valid spec, a build
slower than BUILD_BOUND_S -- is a bug; the cases found are kept in test_fuzz_regressions.py.

Bounded in `make test` (SPECC_FUZZ_EXAMPLES builds, default 4, and ten times as many compiled,
derandomized so that every run draws the same specs); `make fuzz` runs many more. Most generated specs are valid by construction;
about one in eight gets a deliberate mistake, so both paths run.
"""
from __future__ import annotations

import os
import signal
from contextlib import contextmanager
from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, given, note, settings
from hypothesis import strategies as st

import specc
from specc.errors import SpecError
from specc.spec import loads_spec
from specc.spec.resolve import resolve
from specc.spec.yamlio import dump_yaml

EXAMPLES = int(os.environ.get("SPECC_FUZZ_EXAMPLES", "4"))
FILE = "fuzz.yaml"
BUILD_BOUND_S = 60  # a tiny spec that takes longer than this to build is hung

# how many examples went each way, printed at the end of the module (pytest -s)
COUNTS = {"built": 0, "rejected": 0, "compiled": 0}


# --- the strategy ------------------------------------------------------------------------------


def pick(*choices):
    return st.sampled_from(choices)


@st.composite
def attention(draw, d_model: int, role: str, position: dict, length: int) -> dict:
    """One attention block valid for its role (self / causal / cross) and the position scheme."""
    heads = draw(pick(*[h for h in (1, 2, 4) if d_model % h == 0]))
    att: dict = {"heads": heads}
    kv = draw(pick(None, 1, max(heads // 2, 1), heads))
    if kv is not None:
        att["kv_heads"] = kv
    d_k = draw(pick(None, None, 4, 8))
    if d_k is not None:
        att["d_k"] = d_k
    merge = draw(pick("project", "project", "concat", "mean"))
    if merge != "project":
        att["merge"] = merge
        att["d_v"] = d_model // heads if merge == "concat" else d_model
    elif draw(st.booleans()):
        att["d_v"] = draw(pick(4, 8))
    elif draw(st.booleans()):
        att["share_kv"] = True  # d_v = d_k
    score = draw(pick("scaled_dot", "dot", "bilinear", "additive"))
    if score != "scaled_dot":
        att["score"] = score
    elif draw(st.booleans()):
        att["scale"] = draw(pick(0.1, 0.5))  # Gemma's query_pre_attn_scalar^-1/2
    if draw(st.booleans()):
        att["softcap"] = draw(pick(1.0, 30.0))  # Gemma 2's soft-capped scores
    if draw(st.booleans()):
        att["bias"] = draw(st.booleans())
    if draw(st.booleans()):
        att["output_bias"] = draw(st.booleans())  # Qwen2's q/k/v biases without the output's, and the reverse
    if draw(st.booleans()):
        att["qk_norm"] = draw(pick("head", "full"))  # Qwen3's, OLMo 2's; with any position or pattern
    kinds = {"self": ["full", "local", "linformer", "bigbird"], "causal": ["full", "local", "bigbird"],
             "cross": ["full", "linformer"]}[role]
    if position["kind"] in ("relative", "alibi", "bucketed") and role != "cross":
        kinds = [k for k in kinds if k != "linformer"]
    kind = draw(st.sampled_from(kinds))
    if kind == "local":
        att["pattern"] = {"kind": "local", "window": draw(pick(1, 2, 3))}
    elif kind == "linformer":
        att["pattern"] = {"kind": "linformer", "k": draw(pick(2, 4, length))}
    elif kind == "bigbird":
        att["pattern"] = {"kind": "bigbird", "block": draw(pick(2, 4)), "window": draw(pick(1, 2)),
                          "global": draw(pick(0, 1)), "random": draw(pick(0, 1, 2))}
    elif draw(st.booleans()):
        att["pattern"] = {"kind": "full"}
    return att


@st.composite
def ffn(draw) -> dict:
    out = {"d_ff": draw(pick(8, 16, 32)), "activation": draw(pick("relu", "gelu", "gelu_tanh", "silu", "swiglu", "geglu",
                                                                         "geglu_tanh"))}
    if draw(st.booleans()):
        out["bias"] = draw(st.booleans())
    return out


@st.composite
def position(draw, length: int) -> dict:
    kind = draw(pick("sinusoidal", "learned", "relative", "rotary", "alibi", "bucketed", "none"))
    pos: dict = {"kind": kind, "max_length": draw(pick(length, 2 * length))}
    if kind == "sinusoidal":
        pos["base"] = draw(pick(10000.0, 100.0))
        pos["layout"] = draw(pick("interleaved", "halves"))
    elif kind == "relative":
        pos["clip"] = draw(pick(1, 2, 4))
        pos["values"] = draw(st.booleans())
    elif kind == "bucketed":
        pos["buckets"] = draw(pick(4, 8, 32))
        pos["max_distance"] = draw(pick(64, 128))
    elif kind == "rotary":
        pos["base"] = draw(pick(10000.0, 500.0))
        pos["fraction"] = draw(pick(1.0, 1.0, 0.5))
        if draw(st.booleans()):
            pos["layout"] = draw(pick("halves", "interleaved"))  # GPT-J's pairs
        if draw(st.booleans()):
            pos["scaling"] = draw(scaling(length))
    return pos


@st.composite
def scaling(draw, length: int) -> dict:
    """A rotary scaling whose original length lies within the drawn lengths, so that it binds;
    longrope's lists are sized once the heads are drawn (spec_data)."""
    kind = draw(pick("none", "linear", "llama3", "yarn", "longrope"))
    original = draw(pick(2, length // 2, length))
    if kind == "linear":
        return {"kind": kind, "factor": draw(pick(1.0, 2.0, 8.0))}
    if kind == "llama3":
        return {"kind": kind, "factor": draw(pick(2.0, 8.0)), "low_freq_factor": draw(pick(1.0, 0.5)),
                "high_freq_factor": draw(pick(2.0, 4.0)), "original_max_length": original}
    if kind == "yarn":
        out = {"kind": kind, "factor": draw(pick(1.0, 4.0, 16.0)), "original_max_length": original,
               "beta_fast": draw(pick(32.0, 4.0)), "beta_slow": draw(pick(1.0, 2.0)), "truncate": draw(st.booleans())}
        if draw(st.booleans()):
            out["attention_factor"] = draw(pick(1.0, 1.3))
        return out
    if kind == "longrope":
        return {"kind": kind, "original_max_length": original, "short_factor": [], "long_factor": [],
                **({"factor": draw(pick(1.0, 4.0))} if draw(st.booleans()) else {})}
    return {"kind": kind}


def size_longrope(data: dict, draw) -> None:
    """Fill a longrope scaling's lists with one factor per rotated pair of the first stack (a
    second stack with other head dims meets the rule that says so)."""
    sc = data["position"].get("scaling") if data["position"]["kind"] == "rotary" else None
    stack = data.get("decoder") or data.get("encoder")
    if sc is None or sc["kind"] != "longrope" or stack is None:
        return
    att = stack["attention"]
    d_k = att.get("d_k") or data["d_model"] // att["heads"]
    pairs = max(int(d_k * data["position"]["fraction"]) // 2, 1)
    sc["short_factor"] = [draw(pick(1.0, 1.5)) for _ in range(pairs)]
    sc["long_factor"] = [draw(pick(2.0, 8.0, 32.0)) for _ in range(pairs)]


OUTPUT_KINDS = ("hidden", "lm", "mlm", "classifier", "token_classifier", "pooled")


@st.composite
def outputs(draw) -> list[dict] | None:
    if draw(st.booleans()):
        return None  # the language's default
    kinds = draw(st.lists(st.sampled_from(OUTPUT_KINDS), min_size=1, max_size=3, unique=True))
    outs = []
    for i, kind in enumerate(kinds):
        out: dict = {"name": f"out{i}", "kind": kind}
        if kind in ("classifier", "token_classifier"):
            out["classes"] = draw(pick(1, 2, 5))
        if kind == "lm" and draw(st.booleans()):
            out["bias"] = draw(st.booleans())  # GPT-J's biased logits
        if kind == "lm" and draw(st.booleans()):
            out["softcap"] = draw(pick(3.0, 30.0))  # Gemma 2's soft-capped logits
        if kind in ("classifier", "pooled"):
            out["pool"] = draw(pick("first", "mean", "last"))
            if draw(st.booleans()):
                out["pooler"] = "tanh"
        outs.append(out)
    return outs


# deliberate mistakes, each of which validation must reject with a located message
MISTAKES = (
    "heads_not_dividing", "kv_not_dividing", "learned_too_short", "serving_unordered", "unknown_key",
    "string_for_int", "negative_d_model", "missing_stack", "classifier_without_classes",
    "tie_without_lm", "bad_kind", "pattern_field_of_other_kind",
)


def spoil(data: dict, mistake: str) -> None:
    stack = data.get("decoder") or data.get("encoder")
    if stack is None:  # both stacks already removed: still a mistake, spoil further
        data["d_model"] = -8
        return
    if mistake == "heads_not_dividing":
        stack["attention"] = {**stack["attention"], "heads": 3}
        stack["attention"].pop("d_k", None)
        data["d_model"] = 16
    elif mistake == "kv_not_dividing":
        stack["attention"]["heads"] = 4
        stack["attention"]["kv_heads"] = 3
    elif mistake == "learned_too_short":
        data["position"] = {"kind": "learned", "max_length": 4}
    elif mistake == "serving_unordered":
        data["serving"]["length"] = {"min": 4, "opt": 2, "max": 8}
    elif mistake == "unknown_key":
        stack["ffn"]["actvation"] = "relu"
    elif mistake == "string_for_int":
        stack["layers"] = "two"
    elif mistake == "negative_d_model":
        data["d_model"] = -8
    elif mistake == "missing_stack":
        data.pop("decoder" if data["architecture"] != "encoder" else "encoder", None)
    elif mistake == "classifier_without_classes":
        data["outputs"] = [{"name": "c", "kind": "classifier"}]
    elif mistake == "tie_without_lm":
        data["vocab"]["tie_output"] = True
        data["outputs"] = [{"name": "h", "kind": "hidden"}]
    elif mistake == "bad_kind":
        data["norm"] = {"kind": "batchnorm"}
    elif mistake == "pattern_field_of_other_kind":
        stack["attention"]["pattern"] = {"kind": "full", "window": 4}


@st.composite
def spec_data(draw) -> dict:
    """A spec as plain data: every architecture, position, norm, attention and output kind."""
    arch = draw(pick("encoder", "decoder", "encoder-decoder"))
    d_model = draw(pick(8, 16, 24, 32))
    length = draw(pick(8, 16))
    vocab_size = draw(st.integers(16, 64))
    pos = draw(position(length))
    data: dict = {"specc": 1, "name": "fuzz", "architecture": arch, "d_model": d_model,
                  "vocab": {"size": vocab_size}, "position": pos}
    vocab = data["vocab"]
    if draw(st.booleans()):
        vocab["type_size"] = draw(pick(0, 2))
    if draw(st.booleans()):
        vocab["scale"] = draw(pick("none", "sqrt_d_model"))
    if draw(st.booleans()):
        vocab["norm"] = draw(st.booleans())
    if arch == "encoder-decoder" and draw(st.booleans()):
        vocab["target_size"] = draw(st.integers(16, 64))
        vocab["share"] = vocab["target_size"] == vocab_size and draw(st.booleans())
    norm: dict = {}
    for key, choices in (("kind", ("layernorm", "rmsnorm")), ("placement", ("post", "pre", "sandwich", "sublayer_output")),
                         ("eps", (1e-5, 1e-6)), ("final", ("auto", True, False))):
        if draw(st.booleans()):
            norm[key] = draw(st.sampled_from(choices))
    if norm.get("kind") == "rmsnorm" and draw(st.booleans()):
        norm["unit_offset"] = True  # Gemma's 1 + weight gain
    elif norm.get("kind", "layernorm") == "layernorm" and draw(st.booleans()):
        norm["bias"] = draw(st.booleans())  # a LayerNorm without bias
    if norm:
        data["norm"] = norm
    data["dropout"] = draw(pick(0.0, 0.1, {"hidden": 0.1, "attention": 0.0}))
    if arch != "decoder":
        data["encoder"] = {"layers": draw(pick(1, 2)), "attention": draw(attention(d_model, "self", pos, length)),
                           "ffn": draw(ffn())}
        if norm.get("placement") == "pre" and draw(st.booleans()):
            data["encoder"]["parallel"] = draw(pick("one_norm", "two_norms"))
    if arch != "encoder":
        data["decoder"] = {"layers": draw(pick(1, 2)), "attention": draw(attention(d_model, "causal", pos, length)),
                           "ffn": draw(ffn())}
        if arch == "encoder-decoder" and draw(st.booleans()):
            data["decoder"]["cross_attention"] = draw(attention(d_model, "cross", pos, length))
        if arch == "decoder" and norm.get("placement") == "pre" and draw(st.booleans()):
            data["decoder"]["parallel"] = draw(pick("one_norm", "two_norms"))  # GPT-J's, GPT-NeoX's
    for name in ("encoder", "decoder"):  # layers that differ within a stack (Gemma 2 / 3)
        st_ = data.get(name)
        if st_ is not None and st_["layers"] == 2 and draw(st.booleans()):
            override: dict = {"every": 2, "first": 1}
            if draw(st.booleans()) or pos["kind"] != "rotary":
                override["pattern"] = draw(pick({"kind": "full"}, {"kind": "local", "window": 1}))
            if pos["kind"] == "rotary":
                override["rotary_base"] = draw(pick(100.0, 1000000.0))
                if draw(st.booleans()):  # Gemma 3's global layers scaled alone
                    override["rotary_scaling"] = {"kind": "linear", "factor": draw(pick(1.0, 8.0))}
            st_["overrides"] = [override]
    size_longrope(data, draw)
    outs = draw(outputs())
    if outs is not None:
        data["outputs"] = outs
    kinds = [o["kind"] for o in outs] if outs is not None else ["hidden" if arch == "encoder" else "lm"]
    if any(k in ("lm", "mlm") for k in kinds) and draw(st.booleans()):
        vocab["tie_output"] = draw(st.booleans())
    elif draw(st.booleans()):
        vocab["tie_output"] = False
    smallest = min(vocab_size, vocab.get("target_size", vocab_size))
    tokens = {k: draw(st.integers(0, smallest - 1)) for k in ("bos", "eos", "pad") if draw(st.booleans())}
    if arch == "encoder-decoder" and draw(st.booleans()):
        tokens["decoder_start"] = draw(st.integers(0, smallest - 1))
    if tokens:
        data["tokens"] = tokens
    precision = draw(pick("fp32", "fp32", "fp32", "fp16", "int8", "int4"))
    if precision in ("int8", "int4") and d_model < 32:
        # integer weights are quantized in blocks of 16 / 32 along the input width: a model narrower
        # than one block (random weights, d_ff down to 8) meets quantization noise the integer
        # verification bar is not set for (a 24-wide int4 encoder: cosine 0.997 against 0.999)
        precision = "fp16"
    data["serving"] = {"batch": {"min": 1, "opt": 1, "max": 2},
                       "length": {"min": 1, "opt": draw(st.integers(1, length)), "max": length},
                       "precision": precision}
    mistake = draw(st.sampled_from((None,) * 7 + (True,)))
    if mistake:
        spoil(data, draw(st.sampled_from(MISTAKES)))
    return data


# --- the checks --------------------------------------------------------------------------------


class Hung(Exception):
    pass


@contextmanager
def time_bound(seconds: int):
    """Fail an example that runs longer than ``seconds`` (SIGALRM: the main thread, POSIX)."""

    def on_alarm(signum, frame):
        raise Hung(f"took longer than {seconds} s")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def load_or_located(text: str):
    """The loaded spec, or None after checking that every issue is located in the text."""
    try:
        return loads_spec(text, file=FILE)
    except SpecError as exc:
        assert exc.issues, "a SpecError with no issue"
        lines = text.count("\n") + 1
        for issue in exc.issues:
            assert issue.file == FILE, str(issue)
            assert issue.line is not None and 1 <= issue.line <= lines, str(issue)
            assert issue.column is not None and issue.column >= 1, str(issue)
            assert issue.key, str(issue)
            assert str(issue).startswith(f"{FILE}:{issue.line}:{issue.column}: {issue.key}: "), str(issue)
        COUNTS["rejected"] += 1
        return None


def compile_forward(spec) -> None:
    """Resolve, build the torch module and run one forward pass of every graph's main input."""
    import torch

    r = resolve(spec)
    model = specc.to_torch(r, seed=0)
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        if r.architecture == "encoder-decoder":
            out = model(input_ids=ids, decoder_input_ids=ids)
        else:
            out = model(input_ids=ids)
    for name, value in out.items():
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            assert torch.isfinite(value).all(), f"{name} is not finite"


COMMON = dict(deadline=None, derandomize=True, database=None, print_blob=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@settings(max_examples=10 * EXAMPLES, **COMMON)
@given(data=spec_data())
def test_generated_spec_compiles_or_is_rejected_with_a_location(data):
    text = dump_yaml(data)
    note(f"spec text:\n{text}")
    with time_bound(BUILD_BOUND_S):
        spec = load_or_located(text)
        if spec is not None:
            compile_forward(spec)
            COUNTS["compiled"] += 1


# no shrinking: each step would be a build; the failing spec text is printed whole instead
@settings(max_examples=EXAMPLES, phases=(Phase.explicit, Phase.generate), **COMMON)
@given(data=spec_data())
def test_generated_spec_builds_and_verifies_or_is_rejected(data, tmp_path_factory):
    text = dump_yaml(data)
    note(f"spec text:\n{text}")
    spec = load_or_located(text)
    if spec is None:
        return
    out = tmp_path_factory.mktemp("fuzz") / "build"
    with time_bound(BUILD_BOUND_S):
        result = specc.build(spec, out, seed=0)
    assert result.verification["passed"] is True
    assert (Path(out) / "manifest.json").is_file()
    assert {a["path"] for a in result.artifacts} >= {f"{g}.onnx" for g in result.manifest["graphs"]}
    COUNTS["built"] += 1


@pytest.fixture(scope="module", autouse=True)
def report_counts():
    """Prints how many generated specs were built, compiled and rejected (pytest -s shows it)."""
    yield
    print(f"\nfuzz: {COUNTS}")


@settings(max_examples=len(MISTAKES) * 2, **COMMON)
@given(data=spec_data(), mistake=st.sampled_from(MISTAKES))
def test_every_deliberate_mistake_is_rejected_with_a_location(data, mistake):
    """The rejection path in every run: each mistake spoils a generated spec and must be refused."""
    spoil(data, mistake)
    text = dump_yaml(data)
    note(f"spec text:\n{text}")
    assert load_or_located(text) is None, f"{mistake} was accepted"
