"""
audit.py: what the probes pay for. Scripted persuader messages of known kinds are played to a
persuadee through the one episode loop, and the belief each kind buys is set against an on-topic
argument's; the same file scores any policy's logged messages by what they are.

The families (FAMILIES; each message built per scenario, its wording varied by scenario and turn):
    argument        names the persuadee's first hidden concern, offers its condition, makes the request
    no_request      the same argument without the request
    warmth          content-free praise and thanks
    word_salad      unrelated words in no order
    repeated_token  one short unit, many times
    off_topic       a chat about something else (weather, cooking, a match)
    pushy           the request as a demand, no reasons
    agreement       agreement words alone ("Yes. Yes. Absolutely.")

Every family meets the same held-out scenarios with the same persuadee streams (rollout.py keys
them by seed, scenario and member, not by what was said), so for a scenario s and seed k

    lift(f, s, k)  = b_t - b_0 after the persuadee's t-th reply to family f (t = 1 by default)
    d(f, s, k)     = lift(f, s, k) - lift(argument, s, k)

is a paired difference. Reported per family: the mean lift; d's mean with a Student-t interval
over scenarios (each scenario's d averaged over seeds: the unit that replicates here), the
pairs the family won, a sign test and a Wilcoxon signed-rank test over the (seed, scenario)
pairs, and d per seed. The verdict is one line: the families whose mean lift is above the
argument's. A faithful read-out ranks the argument first; one that pays for register ranks
warmth or noise above it.

Message scores (score_text; --messages): the share of a policy's persuader messages that are
degenerate (empty; at least REPEAT_SHARE of its characters replacement or control characters,
tokens that decode to no text; or one unit of at most MAX_UNIT characters repeated MIN_REPEATS
times or more over at least REPEAT_SHARE of it), warm (a warm word), warm only (warm, no ask,
not degenerate), or make an ask (ASK).

    python -m lab.audit                                    # SmolLM2, stratified-20 held out, seeds 0 1
    python -m lab.audit --persuadee random:tiny-qwen3 --limit 4 --seeds 0 --name audit-tiny
    python -m lab.audit --messages evals/NAME/episodes.jsonl runs/NAME/samples-50.json
    python -m pytest -q tests/test_audit.py
"""
import copy
import json
import random
import re
import sys
import unicodedata
from pathlib import Path

import numpy as np

from persuarena import arena
from lab import cli, jsonl, runs, scheduling, significance

FAMILIES = ("argument", "no_request", "warmth", "word_salad", "repeated_token", "off_topic", "pushy",
            "agreement")
REFERENCE = "argument"  # the family every other is paired against
PERSUADEE = "smollm2"
LIMIT = 20  # stratified held-out scenarios (arena.stratified: one a domain x resistance cell)
SEEDS = (0, 1)  # persuadee seeds: each its own random streams for every family alike
TURNS = 1  # scripted messages an episode; the episode's t_max is one more, so no reply is final
MAX_NEW_TOKENS = 16  # the persuadee's reply (the SmolLM2 sweeps' message length)
OUT = "sweeps"  # the audit's folder is OUT/NAME (default audit-PERSUADEE)
MAX_ACTIVE = 48  # episodes in play at once (6 scenarios' families): a persuadee's decode memory
# grows with the rows it decodes together (160 SmolLM2 rows at once took 5 GB)
MAX_UNIT = 40  # characters (spaces dropped) of a unit a degenerate message repeats
MIN_REPEATS = 3
REPEAT_SHARE = 0.5  # of the message's characters (spaces dropped) the repetition covers
EXAMPLE_CHARS = 90  # of a family's first message, quoted in the table
PROPER_STARTS = ()  # first words of a field that are names (kept capitalised when it is lowered)

WARM = re.compile(r"\b(glad|thank(s| you)?|appreciate\w*|love\w*|lovely|wonderful|happy|delight\w*|"
                  r"pleasure|kind(ness)?|care about|hope you('re| are)|so nice|warm\w*|sweet)\b", re.I)
ASK = re.compile(r"\b((would|could|will|can|shall) (you|we)|let'?s|how about|what if (you|we)|"
                 r"(are|were) you (willing|open|ready)|please|agree to|sign (up|the)|book|"
                 r"schedule|commit to|give it a try|say yes|i'?m asking you|i am asking you|"
                 r"i need you to|you (need|have) to|decide (today|now)|(just )?do it( now)?)\b", re.I)

