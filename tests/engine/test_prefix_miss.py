"""PrefixHistory's causes that need the server to lose something (issue 45 item 6): a session evicted or
expired, prefix-cache blocks evicted, a salt; the HTTP test (tests/http/test_prefix_miss.py) covers the
client-side causes end to end."""

from __future__ import annotations

import pytest

from musegl_core.engine.prefix_miss import PrefixHistory


@pytest.fixture(scope="module")
def tokenizer():
    from musegl_core.tiny import default_model_path
    from musegl_core.tokenizer import MuseTokenizer

    return MuseTokenizer.load(str(default_model_path()))


def test_a_dropped_session_names_its_reason(tokenizer):
    history = PrefixHistory(tokenizer)
    held = tuple(tokenizer.encode("The whole conversation so far, turn after turn. " * 4, special=False))
    prompt = list(held) + tokenizer.encode(" Next turn.", special=False)
    for reason in ("evicted", "expired"):
        history.lost("chat-1", reason, held, None)
        miss = history.diagnose(name="chat-1", new=True, held=[], salt=None, prompt=prompt, reused=0, block_size=4)
        assert miss is not None and (miss.cause, miss.position, miss.held, miss.reused) == (reason, 0, len(held), 0)
        assert miss.prompt_text.startswith("The whole")
    # the blocks came back from the prefix cache: nothing was missed
    history.lost("chat-1", "evicted", held, None)
    assert history.diagnose(name="chat-1", new=True, held=[], salt=None, prompt=prompt, reused=len(held) - 2,
                            block_size=4) is None
    # another salt's transcript is not this request's to reuse
    history.lost("chat-1", "evicted", held, "tenant-a")
    assert history.diagnose(name="chat-1", new=True, held=[], salt="tenant-b", prompt=prompt, reused=0,
                            block_size=4) is None


def test_prefix_cache_blocks_evicted_or_under_another_salt(tokenizer):
    history = PrefixHistory(tokenizer)
    prompt = tokenizer.encode("A long shared system prompt for every request. " * 4, special=False)
    history.ran(prompt, None)
    miss = history.diagnose(name=None, new=True, held=[], salt=None, prompt=prompt, reused=0, block_size=4)
    assert miss.cause == "evicted" and miss.held == len(prompt) - 1
    miss = history.diagnose(name=None, new=True, held=[], salt="other", prompt=prompt, reused=0, block_size=4)
    assert miss.cause == "salt"
    assert history.diagnose(name=None, new=True, held=[], salt=None, prompt=prompt, reused=len(prompt) - 1,
                            block_size=4) is None
