"""Run built models with onnxruntime: Session(dir).run(**inputs) and .generate(input_ids, ...).

Never imports specc.nn or specc.export: a build directory stands alone. The modules, each
importing only those before it:

    errors    RunError; ServeError (`specc serve` cannot start)
    graph     one onnxruntime session with IO binding; execution providers, session options
    inputs    the one validation of inputs (feeds, prompts and generation options, input files)
    cache     the KV cache: empty caches, CPU cache buffers, present.* -> past_key_values.*
    arrays    prompt padding, NPZ output
    speculative  speculative decoding of one prompt: drafts checked in one call, the cache cut back
    generate  the decode loops (greedy, sampling, beam search, speculative) over a model's graphs
    text      the build's tokenizer: texts encoded with its padding and mask, whole characters
              streamed, chat templates rendered
    session   Session: a build directory opened, run(), generate()
    scheduler server-side generation: specc/decoding's engine (one store, one batched decode step
              for every sequence) over a Session's graphs
    endpoint  the generate endpoint's fields, read by decoding's parse; the build's tokenizer
    front     `specc serve`'s HTTP port
    pytriton_patch   what `specc serve` changes in PyTriton (one place), and what it relies on
    graph_models     each graph served as a stateless Triton model
    generation_model the generate endpoint, bound to the scheduler
    serve     `specc serve` on Triton (PyTriton, in its own environment): its lifecycle
"""
from specc.runtime.errors import RunError
from specc.runtime.generate import Generated
from specc.runtime.graph import choose_providers
from specc.runtime.session import Session

__all__ = ["Generated", "RunError", "Session", "choose_providers"]
