"""The language model's corpus: the English Wikipedia articles that ship inside gensim's
wheel as test data, tokenized once and cached as word ids.

The paper's language model (Fig. 8) trains on the One Billion Word benchmark, which no
package ships and no test may download. gensim's wheel carries a shortened dump of the
first English Wikipedia pages (``enwiki-latest-pages-articles1.xml-p000000010p000030302-
shortened.bz2``: 206 pages, about 100 of them articles, the rest redirects), real prose of
a few hundred thousand words, so the example trains on real English wherever gensim is
installed, offline. The text is Wikipedia's (CC BY-SA); gensim is LGPL-2.1.

Tokenization follows the Penn Treebank language-modelling setup (Mikolov's preprocessing,
the TensorFlow PTB tutorial's data): gensim's own ``extract_pages``/``filter_wiki`` strip
the markup, each article is cut at its trailing apparatus (See also, References, ...),
the text is split into sentences, lowercased, numbers become ``N``, punctuation goes, and
each sentence ends with ``<eos>``. The vocabulary is the ``vocab_size`` most frequent
words of the training articles plus ``<unk>`` for the rest, numbered by decreasing
frequency (``<unk>`` where its own count puts it), which is the order the log-uniform
candidate sampler of the sampled softmax assumes. The split is by article, in dump order:
the last articles are held out, test last, each holding at least ``HELD_OUT_FRACTION`` of
the words, so no sentence of a held-out article was seen in training.

Parsing takes a few seconds, so the ids are cached under ``$XDG_CACHE_HOME/flowmill/lm``
(``~/.cache`` by default), in a directory named for the gensim version, the vocabulary
size and ``FORMAT``: a new gensim (whose bundled file may differ) or a new tokenizer
builds afresh. Tasks of one job may build at the same time; each writes a directory of
its own and renames it into place, so a reader only ever sees a complete one. Where the
cache cannot be written (a read-only home), the corpus is tokenized on every run.
"""

from __future__ import annotations

import bz2
import json
import os
import re
import shutil
import tempfile
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

FORMAT = 1  # bump when tokenization or the split changes: the cache key includes it
DATA_FILE = "enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
DEFAULT_VOCAB_SIZE = 10_000
HELD_OUT_FRACTION = 0.05  # of all words, at least, for each of validation and test
EOS, UNK = "<eos>", "<unk>"
SPLITS = ("train", "valid", "test")

# Sections after which an article holds lists of links and citations, not prose.
_TAIL_SECTIONS = {
    "see also", "references", "external links", "further reading", "notes", "bibliography",
    "sources", "footnotes", "citations", "notes and references", "references and notes",
}
_HEADING = re.compile(r"^\s*(=+)\s*(.*?)\s*\1\s*$")
_SENTENCE_END = re.compile(r"(?<=[.!?])[\"')\]]*\s+(?=[\"'(\[]*[A-Z0-9])")
_WORD = re.compile(r"[^\W\d_]+(?:['’-][^\W\d_]+)*|\d+(?:[.,:/-]\d+)*")


class CorpusError(RuntimeError):
    """The corpus cannot be read or built; the message says what is missing."""


@dataclass(frozen=True)
class Corpus:
    """Word ids of the three splits (int32, sentences joined, each ending in ``<eos>``),
    the vocabulary (id -> word) and the articles each split holds (their titles)."""

    train: np.ndarray
    valid: np.ndarray
    test: np.ndarray
    vocab: tuple[str, ...]
    articles: dict[str, tuple[str, ...]]
    source: str

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def ids(self, split: str) -> np.ndarray:
        if split not in SPLITS:
            raise ValueError(f"unknown split {split!r}: one of {', '.join(SPLITS)}")
        return getattr(self, split)

    def words(self, ids: Iterable[int]) -> list[str]:
        return [self.vocab[i] for i in ids]

    def unigram_perplexity(self, split: str = "valid") -> float:
        """The perplexity of a model that knows only the training words' frequencies (add-one
        smoothed): what a language model has to beat."""
        counts = np.bincount(self.train, minlength=self.vocab_size).astype(np.float64) + 1.0
        logp = np.log(counts / counts.sum())
        return float(np.exp(-logp[self.ids(split)].mean()))


def _gensim():
    try:
        import gensim
    except ImportError:
        raise CorpusError(
            "the language model's corpus ships with gensim, which is not installed: "
            "pip install 'flowmill[examples]' (or pip install gensim)"
        ) from None
    return gensim


