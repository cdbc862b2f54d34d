"""A model too large to hold: its deep stacks' layers made one at a time (a streamed build).

- short_spec(r, plans): the resolved spec with the planned stacks cut to their first `kept`
  layers, what a streamed build constructs and traces (the rest are copies in the graph,
  specc/export/stitch.py, whose Plan gives each stack's `kept` and each layer's `twin`).
- StreamedWeights: any parameter or buffer of the whole model by its module path, the layers of
  the cut stacks made one at a time,
  seeded (init_weights with the layer's own name prefix: the values the whole model has) or read
  tensor by tensor from a safetensors file, and keeps the last layer it made (the exporter and
  the writers ask for a layer's tensors together).
- streamed_model(short, source, roles): the short module whose cut stacks iterate over all their
  layers, each made from the source when reached and let go of after: the whole model's forward
  (the same Layer code, the same weights) holding one layer at a time. What a streamed build's
  reference run and weights file come from.
- in_lockstep(model, jobs): several forwards of a streamed model, each in its own thread, taking
  each layer in turn, so that a layer is made once for all of them (a layer of a large model takes
  longer to make than to run: a streamed build's reference run, specc/export/verify.py).
"""
from __future__ import annotations

import contextlib
import copy
import math
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch import nn

from specc.nn.blocks import Layer, default_init_skipped, init_parameter, init_weights, stack_depths
from specc.nn.model import SpeccModel
from specc.spec.costs import parameter_shapes
from specc.spec.resolve import ResolvedSpec


def short_spec(r: ResolvedSpec, plans) -> ResolvedSpec:
    """r with the stacks of `plans` ({role: stitch.Plan}) holding their first `kept` layers."""
    update = {}
    for role, plan in plans.items():
        stack = getattr(r, role)
        update[role] = stack.model_copy(update={"layers": tuple(stack.layers[:plan.kept])})
    return r.model_copy(update=update)


def short_model(r: ResolvedSpec, plans, seed: int = 0, hollow: bool = False) -> SpeccModel:
    """The module of short_spec(r, plans) in eval mode, seeded (the whole model's values for the
    parameters it has); weights from a file are copied in by the caller. `hollow`: its layers'
    parameters hold no values (hollowed), only their shapes and dtypes, which is all tracing reads."""
    with default_init_skipped():
        model = SpeccModel(short_spec(r, plans))
    depth = stack_depths(r)  # the whole model's depths
    for name, p in model.named_parameters():
        if hollow and layer_index(name, plans) is not None:
            p.data = hollowed(p)
        else:
            init_parameter(p, name, model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model, seed, depth)
    return model.eval()


def hollowed(t: torch.Tensor) -> torch.Tensor:
    """A tensor of t's shape and dtype that holds one value (a zero every element reads)."""
    return torch.zeros((), dtype=t.dtype).expand(t.shape)


def short_and_source(r: ResolvedSpec, plans, seed: int = 0, weights: str | os.PathLike | None = None,
                     hollow: bool = False) -> tuple[SpeccModel, StreamedWeights]:
    """A streamed build's short module (its own parameters from `weights` where given, seeded
    otherwise; with `hollow`, its layers' parameters hold nothing: the source makes every layer)
    and the source of every layer past them (with `hollow`, of every layer)."""
    short = short_model(r, plans, seed, hollow)
    source = StreamedWeights(r, short, plans, seed=seed, weights=weights, hollow=hollow)
    if source.file is not None:
        with torch.no_grad():
            for name, p in short.named_parameters():
                if not (hollow and layer_index(name, plans) is not None):
                    p.copy_(source.file[name].to(p.dtype))
    return short, source


def layer_index(name: str, roles) -> tuple[str, int] | None:
    """(role, layer) of a parameter path such as decoder.layers.7.ffn.up.weight, for the `roles`
    stacks; None for anything else."""
    parts = name.split(".", 3)
    if len(parts) >= 3 and parts[0] in roles and parts[1] == "layers" and parts[2].isdigit():
        return parts[0], int(parts[2])
    return None


def module_tensor(module: nn.Module, name: str) -> torch.Tensor:
    """A parameter (detached) or buffer of `module` by its path."""
    try:
        return module.get_parameter(name).detach()
    except AttributeError:
        return module.get_buffer(name)


