"""LoRA through `zserve serve`: adapters at start-up and at run time, selected by `model`,
on two API servers and two engines, against transformers + PEFT; and every hostile load."""

from __future__ import annotations

import concurrent.futures

import httpx
import openai
import pytest
from e2e_http import SMALL_KV, assert_error
from hf_generate import hf_greedy
from zserve_proc import ZServe

from launcher.tiny_lora import build_tiny_lora

pytestmark = pytest.mark.timeout(300)

KEY = "lora-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPT = [72, 101, 108, 108, 111, 44, 32, 119]  # byte ids: the tiny tokenizer's
NUM_NEW = 8


def peft_greedy(model_dir, adapter) -> list[int]:
    return hf_greedy(model_dir, [PROMPT], NUM_NEW, adapter)[0]


@pytest.fixture(scope="module")
def adapters(tiny_model, tmp_path_factory):
    model = tiny_model("llama")
    root = tmp_path_factory.mktemp("lora-e2e")
    paths = {
        "a": build_tiny_lora(model, root / "a", seed=1),
        "b": build_tiny_lora(model, root / "b", seed=2, rank=4, targets="attention"),
        "c": build_tiny_lora(model, root / "c", seed=3, rank=6, targets="mlp"),
        "big": build_tiny_lora(model, root / "big", seed=4, rank=16),
    }
    expected = {name: peft_greedy(model, paths.get(name)) for name in (None, "a", "b", "c")}
    return model, paths, expected


@pytest.fixture(scope="module")
def server(adapters):
    model, paths, _ = adapters
    b = f'{{"name": "org/b", "path": "{paths["b"]}", "base_model_name": "tiny"}}'
    args = [
        str(model), "--served-model-name", "tiny", *SMALL_KV, "--api-key", KEY,
        "--api-server-count", "2", "--data-parallel-size", "2",
        "--enable-lora", "--lora-modules", f"a={paths['a']}", b,
        "--max-loras", "2", "--max-lora-rank", "8", "--enable-runtime-lora-updating",
        "--enable-dev-routes",  # /server_info: which API server answered
    ]  # fmt: skip
    with ZServe(*args) as s:
        yield s
        log = s.log()
    assert "Traceback" not in log, log[-4000:]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=KEY, max_retries=0, timeout=60)


def generate(client: openai.OpenAI, model: str, **extra) -> list[int]:
    r = client.completions.create(
        model=model,
        prompt=PROMPT,
        max_tokens=NUM_NEW,
        temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True, **extra},
    )
    assert r.model == model
    return r.choices[0].token_ids


def test_models_lists_each_adapter_with_its_base_as_parent(client):
    models = {m.id: m for m in client.models.list().data}
    assert {"tiny", "a", "org/b"} <= set(models)
    assert models["a"].parent == "tiny" and models["org/b"].parent == "tiny"
    assert models["tiny"].parent is None
    assert all(m.root == m.id for m in models.values())  # never a path of the server


def test_each_adapter_gives_transformers_peft_merged_output(client, adapters):
    _, _, expected = adapters
    assert generate(client, "tiny") == expected[None]
    assert generate(client, "a") == expected["a"]
    assert generate(client, "org/b") == expected["b"]


def test_base_and_adapters_at_once_each_get_their_own_output(client, adapters):
    _, _, expected = adapters
    names = ["tiny", "a", "org/b"] * 4
    with concurrent.futures.ThreadPoolExecutor(len(names)) as pool:
        outputs = list(pool.map(lambda m: generate(client, m), names))
    want = {"tiny": expected[None], "a": expected["a"], "org/b": expected["b"]}
    assert outputs == [want[m] for m in names]


def test_chat_and_tokenize_take_an_adapter_name(client, server):
    chat = client.chat.completions.create(
        model="a", messages=[{"role": "user", "content": "hi"}], max_tokens=3
    )
    assert chat.model == "a" and chat.choices[0].message.content is not None
    r = httpx.post(
        server.base_url + "/tokenize", json={"model": "org/b", "prompt": "hi"}, headers=AUTH
    )
    assert r.status_code == 200 and r.json()["tokens"] == [104, 105]


def test_an_unknown_model_name_is_a_404(client):
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        generate(client, "zz")


