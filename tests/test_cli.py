"""The command line as a user runs it: a fresh cache, the built-in default model."""

import json
import os
import subprocess
import sys


def run_cli(*args, env_extra=None, check=True):
    env = {**os.environ, **(env_extra or {})}
    return subprocess.run([sys.executable, "-m", "expresslane.cli.main", *args], capture_output=True, text=True,
                          env=env, check=check, timeout=300)


def test_generate_on_builtin_default_model(tmp_path):
    res = run_cli("generate", "--prompt", "Hello, world", "--max-tokens", "8", "--ignore-eos",
                  env_extra={"EXPRESSLANE_CACHE": str(tmp_path)})
    assert res.stdout.strip(), "a completion is printed"
    assert "8 tokens" in res.stderr and "ttft" in res.stderr
    assert not any(tmp_path.iterdir())  # the default model ships with the package: nothing is built


def test_generate_with_flags_n_and_chat(tmp_path):
    res = run_cli("generate", "--prompt", "hi", "--chat", "-n", "2", "--temperature", "1.0", "--sampling-seed", "3",
                  "--max-tokens", "4", "--max-num-batched-tokens", "8", "--no-enable-prefix-caching",
                  env_extra={"EXPRESSLANE_CACHE": str(tmp_path)})
    assert res.stdout.count("--- completion") == 2


def test_make_model_then_generate(tmp_path):
    run_cli("make-model", "tiny", str(tmp_path / "m"), "--seed", "5")
    assert json.loads((tmp_path / "m" / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    res = run_cli("generate", str(tmp_path / "m"), "--prompt", "abc", "--max-tokens", "3", "--ignore-eos")
    assert "[3 tokens" in res.stderr  # the directory's model generated


def test_clear_error_exit_code(tmp_path):
    res = run_cli("generate", str(tmp_path / "missing"), "--prompt", "x", check=False)
    assert res.returncode == 2 and "does not exist" in res.stderr
    res = run_cli("generate", "--prompt", "x", "--max-tokens", "0", check=False,
                  env_extra={"EXPRESSLANE_CACHE": str(tmp_path)})
    assert res.returncode == 2 and "max_tokens" in res.stderr
