"""Test helpers for musegl and for plugin authors (needs the test extras: pytest, httpx).

* :mod:`~musegl_core.testing.example_executor`: a complete toy executor written from
  docs/executor.md (numpy, a hash for a model), to watch the engine from the executor's side;
* :mod:`~musegl_core.testing.reference_sampler`: the contract's sampling rule in numpy;
* :mod:`~musegl_core.testing.conformance`: :class:`ExecutorConformance`, the executor
  conformance suite a backend runs against itself;
* :mod:`~musegl_core.testing.scripted`: an executor plugin that replays scripted output
  (for tool parsers, dialects and API surfaces: the real engine, worker and tokenizer,
  with a script for the model);
* :mod:`~musegl_core.testing.server`: a real front + worker in-process
  (:func:`running_server`), and installing a test-only plugin for its worker;
* :mod:`~musegl_core.testing.images`: PNG test images with real content and their data URLs;
* :mod:`~musegl_core.testing.engine_runs`: driving an engine directly (prompt ids, a request's
  ``Done``, a scripted conversation to compare two engines on, an engine over the example executor);
* :mod:`~musegl_core.testing.files`: folders for tests (one this user cannot write).

Nothing here is used to serve.
"""
