"""An event frame from the worker that the front cannot read, for a request in flight
(a Tokens frame whose logprobs do not pair with its ids), fails that request with
``BadEvent`` instead of losing its output; the request is cancelled in the worker, which
goes on serving. The worker, its scripted model and the front are the real ones; only
the bad frame is put on the front's side of the pipe, where the worker would write it."""

from __future__ import annotations

import asyncio

import pytest

from musegl_core.config import ServeConfig
from musegl_core.engine.executor import TokenLogprobs
from musegl_core.engine.request import PromptSegment
from musegl_core.errors import ApiError
from musegl_core.testing.server import scripted_plugin_env
from musegl_core.worker import messages as m
from musegl_core.worker.client import WorkerClient


def test_an_unreadable_tokens_frame_fails_its_request_and_the_worker_serves_on(tmp_path):
    from musegl_core.tiny import default_model_path

    async def scenario() -> None:
        with scripted_plugin_env(tmp_path, [{"when": "", "reply": "ok " * 30, "token_delay": 0.05}]):
            config = ServeConfig(model=str(default_model_path()), executor="scripted",
                                 plugins=("scripted",)).validate()
            client = WorkerClient(config, restart_delay=0.05, max_failures=1)
            await client.start()
            try:
                for _ in range(2400):
                    if client.ready:
                        break
                    await asyncio.sleep(0.05)
                assert client.ready
                pid = client.pid

                def request(rid: str, max_tokens: int) -> m.Generate:
                    return m.Generate(id=rid, prompt=(PromptSegment(text="hi", special=False),),
                                      max_tokens=max_tokens)

                bad = m.encode(m.Tokens("first", (5, 9), "xy", (TokenLogprobs(-0.25),)))
                async with client.generate(request("first", 30)) as events:
                    while not isinstance(await events.__anext__(), m.Started):
                        pass
                    client._deliver(bad)
                    with pytest.raises(ApiError) as failed:
                        async for _event in events:
                            pass
                assert failed.value.status == 500
                assert "the worker sent an unreadable event" in failed.value.message
                assert "one logprobs entry per id" in failed.value.message
                for _ in range(200):  # the stream's exit cancelled it in the worker
                    if (await client.stats())["running"] == 0:
                        break
                    await asyncio.sleep(0.05)
                assert (await client.stats())["running"] == 0
                async with client.generate(request("second", 3)) as events:
                    kinds = [type(event) async for event in events]
                assert kinds[-1] is m.Done and m.Tokens in kinds
                assert client.pid == pid and client.restarts == 0
            finally:
                await client.close()

    asyncio.run(scenario())
