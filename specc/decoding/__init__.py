"""The generation engine of both serving hosts: `specc serve` (specc/runtime/scheduler.py, over
onnxruntime) and the generation model of a `--target triton` repository (specc/export/
triton_generate.py, over BLS calls inside Triton's Python backend). One copy of the logic:

    host: a request's fields ---------> request.parse -> Parsed (Request, stops, stream, text)
                                               |
                                        engine.Engine.submit -> request.check (Refused: 400)
                                               |               -> waiting (Busy: 503)
    host: GraphCall (graphs.py) <------ engine.step: prefill alone, one batched decode step
          onnxruntime | BLS                    |     stores.py: the in-place store | the block
                                               |     sampling.Sampler: greedy | seeded draws
    host: the sink's responses <------- request.Answer: a token's response, the final one

Modules: errors (Refused, Busy, first_line), facts (the build's facts, limits, the endpoint's
table; generation.json), graphs (what the engine reads of a graph; the GraphCall protocol),
sampling (one sampler, which Session.generate uses too; temperature 0 is greedy), text (the
tokenizer, stop strings), draft (speculative decoding's drafters), speculation (its rules: draft
lengths, the check of drafts), request (Request, parse, check, Answer), stores (CacheBlock,
InplaceBlock, the choice between them), engine (the step loop).

Imports: numpy, the standard library, the IO contract (specc/spec/io.py, which imports only the
standard library) and one another, all relative (`from ..spec import io`, `from .graphs import
...`). So the same files work inside specc and copied into a Triton repository as
NAME/specc_decoding/decoding/*.py beside NAME/specc_decoding/spec/io.py (empty __init__ files
between; specc/export/triton.py writes them), where the model imports them as `specc_decoding`
with no specc installed. tests/test_house_rules.py holds the rule.
"""
