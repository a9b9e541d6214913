"""One training step of the paper's LSTM language model: Flowmill beside PyTorch, and the
model as a local job over 1, 2 and 4 workers with 1 and 2 PS tasks (the paper's Fig. 9).

The model is ``examples/lm/train.py``'s, built by its ``build_model``: an embedding,
a 2-layer LSTM run over ``--num-steps`` words by ``dynamic_rnn``, sampled softmax over
the vocabulary, gradients clipped by global norm, plain SGD. The default size is the
paper's LSTM-512-512 (over a 10,000-word vocabulary here, 40,000 in the paper), batch 64,
20 words per truncated-BPTT batch, 1024 sampled classes.

PyTorch runs the same step eagerly: ``torch.nn.Embedding`` and ``torch.nn.LSTM`` (two
layers, its fused CPU kernel), the sampled softmax written out in torch exactly as
Flowmill computes it (true and sampled rows looked up together, log-expected-count
correction, accidental hits removed), sparse embedding gradients (only touched rows are
updated, as Flowmill's IndexedSlices are), the same global-norm clipping and SGD. Both
start from the same weights (Flowmill's initial values, the LSTM gates reordered into
torch's layout), read the same batches of the corpus (gensim's Wikipedia articles, or
Zipf-distributed word ids where gensim is missing: ``data`` says which) and use the same
sampled candidates per step, drawn here and fed to both, so the losses after the first
and the last step can be compared (they agree to float32 rounding). torch's LSTM has two
bias vectors per layer where Flowmill's cell has one: the second is held at zero and not
trained (trained, it would double the bias's step). Each carries its LSTM state from
batch to batch.

Thread counts are fixed before NumPy and PyTorch load (``--threads``, default 1, as in
``mlp_step.py``); steps are timed in interleaved blocks, the figure is the median block.
``words_per_s`` is ``batch * num_steps`` words over the median step time.

``--distributed`` (on by default; ``--no-distributed`` skips it) then runs the model as
local jobs through ``flowmill run --local``: async training, 1 or 2 PS tasks (one shard
of each table per PS task), 1, 2 or 4 workers, each worker this script with ``--worker``.
Workers warm up, meet at a barrier (files in a directory the bench owns), take
``--dist-steps`` timed steps and write when they started and ended; the job's figure is
all the words its workers trained over the span from the first start to the last end.
On a two-core machine the processes share two cores, so the numbers show contention,
not scaling; they are reported as measured.

    python bench/lm_step.py [--hidden 512 512] [--batch 64] [--num-steps 20]
        [--num-sampled 1024] [--threads 1] [--blocks 5] [--block-steps 3]
        [--workers 1,2,4] [--ps 1,2] [--dist-steps 8] [--no-distributed] [--quick]

The last line of output is one JSON object.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, nargs="+", default=[512, 512])
    p.add_argument("--vocab", type=int, default=10_000, help="words besides <unk>")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--num-steps", type=int, default=20)
    p.add_argument("--num-sampled", type=int, default=1024)
    p.add_argument("--lr", type=float, default=0.5)
    p.add_argument("--clip-norm", type=float, default=5.0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--blocks", type=int, default=5, help="timed blocks per framework")
    p.add_argument("--block-steps", type=int, default=3, help="steps per timed block")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per framework")
    p.add_argument("--only", default="", help="flowmill,torch: the frameworks to time")
    p.add_argument("--distributed", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--workers", default="1,2,4")
    p.add_argument("--ps", default="1,2")
    p.add_argument("--dist-steps", type=int, default=8, help="timed steps per worker")
    p.add_argument("--dist-warmup", type=int, default=2)
    p.add_argument("--job-timeout", type=float, default=600.0, help="seconds per local job")
    p.add_argument("--quick", action="store_true", help="a small model and few steps")
    p.add_argument("--worker", metavar="DIR", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.hidden, args.batch, args.num_sampled = [64, 64], 16, 128
        args.blocks, args.block_steps, args.dist_steps = 3, 2, 3
    for name in ("vocab", "batch", "num_steps", "num_sampled", "threads", "blocks",
                 "block_steps", "dist_steps"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if args.warmup < 1 or args.dist_warmup < 0:
        p.error("--warmup must be at least 1 (the first step's loss is printed), "
                "--dist-warmup at least 0")
    if args.num_sampled > args.vocab:
        p.error(f"--num-sampled {args.num_sampled} must be below the vocabulary {args.vocab}")
    if any(h < 1 for h in args.hidden) or len(args.hidden) != 2:
        p.error(f"--hidden takes two positive sizes (torch.nn.LSTM stacks equal layers "
                f"after the first), got {args.hidden}")
    for name in ("workers", "ps"):
        try:
            counts = [int(v) for v in getattr(args, name).split(",") if v.strip()]
        except ValueError:
            p.error(f"--{name} must be comma-separated counts, got {getattr(args, name)!r}")
        if not counts or min(counts) < 1:
            p.error(f"--{name} must list positive counts, got {getattr(args, name)!r}")
        setattr(args, name, counts)
    return args


ARGS = _parse() if __name__ == "__main__" else _parse([])
# Thread counts must be fixed before NumPy (OpenBLAS) or PyTorch load; a job's tasks
# inherit them through the environment.
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = str(ARGS.threads)

import json  # noqa: E402
import math  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

sys.path.insert(1, str(REPO / "examples" / "lm"))
import train as lm  # noqa: E402  (examples/lm/train.py: the model)

import local_job  # noqa: E402  (bench/local_job.py, beside this script)

SEED = 2016
_FLT_MAX = float(np.finfo(np.float32).max)


# ---- data and candidates, the same for every framework


def load_ids(vocab: int) -> tuple[np.ndarray, int, str]:
    """Training word ids, the vocabulary size with ``<unk>``, and where they come from."""
    try:
        corpus = lm.lm_corpus.load(vocab)
        return corpus.train, corpus.vocab_size, "wikipedia"
    except lm.lm_corpus.CorpusError:
        # Without gensim: words with Zipf's frequencies, ids ranked by frequency.
        rng = np.random.default_rng(SEED)
        ids = np.minimum(rng.zipf(1.2, 600_000) - 1, vocab).astype(np.int32)
        return ids, vocab + 1, "synthetic-zipf"


def batch_stream(ids: np.ndarray, batch: int, num_steps: int, start_row: int = 0):
    """Step ``k``'s (inputs, targets), as the example's reader gives them."""
    rows, epoch = lm.lm_corpus.batches(ids, batch, num_steps)
    return lambda k: lm.lm_corpus.batch(rows, num_steps, (start_row + k) % epoch)


def log_uniform_candidates(rng, num_sampled: int, vocab: int, labels: np.ndarray):
    """``log_uniform_candidate_sampler(unique=True)``'s triple for one step, drawn in NumPy:
    ``num_sampled`` distinct classes with P(v) = log((v+2)/(v+1)) / log(vocab+1), and the
    expected count of each true and sampled class over the tries it took."""
    log_range = math.log1p(vocab)
    picked: list[int] = []
    seen: set[int] = set()
    tries = 0
    while len(picked) < num_sampled:
        for v in (np.exp(rng.random(4 * num_sampled) * log_range).astype(np.int64) - 1) % vocab:
            tries += 1
            if v not in seen:
                seen.add(int(v))
                picked.append(int(v))
                if len(picked) == num_sampled:
                    break
    sampled = np.array(picked, np.int64)

    def expected(c):
        p = np.log((c + 2.0) / (c + 1.0)) / log_range
        return (-np.expm1(tries * np.log1p(-p))).astype(np.float32)

    return sampled, expected(labels.reshape(-1, 1).astype(np.float64)), expected(sampled)


# ---- Flowmill


def flowmill_runner(args, vocab, batches, candidates):
    """The step (``make_callable``), the initial weights as NumPy arrays, the plan."""
    import flowmill.runtime as fm

    graph = fm.Graph(seed=SEED)
    n = args.batch * args.num_steps
    with graph.as_default():
        sampled_values = (
            fm.placeholder(fm.int64, (args.num_sampled,), name="sampled"),
            fm.placeholder(fm.float32, (n, 1), name="true_expected"),
            fm.placeholder(fm.float32, (args.num_sampled,), name="sampled_expected"),
        )
        model = lm.build_model(
            vocab, tuple(args.hidden), args.hidden[0], args.num_steps, args.num_sampled,
            shards=1, seed=SEED, sampled_values=sampled_values,
        )
        train_op, _ = lm.build_train_op(model["train_loss"], "sgd", args.lr, args.clip_norm)
        init = fm.global_variables_initializer()
    sess = fm.Session(graph)
    sess.run(init)
    tables = model["tables"]
    lstm = [v for v in fm.trainable_variables(graph) if v.name.startswith("lstm/")]
    weights = dict(zip(
        ["embedding", "softmax_w", "softmax_b", *[v.name for v in lstm]],
        sess.run([tables["embedding"][0].value(), tables["softmax_w"][0].value(),
                  tables["softmax_b"][0].value(), *[v.value() for v in lstm]]),
        strict=True,
    ))
    feeds = [model["inputs"], model["targets"], *model["state_in"], *sampled_values]
    call = sess.make_callable([model["train_loss"], *model["state_out"]], feeds,
                              targets=[train_op])
    state = lm.zero_state(args.hidden, args.batch)
    k = 0

    def step() -> float:
        nonlocal state, k
        x, y = batches(k)
        loss, *state = call(x, y, *state, *candidates(k))
        k += 1
        return float(loss)

    return step, weights, call.plan


# ---- PyTorch


def _one(weights: dict, suffix: str) -> np.ndarray:
    (name,) = [n for n in weights if n.endswith(suffix)]
    return weights[name]


def torch_runner(args, vocab, batches, candidates, weights):
    try:
        import torch
    except ImportError:
        return None
    torch.set_num_threads(args.threads)
    f = torch.nn.functional
    hidden = args.hidden
    emb = torch.nn.Embedding(vocab, hidden[0], sparse=True)
    rnn = torch.nn.LSTM(hidden[0], hidden[1], num_layers=2, batch_first=True)
    with torch.no_grad():
        emb.weight.copy_(torch.from_numpy(weights["embedding"]))
        depth = hidden[0]
        for layer in range(2):
            kernel = _one(weights, f"cell_{layer}/kernel")
            bias = _one(weights, f"cell_{layer}/bias")
            # Flowmill's gates are i, j, f, o over [x, h]; torch's are i, f, g(=j), o.
            i, j, fg, o = np.split(kernel, 4, axis=1)
            reordered = np.concatenate([i, fg, j, o], axis=1).T  # [4H, in + H]
            bi, bj, bf, bo = np.split(bias, 4)
            getattr(rnn, f"weight_ih_l{layer}").copy_(torch.from_numpy(reordered[:, :depth]))
            getattr(rnn, f"weight_hh_l{layer}").copy_(torch.from_numpy(reordered[:, depth:]))
            getattr(rnn, f"bias_ih_l{layer}").copy_(torch.from_numpy(
                np.concatenate([bi, bf, bj, bo])))
            # One bias, as Flowmill's cell has: torch's second one stays zero, untrained
            # (trained, it would double the bias's step and count twice in the norm).
            getattr(rnn, f"bias_hh_l{layer}").zero_()
            getattr(rnn, f"bias_hh_l{layer}").requires_grad_(False)
            depth = hidden[1]
    softmax_w = torch.tensor(weights["softmax_w"], requires_grad=True)
    # A [vocab, 1] leaf: its rows are looked up like the weights' (a sparse gradient
    # cannot flow back through an unsqueeze).
    softmax_b = torch.tensor(weights["softmax_b"][:, None], requires_grad=True)
    params = [emb.weight, *(p for p in rnn.parameters() if p.requires_grad), softmax_w,
              softmax_b]
    zeros = torch.zeros(2, args.batch, hidden[1])
    state = (zeros, zeros.clone())
    k = 0

    def step() -> float:
        nonlocal state, k
        x, y = batches(k)
        sampled, true_exp, sampled_exp = (torch.from_numpy(a) for a in candidates(k))
        k += 1
        out, (h, c) = rnn(emb(torch.from_numpy(x.astype(np.int64))), state)
        state = (h.detach(), c.detach())
        inputs = out.reshape(-1, hidden[1])
        labels = torch.from_numpy(y.astype(np.int64)).reshape(-1)
        ids = torch.cat([labels, sampled])
        rows = f.embedding(ids, softmax_w, sparse=True)
        bias = f.embedding(ids, softmax_b, sparse=True).squeeze(1)
        n = labels.numel()
        true_logits = (inputs * rows[:n]).sum(1) + bias[:n] - torch.log(true_exp[:, 0])
        sampled_logits = inputs @ rows[n:].T + bias[n:]
        hit = labels.unsqueeze(1) == sampled.unsqueeze(0)
        sampled_logits = sampled_logits + hit.to(inputs.dtype) * -_FLT_MAX
        sampled_logits = sampled_logits - torch.log(sampled_exp)
        logits = torch.cat([true_logits.unsqueeze(1), sampled_logits], 1)
        loss = (torch.logsumexp(logits, 1) - logits[:, 0]).mean()
        loss.backward()
        with torch.no_grad():
            # Global norm over what the step computed: a sparse gradient's rows as they
            # came (uncoalesced), as Flowmill's IndexedSlices count them.
            squares = [(p.grad._values() if p.grad.is_sparse else p.grad).pow(2).sum()
                       for p in params]
            norm = torch.sqrt(torch.stack(squares).sum())
            scale = args.clip_norm / torch.clamp(norm, min=args.clip_norm)
            for p in params:
                p.add_(p.grad * (-args.lr * scale))
                p.grad = None
        return float(loss.detach())

    return step


# ---- timing one process


def time_interleaved(steps: dict, blocks: int, block_steps: int):
    """Median seconds per step over ``blocks`` blocks, runners in rotating order; and each
    runner's loss after its last step."""
    names = list(steps)
    samples: dict[str, list[float]] = {n: [] for n in names}
    last: dict[str, float] = {}
    for b in range(blocks):
        for n in names[b % len(names):] + names[: b % len(names)]:
            start = time.perf_counter()
            for _ in range(block_steps):
                last[n] = steps[n]()
            samples[n].append((time.perf_counter() - start) / block_steps)
    return {n: statistics.median(v) for n, v in samples.items()}, last


