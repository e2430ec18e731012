"""Train a small Muse Glimmer target and a DFlash draft for it, then measure DFlash on the CPU.

1. **Corpus**: synthetic conversations rendered with the core's ``muse`` chat
   template (system block, user turn, ``<|start|>assistant<|message|>answer<|eot|>``):
   counting, spelling, repeating, sums, lists (a short system message keeps
   the prompts short). The answers are determined by
   the prompt, so a small model can learn them.
2. **Target**: a Muse Glimmer text decoder (transformers' ``MuseGlimmerTextModel``,
   the tiny tokenizer of ``musegl make-tiny``, the real 202048 vocabulary),
   trained from random init with a head restricted to the ids the corpus uses
   plus one pooled row for all other ids (their total mass is learned);
   exported as ``target/model.gguf`` (the other ids share that row).
3. **Target outputs**: the musegl engine (torch executor) generates greedy
   answers to training prompts; the draft learns those, not the corpus text.
4. **Draft**: transformers' ``MuseGlimmerAssistantModel`` trained the DFlash
   way: random anchors in the target's answers, context = the target's tapped
   hidden states before the anchor, block ``[anchor, MASK × 15]``, labels = the
   next 15 target tokens. Saved as ``draft/`` (HF) and ``draft.gguf``.
5. **Measure**: held-out prompts through the engine with and without the draft
   in the same run (greedy, and seeded sampling at temperature 0.7):
   tokens/s, target forwards, mean acceptance length.

Run from the repository root with the venv active::

    python benchmarks/dflash_pair.py --out /tmp/dflash-pair

``--reuse`` skips training when the files exist. Everything runs on the CPU.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

TARGET = dict(hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=32, sliding_window=512, max_position_embeddings=4096,
              rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
DRAFT = dict(hidden_size=128, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32, sliding_window=2048, block_size=16, mask_token_id=201818,
             target_layer_ids=[0, 1, 2], max_position_embeddings=4096)
WORDS = ("kidohu hanugu bibuse hanofa kosuso buboda hotada dunaho fetitu batodi homiru gosate bidavi fasumu "
         "red green blue yellow orange purple apple pear plum river mountain forest ocean desert").split()
NUMBERS = ("zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen "
           "sixteen seventeen eighteen nineteen twenty").split()


def conversation(rng: random.Random) -> tuple[str, str]:
    """One (user message, answer) pair."""
    kind = rng.randrange(5)
    if kind == 0:
        a = rng.randrange(0, 12)
        b = a + rng.randrange(4, 9)
        return f"Count from {a} to {b}.", ", ".join(str(i) for i in range(a, b + 1)) + "."
    if kind == 1:
        word = rng.choice(WORDS)
        return f"Spell the word {word}.", f"The word {word} is spelled " + "-".join(word) + "."
    if kind == 2:
        words = rng.sample(WORDS, rng.randrange(3, 7))
        return "Repeat after me: " + " ".join(words), "Sure. " + " ".join(words) + ". " + " ".join(words) + "."
    if kind == 3:
        a, b = rng.randrange(0, 11), rng.randrange(0, 11)
        return f"What is {NUMBERS[a]} plus {NUMBERS[b]}?", f"{NUMBERS[a].capitalize()} plus {NUMBERS[b]} is {a + b}."
    n = rng.randrange(3, 7)
    return f"List {n} numbers in words.", "Here they are: " + ", ".join(NUMBERS[1:n + 1]) + "."


def prompt_ids(tokenizer, user: str) -> list[int]:
    from musegl_core.chat.messages import Message
    from musegl_core.chat.template import MuseTemplate, TemplateVariables

    rendered = MuseTemplate().render([Message(role="system", content="Answer briefly."),
                                      Message(role="user", content=user)],
                                     variables=TemplateVariables(current_date="2026-01-01"))
    return tokenizer.encode_segments(rendered.segments, add_bos=False)


def answer_ids(tokenizer, answer: str) -> list[int]:
    return tokenizer.encode(f"<|message|>{answer}<|eot|>", special=True)


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# -- 1-2: the target ------------------------------------------------------------------------
def train_target(out: Path, tokenizer, data: list[tuple[list[int], list[int]]], steps: int, seed: int,
                 batch_size: int = 16):
    import numpy as np
    import torch
    from transformers import MuseGlimmerTextConfig
    from transformers.models.muse_glimmer.modeling_muse_glimmer import MuseGlimmerTextModel

    from musegl_core.checkpoint.gguf_writer import write_text_gguf
    from musegl_core.checkpoint.hf_reader import text_config_from_dict

    torch.manual_seed(seed)
    text = dict(TARGET, vocab_size=tokenizer.vocab_size, bos_token_id=tokenizer.bos_id,
                eos_token_id=list(tokenizer.end_of_generation_ids))
    sequences = [p + a for p, a in data]
    active = sorted({t for s in sequences for t in s})
    index = {t: i for i, t in enumerate(active)}
    # Train over the ids the corpus uses only (the math does not depend on the vocabulary
    # size); the export scatters the rows into the full 202048-row tables.
    model = MuseGlimmerTextModel(MuseGlimmerTextConfig(**dict(text, vocab_size=len(active)))).train()
    head = torch.nn.Parameter(torch.randn(len(active), TARGET["hidden_size"]) * 0.02)
    # Every unused id shares one lm_head row; in the loss they are one pooled class whose
    # logit is that row's plus log(count), so the model learns to keep their total mass
    # small and sampling over the full vocabulary stays sensible.
    unused = torch.nn.Parameter(torch.randn(TARGET["hidden_size"]) * 0.02)
    pooled = float(np.log(tokenizer.vocab_size - len(active)))
    optim = torch.optim.AdamW(list(model.parameters()) + [head, unused], lr=3e-3, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(optim, max_lr=3e-3, total_steps=steps, pct_start=0.1)
    rng = random.Random(seed)
    cap, mult = 20.0, 0.19611613513818404
    started = time.perf_counter()
    for step in range(steps):
        batch = rng.sample(range(len(data)), batch_size)
        width = max(len(sequences[i]) for i in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        labels = torch.full((len(batch), width), -100, dtype=torch.long)
        for row, i in enumerate(batch):
            p, a = data[i]
            seq = sequences[i]
            ids[row, :len(seq)] = torch.tensor([index[t] for t in seq])
            # Learn the answers: the labels are the next tokens from the end of the prompt on.
            labels[row, len(p) - 1:len(seq) - 1] = torch.tensor([index[t] for t in a])
        hidden = model(input_ids=ids).last_hidden_state
        raw = torch.cat([hidden @ head.t(), (hidden @ unused)[..., None]], dim=-1)
        logits = torch.tanh(raw * mult / cap) * cap
        logits = torch.cat([logits[..., :-1], logits[..., -1:] + pooled], dim=-1)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, len(active) + 1), labels.reshape(-1))
        optim.zero_grad()
        loss.backward()
        optim.step()
        sched.step()
        if step % 50 == 0 or step == steps - 1:
            log(f"target step {step}/{steps} loss {loss.item():.3f}")
    log(f"target trained in {time.perf_counter() - started:.0f} s")
    model.eval()
    weights = {name: value.detach().numpy() for name, value in model.state_dict().items()}
    embed = np.zeros((tokenizer.vocab_size, TARGET["hidden_size"]), dtype=np.float32)
    embed[active] = weights["embed_tokens.weight"]
    weights["embed_tokens.weight"] = embed
    lm_head = np.tile(unused.detach().numpy(), (tokenizer.vocab_size, 1))
    lm_head[active] = head.detach().numpy()
    weights["lm_head.weight"] = lm_head
    config = text_config_from_dict({**text, "model_type": "muse_glimmer_text"})
    (out / "target").mkdir(parents=True, exist_ok=True)
    (out / "target" / "tokenizer.json").write_text(tokenizer.to_tokenizer_json(), encoding="utf-8")
    write_text_gguf(out / "target" / "model.gguf", config, weights, tokenizer.to_gguf_data(tokenizer.vocab_size),
                    file_type="f32", name="Muse Glimmer dflash-pair target")
    return out / "target" / "model.gguf"


# -- 3: what the target says ------------------------------------------------------------------
def engine_for(target: Path, draft: Path | None, decode: int = 8, n_draft: int | None = None):
    from musegl_core.config import ServeConfig
    from musegl_core.engine.engine import Engine, EngineConfig
    from musegl_core.worker.loading import load

    extra = {"dflash": str(draft), "dflash_n_draft": n_draft} if draft else {}
    tokenizer, executor, speculator = load(ServeConfig(model=str(target), executor="torch-cpu",
                                                       plugins=("cuda", "dflash"), extra=extra))
    events: list = []
    engine = Engine(executor, tokenizer, EngineConfig(max_context=512, max_sessions=64,
                                                      max_inflight_requests=64, max_decode_sequences=decode),
                    events.append, speculator)
    return tokenizer, engine, events, speculator


def run(engine, events, prompts: list[list[int]], max_tokens: int, temperature: float = 0.0) -> dict[str, list[int]]:
    from musegl_core.engine import events as ev
    from musegl_core.engine.executor import SamplingParams
    from musegl_core.engine.request import PreparedRequest

    events.clear()
    for wave in range(0, len(prompts), 32):  # within the engine's session slots
        for i in range(wave, min(wave + 32, len(prompts))):
            engine.submit(PreparedRequest(id=f"r{i}", prompt_ids=tuple(prompts[i]), max_tokens=max_tokens,
                                          sampling=SamplingParams(temperature=temperature, seed=1000 + i)))
        engine.run_until_idle()
    failed = [e for e in events if isinstance(e, ev.Failed)]
    if failed:
        from musegl_core.worker.errors import api_error

        raise RuntimeError(api_error(failed[0].error).message)
    return {e.id: list(e.generated_ids) for e in events if isinstance(e, ev.Done)}


# -- 4: the draft ---------------------------------------------------------------------------
def train_draft(out: Path, target: Path, sequences: list[tuple[list[int], list[int]]], steps: int, seed: int,
                batch_size: int = 16):
    import numpy as np
    import torch
    from transformers import MuseGlimmerAssistantConfig, MuseGlimmerAssistantModel
    from transformers.cache_utils import DFlashCache

    from musegl_core.checkpoint.hf_reader import text_config_from_dict
    from musegl_core.checkpoint.loader import load_checkpoint
    from transformers import MuseGlimmerTextConfig
    from transformers.models.muse_glimmer.modeling_muse_glimmer import MuseGlimmerTextModel

    # The target, back in transformers, for its tapped hidden states.
    checkpoint = load_checkpoint(target)
    weights = {n: torch.from_numpy(a) for n, a in checkpoint.iter_weights()}
    checkpoint.close()
    c = checkpoint.config
    text = dict(TARGET, vocab_size=c.vocab_size, bos_token_id=c.bos_token_id, eos_token_id=list(c.eos_token_ids))
    target_model = MuseGlimmerTextModel(MuseGlimmerTextConfig(**text)).eval()
    target_model.load_state_dict({n: w for n, w in weights.items() if n != "lm_head.weight"})
    embed, lm_head = weights["embed_tokens.weight"], weights["lm_head.weight"]
    pooled_row = lm_head[-1]  # the last id is a reserved special token: one of the pooled ids
    is_pooled = (lm_head == pooled_row).all(-1)
    active = torch.nonzero(~is_pooled).flatten()
    index = torch.full((c.vocab_size,), -100, dtype=torch.long)
    index[active] = torch.arange(len(active))
    head = torch.cat([lm_head[active], pooled_row[None]])  # the pooled ids as one more class
    pooled = float(np.log(int(is_pooled.sum())))

    taps = [i + 1 for i in DRAFT["target_layer_ids"]]
    features = []
    with torch.no_grad():
        for p, a in sequences:
            ids = torch.tensor([p + a])
            hs = target_model(input_ids=ids, output_hidden_states=True).hidden_states
            features.append(torch.cat([hs[t][0] for t in taps], dim=-1))
    log(f"tapped {len(sequences)} target sequences")

    torch.manual_seed(seed)
    config = MuseGlimmerAssistantConfig(**DRAFT)
    config._attn_implementation = "eager"
    draft = MuseGlimmerAssistantModel(config).train()
    optim = torch.optim.AdamW(draft.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.OneCycleLR(optim, max_lr=3e-3, total_steps=steps, pct_start=0.1)
    rng = random.Random(seed)
    block, mask = DRAFT["block_size"], DRAFT["mask_token_id"]
    started = time.perf_counter()
    for step in range(steps):
        picks = []
        for _ in range(batch_size):
            i = rng.randrange(len(sequences))
            p, a = sequences[i]
            anchor = rng.randrange(len(p) - 1, len(p) + len(a) - 1)  # the anchor's target forward has not run
            picks.append((i, anchor))
        width = max(anchor for _, anchor in picks)
        ctx = torch.zeros(len(picks), width, features[0].shape[-1])
        attention = torch.zeros(len(picks), width + block, dtype=torch.long)
        positions = torch.zeros(len(picks), width + block, dtype=torch.long)
        noise = torch.full((len(picks), block), mask, dtype=torch.long)
        labels = torch.full((len(picks), block - 1), -100, dtype=torch.long)
        for row, (i, anchor) in enumerate(picks):
            seq = sequences[i][0] + sequences[i][1]
            pad = width - anchor
            ctx[row, pad:] = features[i][:anchor]
            attention[row, pad:] = 1
            positions[row, pad:] = torch.arange(anchor + block)
            noise[row, 0] = seq[anchor]
            future = torch.tensor(seq[anchor + 1:anchor + block])
            labels[row, :len(future)] = index[future]
        cache = DFlashCache(config=config)
        cache.set_previous_accepted_tokens(width)
        h = draft(noise_embeds=embed[noise], context_hidden_states=ctx, attention_mask=attention,
                  position_ids=positions, past_key_values=cache).last_hidden_state[:, 1:]
        logits = h @ head.t()
        logits = torch.cat([logits[..., :-1], logits[..., -1:] + pooled], dim=-1)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, len(active) + 1), labels.reshape(-1))
        optim.zero_grad()
        loss.backward()
        optim.step()
        sched.step()
        if step % 50 == 0 or step == steps - 1:
            log(f"draft step {step}/{steps} loss {loss.item():.3f}")
    log(f"draft trained in {time.perf_counter() - started:.0f} s")
    draft.eval()
    draft.save_pretrained(out / "draft")
    from musegl_dflash.checkpoint import config_from_dict, write_draft_gguf
    from musegl_core.tokenizer import MuseTokenizer

    write_draft_gguf(out / "draft.gguf", config_from_dict(draft.config.to_dict()),
                     {n: v.detach().numpy() for n, v in draft.state_dict().items()},
                     MuseTokenizer.load(target).to_gguf_data(c.vocab_size))
    return out / "draft"


# -- 5: measure -----------------------------------------------------------------------------------
def measure(target: Path, draft: Path, prompts: list[list[int]], max_tokens: int, batch: int,
            temperature: float, n_drafts: tuple[int, ...] = (15,)) -> dict:
    """Plain, then with the draft at each ``--dflash-n-draft`` of ``n_drafts``, same prompts."""
    figures: dict = {}
    outputs = {}
    runs = [("plain", None, None)] + [(f"dflash_n{n}", draft, n) for n in n_drafts]
    for name, path, n_draft in runs:
        _, engine, events, speculator = engine_for(target, path, decode=batch, n_draft=n_draft)
        run(engine, events, prompts[:batch], 8, temperature)  # warm-up
        steps0 = engine.steps
        blocks0 = speculator.blocks if speculator else 0
        committed0 = speculator.committed_tokens if speculator else 0
        started = time.perf_counter()
        done = run(engine, events, prompts, max_tokens, temperature)
        seconds = time.perf_counter() - started
        tokens = sum(len(v) for v in done.values())
        outputs[name] = done
        entry = {"tokens": tokens, "seconds": round(seconds, 2), "tokens_per_s": round(tokens / seconds, 1),
                 "target_forwards": engine.steps - steps0,
                 "tokens_per_target_forward": round(tokens / (engine.steps - steps0), 2)}
        if speculator is not None:
            blocks = speculator.blocks - blocks0
            entry["mean_acceptance_length"] = round((speculator.committed_tokens - committed0) / max(blocks, 1), 2)
        figures[name] = entry
        engine.executor.close()
    for name, _, n_draft in runs[1:]:
        figures[name]["identical_output"] = outputs[name] == outputs["plain"]
        figures[name]["speedup"] = round(figures[name]["tokens_per_s"] / figures["plain"]["tokens_per_s"], 2)
    return figures


def build_pair(out: Path, *, target_steps: int, draft_steps: int, conversations: int, draft_sequences: int,
               batch: int = 16, seed: int = 0, reuse: bool = False) -> tuple[Path, Path, dict]:
    """Train (or, with ``reuse``, keep) the pair under ``out``: ``(target GGUF, draft HF dir, timings)``.
    The draft is also written as ``out/draft.gguf``. Trains on one torch thread (on a
    shared CPU, OpenMP spinning costs more than a second thread gives)."""
    import torch

    from musegl_core.tiny import build_tiny_tokenizer

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _build_pair(out, target_steps=target_steps, draft_steps=draft_steps, conversations=conversations,
                           draft_sequences=draft_sequences, batch=batch, seed=seed, reuse=reuse)
    finally:
        torch.set_num_threads(threads)


def _build_pair(out: Path, *, target_steps: int, draft_steps: int, conversations: int, draft_sequences: int,
                batch: int, seed: int, reuse: bool) -> tuple[Path, Path, dict]:
    from musegl_core.tiny import build_tiny_tokenizer

    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tiny_tokenizer()
    rng = random.Random(seed)
    corpus = [conversation(rng) for _ in range(conversations)]
    data = [(prompt_ids(tokenizer, user), answer_ids(tokenizer, answer)) for user, answer in corpus]
    timings: dict = {}
    target, draft = out / "target" / "model.gguf", out / "draft"
    if not (reuse and target.exists()):
        started = time.perf_counter()
        target = train_target(out, tokenizer, data, target_steps, seed, batch)
        timings["target_training_s"] = round(time.perf_counter() - started)
    if not (reuse and (draft / "config.json").exists()):
        started = time.perf_counter()
        _, engine, events, _ = engine_for(target, None, decode=16)
        prompts = [p for p, _ in data[:draft_sequences]]
        said = run(engine, events, prompts, 48)
        engine.executor.close()
        sequences = [(p, said[f"r{i}"]) for i, p in enumerate(prompts)]
        log(f"target answered {len(sequences)} prompts in {time.perf_counter() - started:.0f} s")
        train_draft(out, target, sequences, draft_steps, seed, batch)
        timings["draft_data_and_training_s"] = round(time.perf_counter() - started)
    return target, draft, timings


def held_out_prompts(n: int, seed: int = 0) -> list[list[int]]:
    """Prompts of conversations the pair was not trained on."""
    from musegl_core.tiny import build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    rng = random.Random(seed + 1)
    return [prompt_ids(tokenizer, conversation(rng)[0]) for _ in range(n)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="/tmp/dflash-pair", help="where the pair is written")
    parser.add_argument("--target-steps", type=int, default=200)
    parser.add_argument("--draft-steps", type=int, default=200)
    parser.add_argument("--conversations", type=int, default=3000)
    parser.add_argument("--draft-sequences", type=int, default=200, help="target answers the draft learns from")
    parser.add_argument("--eval-prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--reuse", action="store_true", help="keep an existing pair; only measure")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (1: on a shared CPU, OpenMP spinning costs more than it gives)")
    parser.add_argument("--batch", type=int, default=16, help="training batch")
    parser.add_argument("--n-draft", type=int, action="append", dest="n_drafts",
                        help="--dflash-n-draft values to measure (repeatable; default 15 and 3)")
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    out = Path(args.out)
    target, draft, timings = build_pair(out, target_steps=args.target_steps, draft_steps=args.draft_steps,
                                        conversations=args.conversations, draft_sequences=args.draft_sequences,
                                        batch=args.batch, seed=args.seed, reuse=args.reuse)
    prompts = held_out_prompts(args.eval_prompts, args.seed)
    report = {"timings": timings}
    for batch, temperature in ((1, 0.0), (8, 0.0), (1, 0.7)):
        key = f"batch{batch}_{'greedy' if temperature == 0 else f't{temperature}'}"
        report[key] = measure(target, draft, prompts[:max(batch, 4)] if batch == 1 else prompts, args.max_tokens,
                              batch, temperature, tuple(args.n_drafts or (15, 3)))
        log(f"{key}: {json.dumps(report[key])}")
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
