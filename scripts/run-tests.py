#!/usr/bin/env python3
"""Run the workspace's test binaries a few at a time (scripts/test.sh).

`cargo test` runs its test binaries one after another, and most of a GPU
suite's time on lavapipe is one thread compiling a pipeline while the other
core waits; each binary also ends on its slowest test alone. Running a few
binaries at once (and the browser test and the doc tests beside them) keeps
every core busy. Each job runs as cargo would run it (in its package's
folder, the same arguments); its output goes to a log and is printed whole
when it ends, with its time.

    run-tests.py MESSAGES --logs DIR [--jobs N] [--extra NAME=COMMAND]... [-- TEST ARGS]

FLASHATTN_TEST_JOBS sets N (default: the cores + 1).
MESSAGES is the output of `cargo test --no-run --message-format=json`.
Exits 1 when any job failed, after printing each failed job's log again.
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

# Started first: the longest jobs (measured on lavapipe, 2 cores), so the
# short ones fill the gaps at the end instead of a long one running alone.
LONGEST_FIRST = [
    "browser test",
    "python tests",
    "gpu_backward",
    "gpu_layouts",
    "gpu_forward",
    "shaders",
    "cli",
    "io_accounting",
    "fp8",
    "loop_limit",
    "gpu_decode",
    "backend",
    "gpu_timing",
    "shaders_coop",
    "verify",
    "gpu_tune",
    "cpu_backend",
]


def test_binaries(messages):
    """(name, executable, package folder) of every test binary cargo built."""
    seen = set()
    for line in Path(messages).read_text().splitlines():
        if not line.startswith("{"):
            continue
        msg = json.loads(line)
        exe = msg.get("executable")
        if msg.get("reason") != "compiler-artifact" or not exe or not msg["profile"]["test"]:
            continue
        if exe in seen:
            continue
        seen.add(exe)
        target = msg["target"]
        kind = target["kind"][0]
        name = target["name"] if kind in ("test", "example") else f"{target['name']} ({kind})"
        yield name, [exe], Path(msg["manifest_path"]).parent


def order(name):
    return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)


def run(pending, logs, max_jobs):
    """Keep `max_jobs` jobs running until none is pending; print each one's
    log when it ends. Returns (name, status, seconds, log) per job."""
    running, done = {}, []
    try:
        while pending or running:
            while pending and len(running) < max_jobs:
                name, command, cwd = pending.pop(0)
                log = open(logs / f"{name.replace(' ', '_')}.log", "w")
                proc = subprocess.Popen(command, cwd=cwd, stdout=log, stderr=subprocess.STDOUT)
                running[proc] = (name, log, time.monotonic())
            time.sleep(0.2)
            for proc in [p for p in running if p.poll() is not None]:
                name, log, t0 = running.pop(proc)
                log.close()
                seconds = time.monotonic() - t0
                status = "ok" if proc.returncode == 0 else f"FAILED (status {proc.returncode})"
                text = Path(log.name).read_text(errors="replace")
                print(f"\n==== {name}: {status} in {seconds:.0f} s ====\n{text}", flush=True)
                done.append((name, status, seconds, log.name))
    finally:
        for proc in running:
            proc.kill()
    return done


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("messages")
    parser.add_argument("--logs", required=True)
    jobs = os.environ.get("FLASHATTN_TEST_JOBS") or (os.cpu_count() or 2) + 1
    parser.add_argument("--jobs", type=int, default=int(jobs))
    parser.add_argument("--extra", action="append", default=[], metavar="NAME=COMMAND")
    argv = sys.argv[1:]
    test_args = argv[argv.index("--") + 1 :] if "--" in argv else []
    args = parser.parse_args(argv[: argv.index("--")] if "--" in argv else argv)

    root = Path(__file__).resolve().parent.parent
    jobs = [(n, exe + test_args, cwd) for n, exe, cwd in test_binaries(args.messages)]
    for extra in args.extra:
        name, _, command = extra.partition("=")
        jobs.append((name, ["bash", "-c", command], root))
    jobs.sort(key=lambda j: (order(j[0]), j[0]))

    logs = Path(args.logs)
    logs.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    print(f"run-tests: {len(jobs)} jobs, {args.jobs} at a time; logs in {logs}", flush=True)
    done = run(jobs, logs, args.jobs)

    print(f"\nrun-tests: {len(done)} jobs in {time.monotonic() - start:.0f} s:")
    for name, status, seconds, _ in sorted(done, key=lambda d: -d[2]):
        print(f"  {seconds:6.0f} s  {name}: {status}")
    failed = [d for d in done if d[1] != "ok"]
    for name, _, _, log in failed:
        print(f"\n==== failed: {name} (log {log}) ====")
        print(Path(log).read_text(errors="replace")[-20000:])
    if failed:
        print(f"run-tests: {len(failed)} failed: {', '.join(d[0] for d in failed)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