def one_process(args) -> dict:
    ids, vocab, data = load_ids(args.vocab)
    batches = batch_stream(ids, args.batch, args.num_steps)
    rng = np.random.default_rng(SEED)
    total = args.warmup + args.blocks * args.block_steps
    drawn = [log_uniform_candidates(rng, args.num_sampled, vocab, batches(k)[1])
             for k in range(total)]

    def candidates(k):
        return drawn[k]

    only = {s.strip() for s in args.only.split(",") if s.strip()}
    fm_step, weights, plan = flowmill_runner(args, vocab, batches, candidates)
    steps = {"flowmill": fm_step}
    if not only or "torch" in only:
        torch_step = torch_runner(args, vocab, batches, candidates, weights)
        if torch_step is not None:
            steps["torch"] = torch_step
    sizes = f"LSTM-{'-'.join(map(str, args.hidden))}"
    print(f"lm_step: {sizes}, vocabulary {vocab:,} ({data}), batch {args.batch} x "
          f"{args.num_steps} words, sampled softmax {args.num_sampled}, SGD, clip "
          f"{args.clip_norm}; {args.threads} thread(s); median of {args.blocks} blocks of "
          f"{args.block_steps} steps after {args.warmup} warm-up step(s)")
    print(f"  flowmill plan: {plan.kernel_calls} kernel calls per step (outside the loops)")
    first = {}
    for name, fn in steps.items():
        first[name] = fn()
        for _ in range(args.warmup - 1):
            fn()
    print("  loss after the first step (same weights, data, candidates): "
          + ", ".join(f"{n} {v:.5f}" for n, v in first.items()))
    seconds, last = time_interleaved(steps, args.blocks, args.block_steps)
    words = args.batch * args.num_steps
    rates = {n: words / s for n, s in seconds.items()}
    for n, s in seconds.items():
        print(f"  {n:<9} {s * 1e3:9.1f} ms/step  {rates[n]:9,.0f} words/s  "
              f"loss after the last step {last[n]:.5f}")
    ratio = rates["flowmill"] / rates["torch"] if "torch" in rates else None
    if ratio is not None:
        print(f"  flowmill / torch words/s: {ratio:.2f}")
    return {"flowmill_words_per_s": round(rates["flowmill"], 1),
            "torch_words_per_s": round(rates["torch"], 1) if "torch" in rates else None,
            "ratio": None if ratio is None else round(ratio, 3), "vocab": vocab, "data": data,
            "first_loss": {n: round(v, 5) for n, v in first.items()},
            "last_loss": {n: round(v, 5) for n, v in last.items()}}


