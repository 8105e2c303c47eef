"""Content words of a text, as a retriever without synonyms sees them: lowercased, stop
words dropped, Porter-stemmed (nltk's stemmer needs no data files). The generator uses this
to prove that a paraphrase question shares no word with its evidence and that a distractor
turn shares several with its question."""

from __future__ import annotations

import re
from functools import lru_cache

from nltk.stem.porter import PorterStemmer

# Function words only: a short list keeps the check strict (a word like "move" or "live"
# must count as content, or a question could repeat it and still pass).
STOP_WORDS = frozenset("""
a about above after again against all also am an and any are as at be because been before being below
between both but by can could did do does doing done down during each even ever few for from further get
gets got had has have having he her here hers herself him himself his how i if in into is it its itself
just let lol me might more most much must my myself no nor not now of off oh ok okay on once only or other
our ours ourselves out over own really same shall she should so some such than that the their theirs them
themselves then there these they this those through to too under until up us very was we were what when
where which while who whom whose why will with would yeah yes you your yours yourself yourselves haha
hey hi s t m d ll re ve
""".split())

_WORD = re.compile(r"[a-z0-9]+")
_stemmer = PorterStemmer()


@lru_cache(maxsize=65536)
def _stem(word: str) -> str:
    return _stemmer.stem(word)


def content_stems(text: str) -> frozenset[str]:
    """The stems of the non-stop words of `text` (apostrophes split words: "I'm" -> i, m)."""
    return frozenset(_stem(w) for w in _WORD.findall(text.lower()) if w not in STOP_WORDS)


def shared_stems(a: str, b: str) -> frozenset[str]:
    return content_stems(a) & content_stems(b)
