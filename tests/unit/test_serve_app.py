"""serve-hidden-states over HTTP, with the extractor's transformers backend on a tiny chat
model: the endpoints speculators uses, the files, concurrency, admission and cancellation."""

from __future__ import annotations

import asyncio
import fcntl
import os
import threading
import time

import pytest

torch = pytest.importorskip("torch")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("transformers")

from safetensors.torch import load_file  # noqa: E402

from vllm_compat.extract import HiddenStatesExtractor  # noqa: E402
from vllm_compat.serve.app import create_app  # noqa: E402
from vllm_compat.serve.chat import ChatRenderer  # noqa: E402
from vllm_compat.serve.hs_files import HiddenStatesFiles  # noqa: E402
from vllm_compat.serve.service import HiddenStatesService  # noqa: E402
from vllm_compat.testing.chat_models import build_chat_model  # noqa: E402

LAYERS = [2, 4, 5, 8]
MAX_LEN = 128


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_chat_model(tmp_path_factory.mktemp("chat") / "m")


@pytest.fixture(scope="module")
def reference(model):
    """The extractor itself, outside the server: what every file must hold."""
    with HiddenStatesExtractor(model, layer_ids=LAYERS, backend="transformers") as ex:
        yield lambda ids: next(iter(ex.extract([ids]))).hidden_states


def make_service(model, out, extractor=None, **kw):
    ex = extractor or HiddenStatesExtractor(model, layer_ids=LAYERS, backend="transformers",
                                            max_model_len=MAX_LEN)
    files = HiddenStatesFiles(out, kw.pop("fmt", "model"))
    return HiddenStatesService(ex, files, served_names=["tiny"], model_path=model,
                               renderer=ChatRenderer(model), **kw)


async def _with_client(service, fn):
    await service.start()  # the ASGI transport runs no lifespan
    try:
        transport = httpx.ASGITransport(app=create_app(service))
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
            return await fn(c)
    finally:
        await service.stop()


def serve(service, fn):
    return asyncio.run(_with_client(service, fn))


def read_when_unlocked(path: str) -> dict:
    """speculators' reader: wait for LOCK_EX on the lock file, delete it, load the file."""
    lock = path + ".lock"
    fd = os.open(lock, os.O_RDWR)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                assert time.monotonic() < deadline, "the lock was never released"
                time.sleep(0.01)
    finally:
        os.close(fd)
    os.remove(lock)
    return load_file(path)


def test_models_and_health(model, tmp_path):
    async def go(c):
        m = (await c.get("/v1/models")).json()
        h = await c.get("/health")
        return m, h.status_code

    m, health = serve(make_service(model, tmp_path), go)
    assert health == 200
    assert [d["id"] for d in m["data"]] == ["tiny"]
    assert m["data"][0]["max_model_len"] == MAX_LEN and m["data"][0]["root"] == model


def test_completion_file_holds_the_extractors_states(model, tmp_path, reference):
    ids = [1, 7, 9, 11, 300, 2, 5]

    async def go(c):
        return await c.post("/v1/completions", json={"model": "tiny", "prompt": ids,
                                                     "max_tokens": 1, "return_token_ids": True})

    r = serve(make_service(model, tmp_path), go)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and body["model"] == "tiny"
    assert body["choices"][0]["prompt_token_ids"] == ids
    path = body["kv_transfer_params"]["hidden_states_path"]
    assert os.path.dirname(path) == str(tmp_path)
    data = read_when_unlocked(path)
    assert data["token_ids"].tolist() == ids
    assert data["hidden_states"].dtype == torch.bfloat16
    assert data["hidden_states"].shape == (len(ids), 4, 64)
    assert torch.equal(data["hidden_states"], reference(ids))


def test_prompt_token_ids_only_with_return_token_ids(model, tmp_path):
    async def go(c):
        return await c.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 1})

    body = serve(make_service(model, tmp_path), go).json()
    assert body["choices"][0]["prompt_token_ids"] is None  # as vLLM: only when asked


def test_chat_renders_like_the_render_endpoint(model, tmp_path, reference):
    msgs = [{"role": "user", "content": "What is the capital of France?"},
            {"role": "assistant", "content": "Paris is the capital of France."}]

    async def go(c):
        rendered = await c.post("/v1/chat/completions/render",
                                json={"messages": msgs, "add_generation_prompt": False})
        chat = await c.post("/v1/chat/completions", json={
            "model": "tiny", "messages": msgs, "max_tokens": 1, "add_generation_prompt": False,
            "continue_final_message": False, "return_token_ids": True})
        return rendered, chat

    rendered, chat = serve(make_service(model, tmp_path, fmt="fp8"), go)
    ids = rendered.json()["token_ids"]
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    assert ids == tok.apply_chat_template(msgs, tokenize=True, return_dict=False)
    body = chat.json()
    assert body["object"] == "chat.completion" and body["prompt_token_ids"] == ids
    data = read_when_unlocked(body["kv_transfer_params"]["hidden_states_path"])
    assert data["hidden_states"].dtype == torch.float8_e4m3fn  # --hidden-states-backend fp8
    back = data["hidden_states"].float() * data["hidden_states_scales"]
    ref = reference(ids).float()
    assert ((back - ref).abs() <= 2 ** -4 * ref.abs() + 2 ** -9 * data["hidden_states_scales"]).all()


