#!/usr/bin/env python3
"""How nmt's data path scales: preparation time and memory, and the start of training once a
corpus is prepared, on synthetic corpora of growing size (scripts/synthetic_corpus.py).

For each size in ``--pairs`` the benchmark runs ``nmt train`` twice on the same corpus, each
in a process of its own, with a small model and ``training.max_steps: 1``:

    cold   a fresh data.cache_dir: reads the files, trains the tokenizer on its sample
           (tokenizer.max_train_sentences), tokenises in data.num_proc processes
    warm   a new run directory sharing that cache: everything is found prepared

and reports for each: the time from starting the command to the first training step (the
``epoch 1:`` log line), the stage timings nmt logs, the seconds it spent verifying the
checksums of what it found prepared (``verify``: the warm run's tokenizer and splits; none
in the cold run, which finds nothing), the peak resident memory of the nmt
process (``ru_maxrss``), and the peak proportional set size summed over it and its worker
processes, in all and its anonymous part (sampled from /proc every 0.2 s; Linux only): PSS
counts pages that workers share once, and the anonymous part leaves out the memory-mapped
corpus files, page cache that the kernel reclaims when memory runs short.

Usage::

    .venv/bin/python scripts/bench_data.py --pairs 100000,1000000,4500000
    .venv/bin/python scripts/bench_data.py --pairs 100000 --markdown

Corpora are generated once into ``--work-dir`` (default runs/bench-data; 4.5M pairs take
about 2 GB) and reused; results go to stdout and ``{work-dir}/bench-data.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
STAGES = re.compile(r"data: prepared in (.*) \(")
VERIFY = re.compile(r"data: .*\bverify (\d+(?:\.\d+)?)s")
MODEL = {
    "embedding_size": 64,
    "encoder": {"hidden_size": 64},
    "decoder": {"style": "luong", "hidden_size": 64, "input_feeding": False},
    "attention": {"score": "general"},
}


def tree_memory_kib(pid: int) -> tuple[int, int]:
    """(proportional set size, its anonymous part) of ``pid`` and its descendants, in KiB.

    PSS shares each page among the processes that map it, so workers forked from the main
    process are not counted twice; the anonymous part leaves out the pages of memory-mapped
    files (the corpus's Arrow tables), which are page cache the kernel reclaims at need."""
    total = anon = 0
    todo = [pid]
    while todo:
        current = todo.pop()
        try:
            with open(f"/proc/{current}/smaps_rollup") as handle:
                for line in handle:
                    if line.startswith("Pss:"):
                        total += int(line.split()[1])
                    elif line.startswith("Pss_Anon:"):
                        anon += int(line.split()[1])
            with open(f"/proc/{current}/task/{current}/children") as handle:
                todo.extend(int(child) for child in handle.read().split())
        except (OSError, ValueError):
            continue
    return total, anon


def run_train(work: Path, corpus: Path, cache: Path, name: str, num_proc: int | None) -> dict:
    """One ``nmt train`` run: seconds to the first step, stage timings, peak memory."""
    run_dir = work / "runs" / name
    shutil.rmtree(run_dir, ignore_errors=True)
    config = {
        "data": {
            "src_lang": "en",
            "trg_lang": "de",
            "train": str(corpus / "train"),
            "dev": str(corpus / "dev"),
            "test": None,
            "cache_dir": str(cache),
            "num_proc": num_proc,
        },
        "tokenizer": {"vocab_size": 8000},
        "model": MODEL,
        "training": {
            "max_steps": 1,
            "validate_every": 1000,
            "max_minutes": None,
            "batch_tokens": 4000,
            "precision": "fp32",
        },
        "run": {"dir": str(run_dir), "device": "cpu"},
    }
    config_path = work / f"{name}.json"
    config_path.write_text(json.dumps(config))
    command = [sys.executable, "-m", "nmt", "train", str(config_path)]
    started = time.perf_counter()
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT
    )
    peak = [0, 0]

    def sample() -> None:
        while process.poll() is None:
            pss, anon = tree_memory_kib(process.pid)
            peak[0], peak[1] = max(peak[0], pss), max(peak[1], anon)
            time.sleep(0.2)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    first_step, stages, verify, lines = None, "", None, []
    assert process.stdout is not None
    for line in process.stdout:
        lines.append(line)
        if first_step is None and " epoch 1: " in line:
            first_step = time.perf_counter() - started
        found = STAGES.search(line)
        if found:
            stages = found.group(1)
        checked = VERIFY.search(line)
        if checked:
            verify = float(checked.group(1))
    _, status, usage = os.wait4(process.pid, 0)
    process.returncode = os.waitstatus_to_exitcode(status)
    sampler.join()
    if process.returncode != 0 or first_step is None:
        sys.stderr.write("".join(lines[-20:]))
        raise SystemExit(f"{name}: nmt train failed (exit {process.returncode})")
    return {
        "first_step_s": round(first_step, 1),
        "total_s": round(time.perf_counter() - started, 1),
        "stages": stages,
        "verify_s": verify,
        "peak_rss_gib": round(usage.ru_maxrss / 2**20, 2),
        "peak_pss_gib": round(peak[0] / 2**20, 2),
        "peak_anon_gib": round(peak[1] / 2**20, 2),
    }


