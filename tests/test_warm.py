"""Warm runs of the model tests: ``tests/test_models.py`` (both loops, every model compared against
eager) runs in a fresh process on an empty cache directory, then again in a second fresh process
on the same directory. The second run must pass as the first did while taking its graphs from the
cache: a hit behaves exactly like a miss.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

TESTS = os.path.dirname(__file__)


def run_suite(cache_dir, stats_file) -> dict:
    env = {**os.environ, "FXRT_CACHE_DIR": str(cache_dir), "FXRT_STATS_FILE": str(stats_file)}
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "test_models.py"],
        cwd=TESTS,
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    with open(stats_file) as f:
        return json.load(f)


def test_model_tests_cold_then_warm(tmp_path):
    cold = run_suite(tmp_path / "cache", tmp_path / "cold.json")
    warm = run_suite(tmp_path / "cache", tmp_path / "warm.json")
    assert cold.get("stored", 0) > 0, cold
    assert warm.get("hit", 0) >= cold["stored"], (cold, warm)
    assert warm.get("rejected", 0) == 0, warm
    assert warm.get("compiled", 0) < cold.get("compiled", 0), (cold, warm)
