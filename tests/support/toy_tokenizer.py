"""A toy byte-level BPE document for tokenizer tests."""

from musegl_core.tokenizer import GPT4O_PATTERN, byte_level_alphabet, byte_level_bpe_document


def toy_tokenizer_document() -> dict:
    """A 300-id vocabulary: bytes, one merge, control and user-defined tokens."""
    vocab = {symbol: i for i, symbol in enumerate(byte_level_alphabet())}
    vocab["he"] = 256
    added = [(260, "<|begin_of_text|>", True), (261, "<|end_of_text|>", True), (262, "<|eot|>", True),
             (263, "<think>", False)]
    return byte_level_bpe_document(vocab, [("h", "e")], added, pattern=GPT4O_PATTERN, ignore_merges=False)
