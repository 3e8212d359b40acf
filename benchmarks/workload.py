"""The fixed throughput workload: seeded chat requests over a pool of hand-written paragraphs.

Each request = an instruction (summarize / explain / translate / list facts / ...) over a run of
sentences taken from the paragraph pool, trimmed so the chat-templated prompt (including
SmolLM2's default system prompt) lands near a target length drawn uniformly from
[min_prompt, max_prompt] tokens; max_tokens is drawn uniformly from [16, 200].
Same seed + same tokenizer -> identical prompt_token_ids for every system measured.
"""
from __future__ import annotations

import os
import sys

if __name__ == "__main__":  # as a script: import the project through the repo root
    sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import random  # noqa: E402
import re  # noqa: E402
import statistics  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402

PARAGRAPHS = [
    "The Roman aqueducts carried water across valleys and through hills for hundreds of kilometres. "
    "Engineers surveyed each route so that the channel fell by only a few centimetres per kilometre, "
    "enough to keep the water moving without eroding the stone. Where the ground dropped away, they "
    "built arcades of arches, and where a hill stood in the way, they dug tunnels by hand. At the city "
    "end, the water flowed into distribution tanks that fed public fountains first, then baths, and "
    "finally the private houses of those who paid for a connection.",
    "Photosynthesis turns light into chemical energy. Inside the chloroplasts of a leaf, pigments such "
    "as chlorophyll absorb red and blue light and use that energy to split water molecules. The oxygen "
    "released by this step escapes into the air, while the hydrogen and the captured energy are used "
    "to build sugars from carbon dioxide. Plants burn part of that sugar for their own growth and store "
    "the rest as starch, which is why nearly every food chain on land starts with a green leaf.",
    "Before the printing press, books in Europe were copied by hand, and a single Bible could take a "
    "scribe more than a year. Around 1450, Johannes Gutenberg combined movable metal type, an oil-based "
    "ink and a screw press adapted from wine making. A workshop could now produce hundreds of identical "
    "pages a day. Within fifty years, printers were working in more than two hundred cities, prices of "
    "books fell sharply, and ideas travelled faster than any authority could control them.",
    "A vaccine trains the immune system without exposing the body to the full danger of a disease. It "
    "presents a harmless piece of a pathogen, such as a protein from its surface, or instructions for "
    "making that protein. The immune system reacts by producing antibodies and memory cells. If the real "
    "pathogen appears later, those memory cells recognise it quickly and mount a strong response before "
    "the infection can spread, which is why a vaccinated person usually gets less sick or not sick at all.",
    "Coral reefs cover less than one percent of the ocean floor but shelter about a quarter of all marine "
    "species. A reef is built by tiny animals called polyps, which live in partnership with algae. The "
    "algae provide sugars through photosynthesis, and the polyps provide shelter and nutrients. When the "
    "water becomes too warm, the polyps expel the algae and turn white, a process known as bleaching. If "
    "the heat lasts for weeks, the corals starve and the whole reef community begins to collapse.",
    "The Apollo program landed twelve astronauts on the Moon between 1969 and 1972. Each mission used a "
    "Saturn V rocket, the most powerful machine built at the time, to send a command module and a lunar "
    "module toward the Moon. Two astronauts descended to the surface while the third stayed in orbit. "
    "The crews collected more than three hundred and eighty kilograms of rock and soil, and those samples "
    "still help scientists understand how the Moon and the Earth formed.",
    "Sourdough bread rises without commercial yeast. Instead, the baker keeps a starter, a mixture of flour "
    "and water in which wild yeasts and lactic acid bacteria live together. The yeasts produce carbon "
    "dioxide that lifts the dough, while the bacteria produce acids that give the bread its sour taste and "
    "help it keep longer. Because the fermentation is slow, a loaf can take a full day from mixing to "
    "baking, but many bakers say the flavour is worth the wait.",
    "The surface of the Earth is broken into large plates that move a few centimetres each year, about as "
    "fast as fingernails grow. Where two plates pull apart, molten rock rises and forms new crust, as in "
    "the middle of the Atlantic Ocean. Where they collide, one plate may slide beneath the other, building "
    "deep trenches, volcanoes and mountain ranges. Most earthquakes happen along these boundaries, when "
    "stress that has built up for decades is released in a few seconds.",
    "Honeybees communicate the location of food through a movement called the waggle dance. A forager "
    "returning to the hive runs in a straight line while shaking her body, then loops back and repeats. "
    "The angle of the straight run relative to vertical shows the direction of the flowers relative to the "
    "sun, and the length of the run shows the distance. Other bees follow the dance, sense the scent of "
    "the flowers on the dancer, and fly out to find the same source.",
    "The Silk Road was not a single road but a network of trade routes linking China with Central Asia, "
    "Persia, Arabia and the Mediterranean. Merchants rarely travelled the whole distance; goods passed "
    "from hand to hand through oasis cities such as Samarkand and Kashgar. Silk, spices, paper and glass "
    "moved along these routes, but so did religions, languages, technologies and diseases. For more than "
    "a thousand years, the network shaped the cultures that lay along it.",
    "Jazz grew up in New Orleans in the early twentieth century, where African American musicians mixed "
    "blues, ragtime, brass band marches and church music. Its defining feature is improvisation: players "
    "invent melodies on the spot over a shared pattern of chords. Recordings and radio spread the music "
    "to Chicago, New York and Europe in the 1920s. Over the following decades, jazz split into many "
    "styles, from swing and bebop to cool jazz and fusion.",
    "A transistor is a tiny switch with no moving parts. In the common field-effect design, a voltage on "
    "a terminal called the gate controls whether current can flow between two other terminals. Because "
    "transistors can switch billions of times per second and can be made only a few nanometres wide, a "
    "modern processor contains tens of billions of them. Arranged into logic gates, they perform every "
    "calculation a computer makes, from adding numbers to drawing this sentence on a screen.",
    "The water cycle moves water between the oceans, the air and the land. Heat from the sun evaporates "
    "water from seas, lakes and leaves. The vapour rises, cools and condenses into clouds, and eventually "
    "falls as rain or snow. Some of it runs off into rivers, some soaks into the ground to refill aquifers, "
    "and some is locked away in glaciers for thousands of years. The same water has been recycled this "
    "way since the oceans first formed.",
    "A lighthouse keeper's life was shaped by routine. Every evening the keeper climbed the tower, trimmed "
    "the wick, polished the lens and wound the clockwork that turned the light. Through the night the "
    "keeper checked the flame every few hours, and in fog sounded a horn at fixed intervals. Logs recorded "
    "the weather, passing ships and every repair. Automation in the twentieth century made the job "
    "unnecessary, and most towers now run without anyone living beside them.",
    "Cities are warmer than the countryside around them, an effect called the urban heat island. Asphalt "
    "and concrete absorb sunlight during the day and release the heat slowly at night, while buildings "
    "block the wind that would carry warm air away. Cars, air conditioners and factories add their own "
    "waste heat. Planting trees, painting roofs white and building parks can lower summer temperatures by "
    "several degrees, which saves energy and protects people during heat waves.",
    "Chess engines search millions of positions per second. Classical engines explore a tree of possible "
    "moves, cut away branches that cannot change the result and score the remaining positions with a "
    "hand-tuned evaluation function. Newer engines replace that function with a neural network trained "
    "by playing millions of games against themselves. Today the strongest programs are far beyond any "
    "human player, yet people still study their games to discover new ideas.",
]

