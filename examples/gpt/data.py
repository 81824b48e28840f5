"""Training text from a small probabilistic grammar, generated locally and deterministically.

Documents of English-like sentences over a synthetic word-level vocabulary. The structure
a language model can learn, from easy to hard:
  * syntax: determiner, adjectives, noun, verb, object, punctuation;
  * local agreement: "a"/"an" by the next word's first letter, singular/plural nouns with
    matching determiners and verb forms ("the brel glorps", "these brels glorp");
  * document-level consistency: one tense and one topic per document (a topic owns its
    nouns, verbs and adjectives), and a few names that recur within a document.
Within a word class, words follow a Zipf law, as in natural text.
"""
from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from itertools import accumulate, chain, islice

import torch

DOC = "<doc>"  # starts every document; also the natural "beginning of stream" token
PUNCT = [".", ",", "?"]
DET_SING = ["the", "a", "this", "that", "every", "my", "his", "her", "their", "our"]
DET_PLUR = ["the", "these", "those", "some", "many", "my", "his", "her", "their", "our"]
PREPS = ["of", "in", "on", "with", "near", "under", "over", "behind", "for", "from"]
CONJ = ["and", "but", "because", "while", "so", "when"]
ADVS_COMMON = ["very", "quite", "rather", "not", "never", "often"]
PRONOUNS = {"sing": ["he", "she", "it"], "plur": ["they", "we"]}
OTHER = ["an", "is", "are", "was", "were", "who", "then", "also"]

ONSETS = ["b", "br", "c", "ch", "cl", "d", "dr", "f", "fl", "g", "gl", "gr", "h", "j", "k",
          "l", "m", "n", "p", "pl", "pr", "qu", "r", "s", "sh", "sk", "sl", "sp", "st", "t",
          "th", "tr", "v", "w", "y", "z"]
VOWELS = ["a", "e", "i", "o", "u", "ai", "ea", "ee", "oo", "ou", "oa"]
CODAS = ["", "", "", "n", "r", "l", "m", "nd", "ck", "sh", "x", "rt", "mp"]


@dataclass(frozen=True)
class Topic:
    nouns: tuple[str, ...]       # singular stems; plural adds "s"
    verbs_t: tuple[str, ...]     # transitive stems; "s" present singular, "ed" past
    verbs_i: tuple[str, ...]     # intransitive, same inflections
    adjectives: tuple[str, ...]


def _zipf_cum(n: int) -> list[float]:
    """Cumulative Zipf weights for ``random.choices`` (rank r has weight 1/r)."""
    return list(accumulate(1.0 / (r + 1) for r in range(n)))


