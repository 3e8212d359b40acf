"""The deterministic post-filters of examples/summarize_folder.py, on answers SmolLM2 really gave
(the shipped examples/output/summaries.json before issue 18's fixes). No model, no Redis."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from examples import summarize_folder as sf
from tests.pool_helpers import ROOT

DOCS = {p.name: p.read_text() for p in sorted((ROOT / "examples" / "docs").iterdir())}
BEES, KEEPER, CANAL = "bees_in_winter.txt", "keeper_of_gannet_point.txt", "millbrook_canal.txt"


def clean(name: str, answer: str, source: str | None = None, keep=None) -> str:
    return sf.clean(answer, DOCS[name] if source is None else source,
                    sf.titles_of(name, DOCS[name]), keep)


def test_repeated_title_prefix_is_stripped():
    out = clean(BEES, "Bees in winter: Bees in winter: Notes for the Beginner A colony of honey "
                      "bees does not hibernate.")
    assert out == "A colony of honey bees does not hibernate."


def test_whole_heading_glued_to_a_sentence_is_stripped():
    out = clean(KEEPER, "The Keeper of Gannet Point for thirty-one years, Elias Marr kept the "
                        "light at Gannet Point.")
    assert out.startswith("For thirty-one years, Elias Marr")


def test_a_title_that_is_the_sentence_subject_stays():
    assert clean(BEES, "Bees in winter draw together into a tight ball called the winter "
                       "cluster.").startswith("Bees in winter draw")


@pytest.mark.parametrize("echo", [
    "The text is written in simple sentences, and there are no bold or italic text.",
    "The story is told in a narrative style, with clear and concise language.",
    "The text is a continuation of a story about a lighthouse keeper named Elias.",
    "Here is a summary of the text in two sentences.",
])
def test_sentences_about_the_text_or_the_instructions_are_dropped(echo):
    assert clean(KEEPER, echo) == ""


@pytest.mark.parametrize("invented", [
    "The society's oldest surviving founder, a 92-year-old man named John, was hired.",
    "The ship was a small, three-storied cottage with a single sail.",
    "The ship was a small museum, and the society's motto is carved on the top of the ship.",
])
def test_facts_the_source_does_not_hold_are_dropped(invented):
    assert clean(CANAL, invented) == ""


def test_a_title_alone_is_empty_and_repeats_are_dropped():
    assert clean(BEES, "Bees in winter.") == ""
    s = "The decline came with the railway and traffic fell year by year."
    assert clean(CANAL, "The decline came with the railway. " * 3) == "The decline came with the railway."
    assert clean(CANAL, f"{s} {s}", keep=1) == s


def test_an_empty_answer_falls_back_to_the_source_opening():
    chunk = sf.chunk_text(DOCS[BEES], 1500)[0]
    stage = {"fallbacks": 0, "retried": 0}
    out, fell = sf.cleaned([SimpleNamespace(text="Bees in winter.", finish_reason="stop",
                                            choices=None)], [chunk],
                           [sf.titles_of(BEES, DOCS[BEES])],
                           [sf.lead(chunk, 2, sf.titles_of(BEES, DOCS[BEES]))], stage,
                           labels=["bees part 1"])
    assert stage["fallbacks"] == 1 and stage["fell_back"] == ["bees part 1"] and fell == [True]
    assert out[0].startswith("A colony of honey bees does not hibernate.")
    assert "Notes for the Beginner" not in out[0]


def test_an_emptied_answer_is_asked_again_and_the_best_sample_wins():
    chunk = sf.chunk_text(DOCS[BEES], 1500)[0]
    ts = [sf.titles_of(BEES, DOCS[BEES])]
    good = "A colony of honey bees does not hibernate."
    samples = SimpleNamespace(text="", finish_reason="stop", choices=[
        SimpleNamespace(text="Bees in winter.", finish_reason="stop"),
        SimpleNamespace(text=good, finish_reason="stop")])
    asked = []

    def retry(idx):
        asked.extend(idx)
        return [samples]
    stage = {"fallbacks": 0, "retried": 0}
    out, fell = sf.cleaned([SimpleNamespace(text="Bees in winter.", finish_reason="stop",
                                            choices=None)], [chunk], ts, ["FALLBACK"], stage,
                           retry=retry)
    assert asked == [0] and out == [good] and fell == [False]
    assert stage == {"fallbacks": 0, "retried": 1}


def test_a_cut_off_answer_ends_on_a_whole_sentence():
    out = sf.tidy("The decline came with the railway. In 1852 a line was", "length")
    assert out == "The decline came with the railway."


def test_overview_titles_come_from_the_heading():
    assert sf.title_of(CANAL, DOCS[CANAL]) == "The Canal Locks of Millbrook"
    assert sf.title_of(KEEPER, DOCS[KEEPER]) == "The Keeper of Gannet Point"


def test_list_markers_go_and_copied_sentences_stay():
    out = clean(BEES, "- The cluster moves across the combs during the winter, eating stored "
                      "honey as it goes.")
    assert out.startswith("The cluster moves")
    assert clean(KEEPER, "The lass' skipper told them that he had taken Selcombe roads.") == ""
