"""Optional runtimes: exactly one onnxruntime extra; a missing one is named with its extra."""
from __future__ import annotations

import sys

import pytest

from specc import deps
from specc.errors import RuntimeMissingError


def test_this_environment_has_exactly_one_onnxruntime():
    assert len(deps.installed_runtimes()) == 1


def test_missing_onnxruntime_names_the_extras(monkeypatch):
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # import fails as if not installed
    monkeypatch.setattr(deps, "installed_runtimes", lambda: [])
    with pytest.raises(RuntimeMissingError, match=r"specc\[cpu\].*specc\[gpu\]"):
        deps.require_onnxruntime("specc run")


def test_both_runtimes_installed_is_refused(monkeypatch):
    monkeypatch.setattr(deps, "installed_runtimes", lambda: ["onnxruntime", "onnxruntime-gpu"])
    with pytest.raises(RuntimeMissingError, match="overwrite each other"):
        deps.require_onnxruntime()


def test_missing_tensorrt_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorrt", None)
    with pytest.raises(RuntimeMissingError, match="TensorRT"):
        deps.require_tensorrt("--target tensorrt")
