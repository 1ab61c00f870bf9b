"""A vLLM command line starts zserve unchanged: vLLM's --config YAML file and the vLLM
flags of launcher/vllm_compat.py, each with its vLLM meaning (one server)."""

from __future__ import annotations

import json

import httpx
import pytest
from e2e_http import MODEL, SERVED_NAMES, SMALL_KV, sync_client
from zserve_proc import ZServe

pytestmark = pytest.mark.timeout(120)

TEMPLATE = (
    "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"
    "{% if add_generation_prompt %}[{{ greeting }}]{% endif %}"
)


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    folder = tmp_path_factory.mktemp("vllm-config")
    (folder / "template.jinja").write_text(TEMPLATE)
    # A vLLM deployment's config file, flags as vLLM spells them in YAML.
    (folder / "config.yaml").write_text(
        f"""
model: {tiny_model("llama")}
port: 1  # the command line's --port wins
enforce-eager: true
enable_chunked_prefill: true
disable-uvicorn-access-log: true
async-scheduling: true
enable-log-outputs: true
max-log-len: 100
enable-sleep-mode: true
kv-cache-dtype: auto
load-format: safetensors
tokenizer-mode: auto
chat-template-content-format: string
download-dir: {folder}
generation-config: vllm
override-generation-config: {{temperature: 0.0, max_new_tokens: 5}}
response-role: bot
chat-template: {folder / "template.jinja"}
default-chat-template-kwargs: {{greeting: HELLO}}
enable-prefix-caching: false
hf-overrides: {{max_position_embeddings: 512}}
# launcher/vllm_flags.py: machinery zserve lacks (any value), features at vLLM's default
attention-backend: CPU_ATTN
enable-expert-parallel: true
numa-bind: false
ignore-patterns: ["original/**", "*.pt"]
limit-mm-per-prompt: {{image: 0}}
optimization-level: 3
nnodes: 1
cpu-offload-gb: 0
scheduler-reserve-full-isl: true
enable-prompt-embeds: false
"""
    )
    with ZServe("--config", str(folder / "config.yaml"), *SERVED_NAMES, *SMALL_KV) as s:
        yield s


def test_the_config_file_and_the_accepted_flags_start_the_server(server):
    log = server.log()
    assert f"port {server.port}" in log  # the command line's port, not the file's
    for line in (
        "--enforce-eager: zserve runs eagerly always",
        "--enable-chunked-prefill: zserve always splits prompts",
        "--async-scheduling: zserve's engine schedules each step after the last",
        "--max-log-len: zserve's request lines hold no prompt text",
        'sampling defaults from --override-generation-config: {"max_tokens": 5, "temperature": 0.0}',
        "--attention-backend: no effect: tunes GPU kernels",
        "--enable-expert-parallel: no effect: tunes mixture-of-experts",
        "--numa-bind: no effect: binds GPU workers to NUMA nodes",
        "--ignore-patterns: no effect: tunes how vLLM downloads",
        "--limit-mm-per-prompt: no effect: tunes multimodal inputs",
    ):
        assert line in log, log[-3000:]


def test_hf_overrides_reach_the_engine(server):
    # the tiny model's config says 1024 positions; the override makes the context 512
    models = httpx.get(server.base_url + "/v1/models", timeout=10).json()["data"]
    assert {m["max_model_len"] for m in models} == {512}


def test_override_generation_config_gives_defaults_and_caps_max_tokens(server):
    client = sync_client(server)
    kwargs = dict(model=MODEL, prompt="abc", extra_body={"ignore_eos": True})
    greedy = client.completions.create(**kwargs, max_tokens=5, temperature=0).choices[0].text
    # no temperature: the override's 0.0, so greedy every time
    defaults = {client.completions.create(**kwargs, max_tokens=5).choices[0].text for _ in range(3)}
    assert defaults == {greedy}
    capped = client.completions.create(**kwargs, max_tokens=40, temperature=1.0, seed=1)
    assert capped.usage.completion_tokens == 5 and capped.choices[0].finish_reason == "length"
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], extra_body={"ignore_eos": True}
    )
    assert chat.usage.completion_tokens == 5  # chat's unset max_tokens: the default, 5


def test_response_role_and_default_chat_template_kwargs(server):
    http = httpx.Client(base_url=server.base_url, timeout=60)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    answer = http.post("/v1/chat/completions", json=body).json()
    assert answer["choices"][0]["message"]["role"] == "bot"
    streamed = http.post("/v1/chat/completions", json=body | {"stream": True}).text
    first = json.loads(streamed.split("data: ", 2)[1])
    assert first["choices"][0]["delta"]["role"] == "bot"

    def rendered(**extra) -> str:
        tokens = http.post("/tokenize", json={"model": MODEL, **body, **extra}).json()["tokens"]
        return http.post("/detokenize", json={"model": MODEL, "tokens": tokens}).json()["prompt"]

    assert rendered().endswith("[HELLO]")  # the server's default
    assert rendered(chat_template_kwargs={"greeting": "BYE"}).endswith("[BYE]")  # request wins
