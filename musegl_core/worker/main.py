"""The process that owns the model (``musegl serve`` starts it; not run by hand).

Started by the front (:mod:`musegl_core.worker.client`), which writes the
serve configuration as the first frame on stdin (:class:`~musegl_core.worker.messages.Setup`;
never on the command line, and without the API key). It loads the tokenizer and the executor (with a progress bar
on stderr), announces :class:`Ready` with its capacity, then runs two threads:

* the **control thread** reads request frames from stdin, prepares prompts
  (tokenization) and hands them to the engine, or forwards cancellations;
* the **engine thread** runs the scheduler and the executor.

Events are written to stdout as JSON lines (at most 1 MiB each). Nothing else
may write to stdout, so the real stdout is kept aside for frames and file
descriptor 1 is pointed at stderr.
"""

from __future__ import annotations

import argparse

import attrs
import logging
import os
import sys
import threading
import time
from typing import BinaryIO

from musegl_core.checkpoint.validate import one_line
from musegl_core.config import ServeConfig
from musegl_core.engine.engine import Engine, EngineConfig
from musegl_core.engine.executor import check_executor
from musegl_core.engine.randomness import random_seed, seed_requests
from musegl_core.engine.request import GenerateRequest, PreparedRequest
from musegl_core.engine.sessions import session_policy
from musegl_core.errors import ApiError, ConfigError
from musegl_core.tokenizer import TokenBudgetExceeded
from musegl_core.vision.preprocess import ImagePreprocessor, place_images
from musegl_core.worker import messages as m
from musegl_core.worker.preparation import PreparationPool, prompt_too_long

log = logging.getLogger("musegl.worker")


class EventWriter:
    """Serialises events onto the frame pipe, enforcing the output frame limit."""

    def __init__(self, stream: BinaryIO):
        self.stream = stream
        self.lock = threading.Lock()

    def __call__(self, event: object) -> None:
        try:
            line = m.encode(event, m.MAX_EVENT_FRAME)
        except m.FrameError:
            if isinstance(event, m.Done):  # very long generations: drop the id list
                import attrs

                line = m.encode(attrs.evolve(event, generated_ids=None, generated_chars=None), m.MAX_EVENT_FRAME)
            else:
                rid = getattr(event, "id", None)
                line = m.encode(m.Failed(rid, 500, "an output frame exceeded 1 MiB", "server_error"))
        with self.lock:
            self.stream.write(line)
            self.stream.flush()


def prepare(request: GenerateRequest, tokenizer, vocab_size: int = 0,
            vision: ImagePreprocessor | None = None, *, max_context: int | None = None) -> PreparedRequest:
    """Prepare a request once, on a preparation thread (:mod:`musegl_core.worker.preparation`):
    tokenize the prompt segments, check the ids, decode and place its images
    (``vision`` None: the model sees no images, so an image is a 400), fix the
    seed (a random one when none was given, so every draw is keyed by seed and
    position), compile the output constraint against the served vocabulary
    (``vocab_size``: the model's, when larger than the tokenizer's).

    Cheap checks come first. With ``max_context`` a prompt that cannot fit is
    refused from its length alone (:meth:`MuseTokenizer.token_count_floor`),
    then as soon as tokenizing it has counted too many ids; images are checked
    from their headers against the decode budget before the prompt is
    tokenized and before any is decoded."""
    budget = reservation = None
    if max_context is not None:
        reservation = request.completion_reservation
        budget = max(max_context - reservation, 0)
        floor = tokenizer.token_count_floor(request.prompt)
        if floor > budget:
            raise prompt_too_long(floor, reservation, max_context)
    admitted = vision.admit(request.images) if request.images and vision is not None else None
    try:
        ids = tokenizer.encode_segments(request.prompt, add_bos=request.add_bos, limit=budget)
    except TokenBudgetExceeded as exc:
        raise prompt_too_long(exc.at_least, reservation, max_context) from None
    except Exception as exc:  # TokenizationError (a tokenizer panic included) and anything else it raises
        raise ApiError(400, f"could not tokenize the prompt: {exc}", "invalid_request_error") from exc
    if not ids:
        raise ApiError(400, "the prompt is empty", "invalid_request_error", param="messages")
    vocab = tokenizer.vocab_size
    if any(not 0 <= i < vocab for i in ids):
        raise ApiError(400, f"prompt token ids must be in [0, {vocab})", "invalid_request_error")
    ids, images = place_images(ids, request.images, tokenizer, vision, admitted)
    sampling = request.sampling
    limit = max(vocab, vocab_size)
    for token, _ in sampling.logit_bias:
        if not 0 <= token < limit:
            raise ApiError(400, f"logit_bias names token {token}, outside the vocabulary [0, {limit})",
                           "invalid_request_error", param="logit_bias")
    if sampling.seed is None:
        sampling = attrs.evolve(sampling, seed=random_seed())
    processors = ()
    if request.grammar is not None:
        from musegl_core.constrain.matcher import compile_grammar

        processors = (compile_grammar(request.grammar, tokenizer, vocab_size),)
    elif request.lazy_grammar is not None:
        from musegl_core.constrain.matcher import compile_lazy

        processors = (compile_lazy(request.lazy_grammar, tokenizer, vocab_size),)
    for index, token in enumerate(request.stop_token_ids):
        if not 0 <= token < limit:
            raise ApiError(400, f"stop_token_ids names token {token}, outside the vocabulary [0, {limit})",
                           "invalid_request_error", param=f"stop_token_ids[{index}]")
    if request.min_tokens > 0:
        from musegl_core.engine.min_tokens import MinTokensProcessor

        ends = () if request.ignore_eos else tokenizer.end_of_generation_ids
        processors += (MinTokensProcessor(request.min_tokens, (*ends, *request.stop_token_ids), limit),)
    return PreparedRequest(
        id=request.id,
        prompt_ids=tuple(ids),
        max_tokens=request.max_tokens,
        sampling=sampling,
        stop=request.stop,
        template_stops=request.template_stops,
        ignore_eos=request.ignore_eos,
        session_id=request.session_id,
        add_bos=request.add_bos,
        stream=request.stream,
        logprobs=request.logprobs,
        cache_salt=request.cache_salt,
        soft_session=request.soft_session,
        clamp_to_context=request.clamp_to_context,
        stop_token_ids=frozenset(request.stop_token_ids),
        min_tokens=request.min_tokens,
        processors=processors,
        images=images,
    )


