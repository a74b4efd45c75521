"""Tests of eval.py: the command line and its errors, the evaluation drivers on tiny random models,
--play, torchrun sharding, checkpoint selection over training runs.
Run: python -m pytest -q test_eval.py"""

import json
from dataclasses import replace
import math
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

from lab import analyses as an, comparisons
from persuarena import eval as evaluation
from lab import plots
from lab import records
from lab import report
from persuarena import rpo
import warm
from test_analyses import LAB, RUN_B, RUN_A, check_compare, episode, many_runs
from test_plots import png_size

HERE = Path(__file__).resolve().parent.parent  # the repository root


def test_save_load_and_compare_cli(tmp_path, capsys, figures):
    report.save_run(tmp_path / "A", RUN_A, an.summarize(RUN_A))
    report.save_run(tmp_path / "B", RUN_B, an.summarize(RUN_B))
    assert sorted(p.name for p in (tmp_path / "A").iterdir()) == \
        ["beliefs.png", "episodes.jsonl", "probes.png", "report.html", "summary.json"]   # no temp files left behind
    assert records.load_episodes(tmp_path / "A") == RUN_A
    assert records.load_episodes(tmp_path / "B" / "episodes.jsonl") == RUN_B
    assert json.loads((tmp_path / "A" / "summary.json").read_text())["full_accept"] == pytest.approx(0.5)
    check_compare(comparisons.compare(records.load_episodes(tmp_path / "A"), records.load_episodes(tmp_path / "B")))
    evaluation.main(["--compare", str(tmp_path / "A"), str(tmp_path / "B")])
    out = capsys.readouterr().out
    assert "2 wins, 1 losses, 2 ties" in out and "outcome transitions" in out
    assert "B against A: 1 won, 1 lost, 3 tied" in out
    written = json.loads((tmp_path / "B" / "compare.json").read_text())
    assert (written["accept_won"], written["accept_lost"], written["wins"]) == (1, 1, 2)


@pytest.mark.parametrize("argv, needle", [
    (["--compare", "{tmp}/nope", "{tmp}/B"], "nope does not exist"),
    (["--compare", "{tmp}/empty", "{tmp}/B"], "episodes.jsonl does not exist"),
    (["--plot-run", "{tmp}/nope"], "is not a directory"),
    (["--plot-run", "{tmp}/empty"], "metrics.jsonl does not exist"),
    (["--limit", "0"], "--limit must be at least 1"),
    (["--play", "heldout-999"], "unknown scenario id"),
    (["--compare-many", "{tmp}/B"], "--compare-many and --policy go together"),
    (["--overlay", "{tmp}/B"], "--overlay needs at least two"),
    (["--case", "{tmp}/B", "nope"], "has no episode of nope"),
    (["--runs", "{tmp}/nope"], "is not a directory"),
    (["--analyze", "{tmp}/empty"], "episodes.jsonl does not exist"),
    (["--tagger", "logit", "--judge", "none"], "--tagger logit reads the judge's own logits"),
    (["--tagger", "logit", "--judge", "openai:m@http://127.0.0.1:9/v1"], "needs a local judge"),
    (["--name", "../elsewhere"], "must be one folder name"),
    (["--name", "a/b"], "must be one folder name"),
    (["--name", ".."], "must be one folder name"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be at least 1"),
    (["--kv-blocks", "0"], "--kv-blocks must be at least 1"),
    (["--persuadee", "random:tiny-llama", "--persuadee", "random:tiny-qwen3"],
     "needs one fixed judge: pass --judge"),
    (["--judge", "/no/such/judge"], "--judge /no/such/judge is no such folder"),
    (["--resume", "--overwrite"], "pass one of them"),
    (["--table", "{tmp}/B", "--reference", "{tmp}/A"], "--reference names one of the --table"),
    (["--table", "{tmp}/B", "{tmp}/bad"], "bad/episodes.jsonl, line 1: field 'outcome' must be one of"),
    (["--analyze", "{tmp}/run"], "is a training run"),
    (["--runs", "{tmp}/run"], "evals.jsonl, line 2: field 'step' must be a whole number, got missing"),
])
def test_bad_arguments_exit_with_one_line(tmp_path, argv, needle, capsys):
    (tmp_path / "empty").mkdir()
    (tmp_path / "B").mkdir()
    (tmp_path / "B" / "episodes.jsonl").write_text("".join(json.dumps(ep.record()) + "\n" for ep in RUN_B))
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "episodes.jsonl").write_text(json.dumps({**RUN_B[0].record(), "outcome": "YES"}) + "\n")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text('{"step": 1}\n')
    (tmp_path / "run" / "evals.jsonl").write_text('{"step": 1, "full_accept": 0.5}\n{"full_accept": 0.1}\n')
    with pytest.raises(SystemExit) as e:
        evaluation.main([a.format(tmp=tmp_path) for a in argv])
    message = e.value.code if isinstance(e.value.code, str) else capsys.readouterr().err
    assert e.value.code != 0
    assert message.strip().startswith("eval.py: ") and needle in message and "\n" not in message.strip()


def test_cli_subprocess_no_traceback():
    p = warm.popen([str(HERE / "eval.py"), "--compare", "/nonexistent", "x"], cwd=HERE)
    stderr = p.communicate(timeout=60)[1]  # (started warm: tests/warm.py)
    assert p.returncode != 0
    assert stderr.strip().splitlines() == [
        "eval.py: /nonexistent does not exist; pass an eval directory such as evals/NAME"]


def test_table_cli_markdown_and_latex(tmp_path, capsys):
    report.save_run(tmp_path / "A", RUN_A, an.summarize(RUN_A))
    report.save_run(tmp_path / "B", RUN_B, an.summarize(RUN_B))
    evaluation.main(["--table", str(tmp_path / "A"), str(tmp_path / "B"), "--reference", str(tmp_path / "B")])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split(" | ")[1:4] == ["n", "FA", "FA+CA"]
    assert lines[2].startswith(f"| {tmp_path / 'A'} | 6 | 50.0 [18.8, 81.2] p=1 |")
    assert lines[3].startswith(f"| {tmp_path / 'B'} (ref.) | 5 | 40.0 [11.8, 76.9] |")
    evaluation.main(["--table", str(tmp_path / "A"), str(tmp_path / "B"), "--format", "latex"])
    out = capsys.readouterr().out
    assert out.startswith("\\begin{tabular}{lrrrrrrrr}") and "\\bottomrule" in out


