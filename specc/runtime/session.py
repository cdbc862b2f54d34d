"""Session: a build directory opened for onnxruntime, run() on named inputs and generate().
Never imports specc.nn or specc.export: the build directory (its manifest and graphs) is all a
Session needs.

    s = Session("build/tiny-gpt2")
    s.provider                       # the execution provider that really runs the graphs
    Session("build/tiny-gpt2", provider="cuda")  # CUDA where it works here, else CPU (one notice)
    s.run(input_ids=[[1, 2, 3]])     # {"logits": array, "present.0.key": array, ...}
    s.generate([1, 2, 3], max_new_tokens=8).ids
    s.run(**s.encode(["some text"]))  # with the tokenizer the build carries (s.tokenizer)
    s.generate(s.prompts(["Hi"], chat=True), max_new_tokens=8)

The manifest is read once into a BuildInfo (specc/spec/manifest.py): the graphs and their IO
signatures, and the facts the resolver decided (token ids, learned-position limit, lm output).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from specc.deps import require_onnxruntime
from specc.fileio import sha256s
from specc.runtime.cache import empty_cache, past_length
from specc.runtime.errors import RunError
from specc.runtime.captured import CAPTURE_OPTIONS, CUDA_ATTENTION_DTYPES, CapturedDecoder
from specc.runtime.generate import Generated, generate, lm_output
from specc.runtime.graph import CPU, CUDA, Graph, choose_providers, session_options, usable_providers
from specc.runtime.inputs import DECODER_INPUT_IDS, Limits, check_feeds
from specc.runtime.text import Tokenizer
from specc.spec import manifest as spec_manifest
from specc.spec.io import (
    ATTENTION_MASK,
    ENCODER_ATTENTION_MASK,
    INPUT_IDS,
    LAST_HIDDEN_STATE,
    POSITION_IDS,
    TOKEN_TYPE_IDS,
    is_past,
    is_present,
    positions_from_mask,
    present_to_past,
)
from specc.spec.manifest import MANIFEST, TOKENIZER_FILES, TOKENIZER_JSON, BuildInfo, GraphInfo

ENCODER_OUTPUT = "encoder_last_hidden_state"  # run()'s name for the encoder's last_hidden_state

__all__ = ["RunError", "Session", "choose_providers", "open_build", "session_options"]


def open_build(build_dir: str | Path) -> tuple[dict, BuildInfo]:
    """The manifest of a build directory, parsed and typed; RunError naming the directory if it is
    not a build."""
    path = Path(build_dir) / MANIFEST
    if not path.is_file():
        raise RunError(f"{build_dir}: not a specc build (no {MANIFEST}); run `specc build SPEC -o {build_dir}` first")
    try:
        manifest = spec_manifest.read_manifest(path)
        return manifest, BuildInfo.from_manifest(manifest)
    except OSError as exc:
        raise RunError(f"{path}: cannot read the manifest ({exc.strerror})") from None
    except spec_manifest.NotAManifest as exc:
        raise RunError(f"{path}: {exc}") from None


def check_graph_files(build_dir: Path, manifest: dict, info: BuildInfo) -> None:
    """The graphs a session runs (and their external data) must be the files the build verified:
    each listed among the manifest's artifacts with the sha256 it has now. RunError otherwise,
    naming the file: a graph changed after its verification is refused, never run."""
    files = [g.file for g in info.graphs.values()] + ([info.inplace.file] if info.inplace else [])
    files += [f"{f}.data" for f in files if f"{f}.data" in manifest_paths(manifest) or (build_dir / f"{f}.data").exists()]
    check_files(build_dir, manifest, files)


def manifest_paths(manifest: dict) -> set[str]:
    return {a["path"] for a in manifest["artifacts"]}


def check_files(build_dir: Path, manifest: dict, files: list[str]) -> None:
    """Each of `files` (paths in the build) listed among the manifest's artifacts with the sha256
    it has now; RunError naming the first that is not."""
    listed = {a["path"]: a["sha256"] for a in manifest["artifacts"]}
    for f in files:
        if f not in listed:
            raise RunError(f"{build_dir / MANIFEST}: {f} is not among the build's artifacts; rebuild it")
    try:
        digests = sha256s([build_dir / f for f in files])
    except OSError as exc:
        raise RunError(f"{exc.filename}: {exc.strerror}; rebuild it") from None
    for f, digest in zip(files, digests):
        if digest != listed[f]:
            raise RunError(f"{build_dir / f}: changed since the build verified it (its sha256 is not the "
                           "manifest's); rebuild it, or open it unchecked (--no-hash-check, check_hashes=False)")


def _cache_dtype(info: GraphInfo) -> str:
    """The dtype of a graph's KV cache (its past_key_values.* inputs)."""
    return next(t.dtype for t in info.inputs if is_past(t.name))


