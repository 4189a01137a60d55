"""Benchmark tables and charts, generated at build time from ``bench/results/*.json``.

A benchmark page holds hand-written prose (what is measured, how) and a marker
``<!-- bench:SUITE -->`` where the hook puts this module's :func:`render` of
the suite's latest run; ``<!-- bench:headline -->`` and ``<!-- bench:suites -->``
give the headline table and the list of every suite's runs. Tables come from
the renderers the benchmarks themselves use for bench/README.md
(``bench.<suite>.render``), so the site and bench/README show the same numbers
for the same file; suites without one (crash and damage trials, request rates)
are rendered here. Charts are drawn with ``bench.chart`` at build time.

The latest run of a suite: the file with the newest date (from the record,
else its name); on the same date, the later start time where the record has
one (``uptime_start``, ``started``), then the file named as the harness names
a default run (no qualifier after the date), then the name.
"""

from __future__ import annotations

import datetime
import importlib
import json
import re
import statistics
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DATE = r"(?P<date>\d{4}-\d{2}-\d{2})"


@dataclass(frozen=True)
class Run:
    """One results file."""

    path: Path
    record: dict[str, Any]
    date: str
    time: str
    qualifier: str

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def key(self) -> tuple[str, str, int, str]:
        return (self.date, self.time, 0 if self.qualifier else 1, self.name)


@dataclass(frozen=True)
class Suite:
    """A benchmark and how its runs are found and rendered."""

    slug: str
    title: str
    command: str
    pattern: str
    page: str  # the docs page that shows it
    render: Callable[[Run, "Context"], str]


class Context:
    """What a renderer may add to the site: charts (PNG bytes by docs path)."""

    def __init__(self) -> None:
        self.charts: dict[str, bytes] = {}

    def chart(self, run: Run, page: str) -> str | None:
        """Draw ``run``'s chart with ``bench.chart``; its path relative to ``page``."""
        chart = _module("chart")
        docs_path = f"benchmarks/charts/{run.path.stem}.png"
        if docs_path not in self.charts:
            with tempfile.TemporaryDirectory() as tmp:
                png = Path(tmp) / "chart.png"
                chart.write_chart(run.record, png)
                self.charts[docs_path] = png.read_bytes()
        return "charts/" + Path(docs_path).name if page.startswith("benchmarks/") else docs_path


def _time_of(record: dict[str, Any]) -> tuple[str, str | None]:
    """(start time as text, date from a timestamp) of a record, where it has one."""
    started = record.get("started")
    if isinstance(started, (int, float)):
        moment = datetime.datetime.fromtimestamp(started, tz=datetime.timezone.utc)
        return moment.strftime("%H:%M:%S"), moment.strftime("%Y-%m-%d")
    uptime = record.get("uptime_start")
    if isinstance(uptime, str) and re.match(r"\d{2}:\d{2}:\d{2}", uptime):
        return uptime[:8], None
    return "", None


def runs(results: Path, suite: Suite) -> list[Run]:
    """Every run of ``suite`` in ``results``, newest first."""
    found: list[Run] = []
    regex = re.compile(suite.pattern)
    for path in sorted(results.glob("*.json")):
        match = regex.match(path.name)
        if not match:
            continue
        record = json.loads(path.read_text())
        time, stamped = _time_of(record)
        date = str(record.get("date") or stamped or match["date"])
        found.append(Run(path, record, date, time, match.groupdict().get("qual") or ""))
    return sorted(found, key=lambda r: r.key, reverse=True)


# Where the shared renderers live: bench/harness/ and bench/scale/ since the reorganisation
# of issue 33, flat bench/*.py before it. The first module that imports wins.
_SHARED = {
    "report": ("bench.harness.report", "bench.report"),
    "chart": ("bench.harness.chart", "bench.chart"),
    "scale_report": ("bench.scale.report", "bench.scale_report"),
}


def _module(name: str) -> Any:
    """``bench.<name>`` (a suite), or the shared module ``name`` from :data:`_SHARED`."""
    candidates = _SHARED.get(name, (f"bench.{name}",))
    for candidate in candidates[:-1]:
        try:
            return importlib.import_module(candidate)
        except ModuleNotFoundError as err:
            if err.name is None or not candidate.startswith(err.name):
                raise  # the module exists but something it imports is missing
    return importlib.import_module(candidates[-1])


