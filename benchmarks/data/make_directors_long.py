"""Write long-prompt "Who directed the film X?" items: one answer passage among many distractors.

The questions are those of ``make_directors.py`` (same films, same fixed shuffle), taken after the first ``--skip``
films and leaving out films whose title another film shares (10 films in this corpus), so that two files whose
``--skip`` values differ by at least ``--n`` + 10 ask different questions. Each item holds:

- its answer passage;
- ``--films`` other film passages of the same kind (each naming another film's director), drawn with a fixed seed;
- then, until the passages joined by a blank line (each as ``title\\ntext``) come to about ``--tokens`` tokens of
  the tokenizer at ``--tokenizer``, other corpus passages of at most 120 words that name no director (no word
  starting with "direct") and do not mention the question's film.

Distractors are shuffled; the answer passage goes at a rotating relative position: item *i* (from 0) puts it at
``round(s / (slots - 1) * (len(ctxs) - 1))`` with ``s = i % slots``, so first, middle and last places are all
covered. Filler passages are taken, in a shuffled order, while they fit under the target, until an item is within
``CLOSE_ENOUGH`` tokens of it (a blank line counted as 2 tokens, as SmolLM2 splits it). Lines are
``{id, question, answers, ctxs: [{title, text}], gold_titles}``. Usage:

python make_directors_long.py CORPUS.json OUT.jsonl --tokenizer DIR --tokens 2000 --films 6 --skip 100 --prefix dir2k
"""

import argparse
import json
import random
import re
import statistics
from collections import Counter

from make_directors import SEED, films_in
from transformers import AutoTokenizer

MAX_WORDS = 120
CLOSE_ENOUGH = 25  # tokens under the target at which an item stops taking filler


def passage_text(ctx: dict[str, str]) -> str:
    return f"{ctx['title'].strip()}\n{ctx['text']}"


def mentions(title: str, passage: dict[str, str]) -> bool:
    return re.search(rf"\b{re.escape(title)}\b", passage_text(passage), re.IGNORECASE) is not None


def filler_pool(corpus: list[dict[str, str]]) -> list[dict[str, str]]:
    """Corpus passages that may pad an item: short, naming no director, each text once."""
    seen, pool = set(), []
    for passage in corpus:
        text = passage["text"]
        if text not in seen and len(text.split()) <= MAX_WORDS and not re.search(r"\bdirect", text, re.IGNORECASE):
            seen.add(text)
            pool.append(passage)
    return pool


def make_item(i: int, film: tuple, films: list, pool: list, cost: dict, args, rng: random.Random) -> dict:
    title, director, passage = film
    others = [f[2] for f in films if f[0] != title and not mentions(title, f[2])]
    ctxs = rng.sample(others, args.films)
    total = sum(cost[c["text"]] for c in ctxs) + cost[passage["text"]]
    for extra in rng.sample(pool, len(pool)):
        if total > args.tokens - CLOSE_ENOUGH:
            break
        if total + cost[extra["text"]] <= args.tokens and not mentions(title, extra):
            ctxs.append(extra)
            total += cost[extra["text"]]
    rng.shuffle(ctxs)
    slot = i % args.slots
    ctxs.insert(round(slot / (args.slots - 1) * len(ctxs)), passage)
    return {"id": f"{args.prefix}-{i + 1:03d}", "question": f"Who directed the film {title}?", "answers": [director],
            "ctxs": [{"title": c["title"], "text": c["text"]} for c in ctxs], "gold_titles": [passage["title"]]}


def main(args: argparse.Namespace) -> None:
    corpus = json.load(open(args.corpus))
    films = films_in(corpus)
    random.Random(SEED).shuffle(films)  # the order make_directors.py asks its questions in
    pool = filler_pool(corpus)
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    texts = {p["text"]: p for p in pool + [f[2] for f in films]}
    ids = tokenizer([passage_text(p) for p in texts.values()], add_special_tokens=False)["input_ids"]
    cost = {text: len(t) + 2 for text, t in zip(texts, ids)}  # + 2: the blank line between passages
    rng = random.Random(f"{SEED}/{args.prefix}")
    shared = {title for title, n in Counter(f[0] for f in films).items() if n > 1}
    questions = [f for f in films[args.skip:] if f[0] not in shared][: args.n]
    if len(questions) < args.n:
        raise SystemExit(f"only {len(questions)} films after --skip {args.skip}")
    counts = []
    with open(args.out, "w") as fh:
        for i, film in enumerate(questions):
            item = make_item(i, film, films, pool, cost, args, rng)
            joined = "\n\n".join(passage_text(c) for c in item["ctxs"])
            counts.append(len(tokenizer(joined, add_special_tokens=False)["input_ids"]))
            fh.write(json.dumps(item) + "\n")
    print(f"{args.out}: {len(counts)} items, passage tokens min {min(counts)} mean {statistics.mean(counts):.0f} "
          f"max {max(counts)}")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("corpus", help="2wikimultihopqa_corpus.json: a JSON list of {title, text} passages")
    parser.add_argument("out", help="the QA JSONL file to write")
    parser.add_argument("--tokenizer", required=True, help="folder (or name) of the tokenizer that counts tokens")
    parser.add_argument("--tokens", type=int, required=True, help="target tokens of an item's joined passages")
    parser.add_argument("--films", type=int, default=5, help="same-kind film passages among the distractors")
    parser.add_argument("--n", type=int, default=60, help="items to write")
    parser.add_argument("--skip", type=int, default=100, help="films of the shuffled order not asked about")
    parser.add_argument("--prefix", required=True, help="item ids are PREFIX-001, PREFIX-002, ...")
    parser.add_argument("--slots", type=int, default=10, help="relative answer positions the items rotate over")
    return parser.parse_args()


if __name__ == "__main__":
    main(parse_args())
