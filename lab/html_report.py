"""
report.html: one self-contained page of an evaluation folder, to read rather than parse. At the
top the main table of the run (full acceptance, full or conditional, final belief b_T, turns; all
episodes, by resistance type and by domain) with 95% intervals (Wilson for the shares, Student t
for the means, lab/significance.py's, as in the paper's main table). Below, one row an episode:
id, outcome, resistance, domain, end reason, turns, its belief trace b_0..b_T as inline SVG and
its final probe values (probes.PROBES), sortable by any column and filterable by outcome,
resistance, domain and end reason. Each row opens to its transcript: every persuader message with
its move labels, every persuadee reply with the decision the parser read from it, b_t, r_t (the
run's reward setting, rpo.process_rewards) and the probe values, and the judge's verdict.

    r_t = (b_t - b_{t-1}) / 2          (analyses.case_rows)

A --compare A B page pairs the two runs scenario by scenario, each pair's outcome transition
(A -> B) marked up (B's goal reward higher), down or same, both transcripts side by side.

Each episode opens to its scenario as written (title, the persuader's role, goal and request,
the persuadee, the context, and the hidden profile, marked as the persuadee's alone) above the
transcript; beliefs.png, probes.png and moves.png are written into the page (data: URIs).
The page loads nothing from elsewhere (inline CSS, figures and one small inline script) and every text a model
wrote goes through html.escape: a message is shown, never interpreted. Filters can be set in the
URL fragment too: report.html#outcome=ACCEPT&domain=healthcare (keys outcome, resistance,
domain, endreason; transition on the compare page).

    python eval.py --analyze evals/NAME          # rewrites summary.json, the plots and report.html
    python eval.py --compare evals/A evals/B     # compare.json and report-compare.html in evals/B
    python -m pytest -q tests/test_html_report.py
"""
import base64
import functools
import html
from collections import defaultdict
from pathlib import Path

from persuarena import arena
from persuarena import rpo
from lab import analyses, records, runs, significance, terminal

TRACE_SIZE = (140, 34)  # the belief trace's plot area in pixels (b in [-1, 1])
TRACE_MARGINS = (18, 34)  # pixels left of it (the +1 / -1 scale) and right of it (b_T's value)
FIGURES = {"beliefs.png": "beliefs b_t by outcome", "probes.png": "each probe by outcome",
           "moves.png": "persuader moves by turn"}  # save_plots' figures, embedded when present
PROFILE = ("resistance", "motivation", "concerns", "values", "trust", "relationship", "secret",
           "condition")  # the hidden profile's fields, in the page's order
FILTERS = ("outcome", "resistance", "domain", "end_reason")  # the columns the page filters by
COMPARE_NAME = "report-compare.html"  # a --compare page, beside compare.json in B's folder

STYLE = """
body{font:14px/1.4 system-ui,sans-serif;margin:1.5em;color:#222}
table{border-collapse:collapse;margin:.5em 0}td,th{border:1px solid #ccc;padding:2px 6px;vertical-align:top}
th{background:#f2f2f2}th.sort{cursor:pointer}.num{text-align:right;font-variant-numeric:tabular-nums}
.ci{color:#777;font-size:85%}details>summary{cursor:pointer}.msg{white-space:pre-wrap;margin:4px 0;padding:4px 8px;border-radius:4px}
.persuader{background:#eef4ff}.persuadee{background:#f4f4f4}.meta{color:#555;font-size:85%}
.up{background:#dff5df}.down{background:#fbe0e0}.same{}.filters select{margin-right:1em}
.scenario{background:#fffbea;padding:4px 8px;margin:4px 0}.hidden summary{color:#8a5a00}
figure{display:inline-block;margin:0 1em 1em 0}figure img{max-width:100%}
.ACCEPT{color:#0a6b0a;font-weight:bold}.REJECT,.WALK_AWAY{color:#a30000}.side{display:inline-block;width:49%;vertical-align:top}
"""