def per_api_server(server: ZServe, count: int = 2, tries: int = 64) -> dict[int, httpx.Client]:
    """One kept-alive connection to each API server (the kernel spreads connections)."""
    clients: dict[int, httpx.Client] = {}
    for _ in range(tries):
        c = httpx.Client(base_url=server.base_url, headers=AUTH, timeout=60)
        index = c.get("/server_info").json()["api_server_index"]
        if index in clients:
            c.close()
        else:
            clients[index] = c
        if len(clients) == count:
            return clients
    raise AssertionError(f"reached only API servers {sorted(clients)}")


def complete(c: httpx.Client, model: str, rank: int | None = None) -> httpx.Response:
    headers = {} if rank is None else {"X-data-parallel-rank": str(rank)}
    body = {"model": model, "prompt": PROMPT, "max_tokens": NUM_NEW, "temperature": 0}
    body |= {"ignore_eos": True, "return_token_ids": True}
    return c.post("/v1/completions", json=body, headers=headers)


def test_a_runtime_load_reaches_every_api_server_and_engine_then_unloads(server, adapters):
    _, paths, expected = adapters
    clients = per_api_server(server)
    try:
        r = clients[0].post(
            "/v1/load_lora_adapter", json={"lora_name": "c", "lora_path": str(paths["c"])}
        )
        assert r.status_code == 200 and r.text == "Success: LoRA adapter 'c' added successfully."
        # Loaded through API server 0: API server 1 serves it at once, on either engine.
        for c in clients.values():
            for rank in (0, 1):
                r = complete(c, "c", rank)
                assert r.status_code == 200, r.text
                assert r.json()["choices"][0]["token_ids"] == expected["c"]
        assert "c" in [m["id"] for m in clients[1].get("/v1/models").json()["data"]]
        again = clients[1].post(
            "/v1/load_lora_adapter", json={"lora_name": "c", "lora_path": str(paths["c"])}
        )
        assert_error(again, 400, contains=["has already been loaded"])
        r = clients[1].post("/v1/unload_lora_adapter", json={"lora_name": "c"})
        assert r.status_code == 200 and r.text == "Success: LoRA adapter 'c' removed successfully."
        for c in clients.values():
            for rank in (0, 1):
                assert_error(complete(c, "c", rank), 404, param="model")
        assert_error(
            clients[0].post("/v1/unload_lora_adapter", json={"lora_name": "c"}),
            404,
            contains=["cannot be found"],
        )
    finally:
        for c in clients.values():
            c.close()


def test_load_in_place_swaps_the_adapter(server, adapters):
    _, paths, expected = adapters
    with httpx.Client(base_url=server.base_url, headers=AUTH, timeout=60) as c:
        body = {"lora_name": "d", "lora_path": str(paths["a"])}
        assert c.post("/v1/load_lora_adapter", json=body).status_code == 200
        assert complete(c, "d").json()["choices"][0]["token_ids"] == expected["a"]
        body = {"lora_name": "d", "lora_path": str(paths["c"]), "load_inplace": True}
        assert c.post("/v1/load_lora_adapter", json=body).status_code == 200
        assert complete(c, "d").json()["choices"][0]["token_ids"] == expected["c"]
        assert c.post("/v1/unload_lora_adapter", json={"lora_name": "d"}).status_code == 200


@pytest.mark.parametrize(
    ("body", "status", "param", "contains"),
    [
        ({"lora_path": "/tmp"}, 400, "body.lora_name", "Field required"),
        ({"lora_name": "x"}, 400, "body.lora_path", "Field required"),
        ({"lora_name": "x" * 129, "lora_path": "/tmp"}, 400, "body.lora_name", "at most 128"),
        ({"lora_name": "x", "lora_path": "/" + "p" * 4096}, 400, "body.lora_path", "at most 4096"),
        ({"lora_name": "a b", "lora_path": "/tmp"}, 400, "lora_name", "only letters"),
        ({"lora_name": "../x", "lora_path": "/tmp"}, 400, "lora_name", "start with a letter"),
        ({"lora_name": "x", "lora_path": "relative/dir"}, 400, "lora_path", "absolute path"),
        ({"lora_name": "x", "lora_path": "/tmp/\u0000x"}, 400, "lora_path", "NUL"),
        ({"lora_name": "x", "lora_path": 5}, 400, "body.lora_path", "string"),
        ({"lora_name": "tiny", "lora_path": "/tmp"}, 400, None, "conflicts with a served"),
        ({"lora_name": "x", "lora_path": "/nonexistent/adapter"}, 404, "lora_path", "not a folder"),
        (
            {"lora_name": "x", "lora_path": "/etc"},
            400,
            "lora_path",
            "adapter_config.json is missing",
        ),
        ({"lora_name": "x", "lora_path": "/proc/self"}, 400, "lora_path", "missing"),
    ],
)
def test_hostile_loads_are_refused_naming_the_field(server, body, status, param, contains):
    r = httpx.post(server.base_url + "/v1/load_lora_adapter", json=body, headers=AUTH, timeout=60)
    assert_error(r, status, param=param, contains=[contains])


