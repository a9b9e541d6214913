"""The language-model example as a user runs it: its corpus (gensim's bundled Wikipedia
articles), the script in one process, and the same script as a local job of 2 PS tasks
and 2 workers through ``flowmill run --local``. Sizes are tiny so the whole file stays
well under two minutes on two cores; what is asserted is behaviour: the vocabulary and
the split, perplexity falling from the untrained model's (about the vocabulary size),
and, in the job, each table's shards on distinct PS tasks and each worker on its half."""

from __future__ import annotations

import bz2
import importlib.util
import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest
import yaml

pytest.importorskip("gensim", reason="the language model's corpus ships in gensim's wheel")

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "lm"
SCRIPT = EXAMPLE / "train.py"
LAST_LINE = re.compile(r"^test_perplexity: (\d+\.\d\d)$")
CURVE = re.compile(r"^step +(\d+) +global +\d+ +sampled loss +\S+ +train ppl +([\d.]+) +"
                   r"valid ppl +([\d.]+)")
TINY = ["--hidden", "32", "32", "--batch-size", "16", "--num-steps", "10",
        "--num-sampled", "128", "--eval-words", "1000",
        "--final-eval-words", "3000"]


@pytest.fixture(scope="module")
def corpus_module():
    """examples/lm/corpus.py under a name of its own (other examples have a corpus too)."""
    name = "flowmill_example_lm_corpus"
    spec = importlib.util.spec_from_file_location(name, EXAMPLE / "corpus.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while it loads
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(name, None)


@pytest.fixture(scope="module")
def corpus(corpus_module):
    return corpus_module.load()


def _curve(stdout: str) -> list[tuple[int, float, float]]:
    """(step, train ppl, valid ppl) of each log line (job lines lose their prefix)."""
    points = []
    for line in stdout.splitlines():
        match = CURVE.match(re.sub(r"^\[worker-\d\] ", "", line))
        if match:
            points.append((int(match.group(1)), float(match.group(2)), float(match.group(3))))
    return points


# ---- the corpus


def test_corpus_vocabulary_split_and_determinism(corpus_module, corpus):
    assert corpus.vocab_size == 10_001 and len(set(corpus.vocab)) == corpus.vocab_size
    assert {"<unk>", "<eos>", "the"} <= set(corpus.vocab)
    # Ids are by decreasing training frequency, which the log-uniform sampler assumes.
    counts = np.bincount(corpus.train, minlength=corpus.vocab_size)
    assert (np.diff(counts) <= 0).all() and counts.min() > 0
    assert corpus.train.size > 300_000 and min(corpus.valid.size, corpus.test.size) > 20_000
    # Split by article: the held-out articles are disjoint from training, test last.
    titles = corpus.articles
    assert not set(titles["train"]) & (set(titles["valid"]) | set(titles["test"]))
    assert not set(titles["valid"]) & set(titles["test"])
    # ... and they are the dump's last articles, in its order: valid, then test.
    from gensim.corpora.wikicorpus import extract_pages

    with bz2.open(corpus_module.data_file()) as f:
        dump = [title for title, _, _ in extract_pages(f, filter_namespaces=("0",))]
    held = [*titles["valid"], *titles["test"]]
    assert [t for t in dump if t in set(held)] == held
    assert dump.index(held[0]) > max(dump.index(t) for t in titles["train"])
    # Built again from the dump (no cache): the very same ids, vocabulary and split.
    fresh = corpus_module.build()
    for split in corpus_module.SPLITS:
        np.testing.assert_array_equal(fresh.ids(split), corpus.ids(split))
    assert fresh.vocab == corpus.vocab and fresh.articles == corpus.articles
    assert corpus.words(corpus.valid[:3]) == ["azerbaijan", "officially", "the"]
    with pytest.raises(ValueError, match="unknown split 'dev'"):
        corpus.ids("dev")


def test_a_cache_that_cannot_be_written_is_skipped(corpus_module, corpus, monkeypatch):
    # A hardened pod's home is read-only: the corpus is then tokenized and not cached.
    monkeypatch.setattr(corpus_module, "build", lambda vocab_size: corpus)
    said: list[str] = []
    got = corpus_module.load(cache_dir="/proc/no-such-dir", log=said.append)
    assert got is corpus and "not cached" in said[-1]


def test_corpus_errors_name_what_is_missing(corpus_module, tmp_path, monkeypatch):
    with pytest.raises(corpus_module.CorpusError, match="does not exist"):
        corpus_module.build(path=tmp_path / "missing.xml.bz2")
    monkeypatch.setitem(sys.modules, "gensim", None)  # as if gensim were not installed
    with pytest.raises(corpus_module.CorpusError, match="gensim, which is not installed"):
        corpus_module.load(cache_dir=tmp_path)


def test_bad_flags_are_named():
    for argv, message in [
        (["--optimizer", "adam"], "invalid choice: 'adam'"),
        (["--num-sampled", "20000"], "--num-sampled 20000 must be below --vocab-size 10000"),
        (["--dropout", "1.5"], "--dropout must be in"),
        (["--vocab-size", "500"], "--vocab-size must be at least 10,000"),
        (["--hidden", "0"], "--hidden sizes must be positive"),
    ]:
        proc = subprocess.run([sys.executable, "-c", "import sys; sys.path.insert(0, sys.argv[1]);"
                               "import train; train.parse_args(sys.argv[2:])",
                               str(EXAMPLE), *argv], capture_output=True, text=True, cwd="/")
        assert proc.returncode == 2 and message in proc.stderr, (argv, proc.stderr[-500:])


# ---- training


@pytest.mark.slow
def test_one_process_perplexity_falls_from_the_untrained_model():
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--steps", "80", "--log-every", "40", *TINY],
        capture_output=True, text=True, timeout=240, cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.rstrip("\n").splitlines()
    match = LAST_LINE.match(lines[-1])
    assert match, f"last stdout line is {lines[-1]!r}, expected 'test_perplexity: <value>'"
    curve = _curve(proc.stdout)
    assert [step for step, _, _ in curve] == [0, 40, 80], proc.stdout
    (_, train0, valid0), *_, (_, train_end, valid_end) = curve
    # Untrained, every word is about equally likely: perplexity near the vocabulary size.
    assert 5_000 < valid0 < 20_000 and 5_000 < train0 < 20_000
    assert valid_end < valid0 / 5 and train_end < train0 / 5, curve
    assert float(match.group(1)) < valid0 / 5
    assert "1 shard(s) per table" in lines[0]


@pytest.mark.slow
def test_a_local_job_of_two_ps_and_two_workers_reports_perplexity(tmp_path):
    manifest = yaml.safe_load((EXAMPLE / "job.yaml").read_text())
    container = manifest["spec"]["replicaSpecs"]["worker"]["template"]["spec"]["containers"][0]
    # The manifest's own flags first (its optimizer), then a tiny model's.
    container["args"] = [*container["args"], "--steps", "80", "--log-every", "20", *TINY]
    # Two cores, four processes starting at once: a generous allowance before a stall.
    manifest["spec"]["runPolicy"] = {"stallTimeoutSeconds": 300}
    path = tmp_path / "lm.yaml"
    path.write_text(yaml.safe_dump(manifest))
    proc = subprocess.run(
        [sys.executable, "-m", "flowmill.launcher.cli", "run", str(path), "--local"],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    out = proc.stdout
    chief = [line for line in out.splitlines() if line.startswith("[worker-0] ")]
    match = LAST_LINE.match(chief[-1].removeprefix("[worker-0] "))
    assert match, f"the chief's last line is {chief[-1]!r}"
    # Each worker trains on its half of the text; each table has a shard on each PS.
    words = re.findall(r"\[worker-(\d)\] lm: worker \1 of 2, ([\d,]+) train words", out)
    assert sorted(i for i, _ in words) == ["0", "1"] and len({n for _, n in words}) == 1
    assert "2 shard(s) per table" in out
    for table in ("embedding", "softmax_w", "softmax_b"):
        found = re.search(rf"\[worker-0\] {table}: 2 shard\(s\) on (ps:\d), (ps:\d)\n", out)
        assert found and {found[1], found[2]} == {"ps:0", "ps:1"}, out[-3000:]
    # The chief's first line may come after the other worker's first steps (async), so the
    # untrained model's perplexity is the vocabulary size's order, as in one process.
    curve = _curve(out)
    assert curve[0][0] == 0 and curve[-1][2] < 10_001 / 5, curve
    assert float(match.group(1)) < 10_001 / 5
    assert "flowmill: job lm succeeded" in proc.stderr
