"""torch -> ONNX export (onnx.py), its numerical verification (verify.py) and the safe build
directory (outdir.py). The stages are put together in specc/builder/pipeline.py."""
