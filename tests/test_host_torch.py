"""Set-up's choice of torch (worker_service/host_torch.py) against a faked host.

The host is faked where the script looks: a `nvidia-smi` on PATH that lists a GPU (or
fails as it does on a machine without one), and a "system Python" whose `import torch`
finds a fake package reporting a CUDA or CPU build. The real script runs as a process,
as the Makefile runs it.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "worker_service" / "host_torch.py"
sys.path.insert(0, str(ROOT / "worker_service"))
import host_torch  # noqa: E402  (standard library only, like the Makefile's call)


def fake_python(tmp: Path, cuda: str | None, triton: str | None = "3.6.0") -> str:
    """An executable that runs this Python with a fake torch (and triton) importable."""
    site = tmp / "site"
    (site / "torch").mkdir(parents=True)
    (site / "torch" / "__init__.py").write_text(
        f"__version__ = '2.11.0{'+cu130' if cuda else '+cpu'}'\n"
        f"class version:\n    cuda = {cuda!r}\n")
    if triton:
        (site / "triton").mkdir()
        (site / "triton" / "__init__.py").write_text(f"__version__ = {triton!r}\n")
    exe = tmp / "python3"
    exe.write_text(f"#!/bin/sh\nPYTHONPATH={site} exec {sys.executable} \"$@\"\n")
    exe.chmod(0o755)
    return str(exe)


def fake_bin(tmp: Path, gpus: bool) -> Path:
    """A PATH folder whose nvidia-smi lists one H100, or fails as without a GPU."""
    bin_dir = tmp / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0)'\n" if gpus else
                   "#!/bin/sh\necho 'NVIDIA-SMI has failed because it could not communicate "
                   "with the NVIDIA driver.'\nexit 9\n")
    smi.chmod(0o755)
    return bin_dir


def choice(python: str, path: str) -> str:
    out = subprocess.run([sys.executable, str(SCRIPT), "--python", python, "--print-choice"],
                         capture_output=True, text=True, env=dict(os.environ, PATH=path),
                         check=True)
    return out.stdout.split(":")[0]


@pytest.mark.parametrize("system, gpus, expected", [
    ("cuda", True, "system"),    # a GPU image's torch is kept, nothing downloaded
    ("cuda", False, "system"),   # (a CUDA torch without a visible GPU: still the host's)
    ("cpu", True, "cuda"),       # a CPU torch on a GPU host is not reused
    (None, True, "cuda"),
    ("cpu", False, "cpu"),
    (None, False, "cpu"),
    (None, None, "cpu"),         # no nvidia-smi at all
])
def test_choice_follows_the_host(tmp_path, system, gpus, expected):
    python = fake_python(tmp_path, "13.0" if system == "cuda" else None) if system else \
        str(tmp_path / "no-python")
    path = "/usr/bin:/bin"
    if gpus is not None:
        path = f"{fake_bin(tmp_path, gpus)}:{path}"
    assert choice(python, path) == expected


def test_system_torch_venv_sees_it_and_pins_its_versions(tmp_path):
    """The venv imports the host Python's torch and triton (here a fake CUDA build that
    only that Python sees) and pins exactly their versions, so installing the project
    cannot replace them."""
    python = fake_python(tmp_path, "13.0")
    venv = tmp_path / "venv"
    env = dict(os.environ, PATH=f"{fake_bin(tmp_path, True)}:/usr/bin:/bin")
    subprocess.run([sys.executable, str(SCRIPT), "--python", python, "--venv", str(venv)],
                   check=True, env=env, capture_output=True)
    assert (venv / "constraints.txt").read_text().split() == ["torch==2.11.0", "triton==3.6.0"]
    seen = subprocess.run([str(venv / "bin" / "python"), "-c",
                           "import torch, triton; print(torch.version.cuda, triton.__version__)"],
                          capture_output=True, text=True, check=True, env={"PATH": "/usr/bin:/bin"})
    assert seen.stdout.split() == ["13.0", "3.6.0"]


def test_install_commands(tmp_path):
    pip = ["py", "-m", "pip", "install"]
    assert host_torch.install_command("cuda", pip, "torch==2.13.0", "https://idx") == \
        pip + ["torch==2.13.0"]
    # A CPU build only from the CPU index unless pip's configuration already finds one;
    # an empty index means pip's configuration alone.
    cmd = host_torch.install_command("cpu", pip, "torch==2.13.0", "")
    assert cmd == pip + ["--no-deps", "torch==2.13.0"]
    (tmp_path / "c.txt").write_text("# note\ntorch==2.13.0  # why\ntriton==3.7.1\n")
    assert host_torch.pinned(tmp_path / "c.txt", "torch") == "torch==2.13.0"
    assert host_torch.pinned(tmp_path / "c.txt", "triton") == "triton==3.7.1"


def test_repo_pins_carry_no_local_labels():
    """A pin such as torch==X+cpu is on no public index (PyPI refuses local labels)."""
    pins = [line.split("#")[0].strip() for line in (ROOT / "constraints.txt").read_text().splitlines()]
    assert [p for p in pins if p] and not [p for p in pins if "+" in p]