def corpus_for(work: Path, pairs: int) -> Path:
    """The synthetic corpus of this size, generated once (into a temporary folder renamed
    when complete, so that an interrupted generation is never taken for a corpus)."""
    corpus = work / f"corpus-{pairs}"
    if not corpus.is_dir():
        partial = work / f".corpus-{pairs}.partial"
        shutil.rmtree(partial, ignore_errors=True)
        script = ROOT / "scripts" / "synthetic_corpus.py"
        subprocess.run(
            [sys.executable, str(script), "--pairs", str(pairs), "--dev", "500"]
            + ["--out", str(partial)],
            check=True,
        )
        partial.rename(corpus)
    return corpus


def markdown(results: list[dict]) -> str:
    rows = [
        "| pairs | run | first step (s) | stages | verify (s) | peak RSS, nmt (GiB) "
        "| peak PSS, all (GiB) | peak anonymous PSS, all (GiB) |",
        "| ---: | --- | ---: | --- | ---: | ---: | ---: | ---: |",
    ]
    for result in results:
        for run in ("cold", "warm"):
            r = result[run]
            verify = "-" if r["verify_s"] is None else r["verify_s"]
            rows.append(
                f"| {result['pairs']:,} | {run} | {r['first_step_s']} | {r['stages'] or '-'} "
                f"| {verify} | {r['peak_rss_gib']} | {r['peak_pss_gib']} | {r['peak_anon_gib']} |"
            )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", default="100000,1000000,4500000", help="corpus sizes")
    parser.add_argument("--work-dir", type=Path, default=ROOT / "runs" / "bench-data")
    parser.add_argument("--num-proc", type=int, default=None, help="data.num_proc")
    parser.add_argument("--markdown", action="store_true", help="print a markdown table")
    args = parser.parse_args(argv)
    sizes = [int(p.replace("_", "")) for p in args.pairs.split(",") if p.strip()]
    args.work_dir.mkdir(parents=True, exist_ok=True)
    results = []
    for pairs in sizes:
        corpus = corpus_for(args.work_dir, pairs)
        cache = args.work_dir / f"cache-{pairs}"
        shutil.rmtree(cache, ignore_errors=True)
        result: dict[str, Any] = {"pairs": pairs}
        for run in ("cold", "warm"):
            result[run] = run_train(args.work_dir, corpus, cache, f"{pairs}-{run}", args.num_proc)
            print(f"{pairs:,} pairs, {run}: {json.dumps(result[run])}", file=sys.stderr)
        results.append(result)
    report = {
        "machine": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "results": results,
    }
    (args.work_dir / "bench-data.json").write_text(json.dumps(report, indent=1))
    print(markdown(results) if args.markdown else json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
