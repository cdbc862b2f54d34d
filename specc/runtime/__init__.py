"""Run built models with onnxruntime: Session(dir).run(**inputs) and .generate(input_ids, ...).

Never imports specc.nn or specc.export: a build directory stands alone."""
from specc.runtime.generate import Generated
from specc.runtime.session import RunError, Session, choose_providers

__all__ = ["Generated", "RunError", "Session", "choose_providers"]