# -- renderers ---------------------------------------------------------------


def _throughput(run: Run, ctx: Context) -> str:
    chart = ctx.chart(run, "benchmarks/throughput.md")
    return str(_module("report").render(run.record, chart=chart))


def _object_store(page: str) -> Callable[[Run, Context], str]:
    """A ``python -m bench --only gcs|az`` run: the same tables as the main throughput run."""
    def render(run: Run, ctx: Context) -> str:
        return str(_module("report").render(run.record, chart=ctx.chart(run, page)))

    return render


def _torture_plan_caching(run: Run, ctx: Context) -> str:
    r = run.record
    return (f"Run of {r['date']} (seed {r['seed']}, {r['seconds'] / 60:.1f} min): **{r['trials']} trials, "
            f"{r['with_kill']} with a kill armed, {r['saves_logged']} saves logged, {r['committed']} committed and "
            f"checked, {r['refusals']} refusals, {len(r['violations'])} violations**.\n")


def _compression(run: Run, ctx: Context) -> str:
    chart = ctx.chart(run, "benchmarks/compression.md")
    text = str(_module("compression").render(run.record))
    alt = f"Compression ratio and codec GB/s per data set, save and load GB/s, run of {run.date}"
    return f"{text}\n\n[![{alt}]({chart})]({chart})\n"


def _by_render(module: str) -> Callable[[Run, Context], str]:
    def render(run: Run, ctx: Context) -> str:
        return str(_module(module).render(run.record))

    return render


def _frameworks(run: Run, ctx: Context) -> str:
    """The pooled table of every run of the latest one's date and model size, then the latest run."""
    size = run.record["params"]["size"]
    pooled = [path for path in sorted(run.path.parent.glob("frameworks-*.json"))
              if re.match(_q("frameworks"), path.name)
              and (record := json.loads(path.read_text()))["params"]["size"] == size
              and record.get("date") == run.record.get("date")]
    records = [json.loads(path.read_text()) for path in pooled]
    out = []
    if len(records) > 1:
        out += ["## Runs pooled", "", str(_module("frameworks_pool").render(records, [p.name for p in pooled])), "",
                "## The latest run", ""]
    return "\n".join(out) + str(_module("frameworks_report").render(run.record))


def _scale(run: Run, ctx: Context) -> str:
    report = _module("scale_report")
    return str(report.render_markdown(run.record["rows"], run.record.get("profiles") or ()))


def _pct(value: float) -> str:
    return f"{value:.1f} %"


def _s3_request_rate(run: Run, ctx: Context) -> str:
    r = run.record
    s = r["settings"]
    labels = {
        "sagemaker": "SageMaker names (one prefix per rank's files)",
        "prefixes": f"key prefixes ({s.get('key_prefixes')})",
        "unlimited": "client before the adaptive limiter, SageMaker names (--reference)",
    }
    lines = [
        f"Run of {r['date']}: {s['ranks']} ranks x {s['parts_per_rank']} parts of {s['part_size'] // 1024} KiB, "
        f"{s['rate_per_prefix']:g} requests/s per prefix (burst {s['burst']:g}); server: {s['server']}; "
        f"{len(r.get('rounds', []))} rounds, median (min–max).",
        "",
        "| system | save wall time (s) | requests | throttled | loads bit-exact | failed saves |",
        "|---|---:|---:|---:|---|---:|",
    ]
    summary = r["summary"]
    for key, label in labels.items():
        row = summary.get(key)
        if not row:
            continue
        sec, req, thr = row["seconds"], row["requests"], row["throttled_pct"]
        lines.append(
            f"| {label} | {sec['median']:.2f} <sub>({sec['min']:.2f}–{sec['max']:.2f})</sub> | "
            f"{req['median']:,} <sub>({req['min']:,}–{req['max']:,})</sub> | "
            f"{_pct(thr['median'])} <sub>({thr['min']:.1f}–{thr['max']:.1f})</sub> | "
            f"{'yes' if row['exact'] else 'no'} | {row['failed_rounds']} |"
        )
    if "speedup" in summary:
        sp = summary["speedup"]
        lines += ["", f"Key prefixes save **{sp['median']:.2f}×** faster than SageMaker names "
                      f"(per round: {sp['min']:.2f}–{sp['max']:.2f}×)."]
    return "\n".join(lines)


