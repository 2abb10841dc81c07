"""Fair share: one API key's flood against another key's lone request (issue #41, item 4).

    .venv/bin/python bench/fair_share.py                      # 2 rounds, 4-10 min on 2 cores
    .venv/bin/python bench/fair_share.py --rounds 1 --json bench/out/fair_share.json

Two `tierserve serve` processes on loopback (the embedded smollm2-135m, two API keys, KV tiers
off, a 1 GiB KV cache: no preemption), one with --fair-share (the default) and one with
--no-fair-share (first come, first served, as vLLM, SGLang and llama-server schedule). Requests go
to one server at a time; the other waits on its loop's event (no CPU). Each round, per mode (the
mode that leads alternates):

1. idle: key B sends one request alone, --idle times; B's idle TTFT is their median.
2. flood: key A sends --flood requests at once; key B sends one more --delay s later. B's TTFT,
   and A's wall time (first send to last answer) and output tokens/s.

Every request streams /v1/completions with a prompt of --prompt-len random token ids (each prompt
distinct: no prefix-cache hit), max_tokens --max-tokens, ignore_eos, temperature 0, and
logprobs 0 (a chunk for every token, so TTFT is the first token's, whatever its text). TTFT is
measured by the client (httpx), from the send to the first token's chunk.

Targets: with fair share, B's TTFT under the flood at most 3x its idle TTFT, and A's output
tokens/s at least 0.9x first come's (the medians over rounds).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shlex
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
for _p in (Path(__file__).resolve().parent.parent / "tests", Path(__file__).resolve().parent):
    if str(_p) not in sys.path:  # server_fixtures; tables
        sys.path.insert(0, str(_p))

import httpx  # noqa: E402
from server_fixtures import MODEL, RunningServer, run_server, scrape  # noqa: E402
from tables import markdown_table, write_json  # noqa: E402

KEY_A, KEY_B = "sk-bench-flood-a", "sk-bench-lone-b"
MODES = {"first come": "--no-fair-share", "fair share": "--fair-share"}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


@dataclass
class Answer:
    ttft: float
    """Seconds from the send to the first token's chunk."""
    done: float
    """Seconds from the send to the end of the stream."""
    tokens: int
    """Completion tokens (usage)."""
    end: float
    """perf_counter() at the end of the stream."""


@dataclass
class Turn:
    round: int
    mode: str
    b_idle_ttft: float
    b_ttft: float
    a_wall: float
    a_tokens: int
    a_ttft_median: float
    steps: int
    """Engine steps during the flood (the same work in both modes: the same count)."""
    cpu_s: float
    """The server process's CPU seconds during the flood (user + system, all threads)."""
    load1: float
    """The box's 1-minute load average before the turn (other engineers' work is noise)."""

    @property
    def ratio(self) -> float:
        return self.b_ttft / self.b_idle_ttft

    @property
    def a_tok_s(self) -> float:
        return self.a_tokens / self.a_wall

    @property
    def a_tok_cpu_s(self) -> float:
        """A's tokens per server CPU second: less moved by what else runs on the box."""
        return self.a_tokens / self.cpu_s


class Prompts:
    """Distinct random token-id prompts (ids >= 1000: past the special tokens)."""

    def __init__(self, length: int, seed: int):
        self.length, self.rng = length, random.Random(seed)

    def next(self) -> list[int]:
        return [self.rng.randrange(1000, 49000) for _ in range(self.length)]


async def ask(client: httpx.AsyncClient, server: RunningServer, key: str, prompt: list[int],
              max_tokens: int) -> Answer:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "logprobs": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    start, first, tokens = time.perf_counter(), None, 0
    async with client.stream("POST", server.v1 + "/completions", json=body,
                             headers={"Authorization": f"Bearer {key}"}) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("error"):
                raise RuntimeError(f"stream error: {chunk['error']}")
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if first is None and chunk.get("choices"):
                first = time.perf_counter() - start
    end = time.perf_counter()
    return Answer(first if first is not None else float("nan"), end - start, tokens, end)


async def idle_ttft(client, server, prompts: Prompts, args) -> float:
    times = [(await ask(client, server, KEY_B, prompts.next(), args.max_tokens)).ttft
             for _ in range(args.idle)]
    return statistics.median(times)


async def flood(client, server, prompts: Prompts, args) -> tuple[list[Answer], Answer, float]:
    """A's requests at once, B's one `delay` s later; A's answers, B's, and A's first send."""
    a_prompts = [prompts.next() for _ in range(args.flood)]
    b_prompt = prompts.next()
    start = time.perf_counter()
    a = [asyncio.create_task(ask(client, server, KEY_A, p, args.max_tokens)) for p in a_prompts]
    await asyncio.sleep(args.delay)
    b = await ask(client, server, KEY_B, b_prompt, args.max_tokens)
    return await asyncio.gather(*a), b, start


