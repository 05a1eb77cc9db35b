"""Each cleaning stage on hand-written documents, asserting the exact verdict (as
datatrove's tests do) and the edits it makes."""

from __future__ import annotations

import pytest

from lathe.data.document import Document
from lathe.data.stages.c4 import C4, C4Config
from lathe.data.stages.code import Code, CodeConfig
from lathe.data.stages.extract import Extract, ExtractConfig
from lathe.data.stages.fineweb import FineWeb, FineWebConfig
from lathe.data.stages.gopher import (
    GopherQuality,
    GopherQualityConfig,
    GopherRepetition,
    GopherRepetitionConfig,
)
from lathe.data.stages.language import Language, LanguageConfig
from lathe.data.stages.normalize import Normalize, NormalizeConfig
from tests.data.corpus import html_page, prose

GOOD = prose(0)
ONE_PARAGRAPH = GOOD.replace("\n\n", " ")


def reason(stage, text: str, **kw) -> str | None:
    return stage(Document("d", text, **kw)).drop_reason


@pytest.mark.parametrize("text, expected", [
    (GOOD, None),
    ("\n\n".join(["Same paragraph here, said twice over."] * 4 + [GOOD]), "dup_para_frac"),
    ("\n\n".join([GOOD] + [prose(7, paragraphs=1, sentences=8)] * 3), "dup_para_char_frac"),
    ("\n".join(["one line"] * 4 + ["other line " + str(i) for i in range(4)]),
     "dup_line_frac"),
    ("buy cheap shoes now " * 40, "top_2_gram"),
    (GOOD + (" " + " ".join(f"w{i}" for i in range(200))) * 2, "duplicated_5_n_grams"),
])
def test_gopher_repetition(text, expected):
    assert reason(GopherRepetition(GopherRepetitionConfig()), text) == expected


def test_gopher_repetition_thresholds_are_overridable():
    text = "\n".join(["one line"] * 4 + ["other line " + str(i) for i in range(4)])
    relaxed = GopherRepetitionConfig(dup_line_frac=0.9, dup_para_char_frac=0.9,
                                     dup_line_char_frac=0.9, top_ngram_char_frac=[],
                                     dup_ngram_char_frac=[])
    assert reason(GopherRepetition(relaxed), text) is None


@pytest.mark.parametrize("text, expected", [
    (GOOD, None),
    ("The cat sat on the mat with the hat.", "gopher_short_doc"),
    (" ".join(["a an it is to of by we"] * 20), "gopher_below_avg_threshold"),
    (" ".join(["extraordinarily incomprehensibilities"] * 40), "gopher_above_avg_threshold"),
    (GOOD + " #tag" * 60, "gopher_too_many_hashes"),
    (GOOD + " wait..." * 60, "gopher_too_many_ellipsis"),
    ("\n".join(f"- item {s}" for s in ONE_PARAGRAPH.split(". ")), "gopher_too_many_bullets"),
    ("\n".join(s + "..." for s in ONE_PARAGRAPH.split(". ")), "gopher_too_many_end_ellipsis"),
    (GOOD + " " + " ".join(["123 456 7.8 = + 9"] * 60), "gopher_below_alpha_threshold"),
    (" ".join(["quick brown foxes jump over lazy dogs"] * 10), "gopher_enough_stop_words"),
])
def test_gopher_quality(text, expected):
    assert reason(GopherQuality(GopherQualityConfig()), text) == expected


def test_c4_removes_lines_and_citations():
    text = ("The river carried the letter to the village today.[1]\n"
            "Menu\n"
            "Please enable javascript to view the comments below.\n"
            "By using this site you agree to our privacy policy today.\n"
            + GOOD)
    doc = Document("d", text)
    verdict = C4(C4Config())(doc)
    assert verdict.kept
    assert verdict.edits == {"lines_removed": 3, "citations_removed": 1}
    assert doc.text.startswith("The river carried the letter to the village today.\n")
    assert "javascript" not in doc.text and "Menu" not in doc.text


@pytest.mark.parametrize("text, expected", [
    (GOOD + "\nLorem ipsum dolor sit amet, consectetur adipiscing elit.", "lorem_ipsum"),
    (GOOD + "\nThe function is written as f = {x: x + 1} in the text.", "curly_bracket"),
    ("One sentence only here. And another sentence now.", "too_few_sentences"),
])
def test_c4_drops(text, expected):
    assert reason(C4(C4Config()), text) == expected


