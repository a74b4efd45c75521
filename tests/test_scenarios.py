"""The scenario set itself (scenarios.jsonl): counts, balance, completeness, independence."""
import re
from collections import Counter
from itertools import product

import pytest

from persuarena import arena

SCENARIOS = arena.load_scenarios()
HELDOUT = [s for s in SCENARIOS if s["split"] == "heldout"]
TRAIN = [s for s in SCENARIOS if s["split"] == "train"]
HIDDEN = ("resistance", "motivation", "concerns", "values", "trust", "relationship", "secret",
          "condition")
NEAR_DUPLICATE = 0.6  # Jaccard overlap of content words above which two texts are "the same"


def words(text):
    return {w for w in re.findall(r"[a-z']+", text.lower()) if len(w) > 3}


def overlap(a, b):
    a, b = words(a), words(b)
    return len(a & b) / max(1, len(a | b))


def test_counts_and_ids():
    assert len(HELDOUT) == 120 and len(TRAIN) >= 360
    assert [s["id"] for s in HELDOUT] == [f"heldout-{i:03d}" for i in range(1, 121)]
    assert len({s["id"] for s in SCENARIOS}) == len(SCENARIOS)


def test_heldout_has_six_in_every_domain_resistance_cell_and_every_hidden_field():
    cells = Counter((s["domain"], s["hidden"]["resistance"]) for s in HELDOUT)
    assert cells == {cell: 6 for cell in product(arena.DOMAINS, arena.RESISTANCE_TYPES)}
    for s in HELDOUT:
        assert all(s["hidden"].get(k) for k in HIDDEN), s["id"]


def test_training_covers_every_cell_and_some_omit_optional_fields():
    per_domain = Counter(s["domain"] for s in TRAIN)
    assert min(per_domain.values()) >= 72
    assert {(s["domain"], s["hidden"]["resistance"]) for s in TRAIN if "resistance" in s["hidden"]} == \
        set(product(arena.DOMAINS, arena.RESISTANCE_TYPES))
    omitting = [s for s in TRAIN if not all(k in s["hidden"] for k in ("motivation", "relationship", "secret"))]
    assert 0.1 * len(TRAIN) <= len(omitting) <= 0.5 * len(TRAIN)
    # the paper's B.2: some training scenarios leave the resistance unstated (held-out never does)
    unstated = [s for s in TRAIN if "resistance" not in s["hidden"]]
    assert 0.05 * len(TRAIN) <= len(unstated) <= 0.25 * len(TRAIN)


def test_requests_and_contexts_are_unique():
    for field in (lambda s: s["persuader"]["request"], lambda s: s["context"], lambda s: s["title"]):
        values = [field(s).strip().lower() for s in SCENARIOS]
        assert len(set(values)) == len(values)


@pytest.mark.parametrize("field", ["request", "title", "context"])
def test_no_heldout_text_is_reused_in_training(field):
    """Exact or near reuse (content-word overlap) of a held-out request, title or context."""
    get = (lambda s: s["persuader"]["request"]) if field == "request" else (lambda s: s[field])
    worst = max(((overlap(get(h), get(t)), h["id"], t["id"]) for h in HELDOUT for t in TRAIN))
    assert worst[0] < NEAR_DUPLICATE, worst


def test_overlap_check_catches_a_paraphrase():
    a = "Agree to book the colonoscopy for the fourteenth at the Riverside clinic"
    b = "Agree to book the colonoscopy at the Riverside clinic for the fourteenth, please"
    assert overlap(a, b) >= NEAR_DUPLICATE > overlap(a, "Move the savings into an index fund")


def test_training_distribution_differs_from_heldout():
    """Held-out results measure transfer: the training ages are spread differently."""
    def share_young_or_old(rows):
        return sum(s["persuadee"]["age"] < 30 or s["persuadee"]["age"] >= 65 for s in rows) / len(rows)
    assert share_young_or_old(TRAIN) > share_young_or_old(HELDOUT) + 0.1


def test_training_expands_into_1800_distinct_instances():
    instances = arena.training_instances()
    assert len(instances) >= 1800
    assert len({i["id"] for i in instances}) == len(instances)