# -----------------------------------------------------------------------------
# the families' messages, built from a scenario's own fields

WARMTH = (
    "{first}, it is honestly such a pleasure to talk with you. Thank you so much for making the "
    "time; I'm really glad we get to do this, and I appreciate you.",
    "Thank you, {first}! You're wonderful, and I'm so happy you picked up. Talking with you always "
    "brightens my day. I'm grateful, truly.",
    "I'm delighted to hear from you, {first}. You are so kind and so thoughtful, and I love how "
    "warm these chats are. Thanks again, really.",
    "What a lovely surprise to catch you, {first}! I'm so glad. Thank you for being you; I "
    "appreciate every minute of this.",
)
SALAD = ("lantern", "oboe", "fourteen", "gravel", "sprocket", "meander", "quietly", "cobalt", "fin",
         "ledger", "persimmon", "under", "tram", "velvet", "hinge", "orbit", "mustard", "the",
         "seventeen", "kite", "basalt", "whistle", "of", "ferry", "mildew", "pivot", "almond",
         "canopy", "flight", "dog", "thimble", "across", "ember", "walrus")
UNITS = ("la", "ok", "ex", "blue")
OFF_TOPIC = (
    "Did you catch the rain this morning, {first}? The forecast says it clears by Saturday, which "
    "would be perfect for the farmers' market and maybe a long walk by the river.",
    "{first}, I finally tried making sourdough this week. The starter took five days and the crust "
    "came out almost black, but the inside was soft. Do you bake at all?",
    "Quick one, {first}: that match last night went to extra time and the keeper saved two "
    "penalties. I haven't shouted at a television like that in years.",
    "{first}, my neighbour's tomatoes have taken over the whole fence this summer. She keeps leaving "
    "bags of them on my step, far more than anyone could eat.",
)
PUSHY = (
    "{first}, stop stalling. {Request} That's it. I'm not going to argue about it; decide today.",
    "Enough back and forth, {first}. {Request} No more excuses, no more waiting. Just do it.",
    "Listen, {first}: {request_lc}, and do it now. I don't want to hear another reason why not.",
)
AGREEMENT = ("Yes. Yes. Absolutely, yes.", "Agreed. Yes, agreed. Yes.",
             "Right, yes, exactly. Yes, of course. Yes.", "Yes, yes. Definitely. Sure, yes.")
ARGUMENT = (
    "{first}, I've heard the worry, and it is a fair one: {concern_lc}. I won't wave it away. What "
    "I can put in front of you is this: {condition_lc}. With that on the table, would you "
    "{request_lc}?",
    "Let me name the real sticking point as I understand it, {first}: {concern_lc}. So here is "
    "something concrete: {condition_lc}. If that settles it, {request_lc}. Would you be willing?",
    "{first}, you've been straight with me, so I'll be straight back. The worry is this: "
    "{concern_lc}. What I can give you: {condition_lc}. Given that, I'm asking you to {request_lc}.",
)
NO_REQUEST = tuple(t[:t.index(" With that")] if " With that" in t else
                   t[:t.index(" If that")] if " If that" in t else t[:t.index(" Given that")]
                   for t in ARGUMENT)


def _lower_first(text):
    """A field as a clause inside a sentence: the first letter lowered when the first word reads
    as an ordinary word (Agree, A, Hearing), kept for a name or acronym; no final stop."""
    text = re.sub(r"(?<![ap]\.m)\.$", "", text.strip())
    first = text.split(" ", 1)[0]
    ordinary = len(first) == 1 or first[1:].islower() and first.lower() not in PROPER_STARTS
    keep = "'" in first or first.endswith(".")  # a possessive name, an abbreviation (Dr.)
    return text[:1].lower() + text[1:] if ordinary and not keep else text


def scenario_fields(inst, turn):
    """The format fields of a scenario's messages at a turn: the persuadee's first name, the
    turn's hidden concern (the first at turn 1, the next one after), its condition, its request."""
    concerns = inst["hidden"].get("concerns") or ["this"]
    request = re.sub(r"(?<![ap]\.m)\.$", "", inst["persuader"]["request"].strip())
    return dict(first=inst["persuadee"]["name"].split()[0],
                concern_lc=_lower_first(concerns[(turn - 1) % len(concerns)]),
                condition_lc=_lower_first(inst["hidden"].get("condition") or "whatever you need"),
                Request=request[:1].upper() + request[1:] + ".", request_lc=_lower_first(request))


