"""One stream through the server and the openai client, per --quantization mode (issue 44's
"auto at least 1.8x none per token"): `tierserve serve` started once per mode, the modes in turns
each round, a streamed completion of --tokens tokens after a real-text prompt; the time per token
is the median gap between streamed chunks after the first (inter-token latency, ITL).

    python bench/one_stream.py                                  # auto and none, 3 rounds
    python bench/one_stream.py --modes auto,gguf-exact,none --rounds 2 --json out.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
ROOT = Path(__file__).resolve().parent.parent
for _p in (ROOT, ROOT / "tests"):  # bench.tables; server_fixtures
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

import openai  # noqa: E402

from bench.tables import cpu_line, markdown_table, write_json  # noqa: E402
from server_fixtures import free_port, server_process, wait_healthy  # noqa: E402

PROMPT = (ROOT / "tests" / "data" / "long_text.md").read_text()[:1200]


def itl_ms(base_url: str, tokens: int) -> float:
    """Median gap in ms between streamed chunks after the first, for one greedy completion."""
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="x")
    stamps = []
    for _ in client.completions.create(model="smollm2-135m", prompt=PROMPT, max_tokens=tokens,
                                       temperature=0, stream=True,
                                       extra_body={"ignore_eos": True}):
        stamps.append(time.perf_counter())
    gaps = [b - a for a, b in zip(stamps[1:], stamps[2:])]
    return statistics.median(gaps) * 1e3


def one_round(mode: str, tokens: int, work: Path, extra: list[str]) -> tuple[float, str]:
    """(ITL ms, the server's log) for `mode` on a fresh server."""
    port = free_port()
    cmd = [sys.executable, "-m", "tierserve.server.cli", "serve", "--port", str(port),
           "--log-level", "warning", *extra, "--quantization", mode]
    with server_process(cmd, port, work / f"{mode}.log", dict(os.environ)) as srv:
        wait_healthy(srv, 600)
        itl_ms(srv.base_url, 16)  # warm-up
        return itl_ms(srv.base_url, tokens), srv.log()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--modes", default="auto,none")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--serve-args", default="--kv-tiers none",
                    help='more `tierserve serve` flags (default: "--kv-tiers none")')
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    modes = args.modes.split(",")
    runs: dict[str, list[float]] = {m: [] for m in modes}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for m in (modes if r % 2 == 0 else modes[::-1]):
                ms, _ = one_round(m, args.tokens, Path(tmp), args.serve_args.split())
                runs[m].append(ms)
                print(f"round {r + 1}/{args.rounds} {m}: ITL {ms:.2f} ms", flush=True)
    ref = statistics.median(runs[modes[-1]])
    print("\n    " + " ".join(["python bench/one_stream.py"] + sys.argv[1:]) + "\n")
    print(cpu_line() + "\n")
    rows = [[m, f"{statistics.median(runs[m]):.2f}", f"{ref / statistics.median(runs[m]):.2f}x",
             ", ".join(f"{x:.2f}" for x in runs[m])] for m in modes]
    print(markdown_table(["mode", "ITL p50 ms (median of rounds)", f"speed-up vs {modes[-1]}",
                          "per round"], "lrrl", rows))
    if args.json:
        write_json(args.json, {"itl_ms": runs})


if __name__ == "__main__":
    main()