class StreamedWeights:
    """The whole model's tensors with the planned stacks' layers past their `kept` made one layer
    at a time: seeded from `seed`, or read from `weights` (a safetensors file in specc's parameter
    names, every name and shape checked against the spec before anything is made). `short` is the
    short module (short_spec), whose own tensors are read from it."""

    def __init__(self, r: ResolvedSpec, short: nn.Module, plans, seed: int = 0,
                 weights: str | os.PathLike | None = None, hollow: bool = False):
        self.r, self.short, self.plans, self.seed = r, short, dict(plans), seed
        self.hollow = hollow  # the short module's layers hold no parameter values: every layer is made
        self.file = None
        if weights is not None:
            from specc.weights.io import check_weights, open_weights

            self.file = open_weights(weights)
            check_weights(self.file, parameter_shapes(r))
        self._held: tuple[tuple[str, int], nn.Module] | None = None
        self.turns: Turns | None = None  # while forwards run in lockstep (in_lockstep)
        self.on_layer = None  # on_layer(role, index, layers in the stack): called as each layer is made
        # transform(layer): applied to each layer as it is made; with one, the short module's
        # layers are made too rather than its own changed (a forked process shares those)
        self.transform = None

    def layer(self, role: str, index: int) -> nn.Module:
        """Layer `index` of stack `role` in eval mode, fp32: the short module's own below its
        `kept`, else made (or the one made last, if it is that layer)."""
        if index < self.plans[role].kept and self.transform is None and not self.hollow:
            return getattr(self.short, role).layers[index]
        if self._held is not None and self._held[0] == (role, index):
            return self._held[1]
        self.release()  # the last layer goes before the next is made
        stack = getattr(self.r, role)
        if self.on_layer is not None:
            self.on_layer(role, index, len(stack.layers))
        with default_init_skipped():
            layer = Layer(stack.layers[index], self.r)
        prefix = f"{role}.layers.{index}."
        if self.file is None:
            init_weights(layer, self.seed, prefix=prefix, depth=stack_depths(self.r))
        else:
            with torch.no_grad():
                for name, p in layer.named_parameters():
                    p.copy_(self.file[prefix + name].to(p.dtype))
        layer.eval()
        if self.transform is not None:
            self.transform(layer)
        self._held = ((role, index), layer)
        return layer

    def tensor(self, name: str) -> torch.Tensor:
        """The tensor at `name`: a parameter of a made layer is made alone (read from the file, or
        drawn as init_weights draws it), unless its layer is the one held; anything else from the
        short module or its layer."""
        where = layer_index(name, self.plans)
        if where is None or (where[1] < self.plans[where[0]].kept and not self.hollow):
            return module_tensor(self.short, name)
        rest = name.split(".", 3)[3]
        if self._held is None or self._held[0] != where:
            # the traced layer this one is configured as: its parameters' kinds and shapes
            template = getattr(self.short, where[0]).layers[self.plans[where[0]].twin(where[1])]
            try:
                like = template.get_parameter(rest)
            except AttributeError:
                like = None  # a buffer: its layer is made (a traced layer's own: held)
                if where[1] < self.plans[where[0]].kept:
                    return module_tensor(self.short, name)
            if like is not None:
                if self.file is not None:
                    return self.file[name].to(like.dtype)
                p = torch.empty(like.shape, dtype=like.dtype)
                owner = template.get_submodule(rest.rsplit(".", 1)[0]) if "." in rest else template
                init_parameter(p, name, owner, self.seed, stack_depths(self.r))
                return p
        return module_tensor(self.layer(*where), rest)

    def release(self) -> None:
        """Let go of the layer made last, its tensors at once: a forward loop still holds the
        module until the next layer runs (a tensor already handed out keeps its own memory)."""
        if self._held is not None:
            with torch.no_grad():
                for t in (*self._held[1].parameters(), *self._held[1].buffers()):
                    t.data = torch.empty(0, dtype=t.dtype)
        self._held = None

    def names(self) -> dict[str, torch.Tensor]:
        """Every parameter of the whole model, name -> a meta tensor of its dtype and shape (the
        header of its weights file)."""
        return {name: torch.empty(shape, device="meta") for name, shape in parameter_shapes(self.r).items()}