@pytest.mark.parametrize("text, expected", [
    (GOOD.replace("\n\n", "\n"), None),
    ("\n".join(f"a line without an end mark number {i} here and there" for i in range(10)),
     "line_punct_ratio"),
    ("\n".join(["Short one."] * 3 + [f"Tiny line {i}." for i in range(9)]), "short_line_ratio"),
    (GOOD.replace("\n\n", "\n") + "\nThe same closing sentence appears twice in this page."
     "\nThe same closing sentence appears twice in this page.", "char_dup_ratio"),
])
def test_fineweb(text, expected):
    assert reason(FineWeb(FineWebConfig()), text) == expected


def test_fineweb_list_ratio():
    text = "\n".join(f"Word{i} word{i}." for i in range(40))
    config = FineWebConfig(max_short_lines_ratio=1.0, max_duplicate_line_chars_ratio=1.0)
    assert reason(FineWeb(config), text) == "list_ratio"


def test_extract_keeps_main_text_and_drops_failures():
    stage = Extract(ExtractConfig())
    doc = Document("d", html=html_page(GOOD, "Title"))
    assert stage.applies(doc) and stage(doc).kept
    assert "The " in doc.text and "Home" not in doc.text and doc.html is None
    assert stage(Document("e", html="<html><body><script>x()</script></body></html>")) \
        .drop_reason == "extraction_empty"
    assert not stage.applies(Document("t", "plain text"))


def test_extract_timeout_drops_the_document(monkeypatch):
    import time

    import trafilatura

    monkeypatch.setattr(trafilatura, "extract", lambda *a, **k: time.sleep(5))
    start = time.perf_counter()
    verdict = Extract(ExtractConfig(timeout_s=0.2))(Document("d", html="<p>x</p>"))
    assert verdict.drop_reason == "extraction_timeout"
    assert time.perf_counter() - start < 2


def test_normalize_repairs_mojibake_and_applies_nfc():
    doc = Document("d", "cafÃ© and cafe\u0301")
    verdict = Normalize(NormalizeConfig())(doc)
    assert doc.text == "café and café"
    assert verdict.edits == {"mojibake_fixed": 1, "unicode_normalized": 1}


def test_language_keeps_configured_languages_with_score():
    stage = Language(LanguageConfig(languages=["en"], min_score=0.65))
    doc = Document("d", GOOD)
    assert stage(doc).kept and doc.metadata["language"] == "en"
    german = ("Der schnelle braune Fuchs springt über den faulen Hund, und die Katze "
              "schläft den ganzen Tag in der warmen Sonne im Garten des Hauses.")
    assert reason(stage, german) == "wrong_language"
    assert reason(Language(LanguageConfig(languages=["de", "en"])), german) is None
    assert reason(Language(LanguageConfig(min_score=1.01)), GOOD) == "low_language_score"


LICENSED = '''#!/usr/bin/env python3
# Copyright (C) 2001 Python Software Foundation
# Licensed under the PSF license.

"""A module."""

import os


def main():
    return os.getcwd()
'''


def test_code_strips_license_header_and_keeps_shebang():
    doc = Document("d", LICENSED, kind="code")
    verdict = Code(CodeConfig())(doc)
    assert verdict.edits == {"license_header_stripped": 1}
    assert doc.text.startswith('#!/usr/bin/env python3\n"""A module."""')


@pytest.mark.parametrize("text, expected", [
    ("x = 1\n", "code_too_short"),
    ("# Generated by gencodec.py. DO NOT EDIT.\n" + "x = 1\n" * 10, "code_generated"),
    ("x = 1\n" * 10 + "y = '" + "a" * 2000 + "'\n", "code_long_line"),
    ("z = '" + "b" * 200 + "'\n" * 1 + "x = 1\n" * 0 + ("w = '" + "c" * 150 + "'\n") * 6,
     "code_long_mean_line"),
    ("#" * 60 + "\n" + "x = (1, 2, 3) + [4]  # ----- ====\n" * 10, "code_low_alphanumeric"),
])
def test_code_drops(text, expected):
    assert reason(Code(CodeConfig()), text, kind="code") == expected


def test_prose_filters_skip_code_and_code_stage_skips_prose():
    code = Document("c", LICENSED, kind="code")
    assert not GopherQuality(GopherQualityConfig()).applies(code)
    assert not Code(CodeConfig()).applies(Document("p", GOOD))