async def turn(client, server: RunningServer, mode: str, rnd: int, prompts: Prompts,
               args) -> Turn:
    load1 = os.getloadavg()[0]
    idle = await idle_ttft(client, server, prompts, args)
    steps, cpu = engine_steps(server), cpu_seconds(server)
    a, b, start = await flood(client, server, prompts, args)
    wall = max(x.end for x in a) - start
    t = Turn(rnd, mode, idle, b.ttft, wall, sum(x.tokens for x in a),
             statistics.median(x.ttft for x in a), engine_steps(server) - steps,
             cpu_seconds(server) - cpu, load1)
    log(f"round {rnd} {mode}: B idle TTFT {idle:.3f}s, under flood {b.ttft:.3f}s "
        f"({t.ratio:.1f}x); A {t.a_tokens} tokens in {wall:.1f}s ({t.a_tok_s:.1f} tok/s, "
        f"{t.a_tok_cpu_s:.1f} per server CPU s; {t.steps} steps)")
    return t


def engine_steps(server: RunningServer) -> int:
    return int(next(v for k, v in scrape(server).items() if k.startswith("tierserve:engine_steps")))


def cpu_seconds(server: RunningServer) -> float:
    """utime + stime of the server process (every thread), from /proc."""
    fields = Path(f"/proc/{server.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def measure(servers: dict[str, RunningServer], args) -> list[Turn]:
    prompts = Prompts(args.prompt_len, args.seed)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    turns = []
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        for server in servers.values():  # warm-up: the first steps of a fresh server are slow
            await ask(client, server, KEY_A, prompts.next(), 4)
            await ask(client, server, KEY_B, prompts.next(), 4)
        for rnd in range(1, args.rounds + 1):
            order = list(servers) if rnd % 2 else list(reversed(servers))
            for mode in order:
                turns.append(await turn(client, servers[mode], mode, rnd, prompts, args))
    return turns


def report(turns: list[Turn], cmd: str) -> dict:
    rows = [(t.round, t.mode, f"{t.load1:.1f}", f"{t.b_idle_ttft:.3f}", f"{t.b_ttft:.3f}",
             f"{t.ratio:.1f}x", f"{t.a_wall:.1f}", f"{t.a_tok_s:.1f}", f"{t.a_tok_cpu_s:.1f}",
             t.steps, f"{t.a_ttft_median:.2f}") for t in turns]
    print(f"    {cmd}\n")
    print(markdown_table(["round", "mode", "load (1 min)", "B TTFT idle (s)",
                          "B TTFT, A flooding (s)", "B slowdown", "A wall (s)", "A output tok/s",
                          "A tok / server CPU s", "steps", "A TTFT median (s)"],
                         "rlrrrrrrrrr", rows))
    med = {m: {k: statistics.median(getattr(t, k) for t in turns if t.mode == m)
               for k in ("ratio", "a_tok_s", "a_tok_cpu_s")} for m in MODES}
    fair, first = med["fair share"], med["first come"]
    keep = fair["a_tok_s"] / first["a_tok_s"]
    keep_cpu = fair["a_tok_cpu_s"] / first["a_tok_cpu_s"]
    print(f"\nsummary (medians): B slowdown under the flood {first['ratio']:.1f}x first come -> "
          f"{fair['ratio']:.1f}x fair share (target <= 3x: "
          f"{'met' if fair['ratio'] <= 3 else 'NOT met'}); A output tok/s fair / first come = "
          f"{keep:.2f}x wall, {keep_cpu:.2f}x per server CPU second (target >= 0.9x: "
          f"{'met' if keep >= 0.9 else 'NOT met'} on wall time)")
    return {"command": cmd, "medians": med, "a_throughput_kept": keep,
            "a_throughput_kept_per_cpu_s": keep_cpu,
            "turns": [asdict(t) | {"ratio": t.ratio, "a_tok_s": t.a_tok_s,
                                   "a_tok_cpu_s": t.a_tok_cpu_s} for t in turns]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--flood", type=int, default=40, help="key A's concurrent requests")
    ap.add_argument("--delay", type=float, default=1.0, help="seconds before key B's request")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--idle", type=int, default=3, help="idle TTFT samples per turn")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--server-args", default="", help="more `tierserve serve` flags, quoted")
    ap.add_argument("--json", default=None, help="write the turns and medians here")
    args = ap.parse_args()
    cmd = "python bench/fair_share.py " + shlex.join(sys.argv[1:])
    extra = ["--api-key", f"{KEY_A},{KEY_B}", "--kv-tiers", "none",
             "--kv-cache-memory-bytes", "1GiB", *shlex.split(args.server_args)]
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        servers = {m: stack.enter_context(run_server(Path(tmp), *extra, flag))
                   for m, flag in MODES.items()}
        log(f"servers up: {', '.join(f'{m} {s.base_url}' for m, s in servers.items())}")
        turns = asyncio.run(measure(servers, args))
    out = report(turns, cmd)
    if args.json:
        write_json(args.json, out)


if __name__ == "__main__":
    main()
