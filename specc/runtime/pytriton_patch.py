"""Everything `specc serve` changes in NVIDIA's PyTriton, in one place, and what of PyTriton it
relies on to do so (RELIED_ON, checked by check_pytriton: at the server's start, and by
tests/runtime/test_serve.py against the installed PyTriton, so that an upgrade that moves one of
them fails there, naming it, instead of serving wrongly).

PyTriton answers any exception of an inference callable with HTTP 500 and the tracebacks of two
processes (server paths included), fails every request of a dynamic batch together, and stops the
server on a PyTritonUnrecoverableError; its decoupled models never learn that a client went away.
So this file changes two sides:

    the server's process (`patched`, around Triton's start):
        PyTriton's Model.generate_model / get_proxy_model_files   each model.py PyTriton hands
                                                                   Triton ends with this file's
                                                                   source and `install(globals())`
        pytriton.triton.TritonServer                                quiet unless --verbose
        sh.Command's new_group (PyTriton starts tritonserver        tritonserver in a process group
            with the `sh` package)                                  of its own: a terminal's Ctrl-C
                                                                   reaches specc serve alone, which
                                                                   drains, then stops Triton
    Triton's Python backend stub, this file appended to PyTriton's proxy model.py (`install`):
        _wrap_response             a REFUSAL output becomes that request's own error (INVALID_ARG:
                                   HTTP 400, gRPC INVALID_ARGUMENT; "busy": UNAVAILABLE), its one line
        TritonPythonModel.execute  zero-size inputs (which PyTriton's shared memory cannot carry)
                                   refused before PyTriton sees them; any other failure one line,
                                   INTERNAL (HTTP 500), its traceback left to the server's log
        TritonRequestsServer._wrap_request   each request tagged with a key (CANCEL_KEY)
        DecoupledResponsesHandler.handle_responses   a stream whose client went away (Triton
                                   cancels it) is told to the server's scheduler: its key sent as
                                   a datagram to the socket CANCEL_ENV names

Appended to model.py, this file runs there as it is: so no `from __future__` import (it would
not be that file's first statement), only the standard library and numpy at its top, and
PyTriton's names taken from the model.py's own globals (`install(namespace, cache_prefix)`), and
the one fact of specc's IO contract it needs (how a cache input's name begins) given by the
server.
"""
import ast
import asyncio
import functools
import itertools
import os
import socket
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np

# The refusal of one request, as its response: [kind ("client" | "busy" | "server"), one line],
# carried as an output of this name to install()'s _wrap_response, which answers it as the
# request's error.
REFUSAL = "specc_error"
# The parameter that carries a generate request's key, and the environment variable naming the
# socket its cancellation is sent to (install's handle_responses; generation_model.py's Cancels).
CANCEL_KEY = "specc_cancel_key"
CANCEL_ENV = "SPECC_SERVE_CANCEL_SOCKET"
INTERNAL_ERROR = "specc serve: internal error; the server's log has the traceback"

