#!/usr/bin/env python3
"""Make a small synthetic text corpus and binarize it with fairseq-preprocess.

The text is generated, not downloaded: sentences from a first-order Markov chain over a
Zipf-distributed vocabulary of ``--vocab`` words, so a language model has something to
learn and the embedding dominates the parameter count when the vocabulary is large.

    python scripts/make_corpus.py OUT_DIR [--vocab 2000] [--train-lines 4000]

writes ``OUT_DIR/{train,valid,test}.txt`` and the binarized data in ``OUT_DIR/bin``.
"""
import argparse
import os
import random
import subprocess
import sys


def words(vocab):
    return [f"w{i}" for i in range(vocab)]


def grammar(vocab, seed):
    """The language: each word prefers 4 successors (the same for every split)."""
    rng = random.Random(seed)
    ws = words(vocab)
    weights = [1.0 / (i + 1) for i in range(vocab)]  # Zipf
    return ws, weights, {w: rng.choices(ws, weights, k=4) for w in ws}


def sentences(n, language, seed):
    ws, weights, successors = language
    rng = random.Random(seed)
    for _ in range(n):
        w = rng.choices(ws, weights)[0]
        out = [w]
        for _ in range(rng.randint(5, 20) - 1):
            w = rng.choice(successors[w]) if rng.random() < 0.8 else rng.choices(ws, weights)[0]
            out.append(w)
        yield " ".join(out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out_dir")
    ap.add_argument("--vocab", type=int, default=2000)
    ap.add_argument("--train-lines", type=int, default=4000)
    ap.add_argument("--valid-lines", type=int, default=200)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args(argv)

    os.makedirs(args.out_dir, exist_ok=True)
    sizes = {"train": args.train_lines, "valid": args.valid_lines, "test": args.valid_lines}
    language = grammar(args.vocab, args.seed)
    for i, (split, n) in enumerate(sizes.items()):
        with open(os.path.join(args.out_dir, f"{split}.txt"), "w") as f:
            for line in sentences(n, language, args.seed * 1000 + i + 1):
                f.write(line + "\n")
    bin_dir = os.path.join(args.out_dir, "bin")
    cmd = [
        "fairseq-preprocess", "--only-source",
        "--trainpref", os.path.join(args.out_dir, "train.txt"),
        "--validpref", os.path.join(args.out_dir, "valid.txt"),
        "--testpref", os.path.join(args.out_dir, "test.txt"),
        "--destdir", bin_dir, "--workers", "1",
    ]
    exe = os.path.join(os.path.dirname(sys.executable), "fairseq-preprocess")
    if os.path.exists(exe):
        cmd[0] = exe
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    print(bin_dir)


if __name__ == "__main__":
    main()