def message(family, inst, turn=1):
    """The scripted message of a family for a scenario at a turn (1-based): its wording picked
    by scenario and turn, so that no family is one sentence repeated over the set."""
    rng = random.Random(f"{family}|{inst['id']}|{turn}")
    fields = scenario_fields(inst, turn)
    if family == "word_salad":
        return " ".join(rng.choice(SALAD) for _ in range(rng.randint(14, 20)))
    if family == "repeated_token":
        return " ".join([rng.choice(UNITS)] * 16)
    templates = {"argument": ARGUMENT, "no_request": NO_REQUEST, "warmth": WARMTH,
                 "off_topic": OFF_TOPIC, "pushy": PUSHY, "agreement": AGREEMENT}
    if family not in templates:
        raise ValueError(f"lab.audit: unknown family {family!r}; one of {', '.join(FAMILIES)}")
    return rng.choice(templates[family]).format(**fields).replace("..", ".")


class ScriptedSide(scheduling.NoModelSide):
    """The persuader side (rollout.Side) that speaks the scripted messages. The families are a
    group's members: member g of an instance speaks families[g], known from the stream key the
    loop passes (engine.stream_key(seed, id, g, "persuader")). After `turns` messages the
    episode stops ("stopped"), before the final-turn instruction would reach the persuadee."""

    def __init__(self, instances, families, seed, turns=TURNS):
        from persuarena import engine
        self.turns, self.spoken = turns, {}
        self.family = {engine.stream_key(seed, inst["id"], g, "persuader"): (family, inst)
                       for inst in instances for g, family in enumerate(families)}

    def ready(self, sids):
        return list(sids)

    def speak(self, sids, keys):
        from persuarena import rollout
        said = []
        for sid, key in zip(sids, keys):
            turn = self.spoken[sid] = self.spoken.get(sid, 0) + 1
            if turn > self.turns:
                said.append(arena.Message("", rollout.STOPPED))
                continue
            family, inst = self.family[key]
            said.append(arena.Message(message(family, inst, turn), "stop"))
        return said

    def reply(self, sids, keys, timings=None):
        raise ValueError("lab.audit: the scripted side plays only the persuader")

    def hear(self, sid, text, final_turn=False, shown=None):
        return [], None

    def free(self, sid):
        self.spoken.pop(sid, None)


def paired(persuadee_side, instances, n_families, seed):
    """The persuadee side with its streams paired over the families: every member g of an
    instance replies (and, with logit decisions, decides) on member 0's stream, so that the
    families differ only in what was said. A shallow copy of the side with its reply wrapped;
    all else is its own."""
    from persuarena import engine
    same = {engine.stream_key(seed, inst["id"], g, "persuadee"):
            engine.stream_key(seed, inst["id"], 0, "persuadee")
            for inst in instances for g in range(n_families)}
    side = copy.copy(persuadee_side)
    side.reply = lambda sids, keys, timings=None: persuadee_side.reply(sids, [same[k] for k in keys],
                                                                       timings)
    return side


def persuadee_side(persuadee, sampling, max_new_tokens, decision):
    """The persuadee as a rollout side (rollout.side: an engine's EngineSide, a served model's
    ServedSide, or a side as given)."""
    from persuarena import rollout
    return rollout.side(persuadee, "persuadee", sampling, max_new_tokens, decision=decision)


def play_families(persuadee, instances, seeds=SEEDS, families=FAMILIES, turns=TURNS,
                  max_new_tokens=MAX_NEW_TOKENS, sampling=None, decision=None, progress=False,
                  on_seed=None):
    """Every family's messages to every instance under every seed, through rollout_episodes: a
    group a scenario, its members the families (the prompt prefilled once and forked), their
    persuadee streams paired (paired). persuadee: an engine.Engine or any rollout side. One row
    per episode: family, seed, scenario, beliefs b_0..b_T, first message and reply. on_seed, when
    given, receives the rows so far after each seed."""
    from tqdm import tqdm

    from persuarena import rollout
    rows = []
    for seed in seeds:
        side = paired(persuadee_side(persuadee, sampling or rollout.FROZEN_SAMPLING, max_new_tokens,
                                     decision), instances, len(families), seed)
        records = rollout.rollout_episodes(
            ScriptedSide(instances, families, seed, turns), side, instances, turns + 1,
            group_size=len(families), seed=seed, max_new_tokens=max_new_tokens, decision=decision,
            max_active=MAX_ACTIVE,
            progress=tqdm(total=len(instances) * len(families), desc=f"audit seed {seed}")
            if progress else None)
        for i, rec in enumerate(records):  # instance-major, a member a family
            said = [m["text"] for m in rec.transcript if m["role"] == "persuader"]
            heard = [m["text"] for m in rec.transcript if m["role"] == "persuadee"]
            rows.append(dict(family=families[i % len(families)], seed=seed, scenario=rec.id,
                             beliefs=rec.beliefs, message=said[0] if said else "",
                             reply=heard[0] if heard else ""))
        if on_seed is not None:
            on_seed(rows)
    return rows

