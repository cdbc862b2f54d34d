"""`specc import hf`: a local Hugging Face checkpoint folder as a spec plus safetensors weights in
specc's parameter names (docs/import.md, docs/weights.md), or a refusal naming what specc cannot
compute exactly.

Every parameter of the spec must come from the checkpoint and every tensor of the checkpoint must
find its place (or be a buffer the family ignores), so an imported model never runs computing
something else. The family tables are data, one module per family (specc.importers.families,
written in specc.importers.table's rows); this package reads them. The modules, lowest first:

- checkpoint: reading a folder (config.json, safetensors, pytorch_model.bin, index files);
- convert: config -> spec, checkpoint tensors -> specc's parameters;
- tokenizer: the checkpoint's tokenizer files (or a GGUF file's, converted), carried beside the spec;
- sentence: a sentence-transformers folder's pooling as the `sentence_embedding` output;
- importer: the whole import, writing all its files or none;
- docgen: the mapping tables of docs/import.md;
- as_config: a resolved spec as config.json, the tables read backwards (specc.builder.clients writes it).

This package sits above specc.nn, specc.spec and specc.weights; none of them imports it.
"""
from specc.importers.errors import CheckpointError
from specc.importers.hf.checkpoint import read_checkpoint
from specc.importers.hf.convert import config_to_spec
from specc.importers.hf.docgen import describe
from specc.importers.hf.importer import import_hf

__all__ = ["CheckpointError", "config_to_spec", "describe", "import_hf", "read_checkpoint"]