def _s3_simulation(run: Run, ctx: Context) -> str:
    r = run.record
    lines = [
        f"Run of {r['date']}: {r['setting']}; ideal time {r['ideal_seconds']['shared']:g} s with one shared "
        f"bucket, {r['ideal_seconds']['each']:g} s with a bucket each; median (min–max) of "
        f"{len(next(iter(r['results'].values()))['seconds'])} runs.",
        "",
        "| limiter, buckets | time (s) | throttled |",
        "|---|---:|---:|",
    ]
    for label, res in r["results"].items():
        sec, thr = res["seconds"], res["throttled_pct"]
        lines.append(f"| {label} | {statistics.median(sec):.2f} <sub>({min(sec):.2f}–{max(sec):.2f})</sub> | "
                     f"{statistics.median(thr):.1f} % <sub>({min(thr):.1f}–{max(thr):.1f})</sub> |")
    return "\n".join(lines)


def _torture(run: Run, ctx: Context) -> str:
    r = run.record
    mode = r.get("mode", "sync")
    lines = [
        f"Run of {r['date']} (mode `{mode}`, seed {r.get('seed', 1)}, {r['seconds'] / 60:.1f} min): "
        f"**{r['trials']} trials, {r['armed']} armed, {r['kills']} jobs killed "
        f"({r['committed_despite_kill']} after their commit), {len(r['violations'])} violations**"
        + (f"; {r['referring_saves']} committed saves referring to earlier files, "
           f"{r['retired_seen']} trials leaving a retired directory" if "referring_saves" in r else "")
        + ("; beside the jobs: " + ", ".join(f"{n} {what}" for what, n in r["beside"].items())
           + f", {r.get('compactions_refused', 0)} compactions refused" if "beside" in r else "")
        + ".",
        "",
    ]
    outcomes = r.get("outcomes_by_crash")
    if outcomes:
        lines += ["| crash point | trials | kills | committed despite the kill | violations |",
                  "|---|---:|---:|---:|---:|"]
        for point, o in outcomes.items():
            lines.append(f"| `{point}` | {o['trials']} | {o['kills']} | {o['committed_despite_kill']} | {o['violations']} |")
    else:
        lines += ["| crash point | trials |", "|---|---:|"]
        for point, n in r["by_crash"].items():
            lines.append(f"| `{point}` | {n} |")
    return "\n".join(lines)


