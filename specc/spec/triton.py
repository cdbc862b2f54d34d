"""How specc's graphs become Triton models: their names, their dims and their dynamic batching.

One rule for both Triton routes: `specc build --target triton` (specc/export/triton.py writes it
into config.pbtxt) and `specc serve` (specc/runtime/serve.py hands it to PyTriton), so a client
sees the same models either way. Torch-free: the runtime reads it too.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from specc.spec.io import BATCH

# How long the dynamic batcher may hold a request for others to join its batch. It is the most the
# batcher adds to any request's latency, paid in full by a request that arrives alone. A client
# that decodes sends its next step only after the previous answer, so a longer wait cannot gather
# that client's next request; the delay only lets requests already in flight together (concurrent
# clients, or the rows of one batch split over requests) meet. `serving:` states no latency budget,
# so the bound stays small; change it in config.pbtxt for a fleet that wants fuller batches.
MAX_QUEUE_DELAY_US = 100


@dataclass(frozen=True)
class DynamicBatching:
    """Triton's dynamic batcher for one model: max_batch_size and the dynamic_batching block."""

    max_batch_size: int
    preferred_batch_sizes: tuple[int, ...]
    max_queue_delay_us: int = MAX_QUEUE_DELAY_US


def dynamic_batching(batch_opt: int, batch_max: int) -> DynamicBatching:
    """The batching of a build with `serving.batch` {opt, max}: batches of up to max; preferred
    sizes opt, the batch the build's shapes are chosen for (the TensorRT profile's opt), and max,
    the largest batch the graphs are built to take. Triton sends the largest preferred batch it can
    form at once, so a full batch, or one of opt, never waits out the queue delay."""
    return DynamicBatching(max_batch_size=batch_max,
                           preferred_batch_sizes=tuple(sorted({min(batch_opt, batch_max), batch_max})))


def model_names(spec_name: str, graphs: Iterable[str], generation: bool = False) -> dict[str, str]:
    """graph name -> Triton model name: the spec's name for a build of one graph (encoder-only and
    decoder-only specs), NAME_encoder and NAME_decoder for an encoder-decoder's two. Where the
    spec's name goes to a generation model (`generation`: `specc serve` on a decoder), each
    graph is NAME_GRAPH (a decoder's one graph: NAME_model)."""
    graphs = list(graphs)
    if len(graphs) == 1 and not generation:
        return {graphs[0]: spec_name}
    return {g: f"{spec_name}_{g}" for g in graphs}


def model_dims(dims: Iterable[int | str]) -> tuple[int, ...] | None:
    """A tensor's dims as a Triton model declares them: without the leading batch dim (Triton's
    batching adds it), -1 for every symbolic dim. None for a tensor without a leading batch dim,
    which a batching model cannot take."""
    dims = tuple(dims)
    if not dims or dims[0] != BATCH:
        return None
    return tuple(d if isinstance(d, int) else -1 for d in dims[1:])
