"""`expresslane serve` flags, start-up errors, and import hygiene of the offline package."""

from __future__ import annotations

import subprocess
import sys


def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "expresslane.cli.main", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_serve_help_has_server_and_engine_flags():
    out = cli("serve", "--help").stdout
    for flag in ("--host", "--port", "--api-key", "--served-model-name", "--max-waiting-requests",
                 "--max-waiting-tokens", "--request-timeout", "--shutdown-timeout", "--max-num-batched-tokens",
                 "--scheduling-policy", "--num-kv-blocks", "--enable-prefix-caching"):
        assert flag in out, flag


def test_offline_imports_stay_free_of_server_dependencies():
    code = ("import sys, expresslane, expresslane.cli.main as m; m.build_parser(); "
            "from expresslane import LLM; import expresslane.entrypoint; "
            "bad = [x for x in ('fastapi', 'uvicorn', 'zmq', 'starlette', 'prometheus_client') if x in sys.modules]; "
            "print(bad); sys.exit(1 if bad else 0)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr


def test_bad_flags_and_missing_model_exit_with_a_message(tmp_path):
    res = cli("serve", "--max-waiting-requests", "0")
    assert res.returncode == 2 and "--max-waiting-requests must be positive" in res.stderr
    res = cli("serve", str(tmp_path / "missing"), "--port", "0")
    assert res.returncode == 1 and "does not exist" in res.stderr


def test_serve_without_the_server_extra_says_how_to_install_it():
    """A machine without uvicorn (simulated: its import fails) gets the install command, not a traceback."""
    code = ("import sys, importlib.abc\n"
            "class NoServer(importlib.abc.MetaPathFinder):\n"
            "    def find_spec(self, name, path, target=None):\n"
            "        if name.split('.')[0] == 'uvicorn':\n"
            "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
            "sys.meta_path.insert(0, NoServer())\n"
            "from expresslane.cli.main import main\n"
            "sys.exit(main(['serve']))\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 1, res.stderr
    assert "pip install 'expresslane[server]'" in res.stderr and 'pip install -e ".[server]"' in res.stderr
    assert "'uvicorn'" in res.stderr and "Traceback" not in res.stderr