def control_loop(stdin: BinaryIO, engine: Engine, tokenizer, writer: EventWriter, limit: int,
                 vision: ImagePreprocessor | None = None) -> None:
    """Read frames until EOF. Generation requests are prepared on the
    :class:`PreparationPool`'s threads, so this thread is always free to read
    the next frame (a cancellation, another request)."""
    vocab_size = engine.executor.info.vocab_size

    def fail(request_id: str, err: ApiError) -> None:
        writer(m.Failed(request_id, err.status, err.message, err.type, err.code, err.param, dict(err.metadata)))

    pool = PreparationPool(
        lambda request: engine.plan_replay(prepare(request, tokenizer, vocab_size, vision,
                                                   max_context=engine.config.max_context)),
        engine.submit, fail)
    try:
        _read_frames(stdin, engine, writer, limit, pool)
    finally:
        pool.close()


def _read_frames(stdin: BinaryIO, engine: Engine, writer: EventWriter, limit: int, pool: PreparationPool) -> None:
    while True:
        line = stdin.readline(limit + 1)
        if not line:
            engine.stop()
            return
        if not line.endswith(b"\n") and len(line) > limit:
            while line and not line.endswith(b"\n"):  # discard the rest of the oversized frame
                line = stdin.readline(limit + 1)
            writer(m.Failed(None, 413, f"request frame over {limit} bytes", "invalid_request_error", "request_too_large"))
            continue
        try:
            message = m.decode(line)
        except m.FrameError as exc:
            writer(m.Failed(None, 400, str(exc), "invalid_request_error"))
            continue
        if isinstance(message, m.Cancel):
            if not pool.cancel(message.id):  # not in preparation: the engine has it
                engine.cancel(message.id)
        elif isinstance(message, m.Stats):
            engine.call(lambda values, rid=message.id: writer(m.StatsReport(rid, {**values, **pool.stats()})))
        elif isinstance(message, m.ListSessions):
            engine.list_sessions(lambda infos, rid=message.id: writer(m.SessionList(rid, tuple(infos))))
        elif isinstance(message, m.CloseSession):
            if pool.session_busy(message.session_id):  # its next request is being prepared
                writer(_closed(message, ApiError(
                    409, f"session {message.session_id!r} has a request running or queued; close it when idle",
                    "invalid_request_error", "session_active", "session_id")))
            else:
                engine.close_session(message.session_id, lambda error, msg=message: writer(_closed(msg, error)))
        elif isinstance(message, m.Generate):
            pool.submit(message)


def image_preprocessor(config: ServeConfig, executor) -> ImagePreprocessor | None:
    """The image preprocessing of a model that can see images (``info.vision``), else None."""
    if not executor.info.vision:
        return None
    return ImagePreprocessor(config.max_vision_patches, config.max_image_bytes)


def _closed(message: m.CloseSession, error: ApiError | None):
    if error is None:
        return m.SessionClosed(message.id, message.session_id)
    return m.Failed(message.id, error.status, error.message, error.type, error.code, error.param)


def _expire_idle_sessions(engine: Engine, timeout: float) -> None:
    """Apply --session-idle-timeout about once a second (or faster for short timeouts)."""
    period = min(1.0, timeout / 4)
    while True:
        time.sleep(period)
        engine.expire_idle_sessions()