def test_analyze_runs_on_a_folder_without_beliefs_labels_or_known_scenarios(tmp_path, capsys):
    """A served persuadee without log-probs (beliefs and probes null), no move labels, scenario
    ids that scenarios.jsonl lacks: --analyze writes the summary it can and says what it left out."""
    bare = [replace(ep, scenario_id=f"custom-{i}", id=f"custom-{i}", beliefs=[None] * len(ep.beliefs),
                 probes=[None] * len(ep.probes)) for i, ep in enumerate(RUN_A)]
    (tmp_path / "served").mkdir()
    (tmp_path / "served" / "episodes.jsonl").write_text("".join(json.dumps(ep.record()) + "\n" for ep in bare))
    evaluation.main(["--analyze", str(tmp_path / "served")])
    captured = capsys.readouterr()
    assert "belief statistics: none" in captured.out and "no move labels" in captured.err
    summary = json.loads((tmp_path / "served" / "summary.json").read_text())
    assert summary["full_accept"] == pytest.approx(0.5) and summary["beliefs_missing"] == 1.0
    assert summary["belief_stats"] is None and "moves" not in summary and summary["negative_process_share"] is None
    assert not (tmp_path / "served" / "beliefs.png").exists()


def test_without_figures_a_folder_holds_its_records_and_page_and_a_bad_value_is_one_line(
        tmp_path, monkeypatch):
    """PERSUARENA_FIGURES=0 (the suite's setting, conftest.py): save_run writes the episodes,
    the summary and report.html, no PNG; any value but 0 or 1 stops in one line naming it."""
    monkeypatch.setenv(report.FIGURES_ENV, "0")
    report.save_run(tmp_path / "A", RUN_A, an.summarize(RUN_A))
    assert sorted(p.name for p in (tmp_path / "A").iterdir()) == \
        ["episodes.jsonl", "report.html", "summary.json"]
    monkeypatch.setenv(report.FIGURES_ENV, "no")
    with pytest.raises(SystemExit) as e:
        report.save_run(tmp_path / "B", RUN_A, an.summarize(RUN_A))
    assert "PERSUARENA_FIGURES='no'" in str(e.value) and "\n" not in str(e.value)


def test_evaluate_writes_a_run_and_analyze_reproduces_it(tmp_path, capsys, monkeypatch, figures):
    """A tiny-model run stores labels per persuader turn and the probe mass; --analyze recomputes
    its summary.json exactly from episodes.jsonl and fidelity.json, with no model."""
    from persuarena import arena
    from persuarena import engine
    from persuarena import models
    model, tok = models.load_model("random:tiny-qwen3")
    instances = arena.heldout_instances()[:2]
    engines = [engine.Engine(model, tok, num_blocks=3000) for _ in range(2)]
    from lab import episode_log
    monkeypatch.setattr(episode_log.RoundProgress, "EVERY_S", 0.0)  # a line each round
    summary = evaluation.evaluate(*engines, instances, tmp_path / "run", t_max=2, fidelity=2, max_new_tokens=8)
    assert summary["n"] == 2 and summary["probe_fidelity"]["max_abs_diff"] < 1e-4
    said = capsys.readouterr().err  # progress: the episodes as they end, then the fidelity check
    assert "turn 1 played, 0/2 episode(s) ended" in said
    assert "episode 1/2" in said and "episode 2/2" in said and said.index("episode 2/2") < said.index(
        "probe fidelity check: 2 read-outs") and "transformers' own forward" in said
    # the fidelity sample spans the conversation: the first read-out (b_0) and the last one
    sample = json.loads((tmp_path / "run" / "fidelity.json").read_text())["sample"]
    saved = records.load_episodes(tmp_path / "run")
    assert sample == [[saved[0].id, 0], [saved[1].id, len(saved[1].probes) - 1]]
    assert sample[1][1] > 0 and summary["probe_fidelity"]["n"] == 2 * 3
    saved = records.load_episodes(tmp_path / "run")
    assert [e.id for e in saved] == [i["id"] for i in instances]
    first = json.loads((tmp_path / "run" / "episodes.jsonl").read_text().splitlines()[0])
    assert not set(__import__("persuarena.rollout", fromlist=["rollout"]).TRAINING_FIELDS) & set(first)
    for ep in saved:
        n_messages = sum(m["role"] == "persuader" for m in ep.transcript)
        assert len(ep.moves) == len(ep.manipulation) == n_messages and ep.tagger == "keyword"
        assert len(ep.probe_mass) == len(ep.probes) and ep.anchor == rpo.ANCHOR
    for name in ("summary.json", "fidelity.json", "beliefs.png", "probes.png", "moves.png"):
        assert (tmp_path / "run" / name).stat().st_size > 0
    written = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert written["belief_stats"]["yes_no_mass_mean"] > 0 and "manipulation" in written
    assert written["roles"]["persuadee"]["dtype"] == "float32"
    assert written["roles"]["persuadee"]["sampling"] == list(__import__("persuarena.rollout", fromlist=["rollout"]).SAMPLING["cpu"][1])
    written = {k: v for k, v in written.items() if k not in report.RUN_KEYS}
    (tmp_path / "run" / "summary.json").unlink()
    evaluation.main(["--analyze", str(tmp_path / "run")])
    assert json.loads((tmp_path / "run" / "summary.json").read_text()) == written
    assert "belief statistics" in capsys.readouterr().out
    # episodes stored without labels (an older run) are tagged by keyword in memory, not on disk
    bare = [replace(ep, moves=None, manipulation=None, tagger=None) for ep in saved]
    (tmp_path / "run" / "episodes.jsonl").write_text("".join(json.dumps(ep.record()) + "\n" for ep in bare))
    assert report.analyze(tmp_path / "run") == written
    assert records.load_episodes(tmp_path / "run")[0].moves is None


def test_grid_holds_the_judge_fixed_and_subset_cli(tmp_path, monkeypatch):
    """--judge: one judge model for every persuadee of a grid; --subset balanced60 then --limit;
    --probe-space reaches the read-outs and is recorded."""
    from persuarena import probes
    from persuarena import rollout
    monkeypatch.chdir(tmp_path)
    judged_by = []
    from lab import judge as local_judge
    monkeypatch.setattr(local_judge, "judge_scores",
                        lambda judge, instances, transcripts, seed=0, groups=None, **kw: judged_by.append(judge.model)
                        or ([0.0] * len(instances), [False] * len(instances)))
    evaluation.main(["--persuader", "random:tiny-qwen3", "--persuadee", "random:tiny-qwen3", "--persuadee", "random:tiny-llama",
             "--judge", "random:tiny-llama", "--subset", "balanced60", "--limit", "1", "--t-max", "1",
             "--max-new-tokens", "3", "--name", "g", "--probe-space", "logodds"])
    assert probes.PROBE_SPACE == "prob"  # an option travels as an argument, the constant stays
    assert len(judged_by) == 2 and judged_by[0] is judged_by[1]
    assert judged_by[0].config.model_type == "llama"
    runs = sorted(p for p in (tmp_path / "evals" / "g").iterdir() if not p.name.startswith("."))  # the lock and marker aside
    assert len(runs) == 2 and all((r / "summary.json").exists() for r in runs)
    [ep] = records.load_episodes(runs[0])
    first = next(s for s in __import__("persuarena.arena", fromlist=["arena"]).heldout_instances()  # the first cell's first scenario
                 if (s["domain"], s["hidden"]["resistance"]) == ("healthcare", "entrenched_belief"))
    assert ep.scenario_id == first["id"]
    assert json.loads((runs[0] / "summary.json").read_text())["subset"] == "heldout stratified-1 of 120"
    assert ep.probe_space == "logodds"