def test_concurrent_requests_each_get_their_own_states(model, tmp_path, reference):
    prompts = [[(5 * i + j) % 400 + 3 for j in range(3 + (i * 7) % 40)] for i in range(24)]

    async def go(c):
        return await asyncio.gather(*(c.post("/v1/completions", json={
            "prompt": p, "max_tokens": 1, "return_token_ids": True}) for p in prompts))

    service = make_service(model, tmp_path)
    rs = serve(service, go)
    for p, r in zip(prompts, rs):
        assert r.status_code == 200
        data = read_when_unlocked(r.json()["kv_transfer_params"]["hidden_states_path"])
        assert data["token_ids"].tolist() == p
        assert torch.equal(data["hidden_states"], reference(p))
    assert service.admission.requests == 0 and service.admission.tokens == 0


def test_bad_requests_over_http(model, tmp_path):
    async def go(c):
        return (await c.post("/v1/completions", json={"model": "nope", "prompt": [1],
                                                      "max_tokens": 1}),
                await c.post("/v1/completions", content=b"{}",
                             headers={"content-type": "text/plain"}),
                await c.post("/v1/completions", json={"prompt": list(range(MAX_LEN)),
                                                      "max_tokens": 1}))

    nope, media, long = serve(make_service(model, tmp_path), go)
    assert nope.status_code == 404 and nope.json() == {"error": {
        "message": "The model `nope` does not exist.", "type": "NotFoundError",
        "param": "model", "code": 404}}
    assert media.status_code == 415
    assert long.status_code == 400 and long.json()["error"]["param"] == "input_tokens"
    assert list(tmp_path.iterdir()) == []


class Gated:
    """The real extractor, whose stream computes nothing until ``go`` is set (it keeps
    taking requests and cancels meanwhile, as it does between real steps)."""

    def __init__(self, ex: HiddenStatesExtractor) -> None:
        self.ex = ex
        self.go = threading.Event()
        self.stream = None

    def __getattr__(self, name):
        return getattr(self.ex, name)

    def open_stream(self):
        stream = self.ex.open_stream()
        real = stream.step

        def step():
            if not self.go.is_set():
                time.sleep(0.005)
                return []
            return real()

        stream.step = step
        self.stream = stream
        return stream


def test_admission_bounds_what_the_server_holds(model, tmp_path):
    """One request admitted, two waiting: the others get 503 at once, not an unbounded queue."""
    gated = Gated(HiddenStatesExtractor(model, layer_ids=LAYERS, backend="transformers",
                                        max_model_len=MAX_LEN))
    service = make_service(model, tmp_path, extractor=gated, max_pending_requests=1,
                           max_waiting_requests=2)

    async def go(c):
        tasks = [asyncio.ensure_future(c.post("/v1/completions", json={
            "prompt": [1, 2, 3 + i], "max_tokens": 1})) for i in range(6)]
        await asyncio.sleep(0.5)
        held = (service.admission.requests, service.admission.waiting)
        gated.go.set()
        return held, await asyncio.gather(*tasks)

    held, rs = serve(service, go)
    assert held == (1, 2)
    codes = sorted(r.status_code for r in rs)
    assert codes == [200, 200, 200, 503, 503, 503]
    busy = next(r for r in rs if r.status_code == 503).json()["error"]
    assert busy["type"] == "ServiceUnavailableError" and "--max-waiting-requests" in busy["message"]


def test_a_client_that_gives_up_frees_the_engine_and_leaves_no_file(model, tmp_path):
    """A real server (uvicorn): the client times out, the server sees the disconnect, the
    engine drops the prompt, admission is released and no file or lock is written."""
    import uvicorn

    from vllm_compat.testing.server import free_port

    gated = Gated(HiddenStatesExtractor(model, layer_ids=LAYERS, backend="transformers",
                                        max_model_len=MAX_LEN))
    service = make_service(model, tmp_path, extractor=gated)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(service), host="127.0.0.1", port=port,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        url = f"http://127.0.0.1:{port}/v1/completions"
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url, json={"prompt": list(range(1, 60)), "max_tokens": 1}, timeout=1.0)
        deadline = time.monotonic() + 10
        while gated.stream.running or service.admission.requests:
            assert time.monotonic() < deadline, "the cancelled prompt is still held"
            time.sleep(0.02)
        gated.go.set()
        r = httpx.post(url, json={"prompt": [1, 2, 3], "max_tokens": 1}, timeout=30)
        assert r.status_code == 200
        path = r.json()["kv_transfer_params"]["hidden_states_path"]
        read_when_unlocked(path)
        os.remove(path)
        assert list(tmp_path.iterdir()) == []  # nothing of the abandoned request
    finally:
        server.should_exit = True
        thread.join(30)