SCRIPT = """
function applyFilters(){var f={};document.querySelectorAll('.filters select').forEach(function(s){if(s.value)f[s.name]=s.value});
document.querySelectorAll('tr.episode').forEach(function(r){var show=true;for(var k in f){if(r.dataset[k]!==f[k])show=false}
r.hidden=!show;var d=r.nextElementSibling;if(d&&d.classList.contains('detail'))d.hidden=!show})}
function fromHash(){var h=decodeURIComponent(location.hash.slice(1));h.split('&').forEach(function(p){var kv=p.split('=');
var s=document.querySelector('.filters select[name="'+kv[0]+'"]');if(s&&kv.length==2)s.value=kv[1]});applyFilters()}
function sortBy(th){var table=th.closest('table'),i=th.cellIndex,asc=th.dataset.asc!=='1';th.dataset.asc=asc?'1':'0';
var pairs=[];table.querySelectorAll('tr.episode').forEach(function(r){pairs.push([r,r.nextElementSibling])});
pairs.sort(function(a,b){var x=a[0].cells[i].dataset.v||a[0].cells[i].textContent,y=b[0].cells[i].dataset.v||b[0].cells[i].textContent;
var nx=parseFloat(x),ny=parseFloat(y),c=(!isNaN(nx)&&!isNaN(ny))?nx-ny:x.localeCompare(y);return asc?c:-c});
var body=table.tBodies[0];pairs.forEach(function(p){body.appendChild(p[0]);if(p[1])body.appendChild(p[1])})}
document.addEventListener('DOMContentLoaded',function(){document.querySelectorAll('.filters select').forEach(function(s){
s.addEventListener('change',applyFilters)});document.querySelectorAll('th.sort').forEach(function(th){
th.addEventListener('click',function(){sortBy(th)})});fromHash()});
"""


def esc(value):
    """Any value as escaped HTML text (None as -), its control and bidi characters as visible
    escapes (terminal.visible: a right-to-left override would otherwise reorder what is shown)."""
    return "-" if value is None else html.escape(terminal.visible(value), quote=True)


def number(x, fmt="+.3f"):
    return "-" if x is None else format(x, fmt)


def trace_svg(beliefs):
    """b_0..b_T as an inline SVG polyline on its scale: -1 to +1 labelled on the left, the zero
    line dashed, the last read value written on the right (unread beliefs skipped)."""
    (w, h), (left, right) = TRACE_SIZE, TRACE_MARGINS
    read = [(t, b) for t, b in enumerate(beliefs) if b is not None]
    span = max(len(beliefs) - 1, 1)
    y = lambda b: (1 - b) * (h - 4) / 2 + 2
    points = " ".join(f"{left + 2 + t * (w - 4) / span:.1f},{y(b):.1f}" for t, b in read)
    line = f'<polyline fill="none" stroke="#2a5db0" stroke-width="1.5" points="{points}"/>' if read else ""
    scale = (f'<text x="0" y="8" font-size="8" fill="#777">+1</text>'
             f'<text x="0" y="{h - 1}" font-size="8" fill="#777">-1</text>'
             f'<line x1="{left}" x2="{left}" y1="2" y2="{h - 2}" stroke="#bbb"/>')
    last = (f'<text x="{left + w + 2}" y="{min(max(y(read[-1][1]) + 3, 8), h - 1):.1f}" font-size="9" '
            f'fill="#2a5db0">{number(read[-1][1], "+.2f")}</text>') if read else ""
    return (f'<svg width="{left + w + right}" height="{h}" viewBox="0 0 {left + w + right} {h}" role="img">'
            f'<title>{esc(" ".join(number(b, "+.2f") for b in beliefs))}</title>{scale}'
            f'<line x1="{left}" x2="{left + w}" y1="{h / 2}" y2="{h / 2}" stroke="#bbb" '
            f'stroke-dasharray="3,3"/>{line}{last}</svg>')


@functools.cache
def known_scenarios(path=None):
    """The scenarios of a scenarios file (default arena.SCENARIOS_PATH) by id; none when it
    cannot be read (the page then says so for each episode)."""
    try:
        return {s["id"]: s for s in arena.load_scenarios(path or arena.SCENARIOS_PATH)}
    except (OSError, ValueError):
        return {}