def _damage(run: Run, ctx: Context) -> str:
    r = run.record
    lines = [
        f"Run of {r['date']}.",
        "",
        "| checkpoint | trials | detected | violations | single-byte changes of the metadata | undetected |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, res in r["runs"].items():
        meta = res["metadata_single_byte_changes"]
        lines.append(f"| {name} | {res['trials']} | {res['detected']} | {len(res['violations'])} | "
                     f"{meta['variants']:,} ({meta['bytes']:,} bytes x 255) | {len(meta['undetected'])} |")
    lines += ["", "| damage | " + " | ".join(f"{n}: trials / detected" for n in r["runs"]) + " |",
              "|---|" + "---:|" * len(r["runs"])]
    kinds = list(next(iter(r["runs"].values()))["by_kind"])
    for kind in kinds:
        cells = " | ".join("{} / {}".format(*res["by_kind"].get(kind, ["–", "–"])) for res in r["runs"].values())
        lines.append(f"| `{kind}` | {cells} |")
    lines += ["", "| outcome | " + " | ".join(r["runs"]) + " |", "|---|" + "---:|" * len(r["runs"])]
    hows = sorted({h for res in r["runs"].values() for h in res["how"]})
    for how in hows:
        lines.append(f"| {how} | " + " | ".join(str(res["how"].get(how, 0)) for res in r["runs"].values()) + " |")
    return "\n".join(lines)


def _q(name: str) -> str:
    return rf"^{re.escape(name)}-{DATE}(?P<qual>-.+)?\.json$"


SUITES: tuple[Suite, ...] = (
    Suite("throughput", "Save and load throughput", "python -m bench",
          rf"^{DATE}-[0-9a-f]{{8}}(?P<qual>-.+)?\.json$", "benchmarks/throughput.md", _throughput),
    Suite("replicated", "Replicated loads (read-once)", "python -m bench.replicated",
          rf"^replicated-{DATE}-[0-9a-f]{{8}}(?P<qual>-.+)?\.json$", "benchmarks/replicated.md", _by_render("replicated")),
    Suite("blocking", "Training blocked per save", "python -m bench.blocking",
          _q("blocking"), "benchmarks/blocking.md", _by_render("blocking")),
    Suite("tiers", "Tiered checkpoints", "python -m bench.tiers",
          _q("tiers"), "benchmarks/tiers.md", _by_render("tiers")),
    Suite("cluster", "Many hosts", "python -m bench.cluster",
          _q("cluster"), "benchmarks/cluster.md", _by_render("cluster")),
    Suite("incremental", "Incremental checkpoints", "python -m bench.incremental",
          _q("incremental"), "benchmarks/incremental.md", _by_render("incremental")),
    Suite("compression", "Compression and checksums", "python -m bench.compression",
          _q("compression"), "benchmarks/compression.md", _compression),
    Suite("reshard", "Resharded loads and planning", "python -m bench.reshard",
          _q("reshard"), "benchmarks/reshard.md", _by_render("reshard")),
    Suite("finetune", "Fine-tuning load and export", "python -m bench.finetune",
          _q("finetune"), "benchmarks/finetune.md", _by_render("finetune")),
    Suite("hf-export", "Hugging Face export", "python -m bench.hf_export",
          _q("hf-export"), "benchmarks/hf-export.md", _by_render("hf_export")),
    Suite("frameworks", "Framework saves: torchtitan, Lightning, Megatron-Core", "python -m bench.frameworks",
          _q("frameworks"), "benchmarks/frameworks.md", _frameworks),
    Suite("scale", "Scale: planning and metadata", "python -m bench.scale",
          _q("scale"), "benchmarks/scale.md", _scale),
    Suite("s3-request-rate", "S3 request rates and key prefixes", "python -m bench.s3_request_rate",
          _q("s3-request-rate"), "benchmarks/s3-request-rate.md", _s3_request_rate),
    Suite("s3-request-rate-simulation", "S3 request rates: limiter simulation",
          "python -m bench.s3_request_rate --simulate",
          _q("s3-request-rate-simulation"), "benchmarks/s3-request-rate.md", _s3_simulation),
    Suite("torture", "Crash trials", "python -m bench.torture",
          _q("torture"), "benchmarks/trials.md", _torture),
    Suite("torture-incremental", "Crash trials, incremental saves", "python -m bench.torture --incremental",
          _q("torture-incremental"), "benchmarks/trials.md", _torture),
    Suite("torture-concurrent", "Crash trials, a second process on the root", "python -m bench.torture --concurrent",
          _q("torture-concurrent"), "benchmarks/trials.md", _torture),
    Suite("torture-plan-caching", "Crash trials, plan caching", "python -m bench.torture --plan-caching",
          _q("torture-plan-caching"), "benchmarks/trials.md", _torture_plan_caching),
    Suite("gcs", "Google Cloud Storage", "python -m bench --only gcs",
          _q("gcs"), "benchmarks/cloud-stores.md", _object_store("benchmarks/cloud-stores.md")),
    Suite("azure", "Azure Blob", "python -m bench --only az",
          _q("azure"), "benchmarks/cloud-stores.md", _object_store("benchmarks/cloud-stores.md")),
    Suite("damage", "Damage trials", "python -m bench.damage",
          _q("damage"), "benchmarks/trials.md", _damage),
)

BY_SLUG = {s.slug: s for s in SUITES}


def _source_note(suite: Suite, found: list[Run], shown: Run, extra: str = "") -> str:
    others = [r.name for r in found if r is not shown]
    text = (f"Generated at build time from `bench/results/{shown.name}`, the latest of "
            f"{len(found)} run{'s' if len(found) != 1 else ''} of `{suite.command}` in `bench/results/`{extra}.")
    if others:
        text += " Other runs: " + ", ".join(f"`{o}`" for o in others) + "."
    return '!!! info "Source"\n    ' + text + "\n"


def render(slug: str, results: Path, ctx: Context) -> str:
    """The markdown of suite ``slug``'s latest run (and its source)."""
    suite = BY_SLUG[slug]
    found = runs(results, suite)
    if not found:
        raise LookupError(f"no results file of {suite.command} in {results} (pattern {suite.pattern})")
    latest = found[0]
    body = suite.render(latest, ctx)
    out = [_source_note(suite, found, latest), body]
    if slug == "scale":
        out += _scale_other_cases(found, ctx)
    return "\n".join(out) + "\n"


def _scale_other_cases(found: list[Run], ctx: Context) -> list[str]:
    """Scale runs measure chosen cases (model, ranks, system); the cases the latest run did
    not measure, from the latest run that did, each table naming its file."""

    def case(row: dict[str, Any]) -> tuple[Any, ...]:
        return (row.get("model"), row.get("ranks"), row.get("system"))

    seen = {case(row) for row in found[0].record["rows"]}
    out: list[str] = []
    report = _module("scale_report")
    for run in found[1:]:
        rows = [row for row in run.record["rows"] if case(row) not in seen]
        if not rows:
            continue
        seen |= {case(row) for row in rows}
        cases = ", ".join(f"{m} on {n:,} ranks" for m, n in sorted({(m, n) for m, n, _ in map(case, rows)},
                                                                  key=lambda mn: (str(mn[0]), int(mn[1]))))
        out += [
            f"#### Cases last measured in `bench/results/{run.name}`",
            "",
            f"Run of {run.date} {run.time} UTC ({' '.join(run.record.get('argv') or []) or 'default cases'}): {cases}.",
            "",
            str(report.render_markdown(rows, ())),
            "",
        ]
    return out


def headline(results: Path) -> str:
    """The headline table of the latest ``python -m bench`` run: GB/s, 1 rank / 2 ranks."""
    suite = BY_SLUG["throughput"]
    found = runs(results, suite)
    if not found:
        raise LookupError(f"no results file of {suite.command} in {results}")
    run = found[0]
    report = _module("report")
    summary = run.record.get("summary") or report.summarize(run.record)
    worlds = sorted(run.record.get("worlds", {}), key=int)
    roles = [("dcp_ext", "dcp_ext"), ("torch_default", "torch default"), ("raw", "raw ceiling"),
             ("s3torchconnector", "s3torchconnector")]
    rows = [("local", "save", "local save (fsync'ed)"), ("local", "load_warm", "local load, page cache"),
            ("local", "load_cold", "local load, cold cache"), ("s3", "save", "S3 save"), ("s3", "load_warm", "S3 load")]
    lines = ["| GB/s, " + " / ".join(f"{w} rank{'s' if w != '1' else ''}" for w in worlds) + " | "
             + " | ".join(label for _, label in roles) + " |",
             "|---|" + "---:|" * len(roles)]
    for kind, op, label in rows:
        table = summary["throughput"].get(kind, {})
        cells = []
        for role, _ in roles:
            row = next((r for r in table.values() if r["role"] == role), None)
            values = [row.get(f"{op}_{w}") if row else None for w in worlds]
            cells.append(" / ".join(_gbps(v["gbps"]) for v in values if v) if any(values) else "")
        if any(cells):
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
    m = run.record["machine"]
    note = (f"Run of {run.date} (`bench/results/{run.name}`, generated at build time): "
            f"{m['cpu_count']} × {m['cpu_model']}, torch {m['versions'].get('torch')}, "
            f"{run.record['total_bytes'] / 2**30:.0f} GiB bf16 state dict, medians of "
            f"{_rounds(run.record['params']['repeats'])} rounds.")
    return note + "\n\n" + "\n".join(lines) + "\n"


def _gbps(value: float) -> str:
    return f"{value:.2f}" if value >= 0.1 else f"{value:.3f}"


def _rounds(repeats: Any) -> str:
    if isinstance(repeats, dict):
        values = sorted(set(repeats.values()))
        return str(values[0]) if len(values) == 1 else "–".join(map(str, (values[0], values[-1])))
    return str(repeats)


def suites_table(results: Path) -> str:
    """Every suite: its command, latest file, date and number of runs."""
    lines = ["| suite | command | latest run | date | runs |", "|---|---|---|---|---:|"]
    for suite in SUITES:
        found = runs(results, suite)
        page = Path(suite.page).name
        latest = found[0] if found else None
        lines.append(f"| [{suite.title}]({page}) | `{suite.command}` | "
                     f"{'`' + latest.name + '`' if latest else '–'} | {latest.date if latest else '–'} | {len(found)} |")
    return "\n".join(lines) + "\n"
