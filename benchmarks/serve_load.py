"""Load on `specc serve`'s generate endpoint: N concurrent clients, each streaming greedy requests
(generate_stream) one after another for a fixed time, against the stateless route of before (a
client that runs the decode loop over the raw graph model, sending the whole cache each step).
Reports, per model and concurrency: aggregate tokens/s, time to first token and the gap between
tokens (p50, p99). 127.0.0.1 only; never run under pytest. The goal (docs/serving.md): 16 streams
at least 5x one stream's aggregate tokens/s.

With --scheduler, a route with no server: the build's Scheduler (specc/runtime/scheduler.py) in
this process, the same requests handed to it directly, run before the server starts; the
server's route less this one is what the server's own work (Triton, its Python backend, HTTP,
each token a response) costs on the same cores.

With --llama-server (llama.cpp's own server binary, built from the llama.cpp that
llama-cpp-python's PyPI source vendors: `make llama-server`), a route serves each
LLaMA-shaped build's own weights (the build's model.safetensors: build it with --keep-weights) as
a GGUF of the build's precision (fp32 or fp16) with as many parallel slots as specc serve runs
sequences at once, under the same load.

    .venv/bin/python benchmarks/serve_load.py --builds build/tiny-gpt2 --clients 1 4 --seconds 5
    .venv/bin/python benchmarks/serve_load.py --builds build/gpt2-small build/smollm2 \\
        --clients 1 4 16 64 --seconds 30 --llama-server build/llama-server/bin/llama-server

Each build is served by `.venv-serve/bin/specc serve BUILD --max-sequences M` (M: the most
clients, within serving.batch.max), started and stopped here.

With --chat GGUF (a build imported from that file: `specc import gguf`, then `specc build`), the
OpenAI chat endpoint instead: each client streams /v1/chat/completions (greedy, include_usage)
to specc serve and to llama-server serving GGUF itself, the same messages to both, the sides
alternated within each round. --turns 1: single questions cut from the text files of --text;
--turns T > 1: each client holds conversations of T turns under one shared system prompt
(--system-chars of that text), its replies sent back each turn, on specc serve with its prefix
cache on and off (--prefix-cache-tokens 0) and on llama-server with its prompt cache (its
default). Time to first token is to the first chunk with content; tokens are the usage chunk's
completion_tokens. A reply not ended --cut seconds past its row's end is cut there (its
connection closed, which both servers take for a cancel), its content chunks counted as its tokens:
a row lasts at most --seconds plus --cut.

    .venv/bin/python benchmarks/serve_load.py --builds build/smollm2 --chat $GGUF \\
        --llama-server build/llama-server/bin/llama-server --text DIR --clients 1 4 16 64 --seconds 20 --new 32
    .venv/bin/python benchmarks/serve_load.py --builds build/smollm2 --chat $GGUF \\
        --llama-server build/llama-server/bin/llama-server --text DIR --clients 4 --turns 3 --seconds 50 --cut 50 \\
        --new 32

--speculative adds a side: specc serve with `"speculative": "ngram"` in each body (speculative
decoding by prompt lookup, docs/serving.md), on the same server; --ask repeat asks each passage
back word for word (an answer that copies its prompt, what prompt lookup drafts well) where the
default asks what it says.
"""
from __future__ import annotations

import argparse
import datetime
import http.client
import json
import signal
import socket
import subprocess
import sys
import threading
import tempfile
import time
from pathlib import Path

import numpy as np

from specc.spec import io

ROOT = Path(__file__).resolve().parents[1]
SERVE = ROOT / ".venv-serve" / "bin" / "specc"
THREADS = 2  # llama-server's threads; specc serve's session uses the machine's cores, 2 here
sys.path.insert(0, str(Path(__file__).resolve().parent))


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def start(build: Path, max_sequences: int, *flags: str) -> tuple[subprocess.Popen, int, int]:
    http_port, grpc_port, metrics = free_ports(3)
    proc = subprocess.Popen([str(SERVE), "serve", str(build), "--http-port", str(http_port), "--grpc-port",
                             str(grpc_port), "--metrics-port", str(metrics), "--max-sequences", str(max_sequences),
                             *flags],
                            stderr=subprocess.PIPE, text=True)
    line = proc.stderr.readline()  # the ready line, or an error
    if not line.startswith("serving "):
        proc.kill()
        raise SystemExit(f"specc serve {build}: {line}{proc.stderr.read()}")
    return proc, http_port, grpc_port


