"""musegl's MLX executor vs mlx-lm on the same checkpoint, in one run.

Both sides load the same Hugging Face directory (bfloat16 safetensors,
written here from the bench GGUF: mlx-lm reads no GGUF) on the same MLX.
musegl runs its defaults: on Linux that is float32 on OpenBLAS
(``musegl_mlx.blas``; MLX's CPU wheel ships the reference BLAS). So that the
figures also show what that routing alone is worth, a third side,
``mlx_lm_f32_openblas``, runs mlx-lm on a float32 twin of the directory with
the same routing (``--no-routed-baseline`` leaves it out):

* **batch 1, in process**: musegl's engine over the MLX executor (what
  ``musegl generate --executor mlx`` runs) against ``mlx_lm.stream_generate``:
  one greedy prompt, decode tokens per second (tokens after the first over the
  time after the first, so prefill is out of it);
* **servers**: ``musegl serve --executor mlx`` against ``mlx_lm.server``
  (``/v1/completions``, greedy, the same text prompts), at concurrency 1 and
  at concurrency 4: aggregate completion tokens per second over the wall time.

Prints one JSON object (``--out FILE`` also writes it). Goals from issue 13:
musegl/mlx-lm >= 1.0x at batch 1 and >= 2x at concurrency 4.
Needs ``pip install 'mlx-lm>=0.32,<0.33'`` (the ``bench`` extra of plugins/mlx).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator

import httpx

from common import bench_checkpoint, free_port, serve, server_process

PROMPT = ("The lighthouse keeper counted the ships that passed in the night and wrote each name "
          "into a ledger that nobody had opened for years; ")


def hf_twin(gguf: Path, out: Path, dtype: str = "bfloat16") -> Path:
    """Write ``gguf``'s text decoder as a Hugging Face directory both sides can load:
    config.json (``muse_glimmer`` with a ``text_config``), safetensors in ``dtype`` under
    transformers names, and the tokenizer beside the GGUF."""
    import numpy as np
    import torch
    from safetensors.torch import save_file

    from musegl_core.checkpoint.loader import load_checkpoint

    if (out / "config.json").is_file():
        return out
    out.mkdir(parents=True, exist_ok=True)
    checkpoint = load_checkpoint(gguf)
    c = checkpoint.config
    text = {
        "model_type": "muse_glimmer_text", "vocab_size": c.vocab_size, "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size, "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim,
        "sliding_window": c.sliding_window,
        "layer_types": ["sliding_attention" if s else "full_attention" for s in c.sliding],
        "layer_rope_theta": [c.rope_theta if r else 0 for r in c.rope],
        "rope_parameters": {"rope_type": "default", "rope_theta": c.rope_theta},
        "rms_norm_eps": c.rms_norm_eps, "post_norm_eps": c.post_norm_eps, "qk_scale_factor": c.qk_scale_factor,
        "output_multiplier": c.output_multiplier, "final_logit_softcapping": c.final_logit_softcapping,
        "max_position_embeddings": c.max_position_embeddings, "bos_token_id": c.bos_token_id,
        "eos_token_id": list(c.eos_token_ids) or None, "tie_word_embeddings": False,
        "hidden_activation": "silu",
    }
    config = {"model_type": "muse_glimmer", "architectures": ["MuseGlimmerForConditionalGeneration"],
              "text_config": text, "torch_dtype": dtype}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    tensors = {}
    for name, array in checkpoint.iter_weights():
        key = "lm_head.weight" if name == "lm_head.weight" else f"model.language_model.{name}"
        tensors[key] = torch.from_numpy(np.ascontiguousarray(array)).to(getattr(torch, dtype))
    checkpoint.close()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    tokenizer = gguf.parent / "tokenizer.json"
    (out / "tokenizer.json").write_bytes(tokenizer.read_bytes())
    (out / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    return out


def decode_rate(stamps: list[float]) -> float:
    """Tokens after the first over the time after the first."""
    return (len(stamps) - 1) / (stamps[-1] - stamps[0]) if len(stamps) > 1 else float("nan")


def musegl_batch1(model: Path, max_tokens: int) -> float:
    from musegl_core.config import ServeConfig
    from musegl_core.engine import events as ev
    from musegl_core.engine.engine import Engine, EngineConfig
    from musegl_core.engine.executor import SamplingParams
    from musegl_core.engine.request import GenerateRequest, PromptSegment
    from musegl_core.worker.loading import load
    from musegl_core.worker.prepare import prepare

    tokenizer, executor, _ = load(ServeConfig(model=str(model), executor="mlx"))
    stamps: list[float] = []

    def on_event(event) -> None:
        if isinstance(event, ev.Tokens):
            stamps.extend(time.perf_counter() for _ in event.ids)

    best = 0.0
    for run in range(2):  # the first run warms up
        stamps.clear()
        request = GenerateRequest(id=f"b1-{run}", prompt=(PromptSegment(text=PROMPT),), max_tokens=max_tokens,
                                  sampling=SamplingParams(temperature=0.0), ignore_eos=True, add_bos=False)
        prepared = prepare(request, tokenizer)
        engine = Engine(executor, tokenizer, EngineConfig(max_context=len(prepared.prompt_ids) + max_tokens + 1,
                                                          max_inflight_requests=1), on_event)
        engine.submit(prepared)
        engine.run_until_idle()
        best = decode_rate(stamps)
    executor.close()
    return best


def mlx_lm_batch1(model: Path, max_tokens: int) -> float:
    from mlx_lm import load, stream_generate
    from mlx_lm.sample_utils import make_sampler

    lm, tokenizer = load(str(model))
    rate = 0.0
    for _ in range(2):  # the first run warms up
        stamps = []
        for _response in stream_generate(lm, tokenizer, PROMPT, max_tokens=max_tokens,
                                         sampler=make_sampler(temp=0.0)):
            stamps.append(time.perf_counter())
        rate = decode_rate(stamps)
    return rate


#: ``python -c`` program: mlx-lm's CLI with MLX's BLAS routed to OpenBLAS first.
ROUTED_MLX_LM = ("import runpy, sys; from musegl_mlx import blas; status = blas.route(); "
                 "assert status.routed, status.reason; sys.argv[0] = 'mlx_lm'; "
                 "runpy.run_module('mlx_lm', run_name='__main__')")


@contextlib.contextmanager
def mlx_lm_server(model: Path, routed: bool = False, ready_timeout: float = 600.0) -> Iterator[str]:
    port = free_port()
    launcher = ["-c", ROUTED_MLX_LM] if routed else ["-m", "mlx_lm"]
    command = [sys.executable, *launcher, "server", "--model", str(model), "--port", str(port),
               "--temp", "0", "--log-level", "WARNING"]
    print(f"$ mlx_lm.server{' (routed BLAS)' if routed else ''} " + " ".join(command[4:]), file=sys.stderr)
    with server_process(command, port, name="mlx_lm.server", health="/v1/models",
                        ready_timeout=ready_timeout) as (url, _):
        yield url


async def _load(url: str, model: str, concurrency: int, requests: int, max_tokens: int) -> dict:
    """``requests`` completions, ``concurrency`` at a time: aggregate completion tok/s."""
    queue = list(range(requests))
    tokens = errors = 0

    async def client(http: httpx.AsyncClient) -> None:
        nonlocal tokens, errors
        while queue:
            i = queue.pop()
            body = {"model": model, "prompt": f"{i}: {PROMPT}", "max_tokens": max_tokens, "temperature": 0,
                    "ignore_eos": True, "stream": False}
            r = await http.post(f"{url}/v1/completions", json=body)
            if r.status_code != 200:
                errors += 1
                continue
            tokens += int(r.json().get("usage", {}).get("completion_tokens") or 0)

    async with httpx.AsyncClient(timeout=1800) as http:
        warm = {"model": model, "prompt": PROMPT, "max_tokens": 4, "temperature": 0}
        await http.post(f"{url}/v1/completions", json=warm)
        start = time.perf_counter()
        await asyncio.gather(*[client(http) for _ in range(concurrency)])
        wall = time.perf_counter() - start
    return {"completion_tokens": tokens, "wall_s": round(wall, 3), "tok_s": tokens / wall if wall else 0.0,
            "errors": errors}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=None,
                   help="a GGUF (default: the bench preset, as benchmarks/README.md describes)")
    p.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "musegl-mlx-compare")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--requests-per-client", type=int, default=2)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    p.add_argument("--no-routed-baseline", action="store_true",
                   help="leave out mlx-lm on float32 with MLX's BLAS routed to OpenBLAS")
    args = p.parse_args()
    from musegl_mlx import blas

    routing = blas.route()  # before MLX is imported, as musegl's executor does it
    import mlx.core as mx
    import mlx_lm

    gguf = args.model or bench_checkpoint()
    model = hf_twin(gguf, args.workdir / f"hf-{gguf.parent.name}")
    routed_baseline = routing.routed and not args.no_routed_baseline
    model_f32 = hf_twin(gguf, args.workdir / f"hf-f32-{gguf.parent.name}", "float32") if routed_baseline else None
    figures: dict = {
        "machine": f"{platform.system()} {platform.machine()}, {os.cpu_count()} cpus",
        "mlx": mx.__version__, "mlx_lm": mlx_lm.__version__,
        "device": "metal" if mx.metal.is_available() else "cpu",
        "blas": f"OpenBLAS ({routing.library})" if routing.routed else f"MLX's own ({routing.reason})",
        "model": str(model), "max_tokens": args.max_tokens,
    }
    figures["batch1_decode_tok_s"] = {"musegl": musegl_batch1(model, args.max_tokens),
                                      "mlx_lm": mlx_lm_batch1(model, args.max_tokens)}
    if model_f32 is not None:
        figures["batch1_decode_tok_s"]["mlx_lm_f32_openblas"] = mlx_lm_batch1(model_f32, args.max_tokens)
    servers = {}
    flags = ("--executor", "mlx", "--max-decode-sequences", str(args.concurrency), "--max-inflight-requests",
             str(args.concurrency), "--max-sessions", str(args.concurrency), "--max-context", "1024")
    levels = sorted({1, args.concurrency})
    with serve(model, *flags) as url:
        servers["musegl"] = {str(c): asyncio.run(_load(url, "musegl", c, args.requests_per_client * c,
                                                       args.max_tokens)) for c in levels}
    with mlx_lm_server(model) as url:
        servers["mlx_lm"] = {str(c): asyncio.run(_load(url, str(model), c, args.requests_per_client * c,
                                                       args.max_tokens)) for c in levels}
    if model_f32 is not None:
        with mlx_lm_server(model_f32, routed=True) as url:
            servers["mlx_lm_f32_openblas"] = {
                str(c): asyncio.run(_load(url, str(model_f32), c, args.requests_per_client * c, args.max_tokens))
                for c in levels}
    figures["server_aggregate"] = servers
    b1 = figures["batch1_decode_tok_s"]

    def ratios(base: str) -> dict:
        return {
            "batch1_in_process": b1["musegl"] / b1[base] if b1[base] else None,
            **{f"server_concurrency_{c}": (servers["musegl"][str(c)]["tok_s"] / servers[base][str(c)]["tok_s"]
                                           if servers[base][str(c)]["tok_s"] else None) for c in levels},
        }

    figures["ratios"] = ratios("mlx_lm")
    if model_f32 is not None:
        figures["ratios_vs_mlx_lm_f32_openblas"] = ratios("mlx_lm_f32_openblas")
    figures["goals"] = {"batch1": ">= 1.0x", f"concurrency_{args.concurrency}": ">= 2.0x"}
    text = json.dumps(figures, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    errors = sum(r["errors"] for side in servers.values() for r in side.values())
    return 0 if not errors else 1


if __name__ == "__main__":
    raise SystemExit(main())
