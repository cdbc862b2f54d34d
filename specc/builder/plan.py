"""A build's plan: what is decided from the resolved spec and the options before any work, once,
and handed to the stages that need it.

    ResolvedSpec --stitch_plans--> stitches {graph: {stack: stitch.Plan}} --> export (each graph's stitch)
                 --streamable----> stacks: the stacks made a layer at a time, or why none can be
                 --estimates-----> whole (memory.estimate_memory), streaming (memory.estimate_streamed)
    stream, max_memory --choose--> streamed: refused here, with the estimate, where neither way fits
                                   segmented: a streamed graph verified a layer at a time
                                   longest: the longest sequence verification runs
    out_dir, keep_weights -------> the disk check (memory.check_disk)

The estimates and the checks are specc/builder/memory.py's; the stitch plans are
specc/export/stitch.py's.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from specc.builder import memory
from specc.errors import BuildError
from specc.export.stitch import Plan as StackPlan
from specc.export.stitch import repeats_from_first, stitch_plans, streamable
from specc.export.verify import by_layers
from specc.spec.resolve import ResolvedSpec


@dataclass(frozen=True)
class BuildPlan:
    """stitches: {graph: {stack role: stitch.Plan}} of the stacks each graph traces in part;
    stacks: the stacks a streamed build makes a layer at a time (stitch.streamable), or why the
    spec cannot be built streamed; whole, streaming: memory.estimate_memory's and
    estimate_streamed's estimates; streamed: whether this build is; segmented: its graph is
    verified a layer at a time (specc/export/segments.py); longest: the longest sequence verified."""

    stitches: dict[str, dict[str, StackPlan]]
    stacks: dict[str, StackPlan] | str
    whole: dict
    streaming: dict
    streamed: bool
    segmented: bool
    longest: int

    @property
    def streamed_stacks(self) -> dict[str, StackPlan]:
        """`stacks` of a streamed build (a build that is not streamed makes none a layer at a time)."""
        return self.stacks if self.streamed and isinstance(self.stacks, dict) else {}


def make(r: ResolvedSpec, *, stream: bool | None = None, max_memory: int | None = None,
         out_dir: str | Path | None = None, keep_weights: bool = False) -> BuildPlan:
    """The plan of building `r`: its stitches and estimates, whether it is streamed (choose()), the
    disk checked where `out_dir` is given. BuildError where the build cannot fit."""
    stitches = stitch_plans(r)
    stacks = streamable(r, stitches)
    whole = memory.estimate_memory(r)
    streaming = memory.estimate_streamed(r, stacks)
    streamed = choose(r, stream, max_memory, stacks, whole, streaming)
    if out_dir is not None:
        memory.check_disk(r, Path(out_dir), streaming["stored"], whole["weights"] if keep_weights else None)
    return BuildPlan(stitches, stacks, whole, streaming, streamed,
                     segmented=streamed and not streaming["whole"],
                     longest=memory.verified_length(r, streamed))


def choose(r: ResolvedSpec, stream: bool | None, max_memory: int | None, stacks: dict[str, StackPlan] | str,
           whole: dict, streaming: dict) -> bool:
    """Whether this build is streamed: `stream` where given (refused when the spec cannot be, or
    the build cannot fit), else streamed where the whole model does not fit and the streamed
    build does. Refuses, with the estimate, what fits neither way. `max_memory`: the limit, else
    what the machine has available."""
    have = max_memory if max_memory is not None else memory.available_memory()
    hint = memory.streamed_hint(r, stacks, streaming)
    if stream is None and r.serving.precision == "gguf" and not isinstance(stacks, str):
        stream = True  # the file's blocks are its weights: never the whole model in fp32
    if stream is None and by_layers(r) and not isinstance(stacks, str) and repeats_from_first(r, stacks):
        stream = True  # verified a layer at a time, which a streamed build's graph can be
    if stream is False:
        memory.check_memory(r, whole, have, hint=hint)
        return False
    if stream:
        if isinstance(stacks, str):
            raise BuildError(f"{r.name} cannot be built streamed: {stacks}")
        memory.check_memory(r, streaming, have, streamed=True)
        return True
    try:
        memory.check_memory(r, whole, have, hint=hint)
        return False
    except BuildError as refused:
        if isinstance(stacks, str) or not memory.fits(streaming, have):
            raise refused from None
        return True
