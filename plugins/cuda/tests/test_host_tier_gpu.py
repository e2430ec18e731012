"""The host tier (``--kv-offload-memory``) of the torch executor on CUDA, and the same checks on
the CPU where they apply (``device`` is a parameter: the ``cuda`` cases are marked ``gpu`` and
skipped without a GPU; run them with
``python -m pytest -q -m gpu plugins/cuda/tests/test_host_tier_gpu.py -n 0``).

* Named sessions under device-pool pressure move down to host pages and come back with the same
  answers and the same positions reused as on an unconstrained engine, with bf16-sized K/V and
  with FP8 K/V (float8 e4m3 host pages); on CUDA the host pages are pinned and the copies run on
  the executor's side stream.
* The copies run beside the steps: a restore queued behind a busy side stream does not hold up
  a step of another sequence, and a step that reads the restored pages waits for them (the
  compute stream waits for the copy's event) and reads exactly what was offloaded.
* An offload issued right after a step wrote a page copies what the step wrote (the side stream
  waits for the compute stream), and a copy larger than one staging batch
  (:data:`musegl_cuda.host_kv.STAGE_BYTES`) moves every byte.

The model is the GPU tests' float32 GGUF (8 layers, hidden 512, head_dim 64:
``gpu_checkpoint_support.py``), float32 activations on both devices (greedy ids then do not hang
on bf16 rounding).
"""

from __future__ import annotations

import pytest
from gpu_checkpoint_support import write_gpu_checkpoint

torch = pytest.importorskip("torch")

from musegl_core.checkpoint.loader import load_checkpoint  # noqa: E402
from musegl_core.engine.engine import Engine, EngineConfig  # noqa: E402
from musegl_core.engine.executor import SeqChunk, Step  # noqa: E402
from musegl_core.tokenizer import MuseTokenizer  # noqa: E402
from musegl_cuda import host_kv  # noqa: E402
from musegl_cuda.executor import TorchExecutor  # noqa: E402
from test_host_tier import BLOCK, agents  # noqa: E402  (the same conversation as the CPU test)

ON_GPU = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
CUDA = pytest.param("cuda", marks=ON_GPU)
#: decode graph widths on CUDA (the conversation decodes up to 2 sequences side by side)
GRAPH_SIZES = (1, 2, 4)


@pytest.fixture(scope="module")
def checkpoint_path(tmp_path_factory):
    return write_gpu_checkpoint(tmp_path_factory.mktemp("gpu_host_tier"))


@pytest.fixture(scope="module")
def tokenizer(checkpoint_path):
    return MuseTokenizer.load(str(checkpoint_path))


def make_executor(path, device: str, kv: str = "auto", graphs: bool = True) -> TorchExecutor:
    sizes = {"forward_sizes": GRAPH_SIZES if graphs else ()} if device == "cuda" else {}
    return TorchExecutor(load_checkpoint(str(path)), device=device, dtype="float32", block_size=BLOCK,
                         kv_cache_dtype=kv, **sizes)


def raw(kv: torch.Tensor) -> torch.Tensor:
    """The cache as bytes (indexing float8 is not implemented everywhere)."""
    return kv.view(torch.uint8)


def engine_for(path, tokenizer, device: str, kv: str, *, blocks: int, host: int) -> tuple[Engine, list]:
    events: list = []
    config = EngineConfig(max_context=256, max_sessions=6, max_inflight_requests=4, max_decode_sequences=4,
                          max_prefill_chunk=32, kv_blocks=blocks, kv_offload_memory=host)
    return Engine(make_executor(path, device, kv), tokenizer, config, events.append), events


@pytest.mark.parametrize(("device", "kv"), [
    pytest.param("cpu", "fp8", marks=pytest.mark.slow),  # (the CPU's float32 K/V: test_host_tier.py)
    pytest.param("cuda", "auto", marks=ON_GPU),
    pytest.param("cuda", "fp8", marks=ON_GPU),
])
def test_offloaded_sessions_answer_as_on_an_unconstrained_engine(checkpoint_path, tokenizer, device, kv):
    roomy, roomy_events = engine_for(checkpoint_path, tokenizer, device, kv, blocks=400, host=0)
    tight, tight_events = engine_for(checkpoint_path, tokenizer, device, kv, blocks=32, host=4 << 20)
    try:
        assert roomy.host is None and tight.host is not None
        expected = agents(roomy, roomy_events)
        got = agents(tight, tight_events)
        assert got == expected  # the same ids, and the same positions reused
        assert all(cached > 40 for rid, (_, cached) in expected.items() if rid[-1] in "123")
        stats = tight.stats()
        assert stats["kv_host_offloads"] >= 8 and stats["kv_restores"] >= 8
        assert stats["kv_tier_hit_tokens_host"] > 8 * 40
        pages = tight.executor.host_pages
        assert pages.host.dtype == tight.executor.kv.dtype  # float8 e4m3 pages with FP8 K/V
        assert pages.host.dtype == (torch.float8_e4m3fn if kv == "fp8" else torch.float32)
        if device == "cuda":
            assert pages.host.is_pinned() and pages.host.device.type == "cpu"
            assert pages.stream is not None and pages.stream != torch.cuda.current_stream()
            assert tight.executor.graphs is not None  # decode steps replayed graphs beside the copies
        else:
            assert pages.stream is None
    finally:
        roomy.executor.close()
        tight.executor.close()


