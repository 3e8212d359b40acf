"""Seeded extraction workload: short documents and a JSON schema for each (tests + benchmarks).

Three record families (person, product, event), each document written from a random record,
each schema drawn from the family's fields: nested objects, arrays with bounds, enums, integers
and numbers with bounds, required and optional fields, strings with patterns. Every string is
length-bounded so a complete record fits well inside the jobs' max_tokens.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass

FIRST = ["Ada", "Bruno", "Chen", "Dalia", "Emil", "Farah", "Goran", "Hana", "Ivo", "Jun"]
LAST = ["Lovelace", "Silva", "Wei", "Haddad", "Novak", "Karim", "Petrov", "Sato", "Rossi", "Kim"]
CITIES = ["Paris", "Lisbon", "Osaka", "Lima", "Oslo"]
SKILLS = ["welding", "python", "cooking", "design", "sales"]
PRODUCTS = ["kettle", "lamp", "backpack", "chair", "drill"]
COLORS = ["red", "green", "blue", "black", "white"]
CATEGORIES = ["concert", "lecture", "market", "race", "workshop"]


@dataclass
class Case:
    family: str
    document: str
    schema: dict


def _s(max_len: int, **extra) -> dict:
    return {"type": "string", "minLength": 1, "maxLength": max_len, **extra}


def _person(rng: random.Random) -> Case:
    name = f"{rng.choice(FIRST)} {rng.choice(LAST)}"
    age, city = rng.randint(18, 90), rng.choice(CITIES)
    skills = rng.sample(SKILLS, rng.randint(1, 3))
    zipc = f"{rng.randint(10000, 99999)}"
    doc = (f"{name} is {age} years old and lives in {city}, postal code {zipc}. "
           f"They are known for {', '.join(skills)}.")
    props = {"name": _s(40), "age": {"type": "integer", "minimum": 0, "maximum": 130},
             "city": {"enum": CITIES},
             "address": {"type": "object", "properties": {
                 "city": {"enum": CITIES}, "zip": _s(5, pattern="^[0-9]{5}$")},
                 "required": ["city", "zip"], "additionalProperties": False},
             "skills": {"type": "array", "items": {"enum": SKILLS}, "minItems": 1, "maxItems": 3}}
    return Case("person", doc, _pick(rng, props, ["name", "age"]))


def _product(rng: random.Random) -> Case:
    item, color = rng.choice(PRODUCTS), rng.choice(COLORS)
    price, qty = round(rng.uniform(5, 500), 2), rng.randint(0, 40)
    sku = f"{rng.choice('ABCDEFGH')}{rng.choice('KLMNP')}-{rng.randint(1000, 9999)}"
    doc = (f"The {color} {item} (SKU {sku}) sells for {price} euros; {qty} units are in stock, "
           f"{'and it ships today' if qty else 'so it is back-ordered'}.")
    props = {"sku": _s(7, pattern="^[A-Z]{2}-[0-9]{4}$"), "item": {"enum": PRODUCTS},
             "price": {"type": "number", "minimum": 0, "maximum": 10000},
             "in_stock": {"type": "boolean"}, "quantity": {"type": "integer", "minimum": 0,
                                                           "maximum": 1000},
             "colors": {"type": "array", "items": {"enum": COLORS}, "maxItems": 2},
             "dimensions": {"type": "object", "properties": {
                 "width_cm": {"type": "integer", "minimum": 1, "maximum": 300},
                 "height_cm": {"type": "integer", "minimum": 1, "maximum": 300}},
                 "required": ["width_cm"], "additionalProperties": False}}
    return Case("product", doc, _pick(rng, props, ["sku", "item"]))


def _event(rng: random.Random) -> Case:
    cat = rng.choice(CATEGORIES)
    date = f"2026-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"
    people, city = rng.randint(10, 5000), rng.choice(CITIES)
    doc = f"A {cat} in {city} on {date} drew {people} people; tickets were {rng.randint(0, 80)} euros."
    props = {"category": {"enum": CATEGORIES}, "date": _s(10, pattern="^[0-9]{4}-[0-9]{2}-[0-9]{2}$"),
             "attendees": {"type": "integer", "minimum": 0, "maximum": 100000},
             "venue": {"type": "object", "properties": {"city": {"enum": CITIES},
                                                        "indoor": {"type": "boolean"}},
                       "required": ["city"], "additionalProperties": False},
             "ticket_price": {"type": ["number", "null"], "minimum": 0, "maximum": 1000},
             "notes": _s(30)}
    return Case("event", doc, _pick(rng, props, ["category", "date"]))


def _pick(rng: random.Random, props: dict, always: list[str]) -> dict:
    """The family's always-fields plus a random subset of the rest; some optional (not required)."""
    rest = [k for k in props if k not in always]
    chosen = always + rng.sample(rest, rng.randint(1, len(rest)))
    required = always + [k for k in chosen[len(always):] if rng.random() < 0.6]
    return {"type": "object", "properties": {k: props[k] for k in chosen},
            "required": required, "additionalProperties": False}


def make_cases(n: int, seed: int = 0) -> list[Case]:
    rng = random.Random(seed)
    makers = [_person, _product, _event]
    return [makers[i % 3](rng) for i in range(n)]


def messages(case: Case) -> list[dict]:
    return [{"role": "user", "content":
             f"Extract a {case.family} record as JSON with the fields "
             f"{', '.join(case.schema['properties'])}.\n\n{case.document}"}]


if __name__ == "__main__":
    for c in make_cases(3):
        print(c.document, json.dumps(c.schema)[:200], sep="\n", end="\n\n")
