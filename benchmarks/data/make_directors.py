"""Write directors.jsonl: "Who directed the film X?" over film passages of the 2WikiMultihopQA corpus.

Every passage of the corpus that says "X is a <year> <...> film directed by <name>" gives one question; the
gold answer is the name as the passage spells it. Each item holds its answer passage and five other such film
passages (drawn with a fixed seed) as distractors of the same kind, in a shuffled order, so that a retriever
over all the items' passages finds films of the same years and countries. Usage:
python make_directors.py CORPUS.json OUT.jsonl [N]
"""

import json
import random
import re
import sys

PATTERN = re.compile(r"^(?P<name>.+?) is an? (\d{4}) [A-Z][\w\- ]* film directed by "
                     r"(?P<director>[A-Z][\w\.\-']+(?: [A-Z][\w\.\-']+){0,3})[ ,\.]")
DISTRACTORS = 5
SEED = 20261128


def films_in(corpus: list[dict[str, str]]) -> list[tuple[str, str, dict[str, str]]]:
    """``(title, director, passage)`` of every film passage of ``corpus`` that names its director, in corpus order."""
    films = []
    for passage in corpus:
        found = PATTERN.match(passage["text"])
        title = re.sub(r" \([^)]*\)$", "", passage["title"])
        if found and found["name"].strip() == title and len(passage["text"].split()) <= 120:
            director = found["director"]
            end = re.search(r"\w{3,}\.( |$)", director)  # "Nabil Ayouch. The": the name ends at the full stop
            films.append((title, director[: end.end() - len(end.group(1)) - 1] if end else director.rstrip("."),
                          passage))
    return films


def main(corpus_path: str, out_path: str, n: int = 100) -> None:
    films = films_in(json.load(open(corpus_path)))
    rng = random.Random(SEED)
    rng.shuffle(films)
    with open(out_path, "w") as fh:
        for i, (title, director, passage) in enumerate(films[:n]):
            others = rng.sample([f[2] for f in films if f[0] != title], DISTRACTORS)
            ctxs = others + [passage]
            rng.shuffle(ctxs)
            item = {"id": f"dir{i + 1:03d}", "question": f"Who directed the film {title}?", "answers": [director],
                    "ctxs": [{"title": c["title"], "text": c["text"]} for c in ctxs]}
            fh.write(json.dumps(item) + "\n")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 100)
