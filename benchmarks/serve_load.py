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


def start(build: Path, max_sequences: int) -> tuple[subprocess.Popen, int, int]:
    http_port, grpc_port, metrics = free_ports(3)
    proc = subprocess.Popen([str(SERVE), "serve", str(build), "--http-port", str(http_port), "--grpc-port",
                             str(grpc_port), "--metrics-port", str(metrics), "--max-sequences", str(max_sequences)],
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


def start_llama_server(binary: Path, gguf: Path, slots: int, context: int) -> tuple[subprocess.Popen, int]:
    """llama.cpp's server on GGUF with SLOTS parallel slots of CONTEXT tokens each, the same
    threads as specc's; returns once /health answers 200."""
    port = free_ports(1)[0]
    log = tempfile.NamedTemporaryFile(prefix="llama-server-", suffix=".log", delete=False)
    proc = subprocess.Popen([str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
                             "-t", str(THREADS), "-tb", str(THREADS), "--parallel", str(slots),
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
    threads = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    pct = lambda xs, q: float(np.percentile(xs, q)) * 1000 if xs else float("nan")  # noqa: E731
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
    args = ap.parse_args()
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
        args.out.write_text(f"# Serving load: generate_stream under concurrent clients\n\n"
                            f"Written by `benchmarks/serve_load.py --out`; do not edit by hand. Run {when} on "
                            f"{_cpu()}; command: `{command}`. Each client sends greedy requests of "
                            f"{args.prompt} random prompt tokens and {args.new} new tokens back to back for "
                            f"{args.seconds:g} s; tokens/s is all clients' streamed tokens over the wall time.\n\n"
                            + "\n".join(table) + "\n")

if __name__ == "__main__":
    sys.exit(main())
