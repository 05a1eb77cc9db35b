"""Deterministic synthetic documents for the data tests: English prose that passes the
web recipe's filters, and helpers to write it in each input format."""

from __future__ import annotations

import json
import random

NOUNS = ("river city garden teacher window market engine letter forest doctor village "
         "kitchen mountain student painter harbor bridge library morning winter farmer "
         "country voice mirror journey signal pocket theory problem answer family").split()
VERBS = ("carried watched opened followed described built noticed remembered painted "
         "crossed measured repaired visited explained discovered changed gathered").split()
ADJECTIVES = ("quiet bright narrow ancient gentle heavy curious simple distant golden "
              "careful silver honest patient sudden empty familiar").split()
LINKS = ("and then", "because", "while", "although", "after", "before", "so that")


def sentence(rng: random.Random) -> str:
    a, b = rng.sample(NOUNS, 2)
    return (f"The {rng.choice(ADJECTIVES)} {a} {rng.choice(VERBS)} the {b} "
            f"{rng.choice(LINKS)} the {rng.choice(NOUNS)} {rng.choice(VERBS)} "
            f"a {rng.choice(ADJECTIVES)} {rng.choice(NOUNS)} with {rng.choice(NOUNS)}s.")


def prose(seed: int, paragraphs: int = 4, sentences: int = 5) -> str:
    rng = random.Random(seed)
    return "\n\n".join(" ".join(sentence(rng) for _ in range(sentences))
                       for _ in range(paragraphs))


def html_page(body: str, title: str = "A page") -> str:
    paras = "".join(f"<p>{p}</p>" for p in body.split("\n\n"))
    return (f"<html><head><title>{title}</title></head><body><nav><a href='/'>Home</a>"
            f"</nav><article><h1>{title}</h1>{paras}</article>"
            f"<footer>Copyright 2024</footer></body></html>")


def write_jsonl(path, records) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record) + "\n")
