"""Tool-call validity for `tool_choice` required and auto on 50 held-out prompts (issue 33).

The benchmark writes 50 user requests (10 for each of 5 tools, cities, amounts and times drawn
with a fixed seed), each answerable only by calling one tool. Every request goes through the
gateway's own transformation (producer/openai_tools.prepare: the Hermes tool prompt, and for
`required` the llguidance constraint), then SmolLM2-135M (greedy, one continuous batch through
`LLM.chat`, as a worker would run the job), then the gateway's parser (openai_tools.split).
Counted per mode:
- valid: the answer holds at least one call and every call names a known tool with arguments
  that validate (jsonschema) against that tool's parameters;
- picked (auto): the answer holds any call at all (every request needs one);
- right tool: the first call names the tool the request was written for.

  python benchmarks/tool_calls.py --json out.json
"""
from __future__ import annotations

import os
import sys

sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
import time  # noqa: E402

import jsonschema  # noqa: E402

from genpool.producer import openai_tools  # noqa: E402


def fn(name: str, description: str, props: dict, required: list[str]) -> dict:
    return {"type": "function", "function": {"name": name, "description": description,
            "parameters": {"type": "object", "properties": props, "required": required,
                           "additionalProperties": False}}}


TOOLS = [
    fn("get_weather", "Current weather in a city", {
        "city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}}, ["city"]),
    fn("convert_currency", "Convert an amount of money between currencies", {
        "amount": {"type": "number"}, "from_currency": {"type": "string", "pattern": "^[A-Z]{3}$"},
        "to_currency": {"type": "string", "pattern": "^[A-Z]{3}$"}},
        ["amount", "from_currency", "to_currency"]),
    fn("set_timer", "Start a countdown timer", {
        "minutes": {"type": "integer", "minimum": 1, "maximum": 600},
        "label": {"type": "string"}}, ["minutes"]),
    fn("search_flights", "Find flights between two cities on a date", {
        "origin": {"type": "string"}, "destination": {"type": "string"},
        "date": {"type": "string", "pattern": "^\\d{4}-\\d{2}-\\d{2}$"}},
        ["origin", "destination", "date"]),
    fn("translate", "Translate a text into another language", {
        "text": {"type": "string"}, "target_language": {"type": "string"}},
        ["text", "target_language"]),
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
CITIES = ["Oslo", "Lima", "Nairobi", "Hanoi", "Denver", "Porto", "Osaka", "Tunis", "Quito",
          "Perth", "Krakow", "Dakar"]
CURRENCIES = ["USD", "EUR", "JPY", "GBP", "CHF", "INR", "BRL"]
PHRASES = ["good morning", "where is the station", "thank you very much", "the bill, please",
           "I am lost", "how much does it cost"]
LANGS = ["French", "Spanish", "German", "Italian", "Japanese"]
TEMPLATES = {
    "get_weather": ["What's the weather like in {city} right now?",
                    "Is it raining in {city} today?", "How warm is it in {city} in {unit}?"],
    "convert_currency": ["How much is {amount} {c1} in {c2}?",
                         "Convert {amount} {c1} to {c2}, please."],
    "set_timer": ["Set a timer for {minutes} minutes for the {label}.",
                  "Remind me in {minutes} minutes to check the {label}."],
    "search_flights": ["Find me a flight from {city} to {city2} on {date}.",
                       "Are there flights {city} -> {city2} on {date}?"],
    "translate": ["Translate '{phrase}' into {lang}.", "How do you say '{phrase}' in {lang}?"],
}


def prompts(seed: int = 33) -> list[tuple[str, str]]:
    """50 (tool name, user request) pairs, 10 per tool."""
    rng = random.Random(seed)
    out = []
    for name, forms in TEMPLATES.items():
        for i in range(10):
            city, city2 = rng.sample(CITIES, 2)
            c1, c2 = rng.sample(CURRENCIES, 2)
            out.append((name, forms[i % len(forms)].format(
                city=city, city2=city2, unit=rng.choice(["celsius", "fahrenheit"]),
                amount=rng.choice([20, 75, 120, 2500, 9.5]), c1=c1, c2=c2,
                minutes=rng.randint(2, 90), label=rng.choice(["pasta", "laundry", "oven"]),
                date=f"2027-0{rng.randint(1, 9)}-{rng.randint(10, 28)}",
                phrase=rng.choice(PHRASES), lang=rng.choice(LANGS))))
    return out


def valid(call: dict) -> bool:
    name = call["function"]["name"]
    if name not in SCHEMAS:
        return False
    try:
        jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[name])
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def run_mode(llm, cases, choice: str, max_tokens: int) -> dict:
    from genpool.engine import SamplingParams

    convs, params, parsers = [], [], []
    for _, ask in cases:
        kw = {"messages": [{"role": "user", "content": ask}], "tools": TOOLS,
              "tool_choice": choice}
        tools = openai_tools.prepare(kw)
        convs.append(kw["messages"])
        params.append(SamplingParams(temperature=0, max_tokens=max_tokens,
                                     structured_outputs=kw.get("structured_outputs")))
        parsers.append(tools)
    t0 = time.perf_counter()
    outs = llm.chat(convs, params)
    dt = time.perf_counter() - t0
    n_valid = picked = right = 0
    examples, invalid = [], []
    for (want, ask), tools, o in zip(cases, parsers, outs):
        _, calls = openai_tools.split(tools, o.outputs[0].text)
        ok = bool(calls) and all(valid(c) for c in calls)
        picked += bool(calls)
        n_valid += ok
        right += bool(calls) and calls[0]["function"]["name"] == want
        seen = {"ask": ask, "answer": o.outputs[0].text[:300],
                "finish_reason": o.outputs[0].finish_reason}
        if len(examples) < 3:
            examples.append(seen)
        if calls and not ok or (choice == "required" and not ok):
            invalid.append(seen)
    return {"n": len(cases), "valid": n_valid, "picked": picked, "right_tool": right,
            "seconds": dt, "examples": examples, "invalid": invalid}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--modes", default="required,auto")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    import torch

    from genpool.engine import LLM

    torch.set_num_threads(args.threads)
    llm = LLM(args.model, dtype="float32", max_num_seqs=64)
    cases = prompts()
    res = {"load_avg_start": os.getloadavg(), "modes": {}}
    for choice in args.modes.split(","):
        r = run_mode(llm, cases, choice, args.max_tokens)
        res["modes"][choice] = r
        print(f"{choice}: valid {r['valid']}/{r['n']}, picked a tool {r['picked']}/{r['n']}, "
              f"right tool {r['right_tool']}/{r['n']} ({r['seconds']:.1f} s)", flush=True)
        for ex in r["examples"]:
            print("   ", json.dumps(ex)[:300])
        for ex in r["invalid"]:
            print("    invalid:", json.dumps(ex)[:400])
    res["load_avg_end"] = os.getloadavg()
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(res, fh, indent=1)


if __name__ == "__main__":
    main()
