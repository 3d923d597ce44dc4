#!/usr/bin/env python3
"""Load test of `nmt serve`: throughput and latency of POST /api/translate, with and without
dynamic batching.

For each mode (batching, then ``--no-batching``) it starts ``nmt serve --model RUN`` on a
free local port, waits for GET /api/health, sends a few warm-up requests, then, for each
concurrency (1, 8, 32 by default), sends a fixed number of translate requests (one verse
each, the non-empty lines of ``--source`` in turn) from that many concurrent clients
(httpx's AsyncClient, one each), and stops the server. Every figure goes to a markdown table
on stdout and to ``--out`` (``load_test.md`` and ``load_test.json``, with the machine):
requests/s, p50 and p95 latency in ms (as the client sees it), and the mean ``batched_with``
(sentences decoded together with a request, its own included).

Usage::

    .venv/bin/python scripts/load_test.py --model runs/demo
    .venv/bin/python scripts/load_test.py --model runs/demo --requests 512 --beam 5 \\
        --concurrency 1 8 32 64 --serve-args "--max-batch 32 --batch-window-ms 10"
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from nmt.files import read_lines

ROOT = Path(__file__).resolve().parent.parent
WARM_UP = 8  # requests before the timed ones, one at a time


@dataclass
class Row:
    """One mode and concurrency's figures."""

    batching: bool
    concurrency: int
    requests: int
    seconds: float
    requests_per_s: float
    p50_ms: float
    p95_ms: float
    mean_batched_with: float


def percentile(values: list[float], share: float) -> float:
    """The nearest-rank percentile (``share`` in (0, 1])."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(share * len(ordered)) - 1)]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Server:
    """`nmt serve` in a subprocess of its own, its log in ``log``."""

    def __init__(self, args: argparse.Namespace, batching: bool, log: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        command = [sys.executable, "-m", "nmt", "serve", "--model", str(args.model)]
        command += ["--port", str(self.port), "--device", args.device]
        command += shlex.split(args.serve_args) + ([] if batching else ["--no-batching"])
        self.log = log.open("wb")
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT)
        self.log_path = log

    def wait(self, timeout: float) -> None:
        """Until GET /api/health answers (or the server exits: its log's last lines)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                tail = self.log_path.read_text(errors="replace").strip().splitlines()[-5:]
                raise SystemExit("nmt serve exited:\n" + "\n".join(tail))
            try:
                if httpx.get(f"{self.url}/api/health", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.stop()
        raise SystemExit(f"nmt serve did not answer /api/health within {timeout:.0f} s")

    def stop(self) -> None:
        """Ctrl-C (uvicorn stops gracefully), then a kill after 15 s."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()


async def send_all(
    url: str, sentences: list[str], count: int, concurrency: int, beam: int | None
) -> tuple[float, list[float], list[int]]:
    """``count`` requests from ``concurrency`` clients: the seconds it took, each request's
    latency (ms) and batched_with."""
    latencies: list[float] = []
    together: list[int] = []
    next_index = 0

    async def client() -> None:
        nonlocal next_index
        async with httpx.AsyncClient(base_url=url, timeout=600.0) as http:
            while next_index < count:
                index = next_index
                next_index += 1
                body: dict[str, object] = {"sentences": [sentences[index % len(sentences)]]}
                if beam is not None:
                    body["beam_size"] = beam
                started = time.perf_counter()
                response = await http.post("/api/translate", json=body)
                latencies.append((time.perf_counter() - started) * 1000.0)
                if response.status_code != 200:
                    raise SystemExit(f"request {index}: {response.status_code} {response.text}")
                together.append(int(response.json()["batched_with"]))

    started = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    return time.perf_counter() - started, latencies, together


def measure(args: argparse.Namespace, sentences: list[str], batching: bool) -> list[Row]:
    """One server, every concurrency."""
    args.out.mkdir(parents=True, exist_ok=True)
    mode = "batching" if batching else "no-batching"
    server = Server(args, batching, args.out / f"serve-{mode}.log")
    rows = []
    try:
        server.wait(args.start_timeout)
        asyncio.run(send_all(server.url, sentences, min(WARM_UP, args.requests), 1, args.beam))
        for concurrency in args.concurrency:
            seconds, latencies, together = asyncio.run(
                send_all(server.url, sentences, args.requests, concurrency, args.beam)
            )
            row = Row(
                batching=batching,
                concurrency=concurrency,
                requests=args.requests,
                seconds=round(seconds, 3),
                requests_per_s=round(args.requests / seconds, 2),
                p50_ms=round(percentile(latencies, 0.50), 1),
                p95_ms=round(percentile(latencies, 0.95), 1),
                mean_batched_with=round(float(statistics.mean(together)), 2),
            )
            print(
                f"{mode}, concurrency {concurrency}: {row.requests_per_s} requests/s",
                file=sys.stderr,
            )
            rows.append(row)
    finally:
        server.stop()
    return rows


def markdown(rows: list[Row]) -> str:
    lines = [
        "| batching | concurrency | requests | requests/s | p50 ms | p95 ms | mean batched_with |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        mode = "on" if r.batching else "off (--no-batching)"
        lines.append(
            f"| {mode} | {r.concurrency} | {r.requests} | {r.requests_per_s:.1f} | "
            f"{r.p50_ms:.1f} | {r.p95_ms:.1f} | {r.mean_batched_with:.2f} |"
        )
    return "\n".join(lines) + "\n"


def machine() -> dict[str, object]:
    from nmt.runtime import cpu_name

    return {"cpu": cpu_name(), "cores": os.cpu_count(), "python": platform.python_version()}


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    add = parser.add_argument
    add("--model", type=Path, required=True, help="run directory (or checkpoint) to serve")
    add("--source", type=Path, default=ROOT / "data" / "bible" / "test.es.gz",
        help="sentences to send, one a line (.gz read as such)")  # fmt: skip
    add("--requests", type=int, default=256, help="requests per concurrency (default 256)")
    add("--concurrency", type=int, nargs="+", default=[1, 8, 32], help="default: 1 8 32")
    add("--beam", type=int, default=None, help="beam_size of each request (default: the run's)")
    add("--device", default="auto", help="nmt serve --device (default auto)")
    add("--serve-args", default="", help='more nmt serve flags, e.g. "--max-batch 32"')
    add("--start-timeout", type=float, default=300.0, help="seconds to wait for the server")
    add("--out", type=Path, default=ROOT / "runs" / "load_test",
        help="where load_test.md, load_test.json and the servers' logs go")  # fmt: skip
    return parser


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    if args.requests < 1 or min(args.concurrency) < 1:
        raise SystemExit("--requests and --concurrency must be at least 1")
    sentences = [line for line in read_lines(args.source) if line.strip()]
    if not sentences:
        raise SystemExit(f"--source {args.source}: no sentences")
    rows = measure(args, sentences, batching=True) + measure(args, sentences, batching=False)
    table = markdown(rows)
    print(table, end="")
    report = {
        "model": str(args.model),
        "source": str(args.source),
        "beam": args.beam,
        "serve_args": args.serve_args,
        "machine": machine(),
        "rows": [asdict(row) for row in rows],
    }
    (args.out / "load_test.md").write_text(table, encoding="utf-8")
    (args.out / "load_test.json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