def event_times(port: int, path: str, body: dict, last: bytes) -> list[float]:
    """Arrival times of each server-sent event of one streamed request, from its sending, up to
    the event that holds `last` (the final one, which carries no token)."""
    t0 = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    conn.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
    answer = conn.getresponse()
    times = []
    for line in answer.fp:  # the raw chunked body: read up to the last event, not to the close
        if line.startswith(b"data:"):
            if last in line:
                break
            times.append(time.perf_counter() - t0)
    conn.close()
    return times


def stream_one(port: int, model: str, ids: list[int], new: int) -> list[float]:
    """Arrival times of each token of one streamed greedy request to specc serve."""
    return event_times(port, f"/v2/models/{model}/generate_stream",
                       {"input_ids": ids, "max_tokens": new, "eos": -1, "stream": True}, b"finish_reason")


def start_llama_server(binary: Path, gguf: Path, slots: int, context: int,
                       threads: int = THREADS) -> tuple[subprocess.Popen, int]:
    """llama.cpp's server on GGUF with SLOTS parallel slots of CONTEXT tokens each, by default the
    same threads as specc's; returns once /health answers 200."""
    port = free_ports(1)[0]
    log = tempfile.NamedTemporaryFile(prefix="llama-server-", suffix=".log", delete=False)
    proc = subprocess.Popen([str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
                             "-t", str(threads), "-tb", str(threads), "--parallel", str(slots),
                             "-c", str(slots * context), "--no-kv-unified"],
                            stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"llama-server exited {proc.returncode}: {Path(log.name).read_text()[-2000:]}")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return proc, port
        except OSError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit(f"llama-server did not come up in 300 s: {log.name}")


def llama_stream_one(port: int, ids: list[int], new: int) -> list[float]:
    """The same greedy request to llama.cpp's /completion, streamed: one event per token."""
    return event_times(port, "/completion", {"prompt": ids, "n_predict": new, "stream": True, "temperature": 0,
                                             "ignore_eos": True, "cache_prompt": False}, b'"stop":true')


def llama_gguf(build: Path, spec: dict, out: Path) -> Path:
    """The build's kept weights as a GGUF of its precision (llama_cpp_peer.write_gguf)."""
    from llama_cpp_peer import write_gguf

    weights = build / "model.safetensors"
    if not weights.exists():
        raise SystemExit(f"{build}: no model.safetensors; build it with --keep-weights for --llama-server")
    dtype = np.float16 if json.loads((build / "manifest.json").read_text())["options"]["precision"] == "fp16" else np.float32
    write_gguf(weights, spec, out, dtype=dtype)
    return out


def stateless_one(port: int, model: str, ids: list[int], new: int, graph_inputs: list[str]) -> list[float]:
    """The same request as a client loop over the raw graph model: prefill, then one request per
    token carrying the whole cache back."""
    import tritonclient.http as httpclient
    from tritonclient.utils import np_to_triton_dtype

    client = httpclient.InferenceServerClient(f"127.0.0.1:{port}")
    t0 = time.perf_counter()
    times, past, seq = [], {}, list(ids)
    step_ids = np.array([ids], dtype=np.int64)
    for _ in range(new):
        total = len(seq)
        feeds = {"input_ids": step_ids, "attention_mask": np.ones((1, total), np.int64)}
        if "position_ids" in graph_inputs:
            feeds["position_ids"] = np.arange(total - step_ids.shape[1], total, dtype=np.int64)[None]
        feeds.update(past)
        inputs = []
        for name, arr in feeds.items():
            t = httpclient.InferInput(name, list(arr.shape), np_to_triton_dtype(arr.dtype))
            t.set_data_from_numpy(arr, binary_data=True)
            inputs.append(t)
        res = client.infer(f"{model}_model", inputs)
        token = int(res.as_numpy("logits")[0, -1].argmax())
        times.append(time.perf_counter() - t0)
        past = io.present_to_past({o["name"]: res.as_numpy(o["name"]) for o in res.get_response()["outputs"]})
        seq.append(token)
        step_ids = np.array([[token]], dtype=np.int64)
    return times