def scenario_html(ep, scenarios):
    """The episode's scenario as written: title, the persuader's role, goal and request, the
    persuadee and the context, then the hidden profile, marked as hidden from the persuader."""
    sc = scenarios.get(ep.scenario_id or ep.id)
    if sc is None:
        return f"<p class='meta'>scenario {esc(ep.scenario_id or ep.id)} is not in the scenarios file</p>"
    who, them = sc["persuader"], sc["persuadee"]
    hidden = "".join(f"<dt>{esc(k)}</dt><dd>{esc('; '.join(v) if isinstance(v, list) else v)}</dd>"
                     for k in PROFILE if (v := sc["hidden"].get(k)) is not None)
    return (f"<div class='scenario'><b>{esc(sc['title'])}</b> <span class='meta'>({esc(sc['domain'])})</span>"
            f"<p><b>persuader</b>: {esc(who['role'])}. <b>goal</b>: {esc(who['goal'])}. "
            f"<b>request</b>: {esc(who['request'])}</p><p><b>persuadee</b>: {esc(them['name'])} "
            f"({esc(them.get('pronouns'))}, {esc(them.get('age'))}), {esc(them.get('occupation'))}. "
            f"{esc(them.get('background'))}</p><p><b>context</b>: {esc(sc.get('context'))}</p>"
            f"<details class='hidden'><summary>hidden profile (the persuadee plays it; the persuader "
            f"never sees it)</summary><dl>{hidden}</dl></details></div>")


def figures_html(out_dir):
    """save_plots' figures written into the page as data: URIs (the page stays one file)."""
    parts = []
    for name, caption in FIGURES.items():
        if (path := Path(out_dir) / name).is_file():
            data = base64.b64encode(path.read_bytes()).decode("ascii")
            parts.append(f"<figure><img alt='{esc(caption)}' src='data:image/png;base64,{data}'>"
                         f"<figcaption>{esc(name)}: {esc(caption)}</figcaption></figure>")
    return f"<h2>Figures</h2>{''.join(parts)}" if parts else ""


def share_cell(fraction, n):
    """A share in percent with its Wilson 95% interval."""
    if fraction is None or not n:
        return "<td>-</td>"
    low, high = significance.wilson_interval(round(fraction * n), n)
    return f'<td class="num">{100 * fraction:.1f}% <span class="ci">[{100 * low:.1f}, {100 * high:.1f}]</span></td>'


def mean_cell(values, fmt):
    """A mean with its Student-t 95% interval (no interval below two values)."""
    if not values:
        return "<td>-</td>"
    mean, low, high = significance.t_interval(values)
    ci = f' <span class="ci">[{format(low, fmt)}, {format(high, fmt)}]</span>' if low is not None else ""
    return f'<td class="num">{format(mean, fmt)}{ci}</td>'


def table_row(label, stats, episodes):
    """One row of the main table: the summary's shares, the means of the same episodes."""
    believed = analyses.with_beliefs(episodes)
    return (f"<tr><th>{esc(label)}</th><td class='num'>{stats['n']}</td>"
            + share_cell(stats["full_accept"], stats["n"]) + share_cell(stats["full_or_conditional"], stats["n"])
            + mean_cell([ep.beliefs[-1] for ep in believed], "+.3f")
            + mean_cell([ep.turns for ep in episodes], ".2f") + "</tr>")


def main_table(summary, episodes):
    """The run's main table from summary.json's keys: all episodes, then by resistance and domain."""
    head = ("<tr><th></th><th>n</th><th>full acceptance</th><th>full or conditional</th>"
            "<th>final belief b_T</th><th>turns</th></tr>")
    rows = [table_row("all episodes", summary, episodes)]
    for key, title in (("resistance", "by_resistance"), ("domain", "by_domain")):
        groups = defaultdict(list)
        for ep in episodes:
            groups[getattr(ep, key) or analyses.UNSTATED].append(ep)
        rows.append(f"<tr><th colspan='6'>{title.replace('_', ' ')}</th></tr>")
        rows += [table_row(name, stats, groups.get(name, [])) for name, stats in summary.get(title, {}).items()]
    note = ("<p class='meta'>shares with Wilson 95% intervals, means with Student-t 95% intervals; "
            f"end reasons: {esc(', '.join(f'{k} {v}' for k, v in summary.get('end_reasons', {}).items()))}</p>")
    return f"<table>{head}{''.join(rows)}</table>{note}"


def readouts(ep):
    """Per read-out t: {b, r, probe values}; r from the run's reward setting when beliefs are read."""
    if analyses.with_beliefs([ep]):
        return analyses.case_rows(ep)
    names = records.probe_names()
    return [{"t": t, "b": b, "r": None, **dict(zip(names, values or [None] * len(names)))}
            for t, (values, b) in enumerate(zip(ep.probes or [], ep.beliefs or []))]


def readout_line(row):
    probes = " ".join(f"{esc(name)} {number(row.get(name))}" for name in records.probe_names())
    r = f", r_{row['t']} {number(row.get('r'))}" if row["t"] else ""  # r_t from the first reply on
    return f"b_{row['t']} {number(row['b'])}{r}; {probes}"


