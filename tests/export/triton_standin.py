"""A stand-in for Triton's ONNX Runtime backend, for a tritonserver that lacks it (the one
PyTriton bundles has only the Python backend): a Python-backend model.py that runs the model
folder's model.onnx with onnxruntime, each request of a dynamic batch on its own, answering the
same tensors as the ONNX Runtime backend would. tests/export/test_triton_generate.py copies it
over a graph model of a built repository; it is no part of what specc writes. It also refuses to
load where specc can be imported: the test gives the server a Python without specc (as a fleet
has none), and this checks that the backend's processes run there."""
import importlib
import os

import onnxruntime as ort
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        try:
            importlib.import_module("specc")
        except ImportError:
            pass
        else:
            raise RuntimeError("specc is importable in the Python backend's interpreter; the test hides it")
        path = os.path.join(args["model_repository"], args["model_version"], "model.onnx")
        self.session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
        self.inputs = [i.name for i in self.session.get_inputs()]
        self.outputs = [o.name for o in self.session.get_outputs()]

    def execute(self, requests):
        answers = []
        for request in requests:
            try:
                feeds = {n: pb_utils.get_input_tensor_by_name(request, n).as_numpy() for n in self.inputs}
                values = self.session.run(self.outputs, feeds)
                answers.append(pb_utils.InferenceResponse([pb_utils.Tensor(n, v) for n, v in zip(self.outputs, values)]))
            except Exception as exc:
                answers.append(pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(str(exc))))
        return answers
