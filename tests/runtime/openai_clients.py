"""The official `openai` Python package against a running `specc serve`, run by
tests/runtime/test_openai_serve.py in the serve environment (.venv-serve, where the package is:
the `serve` extra): `python openai_clients.py BASE_URL MODEL CASES.json` prints one JSON object of
what each client saw. Nothing here judges; the test compares.

CASES.json: {"embeddings": [texts]} for an embedding build (embeddings(), below), or
{"chats": [{"messages": [...], "max_tokens": n, "stop": [...] or null}, ...]}; each
chat is asked four ways: sync, streamed (sync), async, and all of them at once as concurrent
async streams (16 or more), plus a completion of each chat's last message as a plain prompt, and the
errors the package raises for an unknown model and a bad request.
"""
from __future__ import annotations

import asyncio
import json
import sys

import openai


def text_of_stream(stream) -> dict:
    """A chat stream's chunks joined: the text, the role, the finish reason, the usage chunk."""
    out = {"text": "", "role": None, "finish_reason": None, "usage": None, "chunks": 0}
    for chunk in stream:
        out["chunks"] += 1
        if chunk.usage is not None:
            out["usage"] = chunk.usage.model_dump()
        for choice in chunk.choices:
            if choice.delta.role:
                out["role"] = choice.delta.role
            out["text"] += choice.delta.content or ""
            out["finish_reason"] = choice.finish_reason or out["finish_reason"]
    return out


async def text_of_async_stream(stream) -> dict:
    out = {"text": "", "finish_reason": None, "usage": None}
    async for chunk in stream:
        if chunk.usage is not None:
            out["usage"] = chunk.usage.model_dump()
        for choice in chunk.choices:
            out["text"] += choice.delta.content or ""
            out["finish_reason"] = choice.finish_reason or out["finish_reason"]
    return out


def embeddings(client, model: str, texts: list[str]) -> dict:
    """The texts' embeddings as the package gives them: by default (it asks for base64 and decodes
    it), as floats, one text alone; and the errors it raises for an unknown model and no input."""
    seen: dict = {}
    r = client.embeddings.create(model=model, input=texts)
    seen["default"] = [d.embedding for d in r.data]
    seen["usage"], seen["object"], seen["model"] = r.usage.model_dump(), r.object, r.model
    seen["float"] = [d.embedding for d in client.embeddings.create(model=model, input=texts,
                                                                    encoding_format="float").data]
    seen["one"] = client.embeddings.create(model=model, input=texts[0]).data[0].embedding
    errors = {}
    try:
        client.embeddings.create(model="no-such-model", input="hi")
    except openai.NotFoundError as exc:
        errors["unknown_model"] = [exc.status_code, exc.body]
    try:
        client.embeddings.create(model=model, input=[])
    except openai.BadRequestError as exc:
        errors["no_input"] = [exc.status_code, exc.body]
    seen["errors"] = errors
    return seen


def main(base_url: str, model: str, cases_file: str) -> None:
    cases = json.load(open(cases_file))
    client = openai.OpenAI(base_url=base_url, api_key="none", max_retries=0)
    seen: dict = {"models": [m.id for m in client.models.list().data]}
    if "embeddings" in cases:  # an embedding build: it has no chat
        seen.update(embeddings(client, model, cases["embeddings"]))
        print(json.dumps(seen))
        return
    chats = cases["chats"]

    def ask(c):
        return {"messages": c["messages"], "max_tokens": c["max_tokens"], **({"stop": c["stop"]} if c.get("stop") else {})}

    sync = []
    for c in chats:
        r = client.chat.completions.create(model=model, **ask(c))
        sync.append({"text": r.choices[0].message.content, "role": r.choices[0].message.role,
                     "finish_reason": r.choices[0].finish_reason, "usage": r.usage.model_dump(), "object": r.object})
    seen["sync"] = sync
    seen["streamed"] = [text_of_stream(client.chat.completions.create(
        model=model, stream=True, stream_options={"include_usage": True}, **ask(c))) for c in chats]
    seen["completions"] = []
    for c in chats:
        r = client.completions.create(model=model, prompt=c["messages"][-1]["content"], max_tokens=c["max_tokens"])
        seen["completions"].append({"text": r.choices[0].text, "finish_reason": r.choices[0].finish_reason,
                                    "usage": r.usage.model_dump()})

    async def concurrently():
        aclient = openai.AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0)
        one = await aclient.chat.completions.create(model=model, **ask(chats[0]))

        async def stream(c):
            return await text_of_async_stream(await aclient.chat.completions.create(
                model=model, stream=True, stream_options={"include_usage": True}, **ask(c)))

        many = await asyncio.gather(*(stream(c) for c in chats))
        await aclient.close()
        return one.choices[0].message.content, many

    seen["async_one"], seen["async_streams"] = asyncio.run(concurrently())
    errors = {}
    try:
        client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "hi"}])
    except openai.NotFoundError as exc:
        errors["unknown_model"] = [exc.status_code, exc.body]
    try:
        client.chat.completions.create(model=model, messages=[])
    except openai.BadRequestError as exc:
        errors["empty_messages"] = [exc.status_code, exc.body]
    try:
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], n=2)
    except openai.BadRequestError as exc:
        errors["n"] = [exc.status_code, exc.body]
    seen["errors"] = errors
    print(json.dumps(seen))


if __name__ == "__main__":
    main(*sys.argv[1:4])