def data_file() -> Path:
    """The bundled dump inside the installed gensim."""
    gensim = _gensim()
    path = Path(gensim.__file__).parent / "test" / "test_data" / DATA_FILE
    if not path.is_file():
        raise CorpusError(
            f"gensim {gensim.__version__} does not ship {DATA_FILE} (looked at {path}); "
            "the corpus needs a gensim whose wheel carries its test data"
        )
    return path


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "flowmill" / "lm"


def cache_key(vocab_size: int) -> str:
    return f"gensim-{_gensim().__version__}-vocab{vocab_size}-v{FORMAT}"


# ---- text


def articles(path: Path) -> Iterator[tuple[str, str]]:
    """(title, plain text) of each article of the dump, in dump order; redirects and pages
    outside the main namespace are skipped."""
    from gensim.corpora.wikicorpus import extract_pages, filter_wiki

    with bz2.open(path) as f:
        for title, markup, _pageid in extract_pages(f, filter_namespaces=("0",)):
            if not markup or markup.lstrip()[:9].lower() == "#redirect":
                continue
            yield title, filter_wiki(markup)


def sentences(text: str) -> Iterator[list[str]]:
    """The article's sentences as lists of lowercased words, numbers as ``N``; headings,
    empty sentences and everything from a trailing section (References, ...) on left out."""
    for line in text.splitlines():
        heading = _HEADING.match(line)
        if heading:
            if heading.group(2).strip().lower() in _TAIL_SECTIONS:
                return
            continue
        line = line.replace("'''", "").replace("''", "").lstrip("*#:; ")
        for sentence in _SENTENCE_END.split(line):
            words = [
                "N" if w[0].isdigit() else w.lower().replace("’", "'")
                for w in _WORD.findall(sentence)
            ]
            if words:
                yield words


def tokenize(path: Path) -> list[tuple[str, list[str]]]:
    """(title, tokens with ``<eos>`` after each sentence) per article with any text."""
    out = []
    for title, text in articles(path):
        tokens = [w for s in sentences(text) for w in (*s, EOS)]
        if tokens:
            out.append((title, tokens))
    return out


def split_articles(docs: list, fraction: float = HELD_OUT_FRACTION) -> dict[str, list]:
    """Train, valid and test by article, in dump order: test takes articles from the end
    until it holds ``fraction`` of the words, valid the ones before it likewise."""
    total = sum(len(tokens) for _, tokens in docs)
    held: dict[str, list] = {"test": [], "valid": []}
    end = len(docs)
    for split in ("test", "valid"):
        words = 0
        while end > 1 and words < fraction * total:
            end -= 1
            held[split].insert(0, docs[end])
            words += len(docs[end][1])
    if not docs[:end] or not held["valid"] or not held["test"]:
        raise CorpusError(f"{len(docs)} articles are too few to split into train/valid/test")
    return {"train": docs[:end], **held}


def build_vocab(train_tokens: list[str], vocab_size: int) -> list[str]:
    """The ``vocab_size`` most frequent training words and ``<unk>``, by decreasing count
    (ties alphabetically), ``<unk>`` placed by the count of the words it stands for."""
    counts = Counter(train_tokens)
    if len(counts) < vocab_size:
        raise CorpusError(
            f"the training articles hold {len(counts)} distinct words, fewer than the "
            f"vocabulary size {vocab_size}"
        )
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    kept = ranked[:vocab_size]
    unk = sum(c for _, c in ranked[vocab_size:])
    return [w for w, _ in sorted([*kept, (UNK, unk)], key=lambda kv: (-kv[1], kv[0] != UNK))]


def build(vocab_size: int = DEFAULT_VOCAB_SIZE, path: Path | None = None) -> Corpus:
    """Parse the dump and number its words (no cache: ``load`` caches)."""
    path = data_file() if path is None else Path(path)
    if not path.is_file():
        raise CorpusError(f"the corpus file {path} does not exist")
    docs = tokenize(path)
    parts = split_articles(docs)
    vocab = build_vocab([w for _, tokens in parts["train"] for w in tokens], vocab_size)
    index = {w: i for i, w in enumerate(vocab)}
    unk = index[UNK]

    def ids(split: str) -> np.ndarray:
        tokens = [w for _, t in parts[split] for w in t]
        return np.fromiter((index.get(w, unk) for w in tokens), np.int32, len(tokens))

    return Corpus(
        ids("train"), ids("valid"), ids("test"), tuple(vocab),
        {s: tuple(title for title, _ in parts[s]) for s in SPLITS}, str(path),
    )


