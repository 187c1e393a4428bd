"""The scheduler service is CPU-only: importing any of its modules must not pull in torch.

Runs in a fresh interpreter (this test process may already have torch loaded) and walks
the package, so modules added later are covered without editing this test.
"""
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

PROBE = r"""
import importlib, pkgutil, sys
import scheduler_service

names = [m.name for m in pkgutil.walk_packages(scheduler_service.__path__, "scheduler_service.")
         if m.name.rsplit(".", 1)[-1] != "__main__"]
for name in names:
    importlib.import_module(name)
    if "torch" in sys.modules:
        sys.exit(f"importing {name} imported torch")
print(len(names), "modules:", " ".join(names))
"""


def test_scheduler_service_never_imports_torch():
    proc = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr + proc.stdout
    assert "scheduler_service.scheduler" in proc.stdout  # the walk found the package's modules