def transcript_html(ep):
    """The transcript in order: persuader messages with their move labels, persuadee replies with
    the parsed decision, b_t, r_t and the probe values read after them, then the judge's verdict."""
    rows, moves, manipulation = readouts(ep), ep.moves or [], ep.manipulation or []
    parts = [f"<div class='meta'>before the first message: {readout_line(rows[0])}</div>" if rows else ""]
    said = heard = 0
    for message in ep.transcript or []:
        if message["role"] == "persuader":
            labels = moves[said] if said < len(moves) else []
            flags = manipulation[said] if said < len(manipulation) else []
            said += 1
            meta = f"moves: {esc(', '.join(labels) or '-')}" + (f"; manipulation: {esc(', '.join(flags))}" if flags else "")
        else:
            heard += 1
            row = rows[heard] if heard < len(rows) else None
            meta = f"decision read: {esc(message.get('decision'))}" + (f"; {readout_line(row)}" if row else "")
        parts.append(f"<div class='msg {esc(message['role'])}'><b>{esc(message['role'])} {said}</b>"
                     f"<div>{esc(message.get('text', ''))}</div><div class='meta'>{meta}</div></div>")
    verdict = ("not judged" if ep.judge is None else
               f"strategy score s = {number(ep.judge, '+.2f')}" + (" (judge failed: fell back to 0)" if ep.judge_failed else ""))
    parts.append(f"<div class='meta'>outcome {esc(ep.outcome)}, end reason {esc(ep.end_reason)}; judge: {verdict}</div>")
    return "".join(parts)


def episode_cells(ep, scenarios):
    """An episode's row cells: id, scenario title, outcome, resistance, domain, end reason, turns,
    trace, probes."""
    last = (ep.probes or [[]])[-1] or []
    probes = "".join(f'<td class="num" data-v="{number(v)}">{number(v)}</td>'
                     for v in list(last) + [None] * (len(records.probe_names()) - len(last)))
    final = (ep.beliefs or [None])[-1]
    title = (scenarios.get(ep.scenario_id or ep.id) or {}).get("title")
    return (f"<td>{esc(ep.id)}</td><td>{esc(title)}</td><td class='{esc(ep.outcome)}'>{esc(ep.outcome)}</td>"
            f"<td>{esc(ep.resistance)}</td><td>{esc(ep.domain)}</td><td>{esc(ep.end_reason)}</td>"
            f"<td class='num'>{ep.turns}</td><td data-v='{number(final)}'>{trace_svg(ep.beliefs or [])}</td>{probes}")


def row_data(ep):
    """The data-* attributes the filters read."""
    return " ".join(f'data-{key.replace("_", "")}="{esc(getattr(ep, key))}"' for key in FILTERS)


def filters_html(episodes):
    """One <select> per filtered column, its options the values present."""
    out = []
    for key in FILTERS:
        values = sorted({str(getattr(ep, key)) if getattr(ep, key) is not None else "-" for ep in episodes})
        options = "".join(f"<option>{esc(v)}</option>" for v in values)
        out.append(f"<label>{key.replace('_', ' ')} <select name='{key.replace('_', '')}'>"
                   f"<option value=''>all</option>{options}</select></label>")
    return f"<p class='filters'>{''.join(out)}</p>"


def episodes_table(episodes, scenarios):
    columns = ["id", "scenario", "outcome", "resistance", "domain", "end reason", "turns", "belief b_0..b_T (sort: b_T)",
               *records.probe_names()]
    head = "".join(f"<th class='sort'>{esc(c)}</th>" for c in columns)
    rows = [f"<tr class='episode' {row_data(ep)}>{episode_cells(ep, scenarios)}</tr>"
            f"<tr class='detail' {row_data(ep)}><td colspan='{len(columns)}'><details><summary>scenario and "
            f"transcript of {esc(ep.id)}</summary>{scenario_html(ep, scenarios)}{transcript_html(ep)}"
            "</details></td></tr>" for ep in episodes]
    return f"{filters_html(episodes)}<table><thead><tr>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table>"


def page(title, body):
    return (f"<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'><title>{esc(title)}</title>"
            f"<style>{STYLE}</style></head><body><h1>{esc(title)}</h1>{body}<script>{SCRIPT}</script></body></html>\n")


