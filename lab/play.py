"""
The terminal player: you are the persuader (python eval.py --play SCENARIO_ID). PersonSide is a
rollout side like any other (rollout.py's docstring lists the interface): each message is typed
at the terminal, each reply shown with its probe values and the belief change of the turn, and
the episode is played by rollout.rollout_episodes and saved like any evaluation's.

    python eval.py --play heldout-017
    python -m pytest -q tests/test_rollout.py -k typed
"""
import sys
import time
from pathlib import Path

from persuarena import arena
from persuarena import probes
from persuarena import rollout
from lab import analyses, hardening, pools, report, runs, scheduling, terminal

TYPING_TRIES = 5  # lines a person may type that are not valid text before the message is ""


def typed_line(prompt):
    """input(), with bytes that are not UTF-8 kept as lone surrogates (surrogateescape), so that
    a bad line is found by hardening.invalid_text and the line after it is read intact."""
    if hasattr(sys.stdin, "reconfigure") and getattr(sys.stdin, "errors", None) == "strict":
        sys.stdin.reconfigure(errors="surrogateescape")
    return input(prompt)


def person_line(read, write, prompt):
    """The person's next line, stripped: "" at the end of input; a line that is not valid text
    (invalid UTF-8) is said in one line and typed again, at most TYPING_TRIES times."""
    for _ in range(TYPING_TRIES):
        try:
            text = read(prompt).strip()
        except EOFError:
            return ""
        except UnicodeDecodeError:
            text = "\ud800"
        if hardening.invalid_text(text) is None:
            return text
        write("that line is not valid UTF-8 text (check the terminal's encoding); type it again")
    return ""


def play(scenario_id, persuadee, *, seed, t_max, out_root, read=input, write=print,
         max_new_tokens=None, dtype="float32", probe_space=None, probe_signs=None, sampling=None,
         decision=None, allow_insecure_key=None, name=None, overwrite=False):
    """You are the persuader (PersonSide): type each message; the persuadee (a local model or
    openai:MODEL@URL) answers and you see its probe values and the belief change of the turn.
    The episode is saved under out_root/NAME (name: checked and locked as any run folder,
    before the model loads), by default out_root/play-SCENARIO_ID-TIME, like any other."""
    found = [inst for split in arena.SPLITS for inst in arena.written_instances(split)
             if inst["id"] == scenario_id]
    if not found:
        sys.exit(f"eval.py: unknown scenario id {scenario_id!r}; use an id from scenarios.jsonl, e.g. heldout-017")
    name = name or f"play-{scenario_id}-{time.strftime('%Y%m%d-%H%M%S')}"
    runs.check_folder(out_root, name, "eval.py", False, overwrite)
    out_dir = Path(out_root) / name
    runs.lock(out_dir, "eval.py")
    if overwrite:
        runs.clear(out_dir)
    try:
        return played(scenario_id, found, persuadee, out_dir, PersonSide(t_max, read, write),
                      seed=seed, t_max=t_max, write=write, max_new_tokens=max_new_tokens,
                      dtype=dtype, probe_space=probe_space, probe_signs=probe_signs,
                      sampling=sampling, decision=decision, allow_insecure_key=allow_insecure_key)
    finally:
        runs.unlock(out_dir)


def played(scenario_id, found, persuadee, out_dir, you, *, seed, t_max, write, max_new_tokens,
           dtype, probe_space, probe_signs, sampling, decision, allow_insecure_key):
    """The episode a person played, saved into out_dir."""
    [ep] = rollout.rollout_episodes(
        you, pools.player(persuadee, {}, dtype, None, allow_insecure_key), found[:1], t_max, seed=seed,
        persuadee_sampling=(sampling or rollout.SAMPLING["paper"])[1],
        max_new_tokens=max_new_tokens, probe_space=probe_space,
        probe_signs=probe_signs, decision=decision)
    ep = rollout.Episode.from_record(dict(ep.record(training=False), judge=None,
                                          persuader="human", persuadee=persuadee, seed=seed))
    report.save_run(out_dir, [ep], analyses.summarize([ep]))
    write(f"outcome {ep.outcome} after {ep.turns} turns; saved to {out_dir}")
    return ep


class PersonSide:
    """The persuader typed by a person at the terminal (play, below): each message is read
    from `read`, each reply written with its probe values and the belief change of the turn. An
    empty line (or end of input) ends the episode "stopped"; a line that is not valid text is
    typed again (person_line)."""
    tokenizer = max_len = eng = None

    def __init__(self, t_max, read=typed_line, write=print):
        self.t_max, self.read, self.write = t_max, read, write
        self.turns, self.next_sid = {}, 0

    def prompt(self, instance):
        return []

    def room(self, instance, n):
        return True

    def prefill(self, instance):
        self.write(f"== {instance['title']} ({instance['id']})\nYou are "
                   f"{instance['persuader']['role']}. Goal: {instance['persuader']['goal']}\n"
                   f"Request: {instance['persuader']['request']}\nThey: "
                   f"{instance['persuadee']['name']}, {instance['persuadee']['age']}, "
                   f"{instance['persuadee']['occupation']}. {instance['context']}\n"
                   "(empty line or Ctrl-D: stop)")
        return None

    def start(self, roots, counts):
        sids, self.next_sid = scheduling.numbered(self.next_sid, counts)
        self.turns.update(dict.fromkeys((s for group in sids for s in group), 0))
        return sids, [None] * len(roots)

    def ready(self, sids):
        return list(sids)

    def speak(self, sids, keys):
        said = []
        for s in sids:
            self.turns[s] += 1
            text = person_line(self.read, self.write, f"turn {self.turns[s]}/{self.t_max} you> ")
            said.append(arena.Message(text, "stop" if text else rollout.STOPPED))
        return said

    def reply(self, sids, keys, timings=None):  # (rollout.Side) a person plays only the persuader
        raise ValueError("play.py: a person plays the persuader; the persuadee is a model")

    def hear(self, sid, text, final_turn=False, shown=None):
        """The reply, its probe values, the belief and its change this turn."""
        self.write(f"them: {terminal.visible(text, one_line=True)}")  # shown, never obeyed,
        # on its own line: a reply cannot print a fake probe line below it
        values, beliefs = shown
        if None not in values and None not in beliefs[-2:]:
            self.write("   " + "  ".join(f"{k} {v:+.2f}" for k, v in zip(probes.PROBES, values))
                       + f"   belief {beliefs[-1]:+.2f} ({beliefs[-1] - beliefs[-2]:+.2f})")
        return [], None

    def free(self, sid):
        self.turns.pop(sid, None)
