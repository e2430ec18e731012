"""Shared fixtures for the core's and the plugins' tests: tiny random Muse
Glimmer checkpoints built with transformers (see musegl_core/testing/reference_models.py),
and the plain server's run of the speculation scenario (musegl_core/testing/speculation.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path

# Under pytest-xdist each worker (and the servers and subprocesses it starts) gets its share of
# the cores for torch's intra-op threads, unless OMP_NUM_THREADS is set: two workers on two
# cores, each with a two-thread pool, ran torch-bound tests ~3x slower than one thread each
# (plugins/cuda/tests/test_stored_weights.py twice at once: 18.6 s vs 5.9 s). Tests of the
# thread count set it themselves (test_kernel_paths runs its products at 1 and 3 threads).
if "PYTEST_XDIST_WORKER_COUNT" in os.environ and "OMP_NUM_THREADS" not in os.environ:
    _cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    os.environ["OMP_NUM_THREADS"] = str(max(1, _cores // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))

import pytest

from musegl_core.testing.reference_models import TinyModel, build_tiny_model, tiny_tokenizer_data


@pytest.fixture(scope="session")
def tiny_hf(tmp_path_factory) -> TinyModel:
    """The reference model, saved as a Hugging Face directory (float32, one safetensors file)."""
    model = build_tiny_model()
    path = tmp_path_factory.mktemp("tiny_hf")
    model.save_pretrained(path)
    return TinyModel(model=model, path=path)


@pytest.fixture(scope="session")
def tiny_gguf(tiny_hf, tmp_path_factory) -> Path:
    """The GGUF (f32) twin of :func:`tiny_hf`, written with ``write_text_gguf``."""
    from musegl_core.checkpoint.gguf_writer import write_text_gguf
    from musegl_core.checkpoint.loader import load_checkpoint

    checkpoint = load_checkpoint(tiny_hf.path)
    path = tmp_path_factory.mktemp("tiny_gguf") / "model.gguf"
    write_text_gguf(path, checkpoint.config, dict(checkpoint.iter_weights()), tiny_tokenizer_data(),
                    file_type="f32", name="Tiny Muse Glimmer")
    return path


@pytest.fixture(scope="session")
def plain_speculation_run(tmp_path_factory) -> dict:
    """The speculation scenario and the seeded draws on a plain server (no speculator,
    :func:`~musegl_core.testing.speculation.scenario_config` on the demo checkpoint):
    ``results`` (the scenario's), ``draws``, ``stops`` (the stops the scenario picked, and
    ``"alone"``: the batch's requests one by one) and ``drafted_tokens`` (the server's
    drafting counter). Run once a test session: under pytest-xdist the first worker to
    ask runs it under a file lock in the run's shared temporary folder and the others
    read what it wrote. Read it; do not change it (it is shared)."""
    from filelock import FileLock

    from musegl_core.testing.server import running_server
    from musegl_core.testing.speculation import draft_metric, draws, scenario, scenario_config
    from musegl_core.tiny import default_model_path

    def run() -> dict:
        stops: dict = {}
        with running_server(scenario_config(str(default_model_path()))) as server:
            results = scenario(server.url, stops)
            return {"results": results, "draws": draws(server.url), "stops": stops,
                    "drafted_tokens": draft_metric(server.url, "spec_drafted_tokens")}

    if os.environ.get("PYTEST_XDIST_WORKER") is None:
        return json.loads(json.dumps(run()))  # as a worker reading the file sees it
    shared = tmp_path_factory.getbasetemp().parent / "plain_speculation_run.json"
    with FileLock(f"{shared}.lock"):
        if not shared.is_file():
            shared.write_text(json.dumps(run()))
        return json.loads(shared.read_text())
