"""Run one raw prompt through the engine and print the generated ids and text.

The prompt is text in which special tokens are written out
(``<|begin_of_text|><|start|>user<|message|>Hi<|eot|><|start|>assistant``) or a
list of token ids (``--token-ids 200000,200022`` or a JSON list as PROMPT).
With ``--image FILE`` (PNG or JPEG; the model needs its projector: an HF
directory with vision weights, or ``--mmproj``) the prompt carries one
``<|patch|>`` where the image goes; it is expanded to ``<|image_start|>`` +
N x ``<|patch|>`` + ``<|image_end|>`` as the server does.
It runs in-process through the same executor and engine the server uses, so
it is the tool to check a checkpoint and to compare the engine with a
reference token by token.
"""

from __future__ import annotations

import base64
import json
import sys


from musegl_core.cli.main import OneLineParser
from musegl_core.config import ServeConfig
from musegl_core.engine.engine import Engine, EngineConfig
from musegl_core.engine.executor import SamplingParams
from musegl_core.errors import ApiError, ConfigError
from musegl_core.engine import events as ev
from musegl_core.engine.request import GenerateRequest, ImageInput, PromptSegment
from musegl_core.vision.preprocess import ImagePreprocessor, vision_patches
from musegl_core.worker.loading import load
from musegl_core.worker.prepare import prepare


def parse_prompt(prompt: str | None, token_ids: str | None) -> PromptSegment:
    if token_ids is not None:
        text = token_ids.strip()
        ids = json.loads(text) if text.startswith("[") else [int(x) for x in text.replace(",", " ").split()]
        return PromptSegment(token_ids=tuple(int(i) for i in ids))
    if prompt is None or prompt == "-":
        prompt = sys.stdin.read()
    stripped = prompt.strip()
    if stripped.startswith("[") and stripped.endswith("]"):
        try:
            ids = json.loads(stripped)
            if isinstance(ids, list) and all(isinstance(i, int) for i in ids):
                return PromptSegment(token_ids=tuple(ids))
        except json.JSONDecodeError:
            pass
    return PromptSegment(text=prompt, special=True)


def read_image(path: str) -> ImageInput:
    """A PNG or JPEG file as the worker receives an inline image."""
    try:
        data = open(path, "rb").read()
    except OSError as exc:
        raise ConfigError(f"cannot read --image {path}: {exc.strerror or exc}") from None
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        media_type = "image/png"
    elif data.startswith(b"\xff\xd8\xff"):
        media_type = "image/jpeg"
    else:
        raise ConfigError(f"--image {path} is neither a PNG nor a JPEG file")
    return ImageInput(media_type, base64.b64encode(data).decode("ascii"))


def main(argv: list[str]) -> int:
    import argparse

    from musegl_core.plugins.manager import PluginManager

    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--plugin", action="append", dest="plugins")
    plugins = PluginManager(only=pre.parse_known_args(argv)[0].plugins)
    p = OneLineParser(prog="musegl generate", description=__doc__.split("\n\n")[0])
    p.add_argument("prompt", nargs="?", help="raw prompt text, a JSON list of ids, or - for stdin")
    p.add_argument("--model", help="GGUF file, HF directory or ExecuTorch export (default: the built-in tiny demo)")
    p.add_argument("--token-ids", help="prompt as token ids: '1,2,3' or '[1, 2, 3]'")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--executor", default=None)
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None, choices=["float32", "float16", "bfloat16"])
    p.add_argument("--plugin", action="append", dest="plugins")
    p.add_argument("--mmproj", metavar="MMPROJ", help="vision projector GGUF for a GGUF --model")
    p.add_argument("--image", metavar="FILE", help="a PNG or JPEG for the prompt's one <|patch|> placeholder")
    p.add_argument("--max-vision-patches", type=int, default=4096, help="vision patch cap (default %(default)s)")
    known = {a.dest for a in p._actions}
    # the flags of the plugins that generate runs (executors, speculators), as `musegl serve` takes them
    plugins.add_serve_options(p, kinds=("executors", "speculators"))
    args = p.parse_args(argv)
    extra = {k: v for k, v in vars(args).items() if k not in known}
    if args.max_tokens < 1:
        raise ConfigError("--max-tokens must be at least 1")
    if args.temperature < 0:
        raise ConfigError("--temperature must be >= 0")
    model, demo = args.model, False
    if model is None:
        from musegl_core.tiny import default_model_path

        model, demo = str(default_model_path(progress=True)), True
        if args.mmproj is None:
            from musegl_core.tiny import demo_mmproj_path

            args.mmproj = demo_mmproj_path(model)
    segment = parse_prompt(args.prompt, args.token_ids)
    images = (read_image(args.image),) if args.image else ()
    config = ServeConfig(model=model, executor=args.executor, device=args.device, dtype=args.dtype,
                         plugins=tuple(args.plugins) if args.plugins else None, demo=demo, mmproj=args.mmproj,
                         extra=extra)
    tokenizer, executor, speculator = load(config, max_context=None)
    events: list = []
    request = GenerateRequest(
        id="generate",
        prompt=(segment,),
        max_tokens=args.max_tokens,
        sampling=SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed),
        stop=tuple(args.stop),
        ignore_eos=args.ignore_eos,
        add_bos=False,
        images=images,
    )
    vision = ImagePreprocessor(vision_patches(args.max_vision_patches, executor.info)) if executor.info.vision else None
    try:
        prepared = prepare(request, tokenizer, vision=vision)
    except ApiError as error:
        raise ConfigError(error.message) from None
    context = max(len(prepared.prompt_ids) + args.max_tokens, 2)
    if context > executor.info.native_context:
        raise ConfigError(f"the prompt and --max-tokens need {context} positions; the model's native context "
                          f"is {executor.info.native_context}")
    engine = Engine(executor, tokenizer, EngineConfig(max_context=context, max_inflight_requests=1),
                    events.append, speculator)
    engine.submit(prepared)
    engine.run_until_idle()
    failed = [e for e in events if isinstance(e, ev.Failed)]
    if failed:
        from musegl_core.worker.errors import api_error

        raise ConfigError(api_error(failed[0].error).message)
    done = next(e for e in events if isinstance(e, ev.Done))
    ids = [i for e in events if isinstance(e, ev.Tokens) for i in e.ids]
    text = "".join(e.text for e in events if isinstance(e, ev.Tokens))
    generated = list(done.generated_ids) if done.generated_ids is not None else ids
    if args.json:
        print(json.dumps({
            "model": executor.info.name,
            "backend": executor.info.backend,
            "demo": demo,
            "prompt_ids": list(prepared.prompt_ids),
            "token_ids": generated,
            "text": text,
            "finish_reason": done.finish_reason,
            "matched_stop": done.matched_stop,
            "usage": {"prompt_tokens": done.prompt_tokens, "completion_tokens": done.completion_tokens},
            "speculation": {"drafted_tokens": done.drafted_tokens, "accepted_tokens": done.accepted_tokens,
                            "target_steps": engine.steps},
        }, ensure_ascii=False))
    else:
        print(f"prompt tokens: {len(prepared.prompt_ids)}")
        print(f"token ids: {' '.join(map(str, generated))}")
        print(f"finish: {done.finish_reason}" + (f" (stop {done.matched_stop!r})" if done.matched_stop else ""))
        if done.drafted_tokens:
            print(f"drafts: {done.accepted_tokens} of {done.drafted_tokens} accepted in {engine.steps} target steps")
        print("text:")
        print(text)
    executor.close()
    return 0