# ---- the model as a local job


def worker_main(args) -> int:
    """One worker of a bench job: the example's model with its in-graph sampler, async SGD
    over the job's PS tasks; warm up, meet the others, take the timed steps, report."""
    import flowmill.runtime as fm
    from flowmill.runtime.job import task
    from flowmill.runtime.session_manager import initialize_or_wait

    out = Path(args.worker)
    me = task()
    ids, vocab, _ = load_ids(args.vocab)
    per = ids.size // me.count
    batches = batch_stream(ids[me.index * per : (me.index + 1) * per], args.batch,
                           args.num_steps)
    graph = fm.Graph(seed=SEED)
    with graph.as_default():
        model = lm.build_model(vocab, tuple(args.hidden), args.hidden[0], args.num_steps,
                               args.num_sampled, max(lm.ps_tasks(), 1), seed=SEED)
        train_op, _ = lm.build_train_op(model["train_loss"], "sgd", args.lr, args.clip_norm)
        init = fm.global_variables_initializer()
    with fm.Session(graph) as sess:
        initialize_or_wait(sess, init)
        call = sess.make_callable([model["train_loss"], *model["state_out"]],
                                  [model["inputs"], model["targets"], *model["state_in"]],
                                  targets=[train_op])
        state = lm.zero_state(args.hidden, args.batch)
        k = 0

        def step() -> float:
            nonlocal state, k
            x, y = batches(k)
            loss, *state = call(x, y, *state)
            k += 1
            return float(loss)

        for _ in range(args.dist_warmup):
            step()
        local_job.barrier(out, me, args.job_timeout)
        start = time.time()
        for _ in range(args.dist_steps):
            loss = step()
        end = time.time()
    words = args.dist_steps * args.batch * args.num_steps
    local_job.report(out, me, {"start": start, "end": end, "words": words, "loss": loss},
                     args.job_timeout)
    return 0


