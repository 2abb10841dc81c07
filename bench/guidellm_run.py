"""Run guidellm (a third-party client, https://github.com/vllm-project/guidellm) against tierserve.

    pip install 'guidellm==0.8.1'          # optional: the `bench` extra; best in its own venv
    python bench/guidellm_run.py --streams 1,8 --max-requests 32 --prompt-tokens 128 \
        --output-tokens 64 [--guidellm /path/to/venv/bin/guidellm] [--base-url URL]

Without --base-url it starts `tierserve serve` on a free loopback port with the embedded model and
stops it afterwards. guidellm needs a Hugging Face tokenizer folder for its synthetic prompts:
the embedded model's tokenizer (from the GGUF) is written to one first, so nothing is downloaded.
guidellm's own table is printed; its JSON report is written to --out (default bench/out/)."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx


def export_tokenizer(model: str, folder: Path) -> Path:
    """tokenizer.json + tokenizer_config.json of the served model, readable by AutoTokenizer."""
    from tierserve.engine.worker.loaders import resolve_path
    from tierserve.engine.worker.loaders.gguf_file import read_gguf
    from tierserve.engine.worker.loaders.gguf_loader import _tokenizer

    path = resolve_path(model)
    info = _tokenizer(path, read_gguf(path).fields)
    folder.mkdir(parents=True, exist_ok=True)
    info.tokenizer.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": info.bos_token,
              "eos_token": info.eos_token, "model_max_length": 8192}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: str, log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "tierserve", "serve", "--model", model, "--port", str(port),
           "--log-level", "warning"]
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"tierserve exited:\n{log.read_text()[-2000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit("tierserve did not become healthy in 300 s")


def guidellm_cmd(args: argparse.Namespace, url: str, model_name: str, tok: Path, out: Path) -> list[str]:
    data = f"kind=synthetic_text,prompt_tokens={args.prompt_tokens},output_tokens={args.output_tokens}"
    return [args.guidellm, "run",
            "--backend", f"kind=openai_http,target={url},model={model_name}",
            "--profile", f"kind=concurrent,streams={args.streams}",
            "--constraint", f"kind=max_requests,count={args.max_requests}",
            "--tokenizer", f"kind=hf_auto,model={tok}",
            "--data", data,
            "--output", "kind=console", "--output", f"kind=json,path={out}",
            "--disable-progress"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default=None, help="a running server (default: start one)")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--guidellm", default=shutil.which("guidellm") or "guidellm")
    p.add_argument("--streams", default="1,8", help="concurrent streams, a comma list")
    p.add_argument("--max-requests", type=int, default=32)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--out", default="bench/out/guidellm.json")
    args = p.parse_args(argv)
    out = Path(args.out).resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="guidellm-"))
    tok = export_tokenizer(args.model, work / "tokenizer")
    proc = None
    url = args.base_url
    if url is None:
        proc, url = start_server(args.model, work / "server.log")
    try:
        name = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
        cmd = guidellm_cmd(args, url, name, tok, out)
        print("$", " ".join(cmd), flush=True)
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        return subprocess.run(cmd, env=env).returncode
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)


if __name__ == "__main__":
    sys.exit(main())