def prefill(ex, seq: int, prompt: list[int], table: list[int], want_logits: bool = False):
    return ex.step(Step([SeqChunk(seq, prompt, list(range(len(prompt))), table, sample=1,
                                  want_logits=want_logits)]))


def decode(ex, seq: int, token: int, position: int, table: list[int]):
    """One decode row (a width the graphs captured): its id and logits."""
    out = ex.step(Step([SeqChunk(seq, [token], [position], table, sample=1, want_logits=True)]))
    return out.tokens[seq][-1], out.logits[seq].float().cpu()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kv", ["auto", "fp8"])
def test_a_restore_runs_beside_the_steps_and_the_step_that_reads_it_waits(checkpoint_path, kv):
    ex = make_executor(checkpoint_path, "cuda", kv)
    try:
        ex.allocate_kv(64)
        ex.allocate_host_kv(16)
        gen = torch.Generator().manual_seed(3)
        prompt = torch.randint(3, 4000, (22,), generator=gen).tolist()  # 6 pages of 4 (the last partly)
        other = torch.randint(3, 4000, (22,), generator=gen).tolist()
        original, restored, beside = list(range(0, 8)), list(range(10, 18)), list(range(20, 28))
        first = prefill(ex, 0, prompt, original).tokens[0][-1]
        prefill(ex, 1, other, beside)  # (the shapes the step beside the copy runs: compiled now)
        ex.offload_pages([(page, page) for page in range(6)])
        ex.host_pages.settle()

        stream = ex.host_pages.stream
        with torch.cuda.stream(stream):  # the side stream busy for about a second or more
            torch.cuda._sleep(2_000_000_000)
        ex.restore_pages([(page, restored[page]) for page in range(6)])  # queued behind the sleep
        prefill(ex, 1, other, beside)  # another sequence's step: done while the copy still waits
        assert not ex.host_pages._event.query(), "the step waited for the side stream's copy"

        got = decode(ex, 0, first, len(prompt), restored)  # reads the restored pages: waits for them
        assert ex.host_pages._event.query()
        expected = decode(ex, 0, first, len(prompt), original)  # the pages the K/V were offloaded from
        assert got[0] == expected[0]
        assert torch.equal(got[1], expected[1])  # the same bytes, the same kernels: the same logits
        assert torch.equal(raw(ex.kv)[:, :, restored[:6]], raw(ex.kv)[:, :, original[:6]])
    finally:
        ex.close()


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_an_offload_right_after_a_write_copies_what_was_written(checkpoint_path, device):
    ex = make_executor(checkpoint_path, device, graphs=False)
    try:
        ex.allocate_kv(16)
        ex.allocate_host_kv(4)
        with torch.inference_mode():
            if device == "cuda":
                torch.cuda._sleep(500_000_000)  # the compute stream busy: the write lands late
            ex.kv[:, :, 3] = 7.0  # a write on the compute stream, as a step's
            ex.offload_pages([(3, 1)])
        data = ex.read_host_pages([1])  # (waits for the copy on the host)
        page = torch.frombuffer(bytearray(data), dtype=torch.float32)
        assert page.numel() == ex.kv[:, :, 3].numel() and bool((page == 7.0).all())
    finally:
        ex.close()


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("kv", ["auto", "fp8"])
def test_copies_of_many_pages_in_small_staging_batches_move_every_byte(checkpoint_path, device, kv, monkeypatch):
    """Offload 24 pages into scattered and consecutive host pages and restore them elsewhere, with
    staging batches of 5 pages (CUDA; the CPU copies at once), then through the bytes the disk
    tier reads and writes."""
    ex = make_executor(checkpoint_path, device, kv, graphs=False)
    try:
        ex.allocate_kv(80)
        ex.allocate_host_kv(40)
        page_bytes = ex.host_pages.host[0].numel() * ex.host_pages.host.element_size()
        monkeypatch.setattr(host_kv, "STAGE_BYTES", 5 * page_bytes)
        assert ex.host_pages._per_batch() == 5
        gen = torch.Generator().manual_seed(9)
        with torch.inference_mode():
            ex.kv[:, :, :24] = torch.randn(ex.kv[:, :, :24].shape, generator=gen).to(ex.device).to(ex.kv.dtype)
        source = raw(ex.kv)[:, :, :24].clone()
        hosts = [0, 1, 2, 3, 9, 7, 8, 20, 21, 22, 23, 24, 30, 11, 12, 13, 14, 15, 16, 17, 33, 35, 36, 37]
        ex.offload_pages(list(zip(range(24), hosts)))
        targets = list(range(40, 64))[::-1]
        ex.restore_pages(list(zip(hosts, targets)))
        ex.host_pages.await_pages(targets)
        assert torch.equal(raw(ex.kv)[:, :, targets], source)
        data = ex.read_host_pages(hosts[:6])
        ex.write_host_pages([38, 39, 34, 31, 32, 25], data)
        ex.restore_pages(list(zip([38, 39, 34, 31, 32, 25], range(70, 76))))
        ex.host_pages.await_pages(range(70, 76))
        assert torch.equal(raw(ex.kv)[:, :, 70:76], source[:, :, :6])
    finally:
        ex.close()