# What of PyTriton this file relies on: (file in the pytriton package, qualified name, the leading
# parameters it is called with, or None for a name that must merely exist). The proxy's files
# are read, not imported: they import Triton's own module, which only the backend stub has.
RELIED_ON = (
    ("models/model.py", "Model.generate_model", ("self", "model_repository")),
    ("models/model.py", "Model.get_proxy_model_files", ("self",)),
    ("models/model.py", "Model.SCRIPT_FILES_TO_COPY", None),
    ("triton.py", "TritonServer", None),
    ("server/triton_server.py", "TritonServer.__init__", ("self", "path", "libs_path", "config", "gpus", "verbose")),
    ("proxy/model.py", "_wrap_response", ("response", "requested_outputs_names", "model_outputs_dict")),
    ("proxy/model.py", "TritonPythonModel.execute", ("self", "triton_requests")),
    ("proxy/model.py", "TritonPythonModel._decoupled_model", None),
    ("proxy/model.py", "TritonRequestsServer._wrap_request", ("self", "triton_request")),
    ("proxy/model.py", "DecoupledResponsesHandler.handle_responses",
     ("self", "scope", "responses_queue", "responses_future")),
    ("proxy/model.py", "DecoupledResponsesHandler._requests_map", None),
    ("proxy/model.py", "DecoupledResponsesHandler._serializer_deserializer", None),
    ("proxy/model.py", "DecoupledResponsesHandler._model_outputs_dict", None),
    ("proxy/model.py", "PyTritonResponseFlags", None),
    ("proxy/communication.py", "PyTritonResponseFlags.EOS", None),
    ("proxy/communication.py", "PyTritonResponseFlags.ERROR", None),
    ("proxy/data.py", "BaseRequestsResponsesSerializerDeserializer.deserialize_responses", ("self", "responses_payload")),
    ("proxy/data.py", "BaseRequestsResponsesSerializerDeserializer.free_responses_resources",
     ("self", "responses_payload")),
)


def refusal(message: str, kind: str = "client") -> dict:
    """A request's refusal as its response from an inference callable (install() answers it)."""
    return {REFUSAL: np.array([kind.encode(), message.encode("utf-8")], dtype=np.bytes_)}


# --- what PyTriton is, checked -------------------------------------------------------------------


def _defined(tree: ast.Module, qualified: str):
    """The node that defines `qualified` (a function, a class, a method, an attribute a class
    body or its methods assign, or a module-level name imported or assigned), or None."""
    first, _, rest = qualified.partition(".")
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == first:
            return node if not rest else _member(node, rest)
        if isinstance(node, (ast.Import, ast.ImportFrom)) and not rest:
            if any((a.asname or a.name.split(".")[0]) == first for a in node.names):
                return node
        if isinstance(node, ast.Assign) and not rest and any(getattr(t, "id", None) == first for t in node.targets):
            return node
    return None


def _member(cls: ast.ClassDef, name: str):
    for node in cls.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
            return node
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        if any(getattr(t, "id", None) == name for t in targets):
            return node
    for node in ast.walk(cls):  # self.NAME = ... in a method
        if isinstance(node, ast.Attribute) and node.attr == name and isinstance(node.ctx, ast.Store):
            return node
    return None


def _parameters(node) -> list[str]:
    a = node.args
    return [p.arg for p in a.posonlyargs + a.args + a.kwonlyargs]


def check_pytriton(sources: dict[str, str] | None = None) -> list[str]:
    """What of RELIED_ON the installed PyTriton lacks (or `sources`: file -> its text, instead of
    the installed package's files), one line each; [] where all is there."""
    if sources is None:
        import pytriton

        root = Path(pytriton.__file__).parent
        sources = {}
        for file, _, _ in RELIED_ON:
            path = root / file
            sources[file] = path.read_text(encoding="utf-8") if path.is_file() else ""
    problems, trees = [], {}
    if sources is None:
        import sh

        if "new_group" not in getattr(sh.Command, "_call_args", {}):
            problems.append("sh: no Command._call_args['new_group'] (how PyTriton's tritonserver gets a process "
                            "group of its own)")
    for file, qualified, parameters in RELIED_ON:
        if file not in trees:
            trees[file] = ast.parse(sources.get(file) or "")
        node = _defined(trees[file], qualified)
        if node is None:
            problems.append(f"pytriton/{file}: no {qualified}")
            continue
        if parameters is not None:
            got = _parameters(node) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else []
            if tuple(got[:len(parameters)]) != parameters:
                problems.append(f"pytriton/{file}: {qualified}({', '.join(got)}), where specc serve calls it with "
                                f"({', '.join(parameters)}, ...)")
    return problems


# --- the server's process -------------------------------------------------------------------------


