"""A stand-in for Triton's Python-backend module (triton_python_backend_utils, "pb_utils"), so that
a repository's generation model (specc/export/triton_generate.py, beside its copy of the engine)
runs in a test's own process: its BLS requests run the graph model's ONNX file with onnxruntime
(each call's tensors copied in and out, as BLS passes them), and its requests and response
senders are plain objects the test drives. It is no part of what specc writes.

    host = load_host(folder)                 the model.py module, its pb_utils this stand-in
    MODELS["tiny-gpt2_model"] = path         what a BLS request to that model runs
    model = host.TritonPythonModel(); model.initialize({"model_repository": ..., "model_version": "1"})
    sender = Sender(); model.execute([Request({"input_ids": ...}, {"max_tokens": 4}, sender)])
"""
from __future__ import annotations

import importlib.util
import json
import sys
import threading
import types
from pathlib import Path

import numpy as np

TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1
MODELS: dict[str, str] = {}  # model name -> the ONNX file a BLS request to it runs
FAIL: dict[str, str] = {}  # model name -> the error message its BLS requests answer (a graph model down)
_SESSIONS: dict[str, object] = {}
_LOCK = threading.Lock()


class TritonError:
    INVALID_ARG, UNAVAILABLE, INTERNAL = "INVALID_ARG", "UNAVAILABLE", "INTERNAL"

    def __init__(self, message: str, code: str = "INTERNAL"):
        self._message, self.code = message, code

    def message(self) -> str:
        return self._message


class Tensor:
    def __init__(self, name: str, value):
        self._name, self._value = name, np.asarray(value)

    def name(self) -> str:
        return self._name

    def as_numpy(self) -> np.ndarray:
        return self._value


class InferenceResponse:
    def __init__(self, output_tensors=(), error: TritonError | None = None):
        self.output_tensors, self._error = list(output_tensors), error

    def has_error(self) -> bool:
        return self._error is not None

    def error(self) -> TritonError | None:
        return self._error

    def outputs(self) -> dict[str, np.ndarray]:
        return {t.name(): t.as_numpy() for t in self.output_tensors}


def get_output_tensor_by_name(response: InferenceResponse, name: str) -> Tensor | None:
    return next((t for t in response.output_tensors if t.name() == name), None)


class InferenceRequest:
    """A BLS request: exec() runs MODELS[model_name] with onnxruntime on copies of the inputs."""

    def __init__(self, model_name: str, requested_output_names, inputs, **_):
        self.model_name, self.names = model_name, list(requested_output_names)
        self.inputs = {t.name(): np.array(t.as_numpy()) for t in inputs}

    def exec(self) -> InferenceResponse:
        if self.model_name in FAIL:
            return InferenceResponse(error=TritonError(FAIL[self.model_name]))
        import onnxruntime as ort

        with _LOCK:
            if self.model_name not in _SESSIONS:
                _SESSIONS[self.model_name] = ort.InferenceSession(MODELS[self.model_name],
                                                                  providers=["CPUExecutionProvider"])
            session = _SESSIONS[self.model_name]
        try:
            values = session.run(self.names, self.inputs)
        except Exception as exc:  # as Triton answers a failed inference
            return InferenceResponse(error=TritonError(f"Model {self.model_name} - Error when running inference:\n  {exc}"))
        return InferenceResponse([Tensor(n, v) for n, v in zip(self.names, values)])


class Logger:
    lines: list[str] = []

    @classmethod
    def log_error(cls, line: str) -> None:
        cls.lines.append(line)


# --- the requests Triton hands a decoupled model, and their response senders ------------------------


class Sender:
    """A request's response sender: what the model sent, and whether it sent the final flag."""

    def __init__(self):
        self.responses: list[InferenceResponse] = []
        self.final = threading.Event()

    def send(self, response=None, flags: int = 0) -> None:
        if response is not None:
            self.responses.append(response)
        if flags & TRITONSERVER_RESPONSE_COMPLETE_FINAL:
            self.final.set()

    def answer(self) -> dict:
        """The responses joined, as a client reads them (test_serve_generate.joined): the ids and
        text of each, the last one's reason and counts; or {"error": message}."""
        for r in self.responses:
            if r.has_error():
                return {"error": r.error().message(), "code": r.error().code}
        return joined([r.outputs() for r in self.responses])


class Request:
    """One request as Triton hands it to execute(): its inputs as tensors, its parameters."""

    def __init__(self, inputs: dict, parameters: dict, sender: Sender, cancelled=lambda: False):
        self._inputs = [Tensor(n, v) for n, v in inputs.items()]
        self._parameters, self._sender, self.is_cancelled = parameters, sender, cancelled

    def inputs(self) -> list[Tensor]:
        return self._inputs

    def parameters(self) -> str:
        return json.dumps(self._parameters)

    def get_response_sender(self) -> Sender:
        return self._sender


def joined(responses: list[dict]) -> dict:
    """Responses (output name -> array) as one answer: ids and text joined, the last one's finish
    reason and counts."""
    out = {"output_ids": [int(i) for r in responses for i in np.atleast_1d(r.get("output_ids", []))]}
    texts = [r["text_output"] for r in responses if "text_output" in r]
    if texts:
        out["text_output"] = "".join(bytes(t.reshape(-1)[0]).decode() for t in texts)
    last = responses[-1] if responses else {}
    for name in ("finish_reason",):
        if name in last:
            out[name] = bytes(last[name].reshape(-1)[0]).decode()
    for name in ("prompt_tokens", "completion_tokens"):
        if name in last:
            out[name] = int(last[name].reshape(-1)[0])
    return out


def load_host(folder: Path, source: Path, engine_files: dict) -> types.ModuleType:
    """`source` (specc/export/triton_generate.py) imported as a repository's model.py imports it:
    beside `folder`/specc_decoding, the engine written there as `engine_files` (specc/export/
    triton.py's: path in the package -> the file it copies, None for an empty one) lays it out,
    with this stand-in as its triton_python_backend_utils. The engine's package is the one named
    specc_decoding of this process from then on."""
    package = folder / "specc_decoding"
    for name, path in engine_files.items():
        (package / name).parent.mkdir(parents=True, exist_ok=True)
        (package / name).write_bytes(b"" if path is None else Path(path).read_bytes())
    spec = importlib.util.spec_from_file_location("specc_decoding", package / "__init__.py",
                                                  submodule_search_locations=[str(package)])
    sys.modules["specc_decoding"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sys.modules["specc_decoding"])
    sys.modules["triton_python_backend_utils"] = sys.modules[__name__]
    try:
        spec = importlib.util.spec_from_file_location("triton_generate", source)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        del sys.modules["triton_python_backend_utils"]
    return module
