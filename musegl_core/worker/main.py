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
import logging
import os
import sys
import threading
import time
from typing import BinaryIO

from musegl_core.servable import one_line
from musegl_core.config import ServeConfig
from musegl_core.engine.engine import Engine, EngineConfig
from musegl_core.engine.randomness import seed_requests
from musegl_core.engine.sessions import session_policy
from musegl_core.engine.errors import EngineError, SessionActive
from musegl_core.errors import ConfigError
from musegl_core.vision.preprocess import ImagePreprocessor, vision_patches
from musegl_core.worker import messages as m
from musegl_core.worker.loading import load
from musegl_core.worker.memory import IdleTrim
from musegl_core.worker.prepare import prepare
from musegl_core.worker.preparation import PreparationPool

log = logging.getLogger("musegl.worker")

#: The worker's GIL switch interval, in seconds (CPython's default: 5 ms). The engine thread
#: gives up the GIL in every torch op and kernel launch and takes it back right after (a
#: prefill step of the 30B shape outside a CUDA graph: several hundred times); while a
#: preparation thread runs Python, each retake waits until that thread is made to yield, up
#: to the interval. On the H200 agent run a 521-row prefill step took 1.14 s instead of
#: ~30 ms while 32 arriving turns were being prepared (docs/engine.md, "Preparation").
SWITCH_INTERVAL = 0.0001


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
                line = m.encode(m.Failed(rid, m.EventTooLarge()))
        with self.lock:
            self.stream.write(line)
            self.stream.flush()


def control_loop(stdin: BinaryIO, engine: Engine, tokenizer, writer: EventWriter, limit: int,
                 vision: ImagePreprocessor | None = None) -> None:
    """Read frames until EOF. Generation requests are prepared on the
    :class:`PreparationPool`'s threads, so this thread is always free to read
    the next frame (a cancellation, another request)."""
    vocab_size = engine.executor.info.vocab_size

    gate = engine.launch_gate

    def prepare_one(request):
        prepared = prepare(request, tokenizer, vocab_size, vision, max_context=engine.config.max_context)
        gate.wait()  # (between the two halves: the engine may be launching a step)
        return engine.plan_replay(prepared)

    pool = PreparationPool(prepare_one, engine.submit, lambda request_id, error: writer(m.Failed(request_id, error)),
                           trace=engine.trace, gate=gate)
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
            writer(m.Failed(None, m.FrameTooLarge(limit)))
            continue
        engine.launch_gate.wait()  # decoding a long frame holds the GIL
        try:
            message = m.decode(line)
        except m.FrameError as exc:
            writer(m.Failed(None, m.BadFrame(str(exc))))
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
                writer(_closed(message, SessionActive(message.session_id)))
            else:
                engine.close_session(message.session_id, lambda error, msg=message: writer(_closed(msg, error)))
        elif isinstance(message, m.Generate):
            if engine.trace is not None:
                engine.trace.request("received", message.id, session=message.session_id)
            pool.submit(message)


def image_preprocessor(config: ServeConfig, executor) -> ImagePreprocessor | None:
    """The image preprocessing of a model that can see images (``info.vision``), else None."""
    if not executor.info.vision:
        return None
    return ImagePreprocessor(vision_patches(config.max_vision_patches, executor.info), config.max_image_bytes)


def _closed(message: m.CloseSession, error: EngineError | None):
    if error is None:
        return m.SessionClosed(message.id, message.session_id)
    return m.Failed(message.id, error)


def _expire_idle_sessions(engine: Engine, timeout: float) -> None:
    """Apply --session-idle-timeout about once a second (or faster for short timeouts)."""
    period = min(1.0, timeout / 4)
    while True:
        time.sleep(period)
        engine.expire_idle_sessions()


def serve(config: ServeConfig, stdin: BinaryIO, stdout: BinaryIO) -> None:
    sys.setswitchinterval(SWITCH_INTERVAL)
    try:
        tokenizer, executor, speculator = load(config)
    except ConfigError:
        raise
    except Exception as exc:  # one line, exit status 2: the front does not retry a model that cannot load
        log.debug("model load failed", exc_info=True)
        raise ConfigError(f"cannot load the model {config.model!r}: {one_line(exc)}") from None
    tokenizer.warm()  # else the first request waits about a second for it
    seed_requests(config.seed)
    writer = EventWriter(stdout)
    engine = Engine(executor, tokenizer, EngineConfig.from_serve(config), writer, speculator)
    engine_thread = threading.Thread(target=engine.run_forever, name="musegl-engine", daemon=True)
    engine_thread.start()
    trim = IdleTrim(lambda: engine.steps, lambda: engine.idle)  # freed memory back after each burst
    threading.Thread(target=trim.run_forever, name="musegl-memory-trim", daemon=True).start()
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
    from musegl_core.allocator import fix_mmap_threshold
    from musegl_core.docstrings import summary
    from musegl_core.logs import configure
    from musegl_core.progress import show_progress

    parser = argparse.ArgumentParser(
        prog="musegl worker", description=summary(__doc__),
        epilog="It reads its settings from the first line of stdin (the front writes them); run by musegl serve.")
    parser.parse_args(argv)
    fix_mmap_threshold()  # large request frames go back to the OS once prepared
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