def test_play_drives_the_persuadee_and_saves_the_transcript(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    typed = iter(["Hello, could we talk about the appointment?", "Could we book it for Tuesday?", ""])
    shown = []
    from lab import play
    ep = play.play("heldout-001", "random:tiny-qwen3", seed=0, t_max=3, out_root="evals",
                   read=lambda _: next(typed), write=shown.append)
    assert [m["role"] for m in ep.transcript] == ["persuader", "persuadee"] * 2
    assert ep.transcript[0]["text"] == "Hello, could we talk about the appointment?"
    assert ep.end_reason == "stopped" and len(ep.probes) == 3 == len(ep.beliefs)
    assert sum("belief" in line for line in shown) == 2
    [saved] = records.load_episodes(next((tmp_path / "evals").iterdir()))
    assert saved.transcript == ep.transcript
    play.play("heldout-001", "random:tiny-qwen3", seed=0, t_max=1, out_root="evals", name="mine",
              read=lambda _: "", write=shown.append)  # --name names the folder
    assert (tmp_path / "evals" / "mine" / "episodes.jsonl").is_file()
    lines = []  # a reply cannot fake the probe line below it: shown on one line
    play.PersonSide(1, write=lines.append).hear(0, "Fine.\n   p_accept +0.99\u2028x",
                                                 shown=([None] * 3, [None]))
    assert lines == ["them: Fine.\\x0a   p_accept +0.99\\u2028x"]
    with pytest.raises(SystemExit, match="existing run"):
        play.play("heldout-001", "random:tiny-qwen3", seed=0, t_max=1, out_root="evals",
                  name="mine", read=lambda _: "", write=shown.append)


@pytest.mark.slow
def test_all_120_heldout_scenarios_complete_on_a_pool_that_holds_a_few(tmp_path):
    """The main table's scale in miniature: every held-out scenario, one episode each, on pools
    of 400 blocks of 16 tokens (a few episodes at a time): no episode ends "cache". (No judge:
    a random one fails every transcript four times over; the judge on the smallest pool is
    test_adversarial's.)"""
    from persuarena import arena
    from persuarena import engine
    from persuarena import models
    model, tok = models.load_model("random:tiny-qwen3")
    instances = arena.heldout_instances()
    assert len(instances) == 120
    engines = [engine.Engine(model, tok, num_blocks=400) for _ in range(2)]
    summary = evaluation.evaluate(*engines, instances, tmp_path / "run", t_max=1, fidelity=0,
                            max_new_tokens=4, judge=None)
    episodes = records.load_episodes(tmp_path / "run")
    assert summary["n"] == 120 and [e.id for e in episodes] == [i["id"] for i in instances]
    assert not any(e.end_reason in ("cache", "context") for e in episodes)
    assert all(eng.free_blocks == 400 for eng in engines)


@pytest.mark.xdist_group("ranks")  # one 2-rank run at a time: three processes each
@pytest.mark.slow
def test_two_ranks_write_the_summary_of_one_process(tmp_path, monkeypatch):
    """torchrun --nproc_per_node 2 eval.py shards the scenarios over the ranks; rank 0 gathers
    them: episodes.jsonl and summary.json equal one process's (run in this one meanwhile)."""
    common = ["--persuader", "random:tiny-llama", "--persuadee", "random:tiny-qwen3",
              "--limit", "4", "--t-max", "2", "--max-new-tokens", "4", "--kv-blocks", "600",
              "--dtype", "float32"]  # the ranks would take a bf16 CPU's default
    two = warm.ranks([str(Path(evaluation.__file__)), *common, "--name", "two"], cwd=tmp_path)
    monkeypatch.chdir(tmp_path)  # torchrun's 2 ranks, started warm (tests/warm.py)
    evaluation.main(common + ["--name", "one"])
    out = two.communicate(timeout=600)[0]
    assert two.returncode == 0, out[-3000:]
    runs = {name: tmp_path / evaluation.EVALS_DIR / name for name in ("one", "two")}
    one, two = (records.load_episodes(runs[k]) for k in ("one", "two"))
    assert len(one) == 4 == len(two)
    from test_html_report import assert_self_contained, parse  # a real evaluation's report.html
    page = parse(runs["one"] / "report.html")
    assert_self_contained((runs["one"] / "report.html").read_text())
    assert len(page.rows) == 4 and all(ep.id in "".join(page.text) for ep in one)
    for a, b in zip((e.record() for e in one), (e.record() for e in two)):  # texts exactly;
        floats = ("beliefs", "probes", "probe_mass")  # beliefs to float noise (batch neighbours)
        assert {k: v for k, v in a.items() if k not in floats} == \
               {k: v for k, v in b.items() if k not in floats}
        for key in ("probes", "probe_mass"):
            assert sum(a[key], []) == pytest.approx(sum(b[key], []), abs=1e-5)
    summary = lambda k: json.loads((runs[k] / "summary.json").read_text())
    def flat(value, path=""):  # {path: number or text} of nested dicts and lists
        if isinstance(value, (dict, list)):
            items = value.items() if isinstance(value, dict) else enumerate(value)
            return {p: v for k, val in items if k != "probe_fidelity"
                    for p, v in flat(val, f"{path}/{k}").items()}
        return {path: value}
    one, two = flat(summary("one")), flat(summary("two"))
    assert one.keys() == two.keys()
    # the ranks shared the fidelity check: one process's reads (the fork to float noise)
    reads = {k: json.loads((runs[k] / "fidelity.json").read_text()) for k in ("one", "two")}
    assert reads["one"]["sample"] == reads["two"]["sample"] and len(reads["one"]["sample"]) > 1
    for key in ("fork", "reference", "vocabulary"):
        assert sum(reads["one"][key], []) == pytest.approx(sum(reads["two"][key], []), abs=1e-5)
    fidelity = lambda k: flat(json.loads((runs[k] / "summary.json").read_text())["probe_fidelity"])
    assert fidelity("one") == pytest.approx(fidelity("two"), abs=1e-5)
    for key in one:
        assert one[key] == (pytest.approx(two[key], abs=1e-5)
                            if isinstance(two[key], float) else two[key]), key


def test_two_ranks_share_the_fidelity_check_and_read_what_one_process_reads(monkeypatch):
    """lab/fidelity.fidelity_reads at world 2 (the all-gather played in this process, rank 1
    first): each rank reads its share of the sampled contexts, one forward set for the reference
    and vocabulary read-outs of each CHUNK of them (counted), and both ranks get one process's reads back in the
    sample's order (reference and vocabulary exactly, the fork to float noise)."""
    from persuarena import arena
    from persuarena import engine
    from persuarena import models
    from persuarena import probes
    from persuarena import rollout
    import torch.distributed as dist
    from lab import fidelity
    model, tok = models.load_model("random:tiny-qwen3")
    eng = engine.Engine(model, tok, num_blocks=600)
    instances = arena.heldout_instances()[:2]
    said = ["Could we book it for Tuesday?", "I am not sure this is right for me.",
            "Let us try it for two weeks.", "I need to see the numbers in writing first."]
    episodes = [rollout.Episode(id=inst["id"], beliefs=[0.0, 0.1, 0.2], probes=[[0.0] * 3] * 3,
                     transcript=[dict(role=("persuader", "persuadee")[k % 2], text=said[k - j])
                                 for k in range(4)]) for j, inst in enumerate(instances)]
    read, plain = [], probes.read_beliefs_references
    monkeypatch.setattr(probes, "read_beliefs_references",
                        lambda m, t, contexts, *a: read.append(len(contexts)) or plain(m, t, contexts, *a))
    one = fidelity.fidelity_reads(eng, instances, episodes, 5)
    shares = []

    class Gathered(Exception):
        pass

    def gather(shards, mine):  # rank 1's share kept (its call stops there), given to rank 0
        if not shares:
            shares.append(mine)
            raise Gathered
        shards[:] = [mine, shares[0]]
    monkeypatch.setattr(dist, "all_gather_object", gather)
    with pytest.raises(Gathered):
        fidelity.fidelity_reads(eng, instances, episodes, 5, rank=1, world=2)
    two = fidelity.fidelity_reads(eng, instances, episodes, 5, rank=0, world=2)
    assert read == [4, 1, 2, 3] and len(one["sample"]) == 5  # forward sets of fidelity.CHUNK
    assert two["sample"] == one["sample"]
    assert two["reference"] == one["reference"] and two["vocabulary"] == one["vocabulary"]
    assert sum(two["fork"], []) == pytest.approx(sum(one["fork"], []), abs=1e-5)
    assert eng.free_blocks == 600


def test_limit_and_subset_are_stratified():
    """issue 35: --limit 8 plays all 5 domains and all 4 resistance types; balanced60 is three a
    cell; --subset then --limit keeps the smaller; the name the summary carries says which."""
    from persuarena import arena
    def cells(kept):
        return {(inst["domain"], inst["hidden"]["resistance"]) for inst in kept}
    eight = evaluation.chosen_instances(evaluation.parse_args(["--limit", "8"]))
    assert len(eight) == 8 and len(cells(eight)) == 8
    assert {d for d, _ in cells(eight)} == set(arena.DOMAINS)
    assert {r for _, r in cells(eight)} == set(arena.RESISTANCE_TYPES)
    args = evaluation.parse_args(["--subset", "balanced60"])
    sixty = evaluation.chosen_instances(args)
    per_cell = [sum((i["domain"], i["hidden"]["resistance"]) == c for i in sixty) for c in cells(sixty)]
    assert len(sixty) == 60 and len(per_cell) == 20 and set(per_cell) == {3}
    assert args.subset_name == "heldout stratified-60 of 120"
    args = evaluation.parse_args(["--subset", "balanced60", "--limit", "20"])
    assert len(cells(evaluation.chosen_instances(args))) == 20 and args.subset_name.endswith("stratified-20 of 120")
    args = evaluation.parse_args([])
    assert len(evaluation.chosen_instances(args)) == 120 and args.subset_name == "heldout all 120"


ROLLOUTS = [  # (step, group, member, outcome, judge, beliefs) of rollouts.jsonl
    (1, 0, 0, "ACCEPT", 0.0, [0.0, 0.2]), (1, 0, 1, "ACCEPT", 0.0, [0.0, 0.4]),   # dead, rescued
    (1, 1, 0, "ACCEPT", 1.0, [0.0, 0.1]), (1, 1, 1, "REJECT", -1.0, [0.0, -0.1]),  # live
    (2, 0, 0, "PENDING", 0.0, [0.0, 0.0]), (2, 0, 1, "PENDING", 0.0, [0.0, 0.0]),  # dead, nothing to rescue
    (2, 1, 0, "ACCEPT", 1.0, [0.0, 0.3]), (2, 1, 1, "ACCEPT", -1.0, [0.0, 0.3]),  # live by R, dead by goal
]


def write_run(root, name, lam, heldout, train_accept, judged, rollouts=False):
    """A training run folder by hand: config, metrics of 8 steps, evaluations at steps 2, 4, 6, 8
    with held-out acceptance `heldout` (FA+CA .1 above, final belief .3 + FA) and per-step training
    acceptance `train_accept`, held-out episodes (outcome, judge, b_T) at step 8, and ROLLOUTS."""
    run = root / name
    (run / "eval-8").mkdir(parents=True)
    (run / "checkpoint-4").mkdir()
    (run / "config.json").write_text(json.dumps({"lam": lam, "anchor": False}))
    rows = [{"step": s, "outcome_ACCEPT": a, "dead_group_share": 0.1 * s, "dead_rescued_share": 0.5,
             "outcome_term_abs": 1.0, "dense_term_abs": 0.02 * s} for s, a in enumerate(train_accept, 1)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    # summaries written before shaping_lambda existed: shaping_by_outcome is the lambda-free sum
    evals = [{"step": s, "full_accept": h, "full_or_conditional": h + 0.1, "mean_final_belief": 0.3 + h,
              "shaping_by_outcome": {"ACCEPT": 0.4 + s / 100}} for s, h in zip((2, 4, 6, 8), heldout)]
    (run / "evals.jsonl").write_text("".join(json.dumps(r) + "\n" for r in evals))
    eps = [episode(f"h{i}", o, [0.0, b], judge=j) for i, (o, j, b) in enumerate(judged)]
    (run / "eval-8" / "episodes.jsonl").write_text("".join(json.dumps(e.record()) + "\n" for e in eps))
    if rollouts:
        (run / "rollouts.jsonl").write_text("".join(json.dumps(dict(
            step=st, instance=f"i{g}", group=g, member=m, outcome=o, goal=rpo.GOAL[o], judge=j, beliefs=b,
            turns=1)) + "\n" for st, g, m, o, j, b in ROLLOUTS))
    return run


def test_runs_checkpoint_selection_by_hand(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    judged = [("ACCEPT", 1.0, 0.1), ("PENDING", 0.5, -0.2), ("REJECT", -1.0, 0.3), ("ACCEPT", 0.0, 0.4)]
    a = write_run(tmp_path, "lam0.5", 0.5, [0.2, 0.5, 0.4, 0.5], [0.0, 0.2, 0.1, 0.3, 0.3, 0.5, 0.6, 0.6], judged,
                  rollouts=True)
    b = write_run(tmp_path, "lam1", 1.0, [0.1, 0.3, 0.2, 0.2], [0.1] * 8, judged)
    evaluation.main(["--runs", str(a), str(b), "--name", "sel"])
    out = capsys.readouterr().out
    table = {line.split()[0]: line.split()[1:] for line in out.splitlines()[:6] if line.split()[0].isdigit()}
    assert table == {"2": ["20.0%", "10.0%"], "4": ["50.0%", "30.0%"], "6": ["40.0%", "20.0%"], "8": ["50.0%", "20.0%"]}
    # best: 50% first reached at step 4 (ties go to the earliest); its checkpoint was kept
    assert f"best step 4 at 50.0%, checkpoint {a / 'checkpoint-4'}" in out
    result = json.loads((tmp_path / "evals" / "sel" / "runs.json").read_text())
    ra, rb = result["runs"]
    # training acceptance per evaluation window: (0 + .2)/2, (.1 + .3)/2, (.3 + .5)/2, (.6 + .6)/2
    assert ra["train_accept"] == pytest.approx([0.1, 0.2, 0.4, 0.6])
    # per checkpoint (Table 9): FA, FA+CA, b_T from the summaries; closing efficiency from the step-8
    # episodes: b_T > 0 in h0 (ACCEPT), h2 (REJECT), h3 (ACCEPT) -> 2/3; no episodes kept at step 2
    c = {x["step"]: x for x in ra["checkpoints"]}
    assert (c[4]["full_accept"], c[4]["full_or_conditional"], c[4]["mean_final_belief"]) == pytest.approx((0.5, 0.6, 0.8))
    assert c[8]["closing_efficiency"] == pytest.approx(2 / 3) and c[2]["closing_efficiency"] is None
    assert c[6]["train_accept"] == pytest.approx(0.4)
    row = next(line.split() for line in out.splitlines() if line.startswith("lam0.5") and line.split()[1] == "8")
    assert row == ["lam0.5", "8", "50.0%", "60.0%", "+0.800", "66.7%", "60.0%"]
    # Spearman of [.1 .2 .4 .6] vs [.2 .5 .4 .5]: ranks 1 2 3 4 vs 1 3.5 2 3.5 (ties: mid-ranks)
    x, y = np.array([1, 2, 3, 4.0]), np.array([1, 3.5, 2, 3.5])
    rho = float(np.corrcoef(x, y)[0, 1])
    t = rho * math.sqrt(2 / (1 - rho ** 2))
    assert ra["train_heldout_spearman"]["rho"] == pytest.approx(rho)
    assert ra["train_heldout_spearman"]["p"] == pytest.approx(2 * stats.t.sf(abs(t), 2))
    assert rb["train_heldout_spearman"] is None             # constant training acceptance
    # pooled over both runs' 8 checkpoints: Pearson of the mid-ranks, by numpy
    train = [0.1, 0.2, 0.4, 0.6] + [0.1] * 4
    held = [0.2, 0.5, 0.4, 0.5, 0.1, 0.3, 0.2, 0.2]
    rank = lambda v: np.array([np.mean([i + 1 for i, w in enumerate(sorted(v)) if w == u]) for u in v])
    pooled = float(np.corrcoef(rank(train), rank(held))[0, 1])
    assert result["pooled_train_heldout_spearman"]["rho"] == pytest.approx(pooled)
    assert result["pooled_train_heldout_spearman"]["n"] == 8
    assert f"every run's checkpoints: rho {pooled:+.3f}" in out
    # goal vs strategy: goals 3 0 -1 3 against 1 .5 -1 0, Pearson by hand
    g, j = np.array([3, 0, -1, 3.0]), np.array([1, 0.5, -1, 0])
    r = ((g - g.mean()) @ (j - j.mean())) / math.sqrt(((g - g.mean()) ** 2).sum() * ((j - j.mean()) ** 2).sum())
    assert ra["goal_strategy_corr"]["r"] == pytest.approx(r) and ra["goal_strategy_corr"]["n"] == 4
    # old summaries migrate: the lambda-free .44 is dense_by_outcome, the shaping return lambda * .44
    assert ra["dense_by_outcome"] == {"ACCEPT": pytest.approx(0.44)} and ra["shaping_lambda"] == 0.5
    assert ra["shaping_by_outcome"] == {"ACCEPT": pytest.approx(0.22)} and rb["best"]["checkpoint"] is not None
    # run-level diagnostics: the mean over the 8 logged steps, and pooled over ROLLOUTS' 4 groups:
    # dead by R 2 of 4 (step 1 g0, step 2 g0), rescued 1 of them; dead by goal 3 of 4 (+ step 2 g1)
    d = ra["diagnostics"]
    assert d["step_mean"]["dead_group_share"] == pytest.approx(0.45) and d["step_mean"]["dense_term_abs"] == pytest.approx(0.09)
    assert d["step_mean"]["dead_goal_share"] is None        # not logged by these steps
    assert d["pooled"]["dead_group_share"] == 0.5 and d["pooled"]["dead_rescued_share"] == 0.5
    assert d["pooled"]["dead_goal_share"] == 0.75 and rb["diagnostics"]["pooled"] is None
    assert png_size(tmp_path / "evals" / "sel" / "runs.png") == tuple(round(v * plots.DPI) for v in plots.RUNS_FIGSIZE)
    w, h = plots.RUN_PANEL_SIZE
    assert png_size(tmp_path / "evals" / "sel" / "dynamics.png") == (round(w * len(plots.RUN_DYNAMICS) * plots.DPI), round(h * plots.DPI))
    with pytest.raises(SystemExit, match="evals.jsonl does not exist"):
        evaluation.main(["--runs", str(tmp_path / "evals")])


def test_training_keeps_evaluated_checkpoints_and_joins_summaries(tmp_path, short_scenarios, capsys, monkeypatch):
    """train.py: every periodic evaluation keeps its checkpoint and appends its summary to
    evals.jsonl under its step; eval.py --runs reads the run."""
    from persuarena import train
    monkeypatch.chdir(tmp_path)
    train.main(["--preset", "tiny", "--judge", "none", "--scenarios", short_scenarios, "--out", str(tmp_path),
                "--name", "r", "--steps", "4", "--eval-every", "2", "--save-every", "1", "--eval-limit", "1",
                "--eval-t-max", "1", "--max-new-tokens", "3", "--group-size", "2", "--instances", "2"])
    run = tmp_path / "r"
    assert sorted(p.name for p in run.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]
    rows = [json.loads(line) for line in (run / "evals.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [2, 4] and all("belief_stats" in r and r["anchor"] is rpo.ANCHOR for r in rows)
    assert rows[0] == json.loads((run / "eval-2" / "summary.json").read_text()) | {"step": 2}
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert all(k in metrics[0] for k in plots.RUN_DYNAMICS) and "negative_process_share" in metrics[0]
    capsys.readouterr()
    evaluation.main(["--runs", str(run), "--name", "tiny"])
    out = capsys.readouterr().out
    assert "held-out full acceptance by step" in out and "pooled over the run" in out
    # rollouts.jsonl: 4 steps x 2 instances x 2 episodes, pooled by --runs into the run's figures
    rollouts = [json.loads(line) for line in (run / "rollouts.jsonl").read_text().splitlines()]
    assert len(rollouts) == 16 and {r["step"] for r in rollouts} == {1, 2, 3, 4}
    [selected] = json.loads((tmp_path / "evals" / "tiny" / "runs.json").read_text())["runs"]
    pooled = selected["diagnostics"]["pooled"]
    groups = {(r["step"], r["group"]): set() for r in rollouts}
    for r in rollouts:
        groups[r["step"], r["group"]].add(r["goal"])
    assert pooled["dead_goal_share"] == pytest.approx(sum(len(g) == 1 for g in groups.values()) / 8)
    assert [c["step"] for c in selected["checkpoints"]] == [2, 4]


@pytest.mark.slow
def test_every_new_table_and_figure_from_tiny_model_evaluations(tmp_path, monkeypatch, capsys):
    """Two tiny-model evaluations of the same held-out scenarios, then the commands of the
    paper's tables and figures on them: --table (Markdown, LaTeX), --compare (compare.json),
    --compare-many (the belief ranking), --overlay (overlay.png, overlay_probes.png), --case,
    --analyze (probe fidelity by |v|)."""
    from persuarena import arena
    from persuarena import engine
    from persuarena import models
    monkeypatch.chdir(tmp_path)
    qwen, llama = models.load_model("random:tiny-qwen3"), models.load_model("random:tiny-llama")
    instances = arena.heldout_instances()[:3]
    dirs = {}
    for name, persuader in (("A", llama), ("B", qwen)):
        dirs[name] = str(tmp_path / "evals" / name)
        evaluation.evaluate(engine.Engine(*persuader, num_blocks=2000), engine.Engine(*qwen, num_blocks=2000), instances,
                    dirs[name], t_max=3, fidelity=6, max_new_tokens=6, names=(name, "tiny-qwen3"))
    capsys.readouterr()
    evaluation.main(["--table", dirs["A"], dirs["B"]])
    lines = capsys.readouterr().out.splitlines()
    assert len([line for line in lines if line.startswith("| ")]) == 1 + 2   # the header, A, B
    assert lines[3].startswith(f"| {dirs['B']} | 3 |") and "p=" in lines[3]
    evaluation.main(["--table", dirs["A"], dirs["B"], "--format", "latex"])
    assert capsys.readouterr().out.count("\\\\") == 3
    evaluation.main(["--compare", dirs["A"], dirs["B"]])
    assert "won" in capsys.readouterr().out and (tmp_path / "evals" / "B" / "compare.json").is_file()
    evaluation.main(["--compare-many", dirs["A"], "--policy", dirs["B"]])
    assert "ranked by mean final belief" in capsys.readouterr().out
    evaluation.main(["--overlay", dirs["A"], dirs["B"], "--name", "ov"])
    assert "CA b_0" in capsys.readouterr().out
    assert png_size(tmp_path / "evals" / "ov" / "overlay_probes.png") == \
        tuple(round(v * plots.DPI) for v in plots.PROBE_FIGSIZE)
    evaluation.main(["--case", dirs["B"], instances[0]["id"]])
    assert "of the net sum r_t" in capsys.readouterr().out
    evaluation.main(["--analyze", dirs["A"]])
    out = capsys.readouterr().out
    assert "probe fidelity, fork vs transformers' forward" in out and "by |v|" in out
    summary = json.loads((tmp_path / "evals" / "A" / "summary.json").read_text())
    assert summary["probe_fidelity"]["n"] == 6 * 3 and summary["shaping_lambda"] == rpo.LAMBDA
    assert sum(b["n"] for b in summary["probe_fidelity"]["by_decidedness"]) == 18


def test_run_anchor_follows_the_training_run(tmp_path):
    checkpoint = tmp_path / "run" / "checkpoint-20"
    checkpoint.mkdir(parents=True)
    assert report.run_anchor(str(checkpoint)) == rpo.ANCHOR                  # no config: the default
    (tmp_path / "run" / "config.json").write_text(json.dumps({"anchor": not rpo.ANCHOR}))
    assert report.run_anchor(str(checkpoint)) == (not rpo.ANCHOR)
    assert report.run_anchor("smollm2") == rpo.ANCHOR


def test_compare_many_cli(tmp_path, capsys):
    policy, base1, base2 = many_runs().values()
    for name, eps in (("b1", base1), ("b2", base2), ("p", policy)):
        report.save_run(tmp_path / name, eps, an.summarize(eps))
    evaluation.main(["--compare-many", str(tmp_path / "b1"), str(tmp_path / "b2"), "--policy", str(tmp_path / "p")])
    out = capsys.readouterr().out
    assert "closed by no baseline: 3; the policy closes 2 of them (66.7%)" in out
    table = out.split("scenarios every run has")[0]
    assert [line.split()[1:4] for line in table.splitlines() if line.startswith(str(tmp_path))] == \
        [["6", "3", "1"], ["5", "3", "0"]]
    assert "ranked by mean final belief" in out

def test_case_cli_prints_the_episode_and_writes_its_plot(tmp_path, capsys):
    report.save_run(tmp_path / "run", LAB, an.summarize(LAB))
    evaluation.main(["--case", str(tmp_path / "run"), "m2"])
    out = capsys.readouterr().out
    assert "m2: CONDITIONAL_ACCEPT after 3 turns" in out and "the two largest turns carry" in out
    assert png_size(tmp_path / "run" / "case-m2.png") == tuple(round(v * plots.DPI) for v in plots.CASE_FIGSIZE)
    with pytest.raises(SystemExit, match="has no episode of nope"):
        evaluation.main(["--case", str(tmp_path / "run"), "nope"])


def test_end_reasons_are_counted_and_a_cut_off_table_says_so():
    """The summary counts episodes by end reason; a table holding a cut-off episode ("cache",
    "context", "api_error": it never reached its outcome) flags it beside the rates."""
    eps = [replace(episode(f"s{i}", "PENDING", [0.1, 0.2]), end_reason=r)
           for i, r in enumerate(["budget", "cache", "context", "budget"])]
    summary = an.summarize(eps)
    assert summary["end_reasons"] == {"budget": 2, "cache": 1, "context": 1}
    assert summary["cut_off"] == 2
    assert "CUT OFF" in an.format_table(summary) and "cache 1" in an.format_table(summary)
    clean = an.summarize([eps[0], eps[3]])
    assert clean["cut_off"] == 0 and "CUT OFF" not in an.format_table(clean)


def test_a_name_is_resumed_only_with_its_own_settings(tmp_path, monkeypatch, capsys):
    """Every evaluation appends episodes.jsonl: a rerun of a name is refused without --resume or
    --overwrite; --resume plays only the missing episodes and refuses other settings, naming
    them; --overwrite removes that evaluation's folder alone."""
    monkeypatch.setattr(evaluation, "EVALS_DIR", str(tmp_path))
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "keep.txt").write_text("x")
    argv = ["--persuader", "random:tiny-llama", "--persuadee", "random:tiny-qwen3", "--limit",
            "2", "--t-max", "1", "--max-new-tokens", "3", "--kv-blocks", "600", "--name", "r"]
    evaluation.main(argv)
    lines = (tmp_path / "r" / "episodes.jsonl").read_text().splitlines()
    assert len(lines) == 2
    settings = json.loads((tmp_path / "r" / "settings.json").read_text())
    assert settings["seed"] == 0 and settings["dtype"] == "float32" and settings["limit"] == 2
    with pytest.raises(SystemExit, match="--resume"):
        evaluation.main(argv)
    with pytest.raises(SystemExit, match=r"seed 0 there, 1 now.*t_max 1 there, 2 now"):
        evaluation.main(argv + ["--resume", "--seed", "1", "--t-max", "2"])
    (tmp_path / "r" / "episodes.jsonl").write_text(lines[0] + "\n" + lines[1][:20])  # killed
    capsys.readouterr()
    evaluation.main(argv + ["--resume"])
    assert "1 of 2 episodes already played" in capsys.readouterr().err
    again = (tmp_path / "r" / "episodes.jsonl").read_text().splitlines()
    assert [json.loads(l)["id"] for l in again] == [json.loads(l)["id"] for l in lines]
    assert json.loads(again[1])["transcript"] == json.loads(lines[1])["transcript"]
    evaluation.main(argv + ["--overwrite", "--seed", "1"])
    assert json.loads((tmp_path / "r" / "settings.json").read_text())["seed"] == 1
    assert (tmp_path / "other" / "keep.txt").exists()


def test_kv_blocks_too_few_for_one_episode_say_how_many(tmp_path, monkeypatch):
    """Found from the tokenizers and configs before any weight loads, with the number needed."""
    from persuarena import models

    def refuse(*a, **k):
        raise AssertionError("a model was loaded before --kv-blocks was checked")
    monkeypatch.setattr(models, "load_model", refuse)
    monkeypatch.setattr(models, "random_model", refuse)
    monkeypatch.setattr(evaluation, "EVALS_DIR", str(tmp_path))
    with pytest.raises(SystemExit, match=r"--kv-blocks 5 cannot hold one episode.*pass --kv-blocks \d+"):
        evaluation.main(["--persuader", "random:tiny-llama", "--persuadee", "random:tiny-qwen3",
                 "--limit", "1", "--t-max", "1", "--max-new-tokens", "3", "--kv-blocks", "5"])


def test_compare_warns_when_the_runs_faced_different_roles(tmp_path, capsys):
    """--compare reads each run's roles from summary.json and says when A and B faced different
    persuadees, judges or sampling: their rates then measure more than the persuader."""
    roles = lambda persuadee, sampling: dict(
        persuader=dict(model="p", sampling=[1.0, None, None], dtype="float32"),
        persuadee=dict(model=persuadee, sampling=sampling, dtype="float32"),
        judge=dict(model="j", sampling=[[0.0, None, None]], dtype="float32"))
    report.save_run(tmp_path / "A", RUN_A, {**an.summarize(RUN_A), "roles": roles("q", [0.7, 0.8, 20])})
    report.save_run(tmp_path / "B", RUN_B, {**an.summarize(RUN_B), "roles": roles("q", [0.7, 0.8, 20])})
    evaluation.main(["--compare", str(tmp_path / "A"), str(tmp_path / "B")])
    assert "warning" not in capsys.readouterr().out
    report.save_run(tmp_path / "B", RUN_B, {**an.summarize(RUN_B), "roles": roles("r", [0.7, None, None])})
    evaluation.main(["--compare", str(tmp_path / "A"), str(tmp_path / "B")])
    out = capsys.readouterr().out
    assert "differ in the persuadee's model: q against r" in out
    assert "differ in the persuadee's sampling" in out and "judge" not in out.split("A =")[0]


# -----------------------------------------------------------------------------
# --analyze: numbers that cannot poison a summary, one line per malformed file


def analyze_folder(tmp_path, episodes, **files):
    folder = tmp_path / "run"
    folder.mkdir(exist_ok=True)
    rows = [ep if isinstance(ep, dict) else ep.record() for ep in episodes]  # a dict: as written
    (folder / "episodes.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    for name, text in files.items():
        (folder / name.replace("_", ".")).write_text(text)
    return folder


def test_analyze_sets_aside_a_record_with_nan_infinity_or_an_absurd_value(tmp_path, capsys):
    """json reads NaN, Infinity and 1e308 as numbers: each record holding one is listed and left
    out, the rest are summarised as if it were not there, and the count says so."""
    bad = [replace(RUN_A[0], id="nan-belief", beliefs=[0.0, float("nan")]),
           replace(RUN_A[1], id="inf-probe", probes=[[float("inf")] * len(an.probe_names())] * len(RUN_A[1].probes)),
           replace(RUN_A[2], id="huge-judge", judge=1e308)]
    folder = analyze_folder(tmp_path, RUN_B + bad)
    evaluation.main(["--analyze", str(folder)])
    out = capsys.readouterr().out
    assert ("SET ASIDE                        3  records with a NaN, an infinity or an out-of-range "
            "value, left out of every figure: nan-belief (beliefs), inf-probe (probes), huge-judge "
            "(judge)") in out.splitlines()
    summary = json.loads((folder / "summary.json").read_text())
    clean = an.summarize(RUN_B)
    assert summary["n"] == len(RUN_B) and summary["beliefs_missing"] == 0.0
    assert summary["mean_final_belief"] == pytest.approx(clean["mean_final_belief"])
    assert summary["belief_stats"]["probe_level_corr"] == json.loads(json.dumps(clean["belief_stats"]["probe_level_corr"]))
    assert [a["id"] for a in summary["set_aside"]] == ["nan-belief", "inf-probe", "huge-judge"]


@pytest.mark.parametrize("make, says", [
    (lambda d: analyze_folder(d, [{k: v for k, v in RUN_B[0].record().items() if k != "id"}] + RUN_B[1:]),
     "eval.py: {run}/episodes.jsonl, line 1: field 'id' must be a string, got missing"),
    (lambda d: analyze_folder(d, RUN_B + RUN_B[:1]),
     "eval.py: {run}/episodes.jsonl: episode '" + RUN_B[0].id + "' is recorded twice (records 1 "
     "and " + str(len(RUN_B) + 1) + "); delete one of them (each counts once)"),
    (lambda d: analyze_folder(d, [dict(RUN_B[0].record(), turns=10**18)] + RUN_B[1:]),
     "eval.py: {run}/episodes.jsonl, line 1: field 'turns' must be a whole number in 0..1000, got "
     "1000000000000000000"),
    (lambda d: analyze_folder(d, RUN_B, fidelity_json='{"fork": [1, 2], "reference": [1]}'),
     "eval.py: {run}/fidelity.json does not hold fork and reference read-outs (lists of finite numbers "
     "of one shape, as eval.py writes them); delete it (the summary then leaves the probe fidelity "
     "out) or restore it"),
    (lambda d: analyze_folder(d, RUN_B, fidelity_json='{"fork": '),
     "eval.py: {run}/fidelity.json cannot be read (Expecting value); delete it (the summary then "
     "leaves the probe fidelity out) or restore it"),
    (lambda d: analyze_folder(d, RUN_B, summary_json="[1, 2"),
     "eval.py: {run}/summary.json cannot be read (Expecting ',' delimiter); delete it (its episodes "
     "give the rest)"),
    (lambda d: (analyze_folder(d, RUN_B), (d / "run" / "summary.json").symlink_to(d / "elsewhere.json")),
     "eval.py: {run} holds links (summary.json), which eval.py never reads or writes through; remove "
     "them (copy the folder with cp -L)"),
])
def test_analyze_names_a_malformed_record_or_file_in_one_line(tmp_path, make, says):
    (tmp_path / "elsewhere.json").write_text('{"roles": "not this run"}')
    make(tmp_path)
    with pytest.raises(SystemExit) as e:
        evaluation.main(["--analyze", str(tmp_path / "run")])
    assert e.value.code == says.format(run=tmp_path / "run")
    assert (tmp_path / "elsewhere.json").read_text() == '{"roles": "not this run"}'


def test_an_episode_that_ended_context_leaves_the_run_finishable(tmp_path, monkeypatch, capsys):
    """A sampled read-out whose context with a probe question passes the persuadee's context (an
    episode that ended "context", its text tokenized again) is skipped, and the count said; the
    evaluation then writes its summary and report.html, --resume finishes a run cut off before
    its judge, and --analyze reads the folder (an unjudged record's judge_failed is null)."""
    from persuarena import arena
    from persuarena import engine
    from persuarena import models
    from lab import fidelity
    model, tok = models.load_model("random:tiny-qwen3")
    instances = arena.heldout_instances()[:2]
    eng = engine.Engine(model, tok, num_blocks=3000)
    built = fidelity.fidelity_contexts
    long_last = lambda t, i, e, sample: [c + [c[-1]] * (eng.max_len if k == len(sample) - 1 else 0)
                                         for k, c in enumerate(built(t, i, e, sample))]
    monkeypatch.setattr(fidelity, "fidelity_contexts", long_last)
    summary = evaluation.evaluate(eng, eng, instances, tmp_path / "run", t_max=2, fidelity=3,
                                  max_new_tokens=6, judge=None)
    assert "1 of 3 sampled read-outs skipped" in capsys.readouterr().err
    reads = json.loads((tmp_path / "run" / "fidelity.json").read_text())
    assert len(reads["sample"]) == len(reads["fork"]) == 2 and reads["skipped"] == 1
    assert summary["probe_fidelity"]["n"] == 2 * 3 and eng.free_blocks == 3000
    for name in ("summary.json", "report.html"):
        assert (tmp_path / "run" / name).stat().st_size > 0
    cut = [{**ep.record(training=False), "judge": None, "judge_failed": None}  # killed before the judge scored them
           for ep in records.load_episodes(tmp_path / "run")]
    (tmp_path / "run" / "episodes.jsonl").write_text("".join(json.dumps(e) + "\n" for e in cut))
    assert report.analyze(tmp_path / "run")["n"] == 2
    again = evaluation.evaluate(eng, eng, instances, tmp_path / "run", t_max=2, fidelity=3,
                                max_new_tokens=6, judge=None, resume=True)
    assert again["n"] == 2 and all(ep.judge_failed is False
                                   for ep in records.load_episodes(tmp_path / "run"))


def test_a_full_disk_while_writing_the_figures_is_one_line(tmp_path, monkeypatch):
    """A figure or report.html cut by a full disk ends eval.py in one line naming the folder
    and the free space (it was a traceback), the episodes already on disk."""
    import errno
    from lab import html_report

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(html_report, "write_report", full)
    with pytest.raises(SystemExit) as e:
        report.save_run(tmp_path / "run", [], {}, None)
    message = str(e.value.code)
    assert message.startswith("eval.py: could not write") and "the disk is full" in message
    assert "\n" not in message and (tmp_path / "run" / "summary.json").is_file()


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="a CPU's default")
def test_eval_on_a_cpu_takes_the_machines_dtype_and_says_why(monkeypatch, capsys):
    """eval.py on a CPU: bfloat16 where lab.presets finds bf16 units (here CPU_BF16 True), else
    float32, printed with why."""
    from lab import presets
    for units, dtype in ((True, "bfloat16"), (False, "float32")):
        monkeypatch.setattr(presets, "CPU_BF16", units)
        assert evaluation.default_dtype() == dtype
        assert f"dtype {dtype} (lab.presets.CPU_BF16 {units}" in capsys.readouterr().out
