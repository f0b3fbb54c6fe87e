"""The Python benchmarks run end to end at a tiny size: they call the package's
internals (the custom op's schema, forward_host, the native module), which
change with it, and no other test reaches them."""

import subprocess
import sys
from pathlib import Path

import pytest

BENCHES = Path(__file__).resolve().parents[2] / "benches"


def test_python_vs_sdpa_runs_every_layer_of_the_call():
    pytest.importorskip("torch")
    script = BENCHES / "python_vs_sdpa.py"
    args = ["--seqlens", "32", "--head-dims", "16", "--repeats", "1", "--warmup", "0"]
    run = subprocess.run(
        [sys.executable, str(script), *args, "--crossing-repeats", "2"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    for line in ("forward+backward", "the custom op flashattn::fwd alone", "inside Rust"):
        assert line in run.stdout, run.stdout
