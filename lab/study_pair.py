"""
study_pair.py: people beside a model persuadee, on the same scenarios and the same persuader.

A study folder of persuadee mode (lab/study.py) holds people's episodes against one persuader,
their self-reports where a model's probe read-outs go. One command sets a model persuadee beside
them:
  1. the model plays each scenario the people played, against the study's persuader (its
     settings.json: model, t_max, max_new_tokens), once, seeded; saved as an evaluation folder,
     FOLDER/model-NAME (resumable; eval.py --analyze reads it);
  2. the model reads each person's own conversation (shadow read-outs): after each of the
     person's replies, the model persuadee's context holds the persona, the persuader's messages
     as it would hear them and the person's replies as its own, closed; the probes are read there
     (probes.read_beliefs), so self-report and read-out are taken on the same words;
  3. pair.json and a table: belief trajectories (people's mean per turn beside the model's own),
     b_T - b_0 (per scenario, paired: Wilcoxon signed-rank), outcomes, and the correlation of
     self-reports with the shadow read-outs (belief, and each probe; Pearson and Spearman).
What it can and cannot show: DECISIONS.md, Study design.

    python -m lab.study_pair studies/pilot --persuadee smollm2
    python -m lab.study_pair studies/pilot --persuadee smollm2 --model-run evals/NAME
    python -m pytest -q tests/test_study.py -k pair
"""
import json
import sys
from pathlib import Path

from persuarena import arena
from persuarena import models
from persuarena import probes
from persuarena import rollout
from lab import analyses, cli, episode_log, records, report, runs
from lab.significance import pearson, spearman, wilcoxon

SEED = 0  # the model's episodes' seed (--seed)


def shadow_contexts(tokenizer, inst, transcript, t_max, max_len):
    """The model persuadee's closed context before the first message and after each reply of a
    person's transcript (the persuader's message as persuadee_heard gives it, the reply's text as
    the model's own message, closed): token ids, None where the context would exceed max_len."""
    ids = list(rollout.prompt_ids(tokenizer, tokenizer, inst)[1])
    contexts, state = [list(ids)], arena.Dialogue(t_max)
    for said, reply in zip(transcript[::2], transcript[1::2]):
        ids += rollout.persuadee_heard(tokenizer, said["text"], state.final_turn)
        text = models.text_ids(tokenizer, reply["text"])
        ids += text + models.closing_ids(tokenizer, text)
        contexts.append(list(ids) if len(ids) < max_len else None)
        if not state.done:
            state.step(reply["decision"])
    return contexts


def shadow_reads(eng, people, instances, t_max):
    """Per person's episode, the model's probe values in each shadow context (None where it did
    not fit its context), read on eng."""
    contexts = [shadow_contexts(eng.tokenizer, instances[ep.id.rsplit("@", 1)[0]],
                                ep.transcript, t_max, eng.max_len) for ep in people]
    flat = [c for cs in contexts for c in cs if c is not None]
    values = iter(probes.read_beliefs(eng, flat).tolist() if flat else [])
    return [[None if c is None else next(values) for c in cs] for cs in contexts]


def trajectory(episodes):
    """The mean belief at each turn over episodes (those still going at that turn)."""
    longest = max(len(ep.beliefs) for ep in episodes)
    return [analyses.mean([ep.beliefs[t] for ep in episodes if len(ep.beliefs) > t
                           and ep.beliefs[t] is not None]) for t in range(longest)]


def change(ep):
    b = ep.beliefs
    return None if len(b) < 2 or None in (b[0], b[-1]) else b[-1] - b[0]


def pairing(people, model_episodes, shadows):
    """pair.json's content (module docstring, 3): per scenario the people's mean trajectory and
    b_T - b_0 beside the model's, the paired test over scenarios, both sides' outcomes, and the
    correlations of self-report with shadow read-out."""
    model = {ep.scenario_id: ep for ep in model_episodes}
    by_scenario = {}
    for ep in people:
        by_scenario.setdefault(ep.scenario_id, []).append(ep)
    common = sorted(set(by_scenario) & set(model))
    scenarios = {s: dict(people=len(by_scenario[s]), people_trajectory=trajectory(by_scenario[s]),
                         model_trajectory=model[s].beliefs,
                         people_change=analyses.mean([change(e) for e in by_scenario[s]
                                                      if change(e) is not None]),
                         model_change=change(model[s]),
                         people_outcomes=[e.outcome for e in by_scenario[s]],
                         model_outcome=model[s].outcome) for s in common}
    paired = [(v["people_change"], v["model_change"]) for v in scenarios.values()
              if None not in (v["people_change"], v["model_change"])]
    points = [(own, read) for ep, reads in zip(people, shadows)
              for own, read in zip(ep.probes, reads) if own is not None and read is not None]
    beliefs = [(probes.belief(own), probes.belief(read)) for own, read in points]
    per_probe = {name: dict(pearson=pearson(*zip(*[(o[k], r[k]) for o, r in points])) if points
                            else None,
                            spearman=spearman(*zip(*[(o[k], r[k]) for o, r in points])) if points
                            else None) for k, name in enumerate(probes.PROBES)}
    count = lambda outcomes: {o: outcomes.count(o) for o in arena.OUTCOMES}  # noqa: E731
    return dict(
        scenarios=scenarios, n_scenarios=len(common), n_people=sum(len(by_scenario[s]) for s in common),
        people_trajectory=trajectory([e for s in common for e in by_scenario[s]]),
        model_trajectory=trajectory([model[s] for s in common]) if common else [],
        people_change=analyses.mean([p for p, _ in paired]),
        model_change=analyses.mean([m for _, m in paired]),
        change_wilcoxon_p=wilcoxon([p for p, _ in paired], [m for _, m in paired]) if paired else None,
        people_outcomes=count([o for s in common for o in scenarios[s]["people_outcomes"]]),
        model_outcomes=count([scenarios[s]["model_outcome"] for s in common]),
        self_report_vs_readout=dict(points=len(beliefs),
                                    belief_pearson=pearson(*zip(*beliefs)) if beliefs else None,
                                    belief_spearman=spearman(*zip(*beliefs)) if beliefs else None,
                                    probes=per_probe))


