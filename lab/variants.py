"""
A training scenario's variants, as arena.training_instances draws them: the same profile under a
new name, a nearby age, a neighbouring trust level and another leading concern; the request and
everything at stake stay as written. arena.py owns the knobs (AGE_SHIFT, MIN_AGE, TRUST_LEVELS)
and passes them in, read when it calls; this module holds the names a variant may take and the
text surgery that renames a persona consistently. Standard library only.

Tests: python -m pytest -q tests/test_arena.py
"""
import re
from typing import NamedTuple

FIRST_NAMES = {  # no name that is also a common English word, so renaming cannot rewrite prose
    "she/her": ("Amara", "Beatriz", "Chiara", "Daniela", "Elena", "Fatima", "Gabriela", "Hana",
                "Ingrid", "Jasmine", "Keiko", "Leila", "Marisol", "Nadia", "Olga", "Priya",
                "Renata", "Sofia", "Tamar", "Valeria", "Wen", "Ximena", "Yasmin", "Zainab",
                "Aisha", "Camila", "Dalia", "Esther", "Ines", "Lucia"),
    "he/him": ("Ahmed", "Bruno", "Carlos", "Dmitri", "Emeka", "Farid", "Gustavo", "Hiroshi",
               "Ivan", "Jamal", "Kwame", "Luca", "Mateo", "Nikhil", "Omar", "Pavel", "Rafael",
               "Santiago", "Tomasz", "Umar", "Viktor", "Wei", "Yusuf", "Zoran", "Andre", "Diego",
               "Elias", "Felix", "Hamid", "Kenji"),
    "they/them": ("Alex", "Avery", "Casey", "Dakota", "Emery", "Finley", "Jordan", "Kai",
                  "Logan", "Morgan", "Quinn", "Reese", "Riley", "Rowan", "Skyler", "Taylor",
                  "Jules", "Noor", "Ari", "Remy", "Sasha", "Charlie", "Jessie", "Devon",
                  "Marlowe", "Ellis", "Sam", "Toby", "Shay", "Blair"),
}
SURNAMES = ("Abara", "Bergstrom", "Castillo", "Dubois", "Eriksen", "Fernandes", "Goldberg",
            "Haddad", "Ibrahim", "Jovanovic", "Kowalski", "Lindqvist", "Mendoza", "Nakamura",
            "Okafor", "Petrov", "Quintero", "Rahman", "Santos", "Tanaka", "Varga", "Wozniak",
            "Yilmaz", "Zhang", "Adeyemi", "Bianchi", "Chowdhury", "Delgado", "Fischer", "Horvat",
            "Iyer", "Jensen", "Reddy", "Laurent", "Moreau", "Novak", "Ortega", "Sato", "Mwangi",
            "Costa")
NOT_TEXT = {"id", "split", "domain", "resistance", "trust", "pronouns"}  # enum fields, never renamed


def texts(obj):
    """Every string of a scenario that is prose (not an enum field), in order."""
    if isinstance(obj, str):
        yield obj
    elif isinstance(obj, (list, dict)):
        for key, value in (obj.items() if isinstance(obj, dict) else enumerate(obj)):
            if key not in NOT_TEXT:
                yield from texts(value)


def map_texts(obj, fn):
    """The scenario with fn applied to each string that is prose."""
    if isinstance(obj, str):
        return fn(obj)
    if isinstance(obj, list):
        return [map_texts(v, fn) for v in obj]
    if isinstance(obj, dict):
        return {k: v if k in NOT_TEXT else map_texts(v, fn) for k, v in obj.items()}
    return obj


def count(word, text, part=lambda c: c.isalnum() or c == "_"):
    """How often word occurs in text as a whole word: no character `part` of a word (what the
    regex \\w matches, by default) on either side; matches do not overlap. A scan, not a regex:
    a pattern compiled per name was most of a training run's instance drawing."""
    n, i = 0, text.find(word)
    while i >= 0:
        end = i + len(word)
        whole = not (i and part(text[i - 1])) and not (end < len(text) and part(text[end]))
        n += whole
        i = text.find(word, max(end, i + 1) if whole else i + 1)
    return n


class Persona(NamedTuple):
    """What every redraw of one scenario shares, read once from its prose (persona)."""
    firsts: list          # first names a variant may take: none a word of the scenario
    lasts: list           # surnames likewise
    keep_surname: bool    # the surname is also a relative's ("her brother, Diego Lopez")
    pattern: re.Pattern   # finds the full name, then the first name alone, as whole words
    age_written: bool     # the age is written out in the prose ("a 34-year-old nurse")


def persona(scenario):
    """The Persona of a scenario. A new name must share no word with the scenario, or the
    replacement would merge two people; a persona without pronouns gets a name that fits any."""
    person = scenario["persuadee"]
    text = "\n".join(texts(scenario))
    words = set(re.findall(r"\w+", text.lower()))
    old = person["name"].split()
    olds = dict.fromkeys([person["name"], old[0]])  # the full name first: the longer match
    return Persona(
        firsts=[f for f in FIRST_NAMES[person.get("pronouns", "they/them")]
                if f.lower() not in words],
        lasts=[last for last in SURNAMES if last.lower() not in words],
        keep_surname=len(old) > 1 and count(old[-1], text) > count(person["name"], text),
        pattern=re.compile(r"(?<!\w)(" + "|".join(map(re.escape, olds)) + r")(?!\w)"),
        age_written=count(str(person["age"]), text, str.isdecimal) > 0)


def draw(scenario, rng, age_shift, min_age, trust_levels, facts=None):
    """One coherent redraw of a scenario's persona (not yet named as an instance): its age moved
    by at most age_shift (never under min_age; not at all where the prose states it), its trust
    one step of trust_levels at most. facts: the scenario's Persona, when the caller keeps it."""
    facts = facts or persona(scenario)
    old = scenario["persuadee"]["name"].split()
    new = [rng.choice(facts.firsts)] + ([rng.choice(facts.lasts)] if len(old) > 1 else [])
    if facts.keep_surname:
        new[1:] = old[1:]
    names = {scenario["persuadee"]["name"]: " ".join(new), old[0]: new[0]}
    s = map_texts(scenario, lambda t: facts.pattern.sub(lambda m: names[m.group(1)], t))
    person, hidden = s["persuadee"], s["hidden"]
    if not facts.age_written:  # a written age would contradict a shifted one
        person["age"] = max(min_age, person["age"] + rng.randint(-age_shift, age_shift))
    level = trust_levels.index(hidden["trust"])
    hidden["trust"] = rng.choice([t for i, t in enumerate(trust_levels) if abs(i - level) <= 1])
    k = rng.randrange(len(hidden["concerns"]))
    hidden["concerns"] = hidden["concerns"][k:] + hidden["concerns"][:k]
    return s


def capacity(scenario, age_shift, min_age, trust_levels):
    """How many distinct variants draw can give a scenario at most (variant 0 included): its
    name, age, trust and leading-concern choices multiplied out."""
    person, hidden, facts = scenario["persuadee"], scenario["hidden"], persona(scenario)
    names = len(facts.firsts)
    if len(person["name"].split()) > 1 and not facts.keep_surname:
        names *= len(facts.lasts)
    ages = 1 if facts.age_written else len(
        {max(min_age, person["age"] + d) for d in range(-age_shift, age_shift + 1)})
    level = trust_levels.index(hidden["trust"])
    trusts = sum(abs(i - level) <= 1 for i in range(len(trust_levels)))
    return 1 + names * ages * trusts * len(hidden["concerns"])
