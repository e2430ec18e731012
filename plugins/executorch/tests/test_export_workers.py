"""Lowering the methods in several processes (``musegl export --jobs``): a small
module's three methods exported and lowered through ExecuTorch for real, in one
process and in two (a forked worker hands its methods back through ExecuTorch's
edge-dialect serialization), must give the same ``.pte`` and ``.ptd`` bytes; a
method that fails in the worker ends the lowering with its traceback."""

from __future__ import annotations

import hashlib
import os

import pytest
import torch
from torch.export import Dim

from musegl_executorch.export.lower import OTHERS, _export, lower_method, prepare, to_program, write
from musegl_executorch.export.workers import STEPS, WorkerFailed, claim_order, lower_all

NAMES = ["forward_1", "forward_4", OTHERS]


class Small(torch.nn.Module):
    """Two linear layers around a softcap, as the head of the decoder."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.up = torch.nn.Linear(16, 32)
        self.down = torch.nn.Linear(32, 8, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 30.0 * torch.tanh(self.down(torch.relu(self.up(x))) / 30.0)


def export_small(module: Small, name: str) -> torch.export.ExportedProgram:
    if name == OTHERS:
        return _export(module, (torch.zeros(3, 16),), ({0: Dim("rows", min=1, max=64)},))
    return _export(module, (torch.zeros(int(name.removeprefix("forward_")), 16),), None)


def program_bytes(lowered, tmp_path, tag: str) -> tuple[str, str]:
    pte, ptd = write(to_program(lowered), tmp_path / tag)
    return hashlib.sha256(pte.read_bytes()).hexdigest(), hashlib.sha256(ptd.read_bytes()).hexdigest()


def test_two_processes_give_the_same_program(tmp_path):
    module = Small()
    prepare()
    with torch.no_grad():
        expected = module(torch.ones(4, 16))
    reports: list[tuple[str, int, int, str]] = []
    one = lower_all(NAMES, lambda name: export_small(module, name), lower_method, 1, tmp_path / "s1")
    two = lower_all(NAMES, lambda name: export_small(module, name), lower_method, 2, tmp_path / "s2",
                    lambda *report: reports.append(report))
    assert list(one) == list(two) == NAMES  # the program's order, whoever lowered them
    assert program_bytes(one, tmp_path, "one") == program_bytes(two, tmp_path, "two")
    finished = {r[0]: r[3] for r in reports if r[1] == r[2] == STEPS}
    assert set(finished) == set(NAMES)
    assert any(what.endswith("(worker 1)") for what in finished.values())  # the worker lowered some
    assert not any((tmp_path / "s2").iterdir())  # the handed-back files are gone

    from executorch.runtime import Runtime

    program = Runtime.get().load_program(tmp_path / "two" / "model.pte", data_path=tmp_path / "two" / "model.ptd")
    got = program.load_method("forward_4").execute([torch.ones(4, 16)])[0]
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_a_failure_in_the_worker_names_the_method(tmp_path):
    module = Small()
    parent = os.getpid()

    def export(name: str) -> torch.export.ExportedProgram:
        if os.getpid() != parent:
            raise ValueError(f"no {name} here")
        return export_small(module, name)

    with pytest.raises(WorkerFailed) as failed:
        lower_all(NAMES, export, lower_method, 2, tmp_path / "s")
    message = str(failed.value)
    assert "failed in the worker 1 process" in message and "ValueError: no forward_" in message


def test_claim_order_takes_the_costliest_first():
    names = ["forward_1", "forward_8", "forward_others", "embed_text", "forward_from_embeddings",
             "vision_encoder", "draft_context", "draft_block"]
    assert claim_order(names) == ["forward_others", "forward_from_embeddings", "draft_block", "forward_8",
                                  "forward_1", "vision_encoder", "draft_context", "embed_text"]