class Graphs(Mapping):
    """A build's graphs by name (model | encoder | decoder), each a Graph opened with `open_graph`:
    all at once (eager), or each the first time it is asked for."""

    def __init__(self, infos: Mapping[str, GraphInfo], open_graph, eager: bool = True):
        self._infos, self._open = infos, open_graph
        self._opened: dict[str, Graph] = {}
        if eager:
            for name in infos:
                self[name]

    def __getitem__(self, name: str) -> Graph:
        if name not in self._opened:
            self._opened[name] = self._open(self._infos[name])
        return self._opened[name]

    def __iter__(self):
        return iter(self._infos)

    def __len__(self) -> int:
        return len(self._infos)


class Session:
    """A built model, ready to run. providers: onnxruntime execution providers to use, in order
    (default: TensorRT, CUDA, CPU, those available); provider: one of them, instead. Each is a
    short name ("cuda", "tensorrt" or "trt", "cpu"; any case) or onnxruntime's full name
    ("CUDAExecutionProvider"); one that is not available is a RunError naming those that are.
    A GPU provider that is available but cannot be created here (onnxruntime-gpu without a GPU or
    its CUDA libraries) is dropped for the next one, CPU at the latest, with one line on stderr
    the first time in a process (specc/runtime/graph.py's usable_providers); the attributes
    `provider` and `providers` read back what really runs. threads: intra-op threads (default: onnxruntime's).

    manifest: the parsed manifest.json; info: its typed view (BuildInfo); spec: the recorded spec;
    limits: what the build takes as input (vocabularies, serving.batch.max and .length.max, learned
    positions); graphs: graph name -> Graph; inplace: the in-place cache graph generation runs
    on the CPU, where the build has one (each graph is then opened when first used; inplace=False:
    generation runs the model graph). On CUDA, an fp16 or bf16 build's in-place graph decodes with
    each step one replayed CUDA graph (captured(); cuda_graph=False runs those steps without
    capture). check_hashes: the graphs are hashed and compared with
    the manifest before they are loaded (check_graph_files); False skips it, for speed on a
    build that is known to be intact."""

    def __init__(self, build_dir: str | Path, providers: Sequence[str] | None = None, *, provider: str | None = None,
                 threads: int | None = None, check_hashes: bool = True, inplace: bool = True, cuda_graph: bool = True):
        if provider is not None and providers is not None:
            raise TypeError("Session takes provider= (one) or providers= (a list, in order), not both")
        if isinstance(providers, str):
            providers = [providers]  # a single name, not its letters
        if provider is not None:
            providers = [provider]
        ort = require_onnxruntime("running a build")
        self.dir = Path(build_dir)
        self.manifest, self.info = open_build(self.dir)
        if check_hashes:
            check_graph_files(self.dir, self.manifest, self.info)
        self.spec = self.manifest["spec"]
        self.architecture = self.info.architecture
        self.limits = Limits.of(self.info)  # what the build takes (specc/runtime/inputs.py)
        options = session_options(ort, threads)
        asked = usable_providers(ort, choose_providers(ort.get_available_providers(), providers))
        def open_graph(g):
            return Graph(ort, self.dir / g.file, g, asked, options)

        self._open_graph = open_graph
        # a decoder's in-place cache graph runs generation on the CPU (specc/export/inplace.py); where
        # a build has one, each graph is opened when first used, so that a large model's weights
        # are held by the one session a command runs (generation: the in-place graph; run(): model)
        self._inplace_info = self.info.inplace if inplace and asked[0] == CPU else None
        self._inplace: Graph | None = None
        # on CUDA, the same graph decodes with each step one replayed CUDA graph where onnxruntime
        # computes its attention there (fp16, bf16: specc/runtime/captured.py); opened on first use
        device_inplace = inplace and asked[0] == CUDA and self.info.inplace is not None \
            and _cache_dtype(self.info.inplace) in CUDA_ATTENTION_DTYPES
        self._device_inplace_info = self.info.inplace if device_inplace else None
        self._device_inplace: Graph | None = None
        self._cuda_graph = cuda_graph
        self._captured: dict[int, CapturedDecoder] = {}

        def open_device_inplace(g):
            return Graph(ort, self.dir / g.file, g, asked, options,
                         provider_options={CUDA: CAPTURE_OPTIONS} if cuda_graph else None)

        self._open_device_inplace = open_device_inplace
        self.graphs = Graphs(self.info.graphs, open_graph, eager=self._inplace_info is None)
        if self._inplace_info is None:
            first = next(iter(self.graphs.values()))
            self.provider = first.provider  # what really runs (onnxruntime falls back silently)
            self.providers = first.session.get_providers()
        else:
            self.provider, self.providers = CPU, [CPU]
        self._check_hashes = check_hashes
        self._tokenizer: Tokenizer | None = None

    # --- facts -----------------------------------------------------------------------------

    @property
    def inplace(self) -> Graph | None:
        """The in-place cache graph generation runs (opened on first use), or None: the build has
        none, the session runs on a GPU, or it was made with inplace=False."""
        if self._inplace is None and self._inplace_info is not None:
            self._inplace = self._open_graph(self._inplace_info)
        return self._inplace

    def captured(self, rows: int) -> CapturedDecoder | None:
        """The device state that decodes `rows` equal-length rows on the GPU, each step one replay
        of a captured CUDA graph (specc/runtime/captured.py), made on first use and kept; None
        where the session has none: not on CUDA, no in-place graph, a float32 cache, or made with
        inplace=False. cuda_graph=False: the same device buffers, each step run without capture."""
        if self._device_inplace_info is None:
            return None
        if self._device_inplace is None:
            self._device_inplace = self._open_device_inplace(self._device_inplace_info)
        if rows not in self._captured:
            self._captured[rows] = CapturedDecoder(self._device_inplace, rows, self.info.length.max,
                                                   lm_output(self.info), capture=self._cuda_graph)
        return self._captured[rows]

    @property
    def tokens(self) -> dict:
        """The spec's tokens: block as recorded (bos, eos, pad, decoder_start); typed: info.tokens."""
        return self.spec.get("tokens", {})

    @property
    def output_names(self) -> list[str]:
        """The main graph's outputs, the KV cache apart."""
        return [n for n in self.graphs[self.info.main_graph.name].outputs if not is_present(n)]

    # --- text ------------------------------------------------------------------------------

    @property
    def has_tokenizer(self) -> bool:
        """Whether the build carries a tokenizer (a tokenizer.json among its artifacts)."""
        return TOKENIZER_JSON in manifest_paths(self.manifest)

    @property
    def tokenizer(self) -> Tokenizer:
        """The tokenizer the build carries (specc/runtime/text.py), its files checked against the
        manifest's sha256 first (unless check_hashes=False); RunError where it carries none."""
        if self._tokenizer is None:
            if not self.has_tokenizer:
                raise RunError(f"{self.dir}: the build carries no tokenizer (its spec has no tokenizer:); "
                               "give one (--tokenizer FILE, or specc.runtime.text.Tokenizer.load(FILE))")
            if self._check_hashes:  # every file of the tokenizer that is there (one added since is refused too)
                listed = manifest_paths(self.manifest)
                check_files(self.dir, self.manifest, [f for f in TOKENIZER_FILES if f in listed or (self.dir / f).exists()])
            self._tokenizer = Tokenizer.load(self.dir / TOKENIZER_JSON)
        return self._tokenizer

    def encode(self, texts: Sequence[str], tokenizer: Tokenizer | None = None) -> dict[str, np.ndarray]:
        """Named inputs for run() from texts: `tokenizer` (default: the build's) with its own
        truncation and padding, and its attention mask; rows it leaves unequal padded as --ids rows
        are (the build's pad id; on the left for a decoder)."""
        tok = tokenizer or self.tokenizer
        feeds = tok.feeds(texts, pad_id=self.info.pad_id, left=self.architecture == "decoder")
        out = {INPUT_IDS: feeds.input_ids, ATTENTION_MASK: feeds.attention_mask}
        main = self.graphs["encoder" if self.architecture == "encoder-decoder" else "model"]
        if TOKEN_TYPE_IDS in main.inputs:
            out[TOKEN_TYPE_IDS] = feeds.token_type_ids
        return out

    def prompts(self, texts: Sequence[str], *, chat: bool = False, tokenizer: Tokenizer | None = None) -> list[list[int]]:
        """Prompt ids for generate() from texts (`tokenizer`, default: the build's). chat: each
        text is a user's message, rendered with the tokenizer's chat template (and a generation
        prompt) before it is encoded, without special tokens added again."""
        tok = tokenizer or self.tokenizer
        if chat:
            return tok.prompts([tok.chat([{"role": "user", "content": t}]) for t in texts], add_special_tokens=False)
        return tok.prompts(texts)

    # --- run -------------------------------------------------------------------------------

    def run(self, **inputs: Any) -> dict[str, np.ndarray]:
        """Named outputs for named inputs (arrays or nested lists). Inputs the graph needs but the
        caller left out get their natural defaults: attention_mask all ones, position_ids counted
        from the mask, token_type_ids zeros, an empty KV cache. An encoder-decoder runs its
        encoder on input_ids and, given decoder_input_ids, its decoder too. Every input is checked
        first (specc/runtime/inputs.py's check_feeds): RunError names the first that is wrong."""
        if INPUT_IDS not in inputs:
            raise RunError(f"run() needs {INPUT_IDS}")
        if self.architecture == "encoder-decoder":
            return self._run_encoder_decoder(dict(inputs))
        graph = self.graphs["model"]
        feeds = check_feeds(graph.info, inputs, self.limits)
        out = graph.run(self._defaults(graph, feeds))
        return {k: v.numpy() for k, v in out.items()}

    def _run_encoder_decoder(self, inputs: dict[str, Any]) -> dict[str, np.ndarray]:
        enc, dec = self.graphs["encoder"], self.graphs["decoder"]
        dec_ids = inputs.pop(DECODER_INPUT_IDS, None)
        feeds = check_feeds(enc.info, inputs, self.limits, what="the encoder",
                            hint=f" (and {DECODER_INPUT_IDS} for the decoder)")
        enc_feeds = self._defaults(enc, feeds)
        if dec_ids is not None:  # checked before the encoder runs, with the source's mask (its batch)
            dec_feeds = check_feeds(dec.info, {ENCODER_ATTENTION_MASK: enc_feeds[ATTENTION_MASK], INPUT_IDS: dec_ids},
                                    self.limits, rename={INPUT_IDS: DECODER_INPUT_IDS})
        enc_out = enc.run(enc_feeds)
        result = {ENCODER_OUTPUT: enc_out[LAST_HIDDEN_STATE].numpy()}
        if dec_ids is None:
            return result
        dec_feeds.update(present_to_past(enc_out))
        out = dec.run(self._defaults(dec, dec_feeds))
        result.update({k: v.numpy() for k, v in out.items()})
        return result

    def _defaults(self, graph: Graph, feeds: dict[str, Any]) -> dict[str, Any]:
        """`feeds` (checked) with what the graph takes and the caller left out."""
        b, t = feeds[INPUT_IDS].shape
        out = dict(feeds)
        for name, val in empty_cache(graph, b).items():
            out.setdefault(name, val)
        if ATTENTION_MASK in graph.inputs and ATTENTION_MASK not in out:
            out[ATTENTION_MASK] = np.ones((b, past_length(graph, out) + t), dtype=np.int64)
        if POSITION_IDS in graph.inputs and POSITION_IDS not in out:
            out[POSITION_IDS] = positions_from_mask(np.asarray(out[ATTENTION_MASK]), t)
        if TOKEN_TYPE_IDS in graph.inputs and TOKEN_TYPE_IDS not in out:
            out[TOKEN_TYPE_IDS] = np.zeros((b, t), dtype=np.int64)
        return out

    # --- generate --------------------------------------------------------------------------

    def generate(self, input_ids, max_new_tokens: int = 20, **options) -> Generated:
        """Generate from one prompt (a list of ids), a batch (a list of lists, any lengths) or an
        int64 array [batch, seq]. Options as `specc generate`: greedy (default), sampling
        (temperature, top_k, top_p, seed), beam search (beams, length_penalty), eos_id, pad_id,
        on_token (a callback getting each step's new ids). Returns a Generated with .ids and
        .new_ids. The loop is specc/runtime/generate.py's."""
        return generate(self, input_ids, max_new_tokens=max_new_tokens, **options)