# ---- the cache


def load(vocab_size: int = DEFAULT_VOCAB_SIZE, cache_dir: str | os.PathLike | None = None,
         log=None) -> Corpus:
    """The corpus from the cache, built (and cached) first if it is not there yet."""
    if not isinstance(vocab_size, int) or vocab_size < 2:
        raise ValueError(f"vocab_size must be an int >= 2, got {vocab_size!r}")
    root = Path(cache_dir) if cache_dir is not None else cache_root()
    where = root / cache_key(vocab_size)  # imports gensim: a missing one is named here
    if not (where / "meta.json").is_file():
        if log:
            log(f"lm corpus: tokenizing {DATA_FILE} (once; cached in {where})")
        corpus = build(vocab_size)
        try:
            _save(corpus, where)
        except OSError as e:  # a read-only home (a hardened pod): tokenize on every run
            if log:
                log(f"lm corpus: cannot cache in {where} ({e.strerror or e}); not cached")
            return corpus
    return _read(where)


def _save(corpus: Corpus, where: Path) -> None:
    where.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".building-", dir=where.parent))
    try:
        tmp.chmod(0o755)  # mkdtemp's is private; the cache is not
        for split in SPLITS:
            np.save(tmp / f"{split}.npy", corpus.ids(split))
        (tmp / "vocab.txt").write_text("\n".join(corpus.vocab) + "\n", encoding="utf-8")
        meta = {"source": corpus.source, "articles": corpus.articles, "format": FORMAT,
                "words": {s: int(corpus.ids(s).size) for s in SPLITS}}
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1), encoding="utf-8")
        try:
            os.rename(tmp, where)  # atomic; fails if another task got there first
        except OSError:
            if not (where / "meta.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _read(where: Path) -> Corpus:
    try:
        meta = json.loads((where / "meta.json").read_text(encoding="utf-8"))
        vocab = tuple((where / "vocab.txt").read_text(encoding="utf-8").splitlines())
        ids = {s: np.load(where / f"{s}.npy") for s in SPLITS}
    except (OSError, ValueError) as e:
        raise CorpusError(f"the cached corpus in {where} is unreadable ({e}); delete it") from e
    for s in SPLITS:
        if ids[s].size != meta["words"][s] or (ids[s].size and ids[s].max() >= len(vocab)):
            raise CorpusError(f"the cached corpus in {where} is damaged ({s}); delete it")
    articles_ = {s: tuple(meta["articles"][s]) for s in SPLITS}
    return Corpus(ids["train"], ids["valid"], ids["test"], vocab, articles_, meta["source"])


def batches(ids: np.ndarray, batch_size: int, num_steps: int) -> tuple[np.ndarray, int]:
    """The PTB reader's layout: ``ids`` cut into ``batch_size`` rows read in parallel, each
    a contiguous stretch of the text, so the state a batch ends in is where the next batch
    of the same row starts. Returns the ``[batch_size, row_len]`` array and how many
    batches of ``num_steps`` words (inputs, with targets one word on) an epoch holds."""
    row_len = ids.size // batch_size
    epoch = (row_len - 1) // num_steps
    if epoch < 1:
        raise ValueError(
            f"{ids.size} words are too few for batches of {batch_size} x {num_steps} words "
            "plus one"
        )
    return ids[: batch_size * row_len].reshape(batch_size, row_len), epoch


def batch(rows: np.ndarray, num_steps: int, i: int) -> tuple[np.ndarray, np.ndarray]:
    """Batch ``i`` of an epoch over ``rows``: inputs and the targets, one word on."""
    x = rows[:, i * num_steps : (i + 1) * num_steps]
    y = rows[:, i * num_steps + 1 : (i + 1) * num_steps + 1]
    return x, y


def main() -> None:
    """Print what the corpus holds (``python examples/lm/corpus.py``)."""
    corpus = load(log=print)
    for s in SPLITS:
        print(f"{s}: {corpus.ids(s).size:,} words in {len(corpus.articles[s])} articles")
    print(f"vocabulary: {corpus.vocab_size:,} words; first: {' '.join(corpus.vocab[:12])}")
    print(f"unigram perplexity on valid: {corpus.unigram_perplexity():.1f}")
    print(" ".join(corpus.words(corpus.valid[:60])))


if __name__ == "__main__":
    main()