class _Times:
    """A scheduler sink that notes each token's arrival, from t0."""

    def __init__(self, t0: float):
        self.t0, self.times, self.ended, self.error = t0, [], threading.Event(), None

    def token(self, token_id: int) -> bool:
        self.times.append(time.perf_counter() - self.t0)
        return True

    def done(self, reason: str, error: str | None = None) -> None:
        self.error = error
        self.ended.set()


def scheduler_one(scheduler, ids: list[int], new: int) -> list[float]:
    """The same greedy request straight to a Scheduler in this process: no server, no HTTP, no
    Triton; what the server's own work costs is the difference from its route."""
    from specc.runtime.scheduler import GenerationRequest

    sink = _Times(time.perf_counter())
    scheduler.submit(GenerationRequest(tuple(ids), new, eos=-1), sink)
    sink.ended.wait()
    if sink.error is not None:
        raise RuntimeError(f"the scheduler failed a request: {sink.error}")
    return sink.times


class ChatStream:
    """What one streamed /v1/chat/completions answer gives its client, fed its body line by line:
    the reply's text, each content chunk's arrival (seconds from the request's sending), and the
    usage chunk's counts (stream_options.include_usage) when it comes."""

    def __init__(self):
        self.pieces, self.times, self.usage, self.done, self.cut = [], [], None, False, False

    def feed(self, line: bytes, at: float) -> bool:
        """One line of the body, arrived `at`; True at `data: [DONE]`. A chunk that carries an
        error object raises it."""
        if not line.startswith(b"data:"):
            return False
        data = line[5:].strip()
        if data == b"[DONE]":
            self.done = True
            return True
        event = json.loads(data)
        if "error" in event:
            raise RuntimeError(f"the stream ended in an error: {event['error']}")
        if event.get("usage"):
            self.usage = event["usage"]
        for choice in event.get("choices") or ():
            piece = (choice.get("delta") or {}).get("content")
            if piece:
                self.pieces.append(piece)
                self.times.append(at)
        return False

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    @property
    def tokens(self) -> int:
        """The reply's tokens: the usage's completion_tokens, else one a content chunk."""
        return self.usage["completion_tokens"] if self.usage else len(self.times)


def chat_one(port: int, model: str, messages: list[dict], new: int, cut: float, extra: dict | None = None) -> ChatStream:
    """One streamed greedy chat request: only fields both servers take (specc refuses others),
    and `extra`'s (a side's own). At `cut` (a time.perf_counter()) a reply not yet ended is cut:
    its connection closed (the server cancels it), `stream.cut` set, what came of it kept."""
    body = {"model": model, "messages": messages, "max_tokens": new, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, **(extra or {})}
    t0 = time.perf_counter()
    stream = ChatStream()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=max(cut - t0, 0.01))
    try:
        conn.request("POST", "/v1/chat/completions", body=json.dumps(body),
                     headers={"Content-Type": "application/json"})
        answer = conn.getresponse()
        if answer.status != 200:
            raise RuntimeError(f"port {port}: /v1/chat/completions answered {answer.status}: {answer.read()[:500]!r}")
        while True:  # the raw chunked body, up to [DONE]
            conn.sock.settimeout(max(cut - time.perf_counter(), 0.01))
            line = answer.fp.readline()
            if not line:
                raise RuntimeError(f"port {port}: the stream closed before data: [DONE]")
            if stream.feed(line, time.perf_counter() - t0):
                break
    except TimeoutError:
        stream.cut = True
    finally:
        conn.close()
    return stream


def passages(folder: Path) -> list[str]:
    """The paragraphs of the text files in `folder` (*.txt, in name order) of 80 to 400
    characters: the questions' material."""
    texts = [f.read_text(encoding="utf-8") for f in sorted(folder.glob("*.txt"))]
    if not texts:
        raise SystemExit(f"--text {folder}: no .txt files")
    found = [" ".join(para.split()) for text in texts for para in text.split("\n\n")]
    return [para for para in found if 80 <= len(para) <= 400]