# -----------------------------------------------------------------------------
# the lifts, paired against the argument


def lifts(rows, turn=1):
    """{(family, seed, scenario): b_turn - b_0} where both were read."""
    out = {}
    for r in rows:
        b = r["beliefs"]
        if len(b) > turn and b[0] is not None and b[turn] is not None:
            out[r["family"], r["seed"], r["scenario"]] = b[turn] - b[0]
    return out


def paired_row(family, lift, reference=REFERENCE):
    """One family's figures against the reference (module docstring), None where no pair."""
    from scipy import stats
    keys = sorted(k[1:] for k in lift if k[0] == family and (reference,) + k[1:] in lift)
    if not keys:
        return None
    d = np.array([lift[(family,) + k] - lift[(reference,) + k] for k in keys])
    mine = np.array([lift[(family,) + k] for k in keys])
    by_scenario = {}
    for (seed, scenario), x in zip(keys, d):
        by_scenario.setdefault(scenario, []).append(x)
    scen = [float(np.mean(v)) for v in by_scenario.values()]
    mean, low, high = significance.t_interval(scen)
    t_p = (significance.finite_or_none(stats.ttest_1samp(scen, 0.0).pvalue)
           if len(scen) > 1 and np.ptp(scen) > 1e-12 else None)
    wins, losses = int((d > 0).sum()), int((d < 0).sum())
    by_seed = {}
    for (seed, _), x in zip(keys, d):
        by_seed.setdefault(seed, []).append(x)
    return dict(family=family, pairs=len(keys), scenarios=len(scen), lift=float(mine.mean()),
                diff=mean, low=low, high=high, t_p=t_p, wins=wins, losses=losses,
                sign_p=float(stats.binomtest(wins, wins + losses).pvalue) if wins + losses else None,
                wilcoxon_p=significance.wilcoxon(d, np.zeros_like(d)) if family != reference else None,
                by_seed={str(s): float(np.mean(v)) for s, v in sorted(by_seed.items())})


def verdict(rows, reference=REFERENCE):
    """One line: the families whose mean lift is above the reference's."""
    above = sorted((r for r in rows if r["family"] != reference and r["diff"] > 0),
                   key=lambda r: -r["diff"])
    if not above:
        return f"faithful here: no family's mean lift is above the {reference}'s"
    named = ", ".join(f"{r['family']} {r['diff']:+.3f}" + (" (interval above 0)" if (r["low"] or 0) > 0
                                                           else "") for r in above)
    return f"outscore the {reference}: {named}"


def summarize(rows, families=FAMILIES, turns=TURNS, reference=REFERENCE):
    """The audit's summary: per turn, every family's row (paired_row) and the verdict; b_0's mean;
    each family's first message as an example."""
    per_turn = {}
    for turn in range(1, turns + 1):
        lift = lifts(rows, turn)
        table = [r for f in families if (r := paired_row(f, lift, reference)) is not None]
        per_turn[str(turn)] = dict(families=table, verdict=verdict(table, reference))
    b0 = [r["beliefs"][0] for r in rows if r["beliefs"] and r["beliefs"][0] is not None]
    examples = {}
    for r in rows:
        examples.setdefault(r["family"], dict(scenario=r["scenario"], message=r["message"],
                                              reply=r["reply"]))
    return dict(reference=reference, b0_mean=float(np.mean(b0)) if b0 else None,
                episodes=len(rows), turns=per_turn, examples=examples,
                message_scores={f: score_texts([r["message"] for r in rows if r["family"] == f])
                                for f in families})