def write_report(out_dir, episodes, summary, scenarios=None):
    """report.html beside summary.json: the main table, the figures, then one row an episode that
    opens to its scenario and transcript. scenarios: {id: scenario}, default scenarios.jsonl's."""
    out_dir = Path(out_dir)
    scenarios = known_scenarios() if scenarios is None else scenarios
    body = (f"<h2>Main table</h2>{main_table(summary, episodes)}{figures_html(out_dir)}"
            f"<h2>Episodes ({len(episodes)})</h2><p class='meta'>click a column to sort; open a row for its "
            "scenario and transcript; belief traces run from b_0 to b_T on a scale of -1 to +1 "
            "(dashed: 0), b_T written at the end; probe columns are the last read-out's values</p>"
            f"{episodes_table(episodes, scenarios)}")
    path = out_dir / "report.html"
    runs.write_atomic(path, page(f"evaluation {out_dir.name}", body))
    return path


def transition_class(outcome_a, outcome_b):
    """up where B's goal reward beats A's on the scenario, down where it falls short, else same."""
    ga, gb = rpo.GOAL[outcome_a], rpo.GOAL[outcome_b]
    return "up" if gb > ga else "down" if gb < ga else "same"


def transitions_table(result):
    """compare()'s A -> B outcome counts, the changed cells coloured by direction."""
    head = "<tr><th>A \\ B</th>" + "".join(f"<th>{o}</th>" for o in arena.OUTCOMES) + "</tr>"
    rows = []
    for oa in arena.OUTCOMES:
        cells = "".join(f"<td class='num {transition_class(oa, ob) if n else ''}'>{n}</td>"
                        for ob, n in ((ob, result["transitions"][oa][ob]) for ob in arena.OUTCOMES))
        rows.append(f"<tr><th>{oa}</th>{cells}</tr>")
    return f"<table>{head}{''.join(rows)}</table>"


def pair_rows(episodes_a, episodes_b):
    """One row a scenario both runs played: A's and B's outcome and trace, the transition marked."""
    a = {ep.scenario_id: ep for ep in episodes_a}
    b = {ep.scenario_id: ep for ep in episodes_b}
    rows = []
    for sid in sorted(set(a) & set(b)):
        ea, eb = a[sid], b[sid]
        kind = transition_class(ea.outcome, eb.outcome)
        data = (f'data-outcome="{esc(ea.outcome)}&gt;{esc(eb.outcome)}" data-transition="{kind}" '
                f'data-resistance="{esc(eb.resistance)}" data-domain="{esc(eb.domain)}"')
        rows.append(f"<tr class='episode {kind}' {data}><td>{esc(sid)}</td><td>{esc(ea.outcome)} &rarr; "
                    f"{esc(eb.outcome)}</td><td>{kind}</td><td>{esc(eb.resistance)}</td><td>{esc(eb.domain)}</td>"
                    f"<td>{trace_svg(ea.beliefs or [])}</td><td>{trace_svg(eb.beliefs or [])}</td></tr>"
                    f"<tr class='detail'><td colspan='7'><details><summary>transcripts of {esc(sid)}</summary>"
                    f"<div class='side'><b>A</b>{transcript_html(ea)}</div><div class='side'><b>B</b>{transcript_html(eb)}</div>"
                    "</details></td></tr>")
    return rows


def write_compare(path, name_a, name_b, result, episodes_a, episodes_b):
    """The --compare page: the tests, the transition table and the scenarios paired, B against A."""
    rows = pair_rows(episodes_a, episodes_b)
    kinds = sorted({"up", "down", "same"})
    select = ("<p class='filters'><label>transition <select name='transition'><option value=''>all</option>"
              + "".join(f"<option>{k}</option>" for k in kinds) + "</select></label></p>")
    head = "".join(f"<th class='sort'>{c}</th>" for c in ("scenario", "A &rarr; B", "transition", "resistance",
                                                           "domain", "belief A", "belief B"))
    body = (f"<p>A = {esc(name_a)}<br>B = {esc(name_b)}</p><p>{result['n']} scenarios paired; acceptance won "
            f"{result['accept_won']}, lost {result['accept_lost']} (McNemar p = {number(result['mcnemar_p'], '.3g')}); "
            f"goal wins {result['wins']}, losses {result['losses']}, ties {result['ties']} "
            f"(Wilcoxon p = {number(result['wilcoxon_p'], '.3g')})</p><h2>Outcome transitions</h2>{transitions_table(result)}"
            f"<h2>Scenarios</h2>{select}<table><thead><tr>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table>")
    runs.write_atomic(Path(path), page(f"compare {Path(name_b).name} against {Path(name_a).name}", body))
    return Path(path)
