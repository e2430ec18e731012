"""``benchmarks/kv_restore.py`` end to end at a tiny size on the CPU (the CLI the GPU run uses
with ``--device cuda --layers N``): its JSON-lines file holds the setup, both engines and the
ratio; the host engine's next turn comes back whole from the host tier, the recompute engine's
does not, and both give the same first token."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "kv_restore.py"


def run(tmp_path: Path, *flags: str) -> list[dict]:
    out = tmp_path / "kv_restore.jsonl"
    done = subprocess.run([sys.executable, str(SCRIPT), *flags, "--out", str(out)], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")] == lines
    return lines


def check(lines: list[dict], tokens: int) -> None:
    setup, host, recompute, ratio = lines
    assert setup["figure"] == "setup" and setup["tokens"] == tokens
    assert (host["engine"], recompute["engine"]) == ("host", "recompute")
    assert host["kv_offload_memory"] > 0 and recompute["kv_offload_memory"] == 0
    (restored,), (recomputed,) = host["runs"], recompute["runs"]
    assert restored["cached_tokens"] >= tokens and restored["restores"] == 1
    assert restored["host_hit_tokens"] >= tokens and restored["restored_blocks"] > 0
    assert recomputed["cached_tokens"] < tokens and recomputed["restores"] == 0
    assert ratio["figure"] == "ratio" and ratio["restored_all"] is True and ratio["same_first_token"] is True
    assert ratio["ratio"] == round(restored["next_turn_ttft_s"] / recomputed["next_turn_ttft_s"], 4)


def test_the_tiny_model_on_the_cpu(tmp_path):
    check(run(tmp_path, "--tokens", "256", "--turn", "8"), 256)  # (8 spare blocks: less would not push)


@pytest.mark.slow
def test_dummy_weights_fp8_kv_and_sliding_pages(tmp_path):
    """The dummy-weight path of the CUDA run (gpu_decode's tiny shape here), with FP8 KV and
    sliding pages, where four sessions push the first off the device."""
    lines = run(tmp_path, "--tiny", "--tokens", "200", "--turn", "8", "--kv-cache-dtype", "fp8",
                "--sliding-window-kv", "--pushers", "4")
    check(lines, 200)
    assert lines[0]["model"] == "muse-glimmer-tiny-4l" and lines[0]["kv_cache_dtype"] == "fp8"
    assert len(lines[1]["runs"][0]["pusher_prefill_s"]) == 4
