"""Serving options a vLLM user brings along: a chat template of their own (--chat-template, a file
or the text) and browser access (--allowed-origins, CORS), on a real `tierserve serve`."""

from __future__ import annotations

import subprocess
import sys

import httpx
import openai
import pytest

from server_fixtures import API_KEY, MODEL, run_server

TEMPLATE = ("{% for m in messages %}<<{{ m.role }}>> {{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}<<assistant>>{% endif %}")
UI = "https://ui.example"
KEY = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("opts")
    (tmp / "chat.jinja").write_text(TEMPLATE)
    with run_server(tmp, "--api-key", API_KEY, "--chat-template", str(tmp / "chat.jinja"),
                    "--allowed-origins", UI) as s:
        yield s


def test_chat_uses_the_given_template(server):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    r = httpx.post(server.base_url + "/tokenize", headers=KEY, timeout=60,
                   json={"model": MODEL, "messages": messages})
    assert r.status_code == 200, r.text
    ids = r.json()["tokens"]
    text = httpx.post(server.base_url + "/detokenize", headers=KEY, timeout=60,
                      json={"model": MODEL, "tokens": ids}).json()["prompt"]
    assert text == "<<system>> Be brief.\n<<user>> Hi there\n<<assistant>>"
    client = openai.OpenAI(base_url=server.v1, api_key=API_KEY, max_retries=0, timeout=120)
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4)
    assert out.usage.prompt_tokens == len(ids) and out.choices[0].message.content


def test_a_browser_origin_gets_cors_headers_and_still_needs_the_key(server):
    preflight = {"Origin": UI, "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type"}
    r = httpx.options(server.v1 + "/chat/completions", headers=preflight, timeout=30)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == UI
    assert "authorization" in r.headers["access-control-allow-headers"].lower()
    other = httpx.options(server.v1 + "/chat/completions", timeout=30,
                          headers={**preflight, "Origin": "https://evil.example"})
    assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 2}
    ok = httpx.post(server.v1 + "/completions", json=body, headers={"Origin": UI, **KEY}, timeout=60)
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == UI
    assert "x-request-id" in ok.headers["access-control-expose-headers"].lower()
    denied = httpx.post(server.v1 + "/completions", json=body, headers={"Origin": UI}, timeout=30)
    assert denied.status_code == 401 and denied.headers["access-control-allow-origin"] == UI
    assert denied.json()["error"]["code"] == "invalid_api_key"


def test_without_allowed_origins_there_are_no_cors_headers(tmp_path):
    with run_server(tmp_path) as plain:
        r = httpx.get(plain.v1 + "/models", headers={"Origin": UI}, timeout=30)
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


@pytest.mark.parametrize("value, words", [("{% for m in %}", "does not parse"),
                                          ("/no/such/template.jinja", "neither a file nor")])
def test_a_bad_chat_template_stops_start_up_with_one_line(value, words):
    r = subprocess.run([sys.executable, "-m", "tierserve", "serve", "--port", "0",
                        "--chat-template", value], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    (line,) = [ln for ln in r.stderr.splitlines() if ln.startswith("tierserve serve:")]
    assert line.startswith("tierserve serve: chat_template:") and words in line, r.stderr
    assert "Loading" not in r.stderr and "backend" not in r.stderr  # failed before the model