def format_pairing(result, name):
    """The table a person reads."""
    fmt = lambda v: "n/a" if v is None else f"{v:+.3f}"  # noqa: E731
    corr = result["self_report_vs_readout"]
    stat = lambda c, key: "n/a" if not c or c[key] is None else f"{c[key]:+.2f} (p {c['p']:.3g})"  # noqa: E731
    lines = [f"people ({result['n_people']} episodes) beside {name} on {result['n_scenarios']} "
             "scenarios, same persuader",
             "belief by turn, people:  " + " ".join(fmt(b) for b in result["people_trajectory"]),
             "belief by turn, model:   " + " ".join(fmt(b) for b in result["model_trajectory"]),
             f"b_T - b_0: people {fmt(result['people_change'])}, model {fmt(result['model_change'])} "
             f"(scenario means, Wilcoxon p {result['change_wilcoxon_p'] if result['change_wilcoxon_p'] is None else round(result['change_wilcoxon_p'], 4)})",
             "outcomes, people: " + ", ".join(f"{k} {v}" for k, v in result["people_outcomes"].items()),
             "outcomes, model:  " + ", ".join(f"{k} {v}" for k, v in result["model_outcomes"].items()),
             f"self-report against the model's read-out of the same conversation ({corr['points']} "
             f"points): belief Pearson {stat(corr['belief_pearson'], 'r')}, Spearman "
             f"{stat(corr['belief_spearman'], 'rho')}"]
    lines += [f"  {k}: Pearson {stat(v['pearson'], 'r')}, Spearman {stat(v['spearman'], 'rho')}"
              for k, v in corr["probes"].items()]
    return "\n".join(lines)


def study_episodes(folder):
    """The people's episodes of a persuadee-mode study folder and its settings, or one line."""
    folder = Path(folder)
    settings = report.read_json(folder / "settings.json", "pass a folder python -m lab.study "
                                "wrote") if (folder / "settings.json").is_file() else None
    if not settings or settings.get("mode") != "persuadee":
        raise SystemExit(f"study_pair.py: {folder} is no persuadee-mode study folder (its "
                         "settings.json names the mode); pass one python -m lab.study wrote")
    people = [ep for ep in records.load_episodes(folder) if ep.extra.get("self_report")]
    return people, settings


def run(folder, persuadee, model_run=None, seed=SEED, dtype="float32", kv_blocks=None):
    """The whole comparison (module docstring): returns pair.json's content, also written."""
    from lab import pools
    from lab.env import load_instances
    people, settings = study_episodes(folder)
    instances = {i["id"]: i for i in load_instances(settings["scenarios"])}
    played = [instances[i] for i in dict.fromkeys(ep.id.rsplit("@", 1)[0] for ep in people)
              if i in instances]
    loaded = {}
    reader = pools.player(persuadee, loaded, dtype, kv_blocks)
    out = Path(model_run) if model_run else Path(folder) / f"model-{report.slug(persuadee)}"
    if model_run is None:
        out.mkdir(exist_ok=True)
        persuader = pools.player(settings["model"], loaded, dtype, kv_blocks)
        episodes = episode_log.play_resumable(
            persuader, pools.player(persuadee, loaded, dtype, kv_blocks), played,
            out / "episodes.jsonl", t_max=settings["t_max"], seed=seed,
            stamp=dict(persuader=settings["model"], persuadee=persuadee, seed=seed),
            max_new_tokens=settings["max_new_tokens"])
        report.save_run(out, episodes, analyses.summarize(episodes))
    model_episodes = records.load_episodes(out)
    shadows = shadow_reads(reader, people, instances, settings["t_max"])
    result = pairing(people, model_episodes, shadows)
    runs.write_atomic(out / "pair.json", json.dumps(result, indent=2) + "\n")
    return result


def main(argv=None):
    ap = cli.new_parser("python -m lab.study_pair", __doc__)
    ap.add_argument("study", help="a persuadee-mode study folder (python -m lab.study)")
    ap.add_argument("--persuadee", default="smollm2", help="the model persuadee set beside the "
                    "people (it also reads their conversations)")
    ap.add_argument("--model-run", help="an evaluation folder of that persuadee against the "
                    "study's persuader on the same scenarios, instead of playing it here")
    ap.add_argument("--seed", type=int, default=SEED)
    ap.add_argument("--dtype", default="float32", choices=cli.DTYPES)
    ap.add_argument("--kv-blocks", type=int)
    args = ap.parse_args(argv)
    models.set_cpu_threads()
    try:
        result = run(args.study, args.persuadee, args.model_run, args.seed, args.dtype,
                     args.kv_blocks)
    except (OSError, ValueError) as e:
        sys.exit(f"study_pair.py: {e}")
    print(format_pairing(result, args.persuadee))


if __name__ == "__main__":
    main()
