"""The core's OpenAI API surfaces, built like any plugin's surface.

* :mod:`.surface`: the routes (``ChatCompletionsSurface``, ``CompletionsSurface``);
* :mod:`.chat`: Chat Completions over the generation service;
* :mod:`.completions`: Completions (a raw prompt, no template);
* :mod:`.tokenize`: ``/tokenize`` and ``/detokenize``;
* :mod:`.schemas`: their wire shapes and cattrs hooks.
"""
