"""``musegl serve --device cpu --tensor-parallel-size N`` through the HTTP API: the answers of 2 and
4 ranks are those of one, and a rank that dies is an error for the requests in flight and a
clean restart of the worker (fresh ranks), never a hang.

The demo checkpoint in float32 (4 query and 2 KV heads, its tiny projector) is served at
1, 2 and 4 ranks; each runs the speculation scenario of
:mod:`musegl_core.testing.speculation` (greedy and seeded sampling, stops, a batch of 8
with a seed each, a session over three turns, a cancelled stream and its session's next
turn, a rewind), a prefix snapshot reused by two sessions, and an image. Every response
must be identical to the one-rank server's. (Float32 weights: a rank's partial sums add
up to the whole product within float32 rounding. With f16 weights the CPU runs prompt rows
in float16 arithmetic, whose rounding depends on the split, and logits of 2 ranks differ
from one's by about 3e-4: greedy answers agree, a seeded draw can flip; docs/scaling.md.)
"""

from __future__ import annotations

import base64
import io
import json
import os
import signal
import time
from pathlib import Path

import attrs
import httpx
import numpy as np
import pytest
from PIL import Image

from musegl_core.config import ServeConfig
from musegl_core.testing.server import metric, running_server
from musegl_core.testing.speculation import chat, scenario

pytestmark = pytest.mark.slow

CASES = ["greedy0", "greedy1", "seeded0", "seeded1", "short0", "short1", "stop0", "stop1", "batch8", "session0",
         "session1", "session2", "after_cancel", "rewound", "snapshot", "image"]
SYSTEM = "You are a careful assistant. " * 12  # a shared prefix long enough to be snapshotted


def base_config() -> ServeConfig:
    from musegl_core.tiny import default_model_path, demo_mmproj_path

    model = str(default_model_path(file_type="f32"))
    return ServeConfig(model=model, mmproj=demo_mmproj_path(model), executor="torch-cpu", device="cpu", port=0,
                       max_context=1024, max_sessions=12, max_inflight_requests=8, max_decode_sequences=8,
                       prefix_cache_entries=4, max_vision_patches=256)


def image_message() -> list[dict]:
    rng = np.random.default_rng(5)
    buffer = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (84, 112, 3), dtype=np.uint8)).save(buffer, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": "What is this?"}]}]


def extra_cases(url: str) -> dict:
    out = {}
    first = chat(url, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "One."}],
                 session_id="snap-a")
    second = chat(url, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Two."}],
                  session_id="snap-b")
    out["snapshot"] = [first, second]
    out["image"] = chat(url, image_message(), max_tokens=8)
    return out


@pytest.fixture(scope="module")
def runs():
    stops: dict = {}
    results = {}
    for size in (1, 2, 4):
        extra = {"tensor_parallel_size": size} if size > 1 else {}
        with running_server(attrs.evolve(base_config(), extra=extra)) as server:
            results[size] = {**scenario(server.url, stops), **extra_cases(server.url)}
    return results


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("case", CASES)
def test_the_answers_are_the_one_rank_servers(runs, size, case):
    assert json.dumps(runs[size][case], sort_keys=True) == json.dumps(runs[1][case], sort_keys=True)


def test_the_second_session_read_the_snapshot(runs):
    second = runs[2]["snapshot"][1]
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def rank_pids(worker_pid: int) -> list[int]:
    """The rank processes: the worker's children spawned by multiprocessing (not its resource tracker)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == worker_pid and b"spawn_main" in cmdline and b"resource_tracker" not in cmdline:
            pids.append(int(entry.name))
    return sorted(pids)


def test_a_rank_killed_mid_request_fails_it_and_the_worker_restarts():
    config = attrs.evolve(base_config(), extra={"tensor_parallel_size": 2})
    sea = [{"role": "user", "content": "Write a few words about the sea."}]
    with running_server(config) as server:
        before = chat(server.url, sea)
        worker_pid = server.worker._proc.pid
        ranks = rank_pids(worker_pid)
        assert len(ranks) == 2
        body = {"model": "m", "messages": [{"role": "user", "content": "Tell me a long story."}],
                "max_tokens": 400, "temperature": 0, "stream": True, "ignore_eos": True}
        seen, error, started = 0, None, None
        with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=60) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    event = json.loads(line[6:])
                    if "error" in event:
                        error = event["error"]
                        break
                    seen += 1
                    if seen == 3:
                        os.kill(ranks[1], signal.SIGKILL)
                        started = time.monotonic()
        assert error is not None and seen < 400, "the stream must end with an error, not finish"
        assert time.monotonic() - started < 20
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # the worker exits; the front restarts it with fresh ranks
            if (metric(server.url, "musegl_worker_restarts") >= 1
                    and httpx.get(f"{server.url}/health", timeout=5).status_code == 200):
                break
            time.sleep(0.5)
        assert metric(server.url, "musegl_worker_restarts") == 1
        new_ranks = rank_pids(server.worker._proc.pid)
        assert len(new_ranks) == 2 and not set(new_ranks) & set(ranks)
        assert not any(Path(f"/proc/{pid}").exists() for pid in ranks)  # the survivor was stopped too
        assert chat(server.url, sea) == before