def system_prompt(folder: Path, chars: int) -> str:
    """The shared system prompt: a line of instruction, then the first `chars` characters of the
    text files of `folder`."""
    text = "\n\n".join(f.read_text(encoding="utf-8") for f in sorted(folder.glob("*.txt")))
    return "You answer questions about these lecture notes, briefly.\n\n" + text[:chars]


ASKS = {"explain": "What does this passage say? {}", "repeat": "Repeat this passage word for word: {}"}


def question(material: list[str], client: int, conversation: int, turn: int, round_: int, ask: str = "explain") -> str:
    """The user's turn: a passage chosen by (round, client, conversation, turn) alone, so that
    every side is asked the same things in the same order, in the words of ASKS[ask]."""
    pick = np.random.default_rng([round_, client, conversation, turn]).integers(len(material))
    return ASKS[ask].format(material[pick])


def run_clients(client, clients: int, daemon: bool = False) -> None:
    """client(k) on a thread of its own for k in 0..clients-1, all started, then all joined."""
    threads = [threading.Thread(target=client, args=(k,), daemon=daemon) for k in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def percentile_ms(xs: list[float], q: float) -> float:
    """The q-th percentile of seconds `xs` in milliseconds; nan for none."""
    return float(np.percentile(xs, q)) * 1000 if xs else float("nan")


def chat_load(ask, clients: int, seconds: float, cut_after: float, system: str | None, turns: int,
              material: list[str], round_: int, words: str = "explain") -> dict:
    """`clients` threads, each holding conversations of `turns` turns back to back for `seconds`
    (each reply sent back in the next turn's messages); `ask(messages, cut)` is one streamed
    request, cut `cut_after` seconds past the end if it has not ended by then. The figures: all
    replies' tokens (a cut reply's: its content chunks) over the wall time, time to first content
    chunk (all turns, and the first turn's and the later turns' apart), tokens and prompt tokens
    per reply, replies cut and those cut before their first token."""
    lock = threading.Lock()
    firsts, laters, tokens, prompts, cuts, blanks = [], [], [], [], [0], [0]
    t0 = time.perf_counter()
    deadline = t0 + seconds
    cut = deadline + cut_after

    def client(k: int) -> None:
        conversation = 0
        while time.perf_counter() < deadline:
            messages = [{"role": "system", "content": system}] if system else []
            for turn in range(turns):
                if time.perf_counter() >= deadline:
                    break
                messages.append({"role": "user", "content": question(material, k, conversation, turn, round_, words)})
                stream = ask(messages, cut)
                messages.append({"role": "assistant", "content": stream.text})
                with lock:
                    if stream.times:
                        (firsts if turn == 0 else laters).append(stream.times[0])
                    else:
                        blanks[0] += 1
                    cuts[0] += stream.cut
                    tokens.append(stream.tokens)
                    if stream.usage:
                        prompts.append(stream.usage["prompt_tokens"])
                if stream.cut:
                    return
            conversation += 1

    run_clients(client, clients, daemon=True)
    wall = time.perf_counter() - t0
    pct = percentile_ms
    return {"clients": clients, "tokens_per_s": sum(tokens) / wall, "replies": len(tokens), "cut": cuts[0],
            "no_first_token": blanks[0], "wall_s": wall,
            "ttft_p50_ms": pct(firsts + laters, 50), "ttft_p99_ms": pct(firsts + laters, 99),
            "first_turn_ttft_p50_ms": pct(firsts, 50), "later_turns_ttft_p50_ms": pct(laters, 50),
            "tokens_per_reply": float(np.mean(tokens)) if tokens else float("nan"),
            "prompt_tokens_p50": float(np.median(prompts)) if prompts else float("nan")}


def load(fn, clients: int, seconds: float, prompt_len: int, new: int, vocab: int) -> dict:
    """`clients` threads each sending requests back to back for `seconds`; the figures."""
    lock = threading.Lock()
    ttft, gaps, tokens = [], [], [0]
    deadline = time.perf_counter() + seconds

    def client(k: int) -> None:
        local = np.random.default_rng(k)
        while time.perf_counter() < deadline:
            ids = local.integers(0, vocab, size=prompt_len).tolist()
            times = fn(ids, new)
            with lock:
                tokens[0] += len(times)
                if times:
                    ttft.append(times[0])
                    gaps.extend(np.diff(times).tolist())

    t0 = time.perf_counter()
    run_clients(client, clients)
    wall = time.perf_counter() - t0
    pct = percentile_ms
    return {"clients": clients, "tokens_per_s": tokens[0] / wall, "ttft_p50_ms": pct(ttft, 50),
            "ttft_p99_ms": pct(ttft, 99), "token_p50_ms": pct(gaps, 50), "token_p99_ms": pct(gaps, 99)}


def measure(model: str, route: str, fn, clients: int, args, vocab: int) -> dict:
    """One row of the table: `load` of `fn` under `clients`, printed as it is made."""
    row = {"model": model, "route": route, **load(fn, clients, args.seconds, args.prompt, args.new, vocab)}
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--builds", nargs="+", required=True, type=Path)
    ap.add_argument("--clients", nargs="+", type=int, default=[1, 4, 16, 64])
    ap.add_argument("--seconds", type=float, default=30.0, help="per model, route and concurrency")
    ap.add_argument("--prompt", type=int, default=32, help="prompt tokens")
    ap.add_argument("--new", type=int, default=64, help="new tokens per request")
    ap.add_argument("--no-stateless", action="store_true", help="skip the client-loop route")
    ap.add_argument("--scheduler", action="store_true",
                    help="also the scheduler alone, in this process (no server), before the server starts")
    ap.add_argument("--llama-server", type=Path, help="llama.cpp's llama-server: a route for LLaMA-shaped builds")
    ap.add_argument("--out", type=Path, help="also write the table, with this command and the machine, to this file")
    ap.add_argument("--chat", type=Path, metavar="GGUF",
                    help="the chat endpoint instead, beside llama-server serving GGUF (the file the build was imported from)")
    ap.add_argument("--turns", type=int, default=1, help="--chat: turns per conversation (1: single questions)")
    ap.add_argument("--text", type=Path, help="--chat: folder of .txt files the questions and the system prompt are cut from")
    ap.add_argument("--system-chars", type=int, default=2750,
                    help="--chat with --turns > 1: characters of --text in the shared system prompt")
    ap.add_argument("--rounds", type=int, default=1, help="--chat: rounds, each measuring every side once")
    ap.add_argument("--llama-threads", type=int, default=THREADS,
                    help="--chat: llama-server's -t and -tb (default: the machine's 2 cores, as specc's session)")
    ap.add_argument("--cut", type=float, default=60.0,
                    help="--chat: seconds past a row's end at which replies not yet ended are cut")
    ap.add_argument("--speculative", action="store_true",
                    help="--chat: a side with \"speculative\": \"ngram\" on specc serve (single questions)")
    ap.add_argument("--ask", choices=sorted(ASKS), default="explain",
                    help="--chat: what the single questions ask of their passage")
    args = ap.parse_args()
    if args.chat:
        return chat_main(args)
    rows = []
    for build in args.builds:
        manifest = json.loads((build / "manifest.json").read_text())
        name, vocab = manifest["spec"]["name"], manifest["spec"]["vocab"]["size"]
        batch_max = manifest["spec"]["serving"]["batch"]["max"]
        if args.llama_server and manifest["spec"]["position"]["kind"] == "rotary":
            with tempfile.TemporaryDirectory(dir=build.parent) as tmp:
                gguf = llama_gguf(build, manifest["spec"], Path(tmp) / f"{name}.gguf")
                # as many slots as specc serve gets sequences at once
                proc, port = start_llama_server(args.llama_server, gguf, min(max(args.clients), batch_max),
                                                args.prompt + args.new + 16)
                try:
                    for clients in args.clients:
                        rows.append(measure(name, "llama.cpp server (completion stream)",
                                            lambda ids, n: llama_stream_one(port, ids, n), clients, args, vocab))
                finally:
                    proc.terminate()
                    proc.wait(timeout=60)
        if args.scheduler:
            from specc.runtime.scheduler import GenerationLimits, Scheduler
            from specc.runtime.session import Session

            session = Session(build)
            scheduler = Scheduler(session, GenerationLimits.of(session.info, max_sequences=min(max(args.clients), batch_max)))
            scheduler.start()
            try:
                for clients in args.clients:
                    rows.append(measure(name, "scheduler alone (no server)",
                                        lambda ids, n: scheduler_one(scheduler, ids, n), clients, args, vocab))
            finally:  # closed first: a client still looping (Ctrl-C) is refused, not queued forever
                scheduler.close()
                scheduler.stop()
                del scheduler, session
        graph_inputs = [t["name"] for t in manifest["graphs"]["model"]["inputs"]]
        proc, http_port, _ = start(build, min(max(args.clients), batch_max))
        try:
            for clients in args.clients:
                routes = {"server (generate_stream)": lambda ids, n: stream_one(http_port, name, ids, n)}
                if not args.no_stateless:
                    routes["stateless (client loop)"] = lambda ids, n: stateless_one(http_port, name, ids, n,
                                                                                     graph_inputs)
                for route, fn in routes.items():
                    rows.append(measure(name, route, fn, clients, args, vocab))
        finally:
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=120)
    table = ["| model | route | clients | tokens/s | vs 1 client | TTFT p50 / p99 ms | per token p50 / p99 ms |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        one = next((o["tokens_per_s"] for o in rows if o["model"] == r["model"] and o["route"] == r["route"]
                    and o["clients"] == 1), None)
        gain = f"{r['tokens_per_s'] / one:.2f}x" if one else "-"
        table.append(f"| {r['model']} | {r['route']} | {r['clients']} | {r['tokens_per_s']:.1f} | {gain} | "
                     f"{r['ttft_p50_ms']:.0f} / {r['ttft_p99_ms']:.0f} | {r['token_p50_ms']:.1f} / {r['token_p99_ms']:.1f} |")
    print("\n" + "\n".join(table))
    if args.out:
        from suite import _cpu

        when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        command = " ".join(["benchmarks/serve_load.py", *sys.argv[1:]])
        write_section(args.out, "## generate_stream under concurrent clients",
                      f"Run {when} on {_cpu()}; command: `{command}`. Each client sends greedy requests of "
                      f"{args.prompt} random prompt tokens and {args.new} new tokens back to back for "
                      f"{args.seconds:g} s; tokens/s is all clients' streamed tokens over the wall time.\n\n"
                      + "\n".join(table) + "\n")



