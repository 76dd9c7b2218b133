"""Text for the GPT chapters, character by character: a real corpus when one is on disk, else generated text.

* **On disk** (``--dataset auto`` finds it, ``--dataset file`` insists): ``<data-root>/text/input.txt``, any UTF-8
  text, for example Karpathy's tiny Shakespeare (``curl -o data/text/input.txt https://raw.githubusercontent.com/
  karpathy/char-rnn/master/data/tinyshakespeare/input.txt``). Nothing is downloaded at run time.
* **Generated** (``--dataset generated``, or ``auto`` when no file is there): sentences from a small grammar
  (:func:`generate_text`), announced as such by the scripts, like the synthetic CIFAR fallback. It has structure a
  model can learn (spelling within words, which word class follows which, a full stop and a capital), and it is the
  same on every machine for the same seed.

:func:`text_datasets` cuts the characters into windows of ``seq_len + 1`` (input and the next-character targets),
90% for training and the rest held out; :func:`unigram_loss` is the baseline a model must beat: the cross-entropy
of predicting every character from its frequency alone, ignoring context.

Example::

    train, test, info = text_datasets(seq_len=64, data_root="data", dataset="auto", seed=0)
    x, y = train[0]                     # two (64,) int64 tensors, y is x shifted by one character
    info.vocab_size, info.unigram_loss  # e.g. 31, 2.86 (nats per character)
"""
from __future__ import annotations

import math
import random
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils.data import Dataset

CORPUS_FILE = Path("text") / "input.txt"
GENERATED_CHARS = 400_000

_WORDS = {
    "det": ["the", "a", "every", "one", "that"],
    "adj": ["small", "quiet", "bright", "old", "quick", "green", "heavy", "little"],
    "noun": ["rank", "node", "model", "batch", "gradient", "worker", "kernel", "tensor", "cluster", "device"],
    "verb": ["sends", "gathers", "reduces", "shards", "waits for", "checks", "copies", "trains"],
    "adv": ["quickly", "again", "slowly", "twice", "early", "at last"],
    "prep": ["on", "with", "after", "before", "across", "near"],
}


def generate_text(n_chars: int = GENERATED_CHARS, seed: int = 0) -> str:
    """``n_chars`` characters of sentences like "The quick rank sends a small tensor across the node again." from a
    fixed grammar and word list, drawn with ``random.Random(seed)``: the same text on every machine."""
    rng = random.Random(seed)

    def phrase():
        words = [rng.choice(_WORDS["det"])]
        if rng.random() < 0.5:
            words.append(rng.choice(_WORDS["adj"]))
        return words + [rng.choice(_WORDS["noun"])]

    sentences, total = [], 0
    while total < n_chars:
        words = phrase() + [rng.choice(_WORDS["verb"])] + phrase()
        if rng.random() < 0.4:
            words += [rng.choice(_WORDS["prep"])] + phrase()
        if rng.random() < 0.3:
            words.append(rng.choice(_WORDS["adv"]))
        sentence = " ".join(words)
        sentence = sentence[0].upper() + sentence[1:] + "."
        sentences.append(sentence)
        total += len(sentence) + 1
    return " ".join(sentences)[:n_chars]


@dataclass(frozen=True)
class TextInfo:
    name: str            # "file" or "generated"
    source: str          # the file's path, or how the text was generated
    vocab: str           # the characters, in token order
    chars: int           # characters in the corpus
    unigram_loss: float  # nats per character: cross-entropy of the training text's character frequencies

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def decode(self, tokens) -> str:
        return "".join(self.vocab[int(t)] for t in tokens)


class Windows(Dataset):
    """Windows of ``seq_len + 1`` tokens starting every ``seq_len`` tokens: item i is (x, y), y = x shifted by one."""

    def __init__(self, tokens: torch.Tensor, seq_len: int):
        if tokens.numel() < seq_len + 1:
            raise ValueError(f"{tokens.numel()} tokens cannot hold one window of seq_len + 1 = {seq_len + 1}")
        self.tokens, self.seq_len = tokens, seq_len

    def __len__(self) -> int:
        return (self.tokens.numel() - 1) // self.seq_len

    def __getitem__(self, i: int):
        start = i * self.seq_len
        chunk = self.tokens[start:start + self.seq_len + 1]
        return chunk[:-1], chunk[1:]


def unigram_loss(tokens: torch.Tensor, vocab_size: int) -> float:
    """Cross-entropy (nats per token) of predicting each token of ``tokens`` by its frequency in ``tokens``: the best
    a model that ignores context can do."""
    counts = Counter(tokens.tolist())
    n = tokens.numel()
    return -sum(c / n * math.log(c / n) for c in counts.values())


def load_text(data_root: str | Path, dataset: str = "auto", seed: int = 0) -> tuple[str, str, str]:
    """(text, name, source): the corpus file under ``data_root`` when it is there (or ``dataset="file"``, which
    fails with what to do when it is not), else the generated text."""
    if dataset not in ("auto", "file", "generated"):
        raise ValueError(f"dataset must be auto, file or generated, got {dataset!r}")
    path = Path(data_root) / CORPUS_FILE
    if dataset == "file" or (dataset == "auto" and path.is_file()):
        if not path.is_file():
            raise FileNotFoundError(f"--dataset file needs a UTF-8 text at {path}; put one there (see "
                                    "helpers/rank/text.py), or use --dataset generated")
        return path.read_text(encoding="utf-8"), "file", str(path)
    return generate_text(seed=seed), "generated", f"generated: a small grammar, seed {seed}, {GENERATED_CHARS} chars"


def text_datasets(seq_len: int, data_root: str | Path = "data", dataset: str = "auto", seed: int = 0,
                  train_windows: int | None = None):
    """(train, test, info): character windows of the corpus, the first 90% for training (the first
    ``train_windows`` of them when given), the rest held out."""
    text, name, source = load_text(data_root, dataset, seed)
    vocab = "".join(sorted(set(text)))
    index = {c: i for i, c in enumerate(vocab)}
    tokens = torch.tensor([index[c] for c in text], dtype=torch.int64)
    split = int(0.9 * tokens.numel())
    train_tokens, test_tokens = tokens[:split], tokens[split:]
    if train_windows is not None:
        train_tokens = train_tokens[:train_windows * seq_len + 1]
    info = TextInfo(name, source, vocab, len(text), unigram_loss(train_tokens, len(vocab)))
    return Windows(train_tokens, seq_len), Windows(test_tokens, seq_len), info


def announcement(info: TextInfo) -> str:
    """The line a script logs about its text, like the synthetic CIFAR announcement."""
    if info.name == "generated":
        return (f"text: no corpus at <data-root>/{CORPUS_FILE}, so GENERATED text ({info.source}); "
                f"{info.vocab_size} characters, unigram baseline {info.unigram_loss:.3f} nats/char")
    return f"text: {info.source}, {info.chars} characters, {info.vocab_size} distinct, unigram baseline " \
           f"{info.unigram_loss:.3f} nats/char"