def run_job(args, ps: int, workers: int) -> float:
    """Words per second of one local job: every worker's timed words over the span from
    the first timed step's start to the last one's end."""

    def command(out: Path) -> list[str]:
        return ["python", str(Path(__file__).resolve()), "--worker", str(out),
                "--hidden", *map(str, args.hidden), "--vocab", str(args.vocab),
                "--batch", str(args.batch), "--num-steps", str(args.num_steps),
                "--num-sampled", str(args.num_sampled), "--lr", str(args.lr),
                "--clip-norm", str(args.clip_norm), "--threads", str(args.threads),
                "--dist-steps", str(args.dist_steps), "--dist-warmup", str(args.dist_warmup),
                "--job-timeout", str(args.job_timeout)]

    reports, _ = local_job.run(f"lm-bench-ps{ps}-w{workers}", command, ps, workers, "async",
                               args.job_timeout)
    start, end = local_job.window(reports)
    return sum(r["words"] for r in reports) / (end - start)


def distributed(args) -> dict:
    print(f"lm_step --distributed: the same model as local jobs (async SGD, one shard per "
          f"PS task), {args.dist_steps} timed steps per worker after {args.dist_warmup} "
          f"warm-up, {os.cpu_count()} CPU core(s) on this machine")
    table: dict[str, dict[str, float]] = {}
    for ps in args.ps:
        row = table[f"ps{ps}"] = {}
        for workers in args.workers:
            began = time.perf_counter()
            rate = run_job(args, ps, workers)
            row[str(workers)] = round(rate, 1)
            print(f"  {ps} ps, {workers} worker(s): {rate:9,.0f} words/s   (job took "
                  f"{time.perf_counter() - began:.0f} s)", flush=True)
    return table


def main() -> int:
    args = ARGS
    if args.worker:
        return worker_main(args)
    figures = one_process(args)
    table = distributed(args) if args.distributed else None
    print(json.dumps({
        "bench": "lm_step",
        "flowmill_words_per_s": figures["flowmill_words_per_s"],
        "torch_words_per_s": figures["torch_words_per_s"],
        "ratio": figures["ratio"],
        "hidden": args.hidden, "vocab": figures["vocab"], "batch": args.batch,
        "num_steps": args.num_steps, "num_sampled": args.num_sampled,
        "threads": args.threads, "data": figures["data"],
        "first_loss": figures["first_loss"], "last_loss": figures["last_loss"],
        "distributed_words_per_s": table,
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