OUT_TITLE = "# Serving load"
OUT_NOTE = "Written by `benchmarks/serve_load.py --out`, one section per kind of run; do not edit by hand."


def write_section(path: Path, heading: str, body: str) -> None:
    """Write `heading` and `body` into the markdown file at `path`, in place of the section of the
    same heading (from its `## ` line to the next), else after the others."""
    text = path.read_text(encoding="utf-8") if path.exists() else ""
    sections, current = [], None
    for line in text.splitlines(keepends=True):
        if line.startswith("## "):
            current = [line]
            sections.append(current)
        elif current is not None:
            current.append(line)
    new = f"{heading}\n\n{body.rstrip()}\n\n"
    kept = ["".join(sec) if sec[0].rstrip("\n") != heading else new for sec in sections]
    if new not in kept:
        kept.append(new)
    path.write_text(f"{OUT_TITLE}\n\n{OUT_NOTE}\n\n" + "".join(kept).rstrip() + "\n", encoding="utf-8")


def chat_main(args) -> None:
    """The chat workload (--chat) on one build beside llama-server on the GGUF file, sides
    alternated within each round; the table, and the goals, printed and written to --out."""
    if len(args.builds) != 1 or not args.llama_server or not args.text:
        raise SystemExit("--chat: one build in --builds, --llama-server and --text")
    if not args.chat.is_file():
        raise SystemExit(f"--chat {args.chat}: no such file")
    build = args.builds[0]
    manifest = json.loads((build / "manifest.json").read_text())
    name, serving = manifest["spec"]["name"], manifest["spec"]["serving"]
    sequences = min(max(args.clients), serving["batch"]["max"])
    material = passages(args.text)
    system = system_prompt(args.text, args.system_chars) if args.turns > 1 else None
    # llama-server: a slot per sequence specc runs at once, each slot the context a conversation needs
    context = serving["length"]["max"] if args.turns > 1 else 512
    heading = ("## Chat: single questions under concurrent clients" if args.turns == 1 else
               "## Chat: conversations under a shared system prompt")
    if args.speculative or args.ask != "explain":  # a section of its own beside the default's
        heading += (", with speculative decoding" if args.speculative else "") + \
            (", passages asked back word for word" if args.ask == "repeat" else "")
    if args.llama_threads != THREADS:  # a section of its own beside the default's
        heading += f", llama-server on {args.llama_threads} thread{'s' if args.llama_threads > 1 else ''}"
    servers, sides = [], {}
    try:
        proc, http_port, _ = start(build, sequences)
        servers.append(proc)
        if args.turns > 1:
            sides["specc serve, prefix cache on"] = http_port
            proc, off_port, _ = start(build, sequences, "--prefix-cache-tokens", "0")
            servers.append(proc)
            sides["specc serve, prefix cache off"] = off_port
        else:
            sides["specc serve"] = http_port
        if args.speculative:
            sides["specc serve, speculative ngram"] = http_port
        proc, llama_port = start_llama_server(args.llama_server, args.chat, sequences, context, args.llama_threads)
        servers.append(proc)
        sides["llama-server, prompt cache on"] = llama_port

        def asker(side):
            extra = {"speculative": "ngram"} if side.endswith("speculative ngram") else None
            return lambda messages, cut: chat_one(sides[side], name, messages, args.new, cut, extra)

        first = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": question(material, 0, 0, 0, 0, args.ask)}]
        checks = {side: asker(side)(first, time.perf_counter() + 600) for side in sides}
        for side, got in checks.items():
            print(json.dumps({"check": side, "prompt_tokens": got.usage and got.usage["prompt_tokens"],
                              "completion_tokens": got.tokens, "reply": got.text[:120]}), flush=True)
        rows = []
        for round_ in range(args.rounds):
            order = list(sides) if round_ % 2 == 0 else list(sides)[::-1]
            for clients in args.clients:
                for side in order:
                    row = {"round": round_ + 1, "route": side,
                           **chat_load(asker(side), clients, args.seconds, args.cut, system, args.turns,
                                       material, round_, args.ask)}
                    print(json.dumps(row), flush=True)
                    rows.append(row)
                    if args.out:  # after each row: a run stopped early leaves what it measured
                        write_section(args.out, heading, chat_report(rows, checks, args, sequences, context, system))
    finally:
        for proc in servers:
            proc.send_signal(signal.SIGINT)
        for proc in servers:
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                proc.kill()
    print("\n" + chat_report(rows, checks, args, sequences, context, system))