def stub_source(cache_prefix: str) -> str:
    """What is appended to each model.py PyTriton hands Triton: this file, and the call that
    installs it there."""
    return ("\n\n# --- appended by specc serve (specc/runtime/pytriton_patch.py) ---\n"
            + Path(__file__).read_text(encoding="utf-8")
            + '\n\nif "TritonPythonModel" in globals() and "_wrap_response" in globals():\n'
            + f"    install(globals(), {cache_prefix!r})\n")


@contextmanager
def patched(verbose: bool, cache_prefix: str):
    """While serving: each model's model.py that PyTriton hands Triton ends with stub_source(),
    whether PyTriton writes it into a local model store (Model.generate_model) or sends its text
    with the load request (Model.get_proxy_model_files, the usual path); and what the
    tritonserver process prints outside its log file (its log with --verbose; else lines such as
    "Error: Failed to initialize NVML" on a machine without a GPU) reaches the terminal only with
    `verbose` (PyTriton echoes it unless its TritonServer is made quiet); and the tritonserver
    process is started in a process group of its own (sh's new_group), so that the SIGINT a
    terminal sends its foreground group at Ctrl-C reaches specc serve alone, which drains its
    requests and then stops Triton (Triton itself would stop at once, waiting out its own exit
    timeout on a running stream). `cache_prefix`: as install() takes it."""
    import pytriton.triton as triton_module
    import sh
    from pytriton.models.model import Model

    addition = stub_source(cache_prefix)
    generate_model, proxy_files, server = Model.generate_model, Model.get_proxy_model_files, triton_module.TritonServer

    def generate_with_refusals(self, model_repository):
        generate_model(self, model_repository)
        path = Path(model_repository) / self.model_name / str(self.model_version) / "model.py"
        if path.is_file():
            path.write_text(path.read_text(encoding="utf-8") + addition, encoding="utf-8")

    def files_with_refusals(self):
        files = proxy_files(self)
        key = f"file:{self.model_version}/model.py"
        if key in files:
            files[key] = files[key] + addition.encode("utf-8")
        return files

    Model.generate_model, Model.get_proxy_model_files = generate_with_refusals, files_with_refusals
    triton_module.TritonServer = functools.partial(server, verbose=verbose)
    new_group = sh.Command._call_args["new_group"]
    sh.Command._call_args["new_group"] = True
    try:
        yield
    finally:
        Model.generate_model, Model.get_proxy_model_files = generate_model, proxy_files
        triton_module.TritonServer = server
        sh.Command._call_args["new_group"] = new_group


# --- Triton's Python backend stub (this file appended to PyTriton's model.py) ---------------------


