"""`make demo` / `make serve` code paths: client.demo drives scheduler_service.launch,
which starts the workers (TP=1 and TP=2 over gloo) and the scheduler as processes,
streams one chat answer and shuts everything down."""
import os
import subprocess
import sys

import pytest

from services import ROOT
from tiny_checkpoint import tiny_qwen3_dir

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("tp", [1, 2])
def test_demo_streams_an_answer_and_shuts_down(tmp_path_factory, tp):
    model = tiny_qwen3_dir(tmp_path_factory, vocab_size=389, seed=5)
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "client.demo", "--model", str(model), "--device", "cpu",
         "--tp", str(tp), "--max-tokens", "12", "--prompt", "hello there",
         "--startup-timeout", "120"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert ">>> hello there" in proc.stdout
    # the stats line: how many tokens came back (eos may end it early, never more than 12)
    line = next(l for l in proc.stderr.splitlines() if " tokens in " in l)
    n = int(line.split("[", 1)[1].split()[0])
    assert 1 <= n <= 12, line
    assert f"scheduler + {tp} worker(s)" in proc.stderr


def test_client_cli_dispatches_bench():
    out = subprocess.run([sys.executable, "-m", "client", "bench", "--help"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "--in-process" in out.stdout and "--request-rate" in out.stdout


def test_launch_help_and_bad_tp():
    out = subprocess.run([sys.executable, "-m", "scheduler_service.launch", "--help"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "--tp" in out.stdout
    bad = subprocess.run([sys.executable, "-m", "scheduler_service.launch", "--model", "x",
                          "--tp", "0"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--tp must be >= 1" in bad.stderr


def test_make_serve_passes_its_variables_to_the_launcher():
    """`make serve`'s recipe (make -n: printed, not run) reaches the launcher's scheduler
    command with HTTP_PORT, ADAPTER_ROOT and SCHED_ARGS."""
    import shlex

    from scheduler_service.launch import commands, parse_args
    out = subprocess.run(["make", "-n", "serve", "MODEL=/m", "TP=2", "HTTP_PORT=8000",
                          "ADAPTER_ROOT=/srv/adapters",
                          "SCHED_ARGS=--max-num-seqs 7 --fast-forward"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    recipe = out.stdout.replace("\\\n", " ")
    line = next(l for l in recipe.splitlines() if "scheduler_service.launch" in l)
    argv = shlex.split(line)
    args = parse_args(argv[argv.index("scheduler_service.launch") + 1:])
    assert args.tp == 2 and args.http_port == 8000
    sched = commands(args)[-1]
    assert sched[-3:] == ["--max-num-seqs", "7", "--fast-forward"]
    at = sched.index("--adapter-root")
    assert sched[at + 1] == "/srv/adapters"
