"""Serving options a vLLM user brings along: a chat template of their own (--chat-template, a file
or the text), browser access (--allowed-origins, CORS) and HTTPS (--ssl-certfile/--ssl-keyfile),
on a real `tierserve serve`."""

from __future__ import annotations

import os
import shutil
import ssl
import subprocess
import sys
import time

import httpx
import openai
import pytest

from server_fixtures import (API_KEY, MODEL, free_port, run_server, server_process,
                             stop_server)

TEMPLATE = ("{% if greeting is defined %}[{{ greeting }}]{% endif %}"
            "{% for m in messages %}<<{{ m.role }}>> {{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}<<assistant>>{% endif %}")
UI = "https://ui.example"
KEY = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("opts")
    (tmp / "chat.jinja").write_text(TEMPLATE)
    with run_server(tmp, "--api-key", API_KEY, "--chat-template", str(tmp / "chat.jinja"),
                    "--allowed-origins", UI, "--served-model-name", f"{MODEL},org/alias") as s:
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


def test_every_served_name_is_the_model_and_answers_carry_the_first(server):
    client = openai.OpenAI(base_url=server.v1, api_key=API_KEY, max_retries=0, timeout=120)
    assert [m.id for m in client.models.list().data] == [MODEL, "org/alias"]
    assert client.models.retrieve("org/alias").id == "org/alias"
    out = client.completions.create(model="org/alias", prompt="Hello", max_tokens=2)
    assert out.model == MODEL and out.usage.completion_tokens == 2
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="alias", prompt="Hello", max_tokens=2)
    assert f"serves `{MODEL}`, `org/alias`" in e.value.body["message"]
    schema = httpx.get(server.base_url + "/openapi.json", headers=KEY, timeout=30).json()
    enum = schema["components"]["schemas"]["CompletionRequest"]["properties"]["model"]["enum"]
    assert enum == [MODEL, "org/alias"]


def test_chat_template_kwargs_reach_the_template(server):
    messages = [{"role": "user", "content": "Hi"}]

    def rendered(**extra) -> tuple[int, str]:
        r = httpx.post(server.base_url + "/tokenize", headers=KEY, timeout=60,
                       json={"model": MODEL, "messages": messages, **extra})
        assert r.status_code == 200, r.text
        ids = r.json()["tokens"]
        return len(ids), httpx.post(server.base_url + "/detokenize", headers=KEY, timeout=60,
                                    json={"tokens": ids}).json()["prompt"]

    n, text = rendered(chat_template_kwargs={"greeting": "hey"})
    assert text == "[hey]<<user>> Hi\n<<assistant>>" and n > rendered()[0]
    client = openai.OpenAI(base_url=server.v1, api_key=API_KEY, max_retries=0, timeout=120)
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2,
                                         extra_body={"chat_template_kwargs": {"greeting": "hey"}})
    assert out.usage.prompt_tokens == n
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2,
                                       extra_body={"chat_template_kwargs": {"messages": []}})
    assert e.value.body["param"] == "chat_template_kwargs.messages"


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


@pytest.mark.parametrize("value, words", [("{% for m in %}", "does not parse"),
                                          ("/no/such/template.jinja", "neither a file nor")])
def test_a_bad_chat_template_stops_start_up_with_one_line(value, words):
    r = subprocess.run([sys.executable, "-m", "tierserve", "serve", "--port", "0",
                        "--chat-template", value], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    (line,) = [ln for ln in r.stderr.splitlines() if ln.startswith("tierserve serve:")]
    assert line.startswith("tierserve serve: chat_template:") and words in line, r.stderr
    assert "Loading" not in r.stderr and "backend" not in r.stderr  # failed before the model


def _self_signed(folder) -> tuple[str, str]:
    """A certificate for 127.0.0.1 and its key, made by the openssl command."""
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
                    "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    return str(cert), str(key)


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
def test_https_with_a_certificate_and_the_probe_follows(tmp_path):
    cert, key = _self_signed(tmp_path)
    port = free_port()
    cmd = [sys.executable, "-m", "tierserve", "serve", "--port", str(port), "--log-level",
           "warning", "--kv-cache-memory-bytes", "256MiB", "--ssl-certfile", cert,
           "--ssl-keyfile", key, "--disk-tier-dir", str(tmp_path / "kv")]
    trust = ssl.create_default_context(cafile=cert)
    with server_process(cmd, port, tmp_path / "tls.log", dict(os.environ)) as srv:
        url = f"https://127.0.0.1:{port}"
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and srv.proc.poll() is None:
            try:
                if httpx.get(url + "/health", verify=trust, timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.3)
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120,
                               http_client=httpx.Client(verify=trust))
        out = client.completions.create(model=MODEL, prompt="The capital of France is",
                                        max_tokens=4, temperature=0)
        assert out.usage.completion_tokens == 4
        with pytest.raises(httpx.HTTPError):  # plain HTTP on the TLS port gets no answer
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).raise_for_status()
        probe = subprocess.run([sys.executable, "-m", "tierserve.server.healthcheck"],
                               env=dict(os.environ, TIERSERVE_PORT=str(port),
                                        TIERSERVE_SSL_CERTFILE=cert),
                               capture_output=True, text=True, timeout=30)
        assert probe.returncode == 0, probe.stderr
        # the client's pooled connection stays open and idle: SIGTERM still exits at once (a
        # TLS close used to wait 30 s for the client's close_notify)
        started = time.monotonic()
        stop_server(srv)
        assert srv.proc.returncode == 0 and time.monotonic() - started < 10


def test_a_certificate_without_its_key_or_unreadable_stops_start_up(tmp_path):
    cert, _ = _self_signed(tmp_path) if shutil.which("openssl") else (str(tmp_path / "c"), "")
    for args, words in ((["--ssl-certfile", cert], "give both or neither"),
                        (["--ssl-certfile", cert, "--ssl-keyfile", str(tmp_path / "no.pem")],
                         "ssl_certfile/ssl_keyfile")):
        r = subprocess.run([sys.executable, "-m", "tierserve", "serve", "--port", "0", *args],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        assert words in r.stderr.strip().splitlines()[-1], r.stderr
