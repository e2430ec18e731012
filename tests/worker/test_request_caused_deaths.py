"""A worker that dies while generating may have died of a request: it is
restarted, and such deaths never count toward giving up (issue 25 item 1),
however many there are in a row. Deaths with nothing in flight still count
(tests/worker/test_worker_supervision.py)."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from musegl_core.config import ServeConfig
from musegl_core.engine.request import PromptSegment
from musegl_core.errors import ApiError
from musegl_core.worker import messages as m
from musegl_core.worker.client import WorkerClient
from musegl_core.testing.server import scripted_plugin_env


@pytest.fixture(scope="module")
def tiny():
    from musegl_core.tiny import default_model_path

    return str(default_model_path())


def test_deaths_while_generating_do_not_count_toward_giving_up(tmp_path, tiny):
    reasons: list[str] = []
    codes: list[str | None] = []

    async def scenario() -> WorkerClient:
        with scripted_plugin_env(tmp_path, [{"when": "", "reply": "ok " * 50, "token_delay": 0.2}]):
            config = ServeConfig(model=tiny, executor="scripted", plugins=("scripted",)).validate()
            # One failure allowed: the second counted death in a row would end the server.
            client = WorkerClient(config, restart_delay=0.05, max_failures=1, on_fatal=reasons.append)

            async def ready() -> None:
                for _ in range(2400):
                    assert client.fatal is None, client.fatal  # the client gave up
                    if client.ready:
                        return
                    await asyncio.sleep(0.05)
                raise AssertionError("the worker did not come back")

            await client.start()
            try:
                for turn in range(3):
                    await ready()
                    pid = client.pid
                    request = m.Generate(id=f"turn-{turn}", prompt=(PromptSegment(text="hi", special=False),),
                                         max_tokens=40)
                    async with client.generate(request) as events:
                        while not isinstance(await events.__anext__(), m.Started):
                            pass  # admitted; generating once Started arrives
                        os.kill(pid, signal.SIGKILL)
                        with pytest.raises(ApiError) as failed:
                            async for _event in events:
                                pass
                        codes.append(failed.value.code)
                await ready()
                assert client.pid not in (None, pid)
            finally:
                await client.close()
            return client

    client = asyncio.run(scenario())
    assert codes == ["worker_restarting"] * 3
    assert client.fatal is None and reasons == []
    assert client.restarts == 3 and client.failures == 0