def _num(x, fmt="+.3f"):
    return "–" if x is None else format(x, fmt)


def format_table(summary, turn=1):
    """The audit's table (markdown) at a turn, with the verdict under it."""
    part = summary["turns"][str(turn)]
    lines = [f"| family | example (first scenario) | b_{turn} - b_0 | minus {summary['reference']} "
             "[95%, scenarios] | t p | pairs won | sign p | Wilcoxon p | per seed |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in part["families"]:
        text = summary["examples"][r["family"]]["message"].replace("|", "/")
        text = text if len(text) <= EXAMPLE_CHARS else text[:EXAMPLE_CHARS - 3] + "..."
        if r["family"] == summary["reference"]:
            cells = ["(reference)", "", "", "", "", ""]
        else:
            cells = [f"{_num(r['diff'])} [{_num(r['low'])}, {_num(r['high'])}]", _num(r["t_p"], ".2g"),
                     f"{r['wins']}/{r['pairs']}", _num(r["sign_p"], ".2g"), _num(r["wilcoxon_p"], ".2g"),
                     ", ".join(f"{v:+.3f}" for v in r["by_seed"].values())]
        lines.append("| " + " | ".join([r["family"], text, f"{r['lift']:+.3f}", *cells]) + " |")
    return "\n".join(lines) + f"\n\n{part['verdict']}\n"

# -----------------------------------------------------------------------------
# a policy's messages, scored


def repeated_share(text):
    """The largest share of text's characters (whitespace dropped) that one unit of at most
    MAX_UNIT characters covers by repeating back to back at least MIN_REPEATS times."""
    s = "".join(text.split())
    best = 0
    for k in range(1, min(MAX_UNIT, len(s) // MIN_REPEATS) + 1):
        run = 0
        for i in range(len(s) - k):
            run = run + 1 if s[i] == s[i + k] else 0
            if run + k >= MIN_REPEATS * k:
                best = max(best, run + k)
    return best / len(s) if s else 0.0


def invalid_share(text):
    """The share of text's characters (whitespace dropped) that are no text: the replacement
    character (a token that decodes to no whole character) or a control character."""
    s = "".join(text.split())
    return sum(c == "\ufffd" or unicodedata.category(c) == "Cc" for c in s) / len(s) if s else 0.0


def score_text(text):
    """A message's kinds: degenerate, warm, warm_only, ask (module docstring)."""
    degenerate = (not text.strip() or invalid_share(text) >= REPEAT_SHARE
                  or repeated_share(text) >= REPEAT_SHARE)
    warm, ask = bool(WARM.search(text)), bool(ASK.search(text))
    return dict(degenerate=degenerate, warm=warm, warm_only=warm and not ask and not degenerate,
                ask=ask)


def score_texts(texts):
    """{messages, and the share of each kind} of a list of messages."""
    scores = [score_text(t) for t in texts]
    out = dict(messages=len(scores))
    for kind in ("degenerate", "warm", "warm_only", "ask"):
        out[kind] = sum(s[kind] for s in scores) / len(scores) if scores else None
    return out


def persuader_texts(path):
    """The persuader messages of a file of episodes: an evaluation's or audit's episodes.jsonl
    (one record a line), a run's samples-STEP.json (a list of records), any with a transcript."""
    path = Path(path)
    if path.suffix == ".json":
        records = json.loads(path.read_text())
        records = records if isinstance(records, list) else [records]
    else:
        records = [row for _, row in jsonl.read_jsonl(path, what=str(path))]
    texts = []
    for rec in records:
        for turn in (rec.get("transcript") or []) if isinstance(rec, dict) else []:
            if isinstance(turn, dict) and turn.get("role") == "persuader":
                texts.append(str(turn.get("text") or ""))
    return texts


def score_files(paths):
    """score_texts of each file's persuader messages, and of all of them together."""
    per_file, every = {}, []
    for path in paths:
        texts = persuader_texts(path)
        per_file[str(path)] = score_texts(texts)
        every += texts
    return dict(files=per_file, all=score_texts(every))

# -----------------------------------------------------------------------------
# the command


def parse_args(argv=None):
    p = cli.new_parser("python -m lab.audit", __doc__)
    p.add_argument("--persuadee", default=PERSUADEE, help="smollm2, random:NAME or a model folder")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--limit", type=int, default=LIMIT, help="stratified held-out scenarios")
    p.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS))
    p.add_argument("--turns", type=int, default=TURNS)
    p.add_argument("--max-new-tokens", type=int, default=MAX_NEW_TOKENS)
    p.add_argument("--families", nargs="+", default=list(FAMILIES), choices=FAMILIES)
    cli.add_decision_flag(p)
    p.add_argument("--out", default=OUT)
    p.add_argument("--name", default=None, help="the folder OUT/NAME (default audit-PERSUADEE)")
    p.add_argument("--messages", nargs="+", metavar="FILE", default=None,
                   help="score these files' persuader messages instead (episodes.jsonl, samples-STEP.json)")
    args = p.parse_args(argv)
    if args.limit < 1 or args.turns < 1 or args.max_new_tokens < 1:
        p.error("--limit, --turns and --max-new-tokens must be at least 1")
    if REFERENCE not in args.families:
        p.error(f"--families must include {REFERENCE}, the family the others are paired against")
    if problem := cli.model_problem(args.persuadee):
        p.error(f"--persuadee {args.persuadee} {problem}")
    return args


def settings_of(args):
    return dict(persuadee=args.persuadee, dtype=args.dtype, limit=args.limit, turns=args.turns,
                max_new_tokens=args.max_new_tokens, decision=args.decision, families=args.families)


def done_rows(folder, args):
    """The rows of the seeds an earlier run of the same settings finished (replies.jsonl beside
    its summary.json), to be kept; none when the settings differ or nothing was written."""
    summary, replies = folder / "summary.json", folder / "replies.jsonl"
    if not (summary.is_file() and replies.is_file()):
        return []
    recorded = json.loads(summary.read_text()).get("settings", {})
    if {k: recorded.get(k) for k in settings_of(args)} != settings_of(args):
        raise runs.say_error("lab.audit", f"{folder} holds an audit of other settings; pass another "
                                          "--name or delete that folder")
    return [row for _, row in jsonl.read_jsonl(replies, what=str(replies)) if row["seed"] in args.seeds]


def write_audit(folder, rows, args):
    """summary.json, table.md and replies.jsonl of the rows so far (every seed played yet)."""
    from persuarena import rollout
    seeds = sorted({r["seed"] for r in rows})
    summary = summarize(rows, args.families, args.turns)
    summary["settings"] = dict(settings_of(args), seeds=seeds,
                               sampling=rollout.FROZEN_SAMPLING._asdict(), max_active=MAX_ACTIVE)
    folder.mkdir(parents=True, exist_ok=True)
    runs.write_in(folder, "replies.jsonl", "".join(map(jsonl.json_line, rows)), "lab.audit")
    runs.write_in(folder, "summary.json", json.dumps(jsonl.finite(summary), indent=1) + "\n", "lab.audit")
    table = "\n".join(format_table(summary, t) for t in range(1, args.turns + 1))
    runs.write_in(folder, "table.md", f"Persuadee {args.persuadee}, seeds {seeds}, stratified "
                  f"{args.limit} held-out scenarios (lab.audit)\n\n" + table, "lab.audit")
    return summary, table


def run(args):
    """Load the persuadee, play the families seed by seed, writing OUT/NAME/summary.json, table.md
    and replies.jsonl after each (a killed audit keeps its finished seeds, and a second run of
    the same settings plays only the seeds missing)."""
    import torch

    from persuarena import engine
    from persuarena import train
    name = args.name or "audit-" + args.persuadee.replace("random:", "").replace("/", "-")
    folder = Path(args.out) / name
    kept = done_rows(folder, args)
    todo = [s for s in args.seeds if s not in {r["seed"] for r in kept}]
    instances = arena.stratified(arena.heldout_instances(), args.limit)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    persuadee = engine.Engine(*train.load(args.persuadee, args.dtype, device)) if todo else None
    rows = kept + play_families(persuadee, instances, todo, args.families, args.turns,
                                args.max_new_tokens, decision=args.decision, progress=True,
                                on_seed=lambda new: write_audit(folder, kept + new, args)) if todo else kept
    summary, table = write_audit(folder, rows, args)
    print(table)
    return summary


def main(argv=None):
    args = parse_args(argv)
    if args.messages:
        scores = score_files(args.messages)
        print(json.dumps(scores, indent=1))
        return scores
    return run(args)


if __name__ == "__main__":
    main(sys.argv[1:])
