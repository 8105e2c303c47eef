"""ReplyText gives, token by token, what decoding the whole reply gives."""

import random

from agentmem.engine.detokenize import ReplyText


def _grown(decode, ids):
    rt = ReplyText(decode)
    return [(rt.text(ids[: i + 1]), decode(ids[: i + 1])) for i in range(len(ids))]


def test_every_prefix_of_a_reply_reads_as_its_whole_decode(engine):
    text = ("Naïve café owners in Zürich said “hello” 👋🏽 — 東京 is far, "
            "and    spaces\n\nstay put. Ça va? Sí! ") * 3
    ids = engine.encode(text)
    for got, want in _grown(engine.decode, ids):
        assert got == want
    rng = random.Random(0)
    for _ in range(5):  # arbitrary ids: byte pieces that never complete a character
        ids = [rng.randrange(engine.tokenizer.vocab_size) for _ in range(60)]
        for got, want in _grown(engine.decode, ids):
            assert got == want


def test_a_reply_cut_back_or_replaced_is_decoded_anew(engine):
    ids = engine.encode("one two three four five six seven eight nine ten")
    rt = ReplyText(engine.decode)
    for i in range(len(ids)):
        rt.text(ids[: i + 1])
    assert rt.text(ids[:3]) == engine.decode(ids[:3])  # a loop rolled back
    other = engine.encode("a different reply altogether")
    assert rt.text(other) == engine.decode(other)
    assert rt.text(other + ids[:2]) == engine.decode(other + ids[:2])


def test_a_decoder_that_drops_a_leading_space_is_read_with_context():
    # SentencePiece-like: the text's first piece loses its leading space
    vocab = {1: " hello", 2: " world", 3: "!", 4: " again"}

    def decode(ids):
        return "".join(vocab[i] for i in ids).removeprefix(" ")

    ids = [1, 2, 3, 4, 2, 3]
    for got, want in _grown(decode, ids):
        assert got == want


def test_decoding_only_the_tail_costs_a_few_tokens_a_step():
    seen = []

    def whole(ids):
        return "".join(chr(97 + i % 26) for i in ids)

    def decode(ids):
        seen.append(len(ids))
        return whole(ids)

    rt = ReplyText(decode)
    ids = list(range(300))
    for i in range(len(ids)):
        assert rt.text(ids[: i + 1]) == whole(ids[: i + 1])
    assert len(seen) <= 2 * len(ids) and max(seen) <= 5  # the context and the tail, never the reply


def test_engine_decode_gives_what_the_tokenizers_own_decode_gives(engine):
    """Engine.decode skips HF's Python wrapper where it would add nothing: the same text,
    special tokens left out, for ordinary text, arbitrary ids and end-of-turn ids."""
    rng = random.Random(1)
    special = sorted(engine.tokenizer.all_special_ids)
    cases = [engine.encode("Hello there, 東京 👋 and   spaces.")]
    cases += [[rng.randrange(engine.tokenizer.vocab_size) for _ in range(40)] + special for _ in range(5)]
    for ids in cases:
        assert engine.decode(ids) == engine.tokenizer.decode(ids, skip_special_tokens=True)
    assert special and all(engine.tokenizer.convert_ids_to_tokens(i) not in engine.decode(special) for i in special)