class StreamedLayers(nn.Module):
    """Stands for a stack's `layers` ModuleList: iterating it yields every layer of the whole
    stack, each made from the source when reached. tap(fn): while inside, fn(index, output) is
    called with each layer's output as it runs in this thread (a layer's (hidden, present,
    cross present)): recorded hidden states (specc/export/verify.py), a later case's caches."""

    def __init__(self, source: StreamedWeights, role: str, count: int):
        super().__init__()
        self._source, self._role, self._count = source, role, count
        self._taps: dict[int, list[Callable]] = {}  # thread -> its taps

    def __len__(self) -> int:
        return self._count

    @contextlib.contextmanager
    def tap(self, fn: Callable[[int, tuple], None]) -> Iterator[None]:
        taps = self._taps.setdefault(threading.get_ident(), [])
        taps.append(fn)
        try:
            yield
        finally:
            taps.remove(fn)

    def __iter__(self) -> Iterator[nn.Module]:
        turns = self._source.turns
        for index in range(self._count):
            if turns is not None:
                turns.take(index)
            layer = self._source.layer(self._role, index)
            taps = list(self._taps.get(threading.get_ident(), ()))
            if not taps:
                yield layer
                continue
            def tapped(_module, _inputs, out, index=index) -> None:  # None: the output stays as it is
                for fn in taps:
                    fn(index, out)

            # a hook is the module's, not the thread's: in lockstep one thread runs a layer at a time
            hook = layer.register_forward_hook(tapped)
            try:
                yield layer
            finally:
                hook.remove()
        if turns is not None:
            turns.ran(self._count)  # done with the last layer: nobody waits for this job at the stack

    def __getitem__(self, index: int) -> nn.Module:
        return self._source.layer(self._role, range(self._count)[index])


class Turns:
    """Who may take a layer, for forwards in lockstep: job j takes layer i once every job before
    it has run layer i and every job after it layer i - 1 (or has ended). So each layer is made
    once, and job j runs it after the jobs before it: a job whose caches come from an earlier
    job's presents finds that layer's filled (verify.py)."""

    def __init__(self, jobs: int):
        self._done = [0] * jobs  # layers each job has run (math.inf once it has ended)
        self._who: dict[int, int] = {}  # thread -> job
        self._cond = threading.Condition()

    def join(self, job: int) -> None:
        with self._cond:
            self._who[threading.get_ident()] = job

    def ran(self, layers: int) -> None:
        """This thread's job has run the first `layers` layers."""
        with self._cond:
            self._done[self._who[threading.get_ident()]] = layers
            self._cond.notify_all()

    def take(self, index: int) -> None:
        """This thread's job has run the layers below `index` and waits for its turn at it."""
        self.ran(index)
        with self._cond:
            j = self._who[threading.get_ident()]
            self._cond.wait_for(lambda: all(d > index for d in self._done[:j])
                                and all(d >= index for d in self._done[j + 1:]))

    def end(self) -> None:
        """This thread's job has ended (done, or failed): nobody waits for it."""
        with self._cond:
            self._done[self._who[threading.get_ident()]] = math.inf
            self._cond.notify_all()


def in_lockstep(model: nn.Module, jobs: list[Callable[[], object]]) -> list:
    """Each job's result, the jobs run in threads of their own whose forwards of the streamed
    `model` (one cut stack) take each layer in turn (Turns), job 0 first. A job's failure is
    raised here once every job has ended (the others run on, reading what it left unfilled)."""
    (layers,) = [m for m in model.modules() if isinstance(m, StreamedLayers)]
    source = layers._source
    turns = Turns(len(jobs))
    results: list = [None] * len(jobs)
    failures: list[BaseException] = []

    def run(j: int) -> None:
        turns.join(j)
        try:
            results[j] = jobs[j]()
        except BaseException as exc:  # raised by the caller's thread
            failures.append(exc)
        finally:
            turns.end()

    source.turns = turns
    threads = [threading.Thread(target=run, args=(j,), name=f"specc-lockstep-{j}", daemon=True)
               for j in range(len(jobs))]
    try:
        for t in threads:
            t.start()
        for t in threads:
            while t.is_alive():
                t.join(0.2)  # a Ctrl-C reaches this thread between waits
    finally:
        source.turns = None
    if failures:
        raise failures[0]
    return results


def streamed_model(short: SpeccModel, source: StreamedWeights) -> SpeccModel:
    """A shallow copy of `short` whose cut stacks run all their layers (StreamedLayers)."""
    model = copy.copy(short)
    model._modules = dict(short._modules)
    for role in source.plans:
        stack = copy.copy(short._modules[role])
        stack._modules = dict(stack._modules)
        stack._modules["layers"] = StreamedLayers(source, role, len(getattr(source.r, role).layers))
        model._modules[role] = stack
    return model


def transform_layers(model: nn.Module, transform) -> None:
    """Every layer a streamed model makes from now on gets transform(layer) (StreamedWeights.transform)."""
    for module in model.modules():
        if isinstance(module, StreamedLayers):
            module._source.transform = transform


def write_weights(source: StreamedWeights, path: Path) -> None:
    """The whole model's weights file (what save_module writes of an in-memory build, the same
    bytes), made and written one tensor at a time."""
    from specc.weights.io import write_safetensors

    write_safetensors(source.names(), lambda name: source.tensor(name).float(), path)