def mean_of(rows: list[dict], route: str, clients: int, key: str) -> float:
    """The mean over the rounds of one route's `key` at `clients`; nan where there is none."""
    got = [r[key] for r in rows if r["route"] == route and r["clients"] == clients]
    return float(np.mean(got)) if got else float("nan")


def chat_report(rows: list[dict], checks: dict, args, sequences: int, context: int, system: str | None) -> str:
    """The markdown of a --chat run: what was run, the table, and the goals met or not."""
    from suite import _cpu

    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    command = " ".join(["benchmarks/serve_load.py", *sys.argv[1:]])
    check = "; ".join(f"{side}: {got.usage['prompt_tokens'] if got.usage else '?'} prompt tokens, "
                      f"{got.tokens} in the reply" for side, got in checks.items())
    same = len({got.text for got in checks.values()}) == 1
    what = (f"each client asks single questions (a passage of --text and a line asking "
            f"{'for it word for word' if args.ask == 'repeat' else 'what it says'}, no system "
            f"prompt: {rows[0]['prompt_tokens_p50']:.0f} prompt tokens at the median)" if args.turns == 1 else
            f"each client holds conversations of {args.turns} turns under one system prompt of "
            f"{args.system_chars} characters of --text shared by all (the first request's prompt below: the system "
            f"prompt and one question), its replies sent back in the next turn's messages (the prompt tokens at "
            f"the median over all turns: the table's first row's {rows[0]['prompt_tokens_p50']:.0f})")
    lines = [f"Run {when} on {_cpu()}, 2 cores shared by both servers and the clients (and by whatever else ran on "
             f"the machine then: the sides alternate within each round, the order reversed every other round); "
             f"command: `{command}`. Streamed `/v1/chat/completions`, greedy (temperature 0), at most {args.new} new "
             f"tokens, `stream_options.include_usage`; {what}, back to back for {args.seconds:g} s per row, a reply "
             f"not ended {args.cut:g} s past the row's end cut there (its connection closed; its content chunks "
             f"counted as its tokens). specc "
             f"serve runs {sequences} sequences at once; llama-server (`-t {args.llama_threads} --parallel {sequences} -c "
             f"{sequences * context} --no-kv-unified`: {sequences} slots of {context} positions, its chat template "
             f"the file's, its prompt cache on as by default) serves the GGUF file the build was imported from. "
             f"tokens/s: the usage chunks' completion tokens of all replies over the wall time; time to first token: "
             f"to the first chunk with content, over the replies that had one (cut: the replies cut, and of them "
             f"those cut before their first token).",
             "",
             f"The first request, sent to each side before the rows: {check}; the replies are "
             f"{'the same text' if same else 'not the same text (specc computes in fp32 from the dequantized weights, llama.cpp in its Q4_1 kernels)'}.",
             ""]
    turns = args.turns > 1
    lines += ["| round | route | clients | tokens/s | TTFT p50 / p99 ms | " +
              ("first turn / later turns TTFT p50 ms | " if turns else "") + "tokens per reply | replies | cut | wall s |",
              "|---|---|---|---|---|" + ("---|" if turns else "") + "---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['round']} | {r['route']} | {r['clients']} | {r['tokens_per_s']:.1f} | "
                     f"{r['ttft_p50_ms']:.0f} / {r['ttft_p99_ms']:.0f} | " +
                     (f"{r['first_turn_ttft_p50_ms']:.0f} / {r['later_turns_ttft_p50_ms']:.0f} | " if turns else "") +
                     f"{r['tokens_per_reply']:.1f} | {r['replies']} | {r['cut']} ({r['no_first_token']} before a token) | "
                     f"{r['wall_s']:.0f} |")
    lines.append("")
    llama = "llama-server, prompt cache on"
    if not turns and 16 in args.clients:
        ours, theirs = mean_of(rows, "specc serve", 16, "tokens_per_s"), mean_of(rows, llama, 16, "tokens_per_s")
        lines.append("Goal, at 16 clients specc serve at least 1.3x llama-server's tokens/s: " + (
            "not measured (the run stopped before both rows)." if np.isnan(ours + theirs) else
            f"**{'met' if ours >= 1.3 * theirs else 'not met'}**, " + (
                f"{ours / theirs:.2f}x" if theirs else "llama-server made no token in its row") +
            f" ({ours:.1f} against {theirs:.1f} tokens/s, the rounds' means)."))
    if turns:
        for clients in args.clients:
            ours = mean_of(rows, "specc serve, prefix cache on", clients, "ttft_p50_ms")
            theirs = mean_of(rows, llama, clients, "ttft_p50_ms")
            off = mean_of(rows, "specc serve, prefix cache off", clients, "ttft_p50_ms")
            measured = {r["route"] for r in rows if r["clients"] == clients} >= {"specc serve, prefix cache on", llama}
            verdict = ("not measured (the run stopped before both rows)" if not measured else
                       "**not met**, specc serve had no first token before the cut" if np.isnan(ours) else
                       "**met**, llama-server had no first token before the cut" if np.isnan(theirs) else
                       f"**{'met' if ours <= theirs else 'not met'}**, {ours:.0f} ms against {theirs:.0f} ms")
            lines.append(f"Goal, with the prefix cache specc serve's time to first token p50 no worse than "
                         f"llama-server's ({clients} clients): {verdict} (the rounds' mean of the p50s; {off:.0f} ms "
                         f"with the prefix cache off).")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
