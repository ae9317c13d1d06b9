"""BENCHMARKS.md is generated from benchmarks/results/ by benchmarks/report.py, and every benchmark figure
the README quotes is in it."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def report():
    spec = importlib.util.spec_from_file_location("benchmarks_report", ROOT / "benchmarks" / "report.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_benchmarks_md_is_what_the_generator_writes(report):
    current = (ROOT / "BENCHMARKS.md").read_text(encoding="utf-8")
    assert current == report.build(), "BENCHMARKS.md is out of date: run python benchmarks/report.py"


def test_check_flag_fails_on_a_stale_file(report, tmp_path, monkeypatch):
    stale = tmp_path / "BENCHMARKS.md"
    stale.write_text(report.build().replace("| 36.23 |", "| 36.24 |", 1), encoding="utf-8")
    monkeypatch.setattr(report, "OUTPUT", stale)
    assert report.main(["--check"]) == 1
    stale.write_text(report.build(), encoding="utf-8")
    assert report.main(["--check"]) == 0


def test_benchmarks_checks_md_is_what_the_generator_writes(report):
    current = (ROOT / "benchmarks" / "CHECKS.md").read_text(encoding="utf-8")
    assert current == report.build(audience="checks"), "benchmarks/CHECKS.md is out of date: run benchmarks/report.py"


def test_the_projects_own_checks_stay_out_of_benchmarks_md(report):
    """BENCHMARKS.md holds users' figures; byte-identity records and the GPU kit's runs go to CHECKS.md."""
    results = report.load_results()
    users, checks = report.build(results), report.build(results, audience="checks")
    for title in ("compress output bytes across the refactoring", "GPU check (one NVIDIA H100"):
        assert title in checks and title not in users, title
    assert "## Rotation (`hf-symmetry rotate`)" in users and "## Rotation" not in checks
    # negative control: a results file that says it is a check is drawn in CHECKS.md only
    results["zz_own_check"] = {
        "audience": "checks",
        "title": "An own check",
        "machine": "m",
        "date": "d",
        "command": "c",
        "rows": [{"a": 1}],
    }
    assert "## An own check" in report.build(results, audience="checks")
    assert "## An own check" not in report.build(results)
    del results["zz_own_check"]["audience"]
    assert "## An own check" in report.build(results)


def test_every_results_file_has_a_section_with_machine_date_and_command(report):
    users, checks = report.build(), report.build(audience="checks")
    text = users + checks
    sections = users.split("\n## ")[2:] + checks.split("\n## ")[2:]
    for path in sorted((ROOT / "benchmarks" / "results").iterdir()):
        assert f"`benchmarks/results/{path.name}`" in text, path.name
    for section in sections:
        head = section.split("\n\n", 2)[1]
        for key in ("- Machine: ", "- Date: ", "- Command: "):
            assert key in head, (section.splitlines()[0], key)


def test_a_new_results_file_gets_a_generic_section(report):
    results = report.load_results()
    results["zz_new_benchmark"] = {
        "title": "A new benchmark",
        "machine": "one test machine",
        "date": "2026-01-01",
        "command": "python bench_new.py",
        "rows": [{"variant": "a", "seconds": 1.5}, {"variant": "b", "seconds": 2.25}],
    }
    text = report.build(results)
    section = text.split("## A new benchmark\n", 1)[1]
    assert "- Machine: one test machine" in section and "- Command: `python bench_new.py`" in section
    assert "| variant | seconds |" in section and "| b | 2.25 |" in section
    assert "[A new benchmark](#a-new-benchmark)" in text


def test_a_renderer_that_fails_on_a_changed_shape_falls_back_and_says_so(report):
    results = report.load_results()
    results["rotate"] = {"date": "2026-01-02", "rows": [{"checkpoint": "tiny", "seconds": 3.5}]}
    text = report.build(results)
    section = text.split("## Rotation", 1)[1].split("\n## ", 1)[0]
    assert "The renderer for `rotate` failed (KeyError" in section
    assert "| tiny | 3.5 |" in section  # the generic renderer drew what the file holds
    assert "*(table `rotate` could not be drawn from the results)*" in section


def test_a_missing_results_file_is_reported_not_fatal(report):
    results = report.load_results()
    del results["tpa"]
    text = report.build(results)
    assert "`benchmarks/results/tpa.json` is missing." in text
    assert "## Rotation" in text


def test_readme_figures_are_in_benchmarks(report):
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    benchmarks = (ROOT / "BENCHMARKS.md").read_text(encoding="utf-8")
    figures = report.readme_figures(readme)
    assert len(figures) >= 10  # the main job's output and the examples' printed figures
    assert report.missing_readme_figures(readme, benchmarks) == []
    # negative control: a figure the benchmarks do not hold is reported
    planted = readme + "\nThe rotation now takes 123.457 s on one core.\n"
    assert report.missing_readme_figures(planted, benchmarks) == ["123.457"]


def test_readme_figure_rule(report):
    text = "\n".join(
        [
            "Tested with Python 3.11, torch 2.13.0 and transformers 5.24.0; 2048 tokens, 25 % removed.",
            "It goes 152.9 → 76.7 with 16,384 tokens; see [x](docs/a.md#v1.5) and `--ratio 0.25`.",
            "```bash",
            "hf-symmetry verify a b --tolerance 1e-3",
            "hf-symmetry eval default   # perplexity 36.2335",
            "```",
            "```text",
            "  max |Δlogit|: 2.17e-04 (Δ -7.56e-06), verified in 24.8 s",
            "```",
        ]
    )
    assert report.readme_figures(text) == ["152.9", "76.7", "16,384", "36.2335", "2.17e-04", "7.56e-06", "24.8"]
    assert report.missing_readme_figures("perplexity 36.23", "perplexity 136.234") == ["36.23"]


def test_readme_stays_a_front_door():
    assert len((ROOT / "README.md").read_text(encoding="utf-8").splitlines()) <= 300


def test_links_into_benchmarks_md_resolve(report):
    anchors = {
        report.anchor(line[3:])
        for line in (ROOT / "BENCHMARKS.md").read_text(encoding="utf-8").splitlines()
        if line.startswith("## ")
    }
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for anchor in re.findall(r"BENCHMARKS\.md#([\w\-]+)", path.read_text(encoding="utf-8")):
            assert anchor in anchors, (path.name, anchor)


def test_a_new_heal_results_file_is_drawn_by_the_heal_renderer(report):
    results = report.load_results()
    run = dict(results["heal_gpu_h200"], title="Heal recipes on a CPU", command="python benchmarks/bench_heal.py")
    results["heal_cpu_test"] = run
    section = report.build(results).split("## Heal recipes on a CPU\n", 1)[1]
    assert "| student | recipe | britannica-eval before → after |" in section
    assert "| SliceGPT 25 % | logits | 153.9 → 105.8 |" in section