def test_a_flood_of_maximal_loads_leaves_the_server_healthy_and_bounded(server):
    """Names and paths at their limits, and a folder that is not an adapter: each a fast
    4xx; meanwhile /health answers and the API servers' memory stays put."""

    def api_rss() -> int:
        info = httpx.get(server.base_url + "/server_info", headers=AUTH, timeout=30).json()
        status = open(f"/proc/{info['pid']}/status").read()
        return int(status.split("VmRSS:")[1].split()[0]) * 1024

    url = server.base_url + "/v1/load_lora_adapter"
    bodies = [
        {"lora_name": "n" * 128, "lora_path": "/" + "p" * 4095},
        {"lora_name": "n" * 128, "lora_path": "/etc"},
        {"lora_name": "x" * 10_000, "lora_path": "/" + "p" * 100_000},
    ]
    before = api_rss()
    with httpx.Client(headers=AUTH, timeout=60) as c:
        for i in range(150):
            r = c.post(url, json=bodies[i % len(bodies)])
            assert 400 <= r.status_code < 500, r.text[:300]
            if i % 25 == 0:
                assert c.get(server.base_url + "/health", timeout=5).status_code == 200
    assert api_rss() - before < 50 << 20
    models = httpx.get(server.base_url + "/v1/models", headers=AUTH).json()["data"]
    assert not [m["id"] for m in models if m["id"].startswith(("n" * 8, "x" * 8))]


def test_an_adapter_above_max_lora_rank_or_not_json_is_refused(server, adapters):
    _, paths, _ = adapters
    url = server.base_url + "/v1/load_lora_adapter"
    r = httpx.post(url, json={"lora_name": "big", "lora_path": str(paths["big"])}, headers=AUTH)
    assert_error(r, 400, contains=["rank 16 is above --max-lora-rank 8"])
    r = httpx.post(url, content=b"{not json", headers=AUTH | {"content-type": "application/json"})
    assert_error(r, 400, contains=["not valid JSON"])
    models = httpx.get(server.base_url + "/v1/models", headers=AUTH).json()["data"]
    assert "big" not in [m["id"] for m in models]


def test_the_load_routes_need_the_api_key(server, adapters):
    _, paths, _ = adapters
    body = {"lora_name": "x", "lora_path": str(paths["a"])}
    assert httpx.post(server.base_url + "/v1/load_lora_adapter", json=body).status_code == 401
    assert httpx.post(server.base_url + "/v1/unload_lora_adapter", json=body).status_code == 401


def test_without_the_flags_there_are_no_load_routes_and_no_adapters(default_server):
    r = httpx.post(
        default_server.base_url + "/v1/load_lora_adapter",
        json={"lora_name": "x", "lora_path": "/tmp"},
    )
    assert r.status_code == 404
    r = httpx.post(
        default_server.base_url + "/v1/completions",
        json={"model": "a", "prompt": "hi", "max_tokens": 1},
    )
    assert_error(r, 404, param="model")


def test_a_bad_start_up_adapter_stops_the_server_with_its_reason(adapters, tmp_path):
    model, paths, _ = adapters
    args = [str(model), *SMALL_KV, "--enable-lora"]
    not_adapter = ZServe(*args, "--lora-modules", f"x={tmp_path}", wait_ready=False)
    with not_adapter:
        assert not_adapter.proc.wait(60) == 2
        assert "has no adapter_config.json" in not_adapter.log()
    too_big = ZServe(
        *args, "--lora-modules", f"big={paths['big']}", "--max-lora-rank", "8", wait_ready=False
    )
    with too_big:
        assert too_big.proc.wait(120) == 1
        assert "LoRA adapter 'big': rank 16 is above --max-lora-rank 8" in too_big.log()