def load(config: ServeConfig, max_context: int | None | bool = True):
    """Load tokenizer, executor and speculator (if a plugin enables one) for
    ``config``, with a progress bar. ``max_context`` is what the executor is
    told of the context budget: ``True`` means ``config.max_context``, None no
    fixed budget (``musegl generate`` sizes its own)."""
    from musegl_core.plugins.manager import PluginManager
    from musegl_core.plugins.specs import ExecutorOptions
    from musegl_core.progress import loading_progress
    from musegl_core.checkpoint.model_tokenizer import load_tokenizer

    plugins = PluginManager(only=config.plugins)
    spec = plugins.choose_executor(config.executor, config.model)
    tokenizer = load_tokenizer(config.model)
    with loading_progress(f"loading {os.path.basename(config.model)} ({spec.name})") as progress:
        options = ExecutorOptions(
            model=config.model,
            device=config.device,
            dtype=config.dtype,
            demo=config.demo,
            mmproj=config.mmproj,
            max_context=config.max_context if max_context is True else max_context,
            progress=progress,
            extra=dict(config.extra),
        )
        executor = spec.create(options)
        check_executor(executor, spec.name)  # one line naming what is missing, not an AttributeError later
        speculator = plugins.create_speculator(executor, options)
    check_speculator(executor, speculator)
    return tokenizer, executor, speculator


def check_speculator(executor, speculator) -> None:
    """Refuse, at load, a speculator that reads hidden states from an executor that returns none."""
    if speculator is not None and tuple(speculator.taps) and not executor.info.hidden_states:
        raise ConfigError(f"the {executor.info.backend} executor returns no hidden states, which the "
                          f"speculator needs (layers {list(speculator.taps)}); serve without it")


def serve(config: ServeConfig, stdin: BinaryIO, stdout: BinaryIO) -> None:
    try:
        tokenizer, executor, speculator = load(config)
    except ConfigError:
        raise
    except Exception as exc:  # one line, exit status 2: the front does not retry a model that cannot load
        log.debug("model load failed", exc_info=True)
        raise ConfigError(f"cannot load the model {config.model!r}: {one_line(exc)}") from None
    seed_requests(config.seed)
    writer = EventWriter(stdout)
    engine = Engine(executor, tokenizer, EngineConfig.from_serve(config), writer, speculator)
    engine_thread = threading.Thread(target=engine.run_forever, name="musegl-engine", daemon=True)
    engine_thread.start()
    if config.session_idle_timeout is not None:
        threading.Thread(target=_expire_idle_sessions, args=(engine, config.session_idle_timeout),
                         name="musegl-session-expiry", daemon=True).start()
    log.info("%s", session_policy(config))
    writer(
        m.Ready(
            model=executor.info,
            capacity=m.Capacity(
                config.max_context, config.max_sessions, config.max_inflight_requests, config.max_decode_sequences
            ),
            pid=os.getpid(),
        )
    )
    control_loop(stdin, engine, tokenizer, writer, config.max_request_bytes, image_preprocessor(config, executor))
    engine_thread.join(timeout=5)
    executor.close()


#: the most bytes the setup frame (the first line on stdin) may take
SETUP_FRAME_LIMIT = 1 << 20


def read_setup(stdin: BinaryIO) -> m.Setup:
    """The worker's settings: the first frame on stdin (never the command line,
    which every user of the machine can read in ``/proc/PID/cmdline``)."""
    line = stdin.readline(SETUP_FRAME_LIMIT + 1)
    if not line.endswith(b"\n"):
        raise ConfigError("expected the setup frame (the serve settings as one JSON line) on stdin")
    try:
        setup = m.decode(line)
    except m.FrameError as exc:
        raise ConfigError(f"bad setup frame on stdin: {exc}") from None
    if not isinstance(setup, m.Setup):
        raise ConfigError("the first frame on stdin must be the setup frame")
    return setup


def main(argv: list[str] | None = None) -> int:
    from musegl_core.cli.main import summary
    from musegl_core.logs import configure
    from musegl_core.progress import show_progress

    parser = argparse.ArgumentParser(
        prog="musegl worker", description=summary(__doc__),
        epilog="It reads its settings from the first line of stdin (the front writes them); run by musegl serve.")
    parser.parse_args(argv)
    configure("info", "worker")  # until the setup frame names the level
    frames_out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # stray prints go to stderr, never into the frame pipe
    sys.stdout = sys.stderr
    try:
        setup = read_setup(sys.stdin.buffer)
        configure(setup.log_level, "worker")
        show_progress(setup.log_level in ("debug", "info"))
        serve(setup.config, sys.stdin.buffer, frames_out)
    except ConfigError as exc:
        print(f"musegl worker: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
