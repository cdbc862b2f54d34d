"""The families specc imports: one module each, registered here, read by every importer.

A family module holds everything about its family, as data (specc.importers.table.Registered):

- its Hugging Face table (specc.importers.table.Family): config fields to spec keys, fixed values,
  refusals, output heads, parameter names, and its `extra` rules (their docstrings are printed in
  docs/import.md, specc.importers.hf.describe());
- its config.json inverse: the `extra` rules written backwards, per model type
  (specc.importers.hf.as_config);
- its GGUF rows (specc.importers.gguftable.Arch): how llama.cpp's files of an architecture map onto
  the family's Hugging Face form, and the converter's changes undone (specc.importers.gguf); and
  the GGUF architectures near it that are refused, with why.

A family built on another's table (Qwen2 = replace(LLaMA, ...)) imports its parent's module. What
several families share lives in shared modules: the table's vocabulary and the activation names
(specc.importers.table), rotary positions both ways (specc.importers.rope), layers that differ
within a stack both ways (specc.importers.layers: windows in some layers, dense layers among
routed experts), the GGUF row's vocabulary and readers (specc.importers.gguftable).

        families/<name>.py --REGISTERED--> MODULES (this list, in order)
            --> FAMILIES, BY_TYPE       (specc.importers.hf.convert, docgen: config.json -> spec)
            --> INVERSE                 (specc.importers.hf.as_config: spec -> config.json)
            --> ARCHITECTURES, GGUF_REFUSED  (specc.importers.gguf: GGUF file -> config.json, tensors)

Adding a family: its module and its test, and one line in MODULES. The order of MODULES is the
order docs/import.md prints the tables in and the order as_config tries the families in (the first
that describes a spec writes its config.json).

Contract: data. A family module reads no files, imports no torch, and raises nothing at import; a
hook refuses a config by raising ValueError (or KeyError for a missing field), which the importer
reports against config.json, and a GGUF row refuses a file through Meta.refuse (CheckpointError
naming the file and the key). tests/importers/test_families.py checks that no model type and no GGUF
architecture is registered twice.
"""
from __future__ import annotations

from specc.importers.families import (bart, bert, bloom, deepseek_v2, deepseek_v3, distilbert, electra, falcon,
                                      gemma, gemma2, gemma3, gpt2, gpt_neox, gpt_oss, gptj, granitemoe, llama, mixtral,
                                      olmo2, olmoe, opt, phi3, phimoe, qwen2, qwen2_moe, qwen3, qwen3_moe, roberta,
                                      stablelm, t5)
from specc.importers.gguftable import Arch
from specc.importers.table import Family, Registered

# in the order docs/import.md prints them and as_config tries them
MODULES = (bert, roberta, electra, distilbert, gpt2, opt, llama, qwen2, qwen3, olmo2, gemma, gemma2, gemma3, phi3,
           stablelm, bloom, gpt_neox, gptj, falcon, mixtral, qwen2_moe, qwen3_moe, olmoe, granitemoe, phimoe, gpt_oss,
           deepseek_v2, deepseek_v3, bart, t5)

REGISTERED: tuple[Registered, ...] = tuple(m.REGISTERED for m in MODULES)
FAMILIES: tuple[Family, ...] = tuple(r.table for r in REGISTERED)
BY_TYPE: dict[str, Family] = {mt: r.table for r in REGISTERED for mt in r.table.model_types}
INVERSE = {mt: inverse for r in REGISTERED for mt, inverse in r.inverse.items()}
ARCHITECTURES: dict[str, Arch] = {arch: row for r in REGISTERED for arch, row in r.gguf.items()}
GGUF_REFUSED: dict[str, str] = {arch: why for r in REGISTERED for arch, why in r.gguf_refused.items()}