class Language:
    """A seeded grammar with its vocabulary; ``seed`` fixes the words, not the text."""

    def __init__(self, n_topics: int = 8, nouns: int = 32, verbs_t: int = 12, verbs_i: int = 8,
                 adjectives: int = 16, names: int = 256, seed: int = 0) -> None:
        rng = random.Random(seed)
        self._used = set(DET_SING + DET_PLUR + PREPS + CONJ + ADVS_COMMON + OTHER + PUNCT
                         + PRONOUNS["sing"] + PRONOUNS["plur"] + [DOC])
        self.topics = [
            Topic(nouns=self._words(rng, nouns, ["", "s"]),
                  verbs_t=self._words(rng, verbs_t, ["", "s", "ed"]),
                  verbs_i=self._words(rng, verbs_i, ["", "s", "ed"]),
                  adjectives=self._words(rng, adjectives, [""]))
            for _ in range(n_topics)]
        self.names = tuple(w.capitalize() for w in self._words(rng, names, [""]))
        self._used.update(self.names)
        self.vocab = sorted(self._used)
        self.index = {w: i for i, w in enumerate(self.vocab)}
        self._cum = {n: _zipf_cum(n) for n in {nouns, verbs_t, verbs_i, adjectives}}

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def _words(self, rng: random.Random, n: int, suffixes: list[str]) -> tuple[str, ...]:
        """``n`` new pseudo-words of 1-2 syllables whose inflected forms are all unused."""
        out: list[str] = []
        while len(out) < n:
            stem = "".join(rng.choice(ONSETS) + rng.choice(VOWELS) + rng.choice(CODAS)
                           for _ in range(rng.choice((1, 2, 2))))
            forms = [stem + s for s in suffixes]
            if len(stem) > 2 and not any(f in self._used for f in forms):
                self._used.update(forms)
                out.append(stem)
        return tuple(out)

    # -- the grammar -------------------------------------------------------------------

    def _pick(self, rng: random.Random, words: Sequence[str]) -> str:
        return rng.choices(words, cum_weights=self._cum[len(words)])[0]

    def _noun_phrase(self, rng: random.Random, topic: Topic, plural: bool) -> list[str]:
        det = rng.choice(DET_PLUR if plural else DET_SING)
        adjs = [self._pick(rng, topic.adjectives) for _ in range(rng.choice((0, 0, 1, 1, 2)))]
        noun = self._pick(rng, topic.nouns) + ("s" if plural else "")
        words = adjs + [noun]
        if det == "a" and words[0][0] in "aeiou":
            det = "an"
        return [det] + words

    def _subject(self, rng: random.Random, topic: Topic, names: list[str], past: bool
                 ) -> tuple[list[str], bool]:
        """A subject and whether it is plural."""
        r = rng.random()
        if r < 0.25:
            return [rng.choice(names)], False
        if r < 0.35:
            plural = rng.random() < 0.4
            return [rng.choice(PRONOUNS["plur" if plural else "sing"])], plural
        plural = rng.random() < 0.4
        np_ = self._noun_phrase(rng, topic, plural)
        if rng.random() < 0.2:  # a relative clause between subject and verb: agreement at a distance
            np_ += ["who"] + self._verb_phrase(rng, topic, names, plural, past, short=True)
        return np_, plural

    def _verb(self, stem: str, plural: bool, past: bool) -> str:
        return stem + ("ed" if past else "" if plural else "s")

    def _verb_phrase(self, rng: random.Random, topic: Topic, names: list[str], plural: bool,
                     past: bool, short: bool = False) -> list[str]:
        r = rng.random()
        if r < 0.45:  # transitive: verb + object
            obj = [rng.choice(names)] if rng.random() < 0.2 else \
                self._noun_phrase(rng, topic, rng.random() < 0.4)
            vp = [self._verb(self._pick(rng, topic.verbs_t), plural, past)] + obj
        elif r < 0.75:  # intransitive, maybe with a place
            vp = [self._verb(self._pick(rng, topic.verbs_i), plural, past)]
            if not short and rng.random() < 0.5:
                vp += [rng.choice(PREPS)] + self._noun_phrase(rng, topic, rng.random() < 0.4)
        else:  # copula + adjective
            be = ("were" if plural else "was") if past else ("are" if plural else "is")
            adv = [rng.choice(ADVS_COMMON)] if rng.random() < 0.4 else []
            vp = [be] + adv + [self._pick(rng, topic.adjectives)]
        return vp

    def _clause(self, rng: random.Random, topic: Topic, names: list[str], past: bool) -> list[str]:
        subject, plural = self._subject(rng, topic, names, past)
        return subject + self._verb_phrase(rng, topic, names, plural, past)

    def _sentence(self, rng: random.Random, topic: Topic, names: list[str], past: bool) -> list[str]:
        words = self._clause(rng, topic, names, past)
        if rng.random() < 0.3:
            words += [",", rng.choice(CONJ)] + self._clause(rng, topic, names, past)
        return words + ["."]

    def document(self, rng: random.Random) -> list[str]:
        """One document: a topic, a tense and two names kept for 3-7 sentences."""
        topic = rng.choice(self.topics)
        names = rng.sample(self.names, 2)
        past = rng.random() < 0.5
        words = [DOC]
        for _ in range(rng.randint(3, 7)):
            words += self._sentence(rng, topic, names, past)
        return words

    # -- tokenizer ---------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        """Word-level: the grammar's output is whitespace-separated words and punctuation."""
        return [self.index[w] for w in text.split()]

    def decode(self, ids: Sequence[int]) -> str:
        return " ".join(self.vocab[i] for i in ids)

    def sample_text(self, seed: int = 0, documents: int = 2) -> str:
        rng = random.Random(seed)
        return "\n".join(" ".join(self.document(rng)) for _ in range(documents))


def batches(lang: Language, batch_size: int, seq_len: int, seed: int
            ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Endless (inputs, targets) int64 batches of shape (batch_size, seq_len).

    Documents are packed into one stream (GPT-style) that is cut into rows of
    ``seq_len + 1`` tokens; targets are the inputs shifted by one. The stream depends on
    ``seed`` only, so every run with the same seed sees the same batches.
    """
    rng = random.Random(seed)
    need = batch_size * (seq_len + 1)
    buf: list[int] = []
    while True:
        while len(buf) < need:
            buf += [lang.index[w] for w in lang.document(rng)]
        rows = torch.tensor(buf[:need], dtype=torch.int64).view(batch_size, seq_len + 1)
        del buf[:need]
        yield rows[:, :-1], rows[:, 1:]


def made_ahead(lang: Language, batch_size: int, seq_len: int, seed: int, count: int,
               device: torch.device, most: int = 256) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """``batches`` on ``device``, the first ``count`` of them (up to ``most``) made before
    training starts, as a DataLoader's workers would have them ready: one batch of 8 x 1024
    takes about 15 ms of Python to make (``bench/measured/h200-j-7b-*``, ``between.data``),
    which a timed iteration should not hold. Those after are made as they are read."""
    stream = batches(lang, batch_size, seq_len, seed)
    ready = [tuple(t.to(device) for t in b) for b in islice(stream, min(count, most))]
    return chain(ready, (tuple(t.to(device) for t in b) for b in stream))