INSTRUCTIONS = [
    "Summarize the following text in a few sentences.\n\n{text}",
    "Explain the main idea of this passage to a twelve-year-old.\n\n{text}",
    "Translate the following text into French.\n\n{text}",
    "List the three most important facts in the text below.\n\n{text}",
    "Write a short title and a one-paragraph summary for this article.\n\n{text}",
    "Read the passage and write two questions a curious reader might ask about it.\n\n{text}",
    "Rewrite the following text in simpler words.\n\n{text}",
    "Text:\n{text}\n\nWhat is this text about? Answer briefly.",
]


@dataclass
class WorkloadRequest:
    idx: int
    messages: list
    prompt_token_ids: list = field(repr=False)
    max_tokens: int
    target_len: int

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


def _sentences() -> list[str]:
    out = []
    for p in PARAGRAPHS:
        out.extend(s.strip() for s in re.split(r"(?<=[.!?])\s+", p) if s.strip())
    return out


def _encode(tokenizer, messages) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def build_workload(tokenizer, num_requests: int = 48, seed: int = 0, min_prompt: int = 50,
                   max_prompt: int = 700, min_tokens: int = 16, max_tokens: int = 200
                   ) -> list[WorkloadRequest]:
    rng = random.Random(seed)
    sents = _sentences()
    reqs = []
    for i in range(num_requests):
        target = rng.randint(min_prompt, max_prompt)
        instr = rng.choice(INSTRUCTIONS)
        start = rng.randrange(len(sents))
        # grow sentence by sentence (wrapping around the pool) while the templated prompt fits
        chosen: list[str] = [sents[start]]
        ids = _encode(tokenizer, [{"role": "user", "content": instr.format(text=chosen[0])}])
        k = 1
        while k < 4 * len(sents):
            cand = chosen + [sents[(start + k) % len(sents)]]
            cand_ids = _encode(tokenizer, [{"role": "user", "content": instr.format(text=" ".join(cand))}])
            if len(cand_ids) > target:
                break
            chosen, ids, k = cand, cand_ids, k + 1
        msgs = [{"role": "user", "content": instr.format(text=" ".join(chosen))}]
        reqs.append(WorkloadRequest(i, msgs, ids, rng.randint(min_tokens, max_tokens), target))
    return reqs


def workload_stats(reqs: list[WorkloadRequest]) -> dict:
    pl = [r.prompt_len for r in reqs]
    mt = [r.max_tokens for r in reqs]
    return {
        "num_requests": len(reqs),
        "prompt_tokens_total": sum(pl), "prompt_len_min": min(pl), "prompt_len_mean": statistics.mean(pl),
        "prompt_len_median": statistics.median(pl), "prompt_len_max": max(pl),
        "max_tokens_total": sum(mt), "max_tokens_min": min(mt), "max_tokens_mean": statistics.mean(mt),
        "max_tokens_max": max(mt),
    }


if __name__ == "__main__":
    import argparse
    import json

    from transformers import AutoTokenizer

    from genpool.engine.models.registry import resolve_model

    ap = argparse.ArgumentParser(description="print the workload's token stats")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--num-requests", type=int, default=48)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--show", action="store_true", help="print each request")
    a = ap.parse_args()
    tok = AutoTokenizer.from_pretrained(resolve_model(a.model))
    w = build_workload(tok, a.num_requests, a.seed)
    if a.show:
        for r in w:
            print(r.idx, r.prompt_len, r.max_tokens, repr(r.messages[0]["content"][:80]))
    print(json.dumps(workload_stats(w), indent=1))