def install(namespace: dict, cache_prefix: str) -> None:
    """Patch the PyTriton proxy whose module globals are `namespace` (the module's doc);
    `cache_prefix`: how the names of a graph's cache inputs begin (specc/spec/io.py's, given by
    the server: this file imports nothing of specc)."""
    pb_utils = namespace["pb_utils"]
    model_class = namespace["TritonPythonModel"]
    requests_server = namespace["TritonRequestsServer"]
    decoupled_handler = namespace["DecoupledResponsesHandler"]
    flags_of = namespace["PyTritonResponseFlags"]
    pytriton_wrap_response = namespace["_wrap_response"]
    pytriton_execute = model_class.execute
    pytriton_wrap_request = requests_server._wrap_request
    codes = {"client": "INVALID_ARG", "busy": "UNAVAILABLE"}

    def error_response(kind, message):
        code = getattr(pb_utils.TritonError, codes.get(kind, "INTERNAL"), None)
        error = pb_utils.TritonError(message) if code is None else pb_utils.TritonError(message, code)
        return pb_utils.InferenceResponse(output_tensors=[], error=error)

    def empty_input(request):
        for tensor in request.inputs():
            shape = list(tensor.as_numpy().shape)
            if 0 in shape:
                name = tensor.name()
                if name.startswith(cache_prefix):
                    return (f"{name}: a zero-length cache (shape {shape}) cannot be sent; leave the "
                            f"{cache_prefix}* inputs out at prefill (the server supplies the empty cache)")
                return f"{name}: empty tensor (shape {shape}); give at least one token"
        return None

    def wrap_response(response, requested_outputs_names, model_outputs_dict):
        data = getattr(response, "data", None)
        if data and REFUSAL in data:
            kind, message = (bytes(x).decode("utf-8", "replace") for x in data[REFUSAL].reshape(-1)[:2])
            return error_response(kind, message)
        return pytriton_wrap_response(response, requested_outputs_names, model_outputs_dict)

    def execute(self, requests):
        answers = [None] * len(requests)
        passed = []
        for i, request in enumerate(requests):
            message = empty_input(request)
            if message is None:
                passed.append(i)
            elif self._decoupled_model:
                request.get_response_sender().send(error_response("client", message),
                                                   flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            else:
                answers[i] = error_response("client", message)
        if self._decoupled_model:  # answered through the requests' response senders
            if passed:
                pytriton_execute(self, [requests[i] for i in passed])
            return None
        if passed:
            try:
                done = pytriton_execute(self, [requests[i] for i in passed])
            except Exception:
                done = [error_response("server", INTERNAL_ERROR) for _ in passed]
            for i, answer in zip(passed, done):
                answers[i] = answer
        return answers

    keys = {}
    counter = itertools.count()

    def wrap_request(self, triton_request, *args, **kwargs):
        request = pytriton_wrap_request(self, triton_request, *args, **kwargs)
        key = f"{os.getpid()}-{next(counter)}"
        request.parameters = dict(request.parameters or {}, **{CANCEL_KEY: key})
        keys[id(triton_request)] = key
        return request

    def tell_cancelled(key):
        path = os.environ.get(CANCEL_ENV)
        if not path:
            return
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
                s.sendto(key.encode(), path)
        except OSError:
            pass

    async def handle_decoupled(self, scope, responses_queue, responses_future):
        requests_id = scope["requests_id"]
        loop = asyncio.get_running_loop()
        triton_requests = self._requests_map[requests_id]
        senders = [r.get_response_sender() for r in triton_requests]
        gone = [False] * len(senders)
        checked = [0.0] * len(senders)

        def send(i, response, flags):
            if gone[i]:
                return
            now = time.monotonic()
            try:
                if now - checked[i] > 0.05:
                    checked[i] = now
                    if triton_requests[i].is_cancelled():
                        raise ConnectionAbortedError
                senders[i].send(response, flags)
            except Exception:
                gone[i] = True
                tell_cancelled(keys.get(id(triton_requests[i]), ""))
                try:
                    senders[i].send(None, pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                except Exception:  # noqa: S110 - the request is gone already
                    pass

        eos = False
        while not eos:
            flags, payload = await responses_queue.get()
            error = flags & flags_of.ERROR
            try:
                eos = flags & flags_of.EOS
                if error:
                    answers = [error_response("server", INTERNAL_ERROR) for _ in senders]
                else:
                    answers = [wrap_response(r, q.requested_output_names(), self._model_outputs_dict)
                               for q, r in zip(triton_requests, self._serializer_deserializer.deserialize_responses(payload))]
                final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if eos else 0
                if eos and not any(a is not None for a in answers):
                    answers = [None] * len(senders)
                await asyncio.gather(*(loop.run_in_executor(None, send, i, a, final) for i, a in enumerate(answers)))
            finally:
                if not error:
                    self._serializer_deserializer.free_responses_resources(payload)
                responses_queue.task_done()
        for r in triton_requests:
            keys.pop(id(r), None)
        self._requests_map.pop(requests_id)
        responses_future.set_result(None)

    namespace["_wrap_response"] = wrap_response
    model_class.execute = execute
    requests_server._wrap_request = wrap_request
    decoupled_handler.handle_responses = handle_decoupled

