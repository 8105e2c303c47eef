"""`agentmem bench report`: the README's benchmark table, made from the result files."""

from __future__ import annotations

from pathlib import Path

from agentmem import cli
from agentmem.bench import report
from agentmem.bench.results import Machine, result_path, stamp, write

REPO = Path(__file__).resolve().parents[2]


def test_the_report_has_a_row_for_every_current_result_it_reads():
    root = REPO / "docs" / "bench"
    text = report.table(root, REPO)
    for row in report.ROWS:
        for path, r in report.current(report.results(row.bench, row.variant, root)):
            link = path.relative_to(REPO).as_posix()
            line = next((x for x in text.splitlines() if x.startswith(f"| {row.what} |") and f"({link})" in x), None)
            assert line is not None, (row.what, link)
            assert r["cpu"] in line and r["date"] in line


def _result(root: Path, bench: str, kind: str, day: str, **figures) -> None:
    m = Machine(kind=kind, cpu=f"CPU of {kind}", flags=("avx2",))
    write(result_path(bench, kind, root=root), stamp(figures, m, "bfloat16", "0" * 40, day))


ENGINE = dict(decode_tok_s=313.1, decode_speedup_vs_hf=12.5, llamacpp_decode_tok_s=127.3, prefill_tok_s=1306.4,
              prefill_speedup_vs_hf=1.54, llamacpp_prefill_tok_s=261.3, prompt_tokens=2048, weights="int4")


def test_the_report_rows_name_the_cpu_and_date_newest_first(tmp_path):
    root = tmp_path / "docs" / "bench"
    _result(root, "engine", "old-box", "2026-01-02", **ENGINE)
    _result(root, "engine", "new-box", "2026-03-04", **{**ENGINE, "decode_tok_s": 200.0, "llamacpp_decode_tok_s": 100.0})
    rows = [x for x in report.table(root, tmp_path).splitlines() if x.startswith("| `bench engine`")]
    assert len(rows) == 2
    assert "CPU of new-box" in rows[0] and "2026-03-04" in rows[0] and "decode 200.0 tok/s (12.5x HF, 2.00x llama.cpp)" in rows[0]
    assert "CPU of old-box" in rows[1] and "2026-01-02" in rows[1]
    assert "decode 313.1 tok/s (12.5x HF, 2.46x llama.cpp)" in rows[1]
    assert "prefill of 2,048 tokens 1,306 tok/s (1.54x HF, 5.00x llama.cpp)" in rows[1]
    assert "| bf16, int4 weights |" in rows[1] and "(docs/bench/engine/old-box.json)" in rows[1]


def test_report_write_replaces_only_the_text_between_the_markers(tmp_path):
    root = tmp_path / "docs" / "bench"
    _result(root, "engine", "box", "2026-01-02", **ENGINE)
    readme = tmp_path / "README.md"
    before, after = "# agentmem\n\nintro\n\n", "\n\nafter the table\n"
    readme.write_text(f"{before}{report.START}\nan old table\n{report.END}{after}")
    argv = ["report", "--write", "--readme", str(readme), "--results", str(root)]
    assert cli.main(["bench", *argv]) == 0
    text = readme.read_text()
    assert text.startswith(before + report.START + "\n") and text.endswith(report.END + after)
    assert "an old table" not in text and "CPU of box" in text
    assert "(docs/bench/engine/box.json)" in text  # relative to the README's folder
    assert cli.main(["bench", *argv]) == 0
    assert readme.read_text() == text  # a second run changes nothing


def test_report_write_refuses_a_readme_without_the_markers(tmp_path, capsys):
    readme = tmp_path / "README.md"
    readme.write_text(f"# agentmem\n{report.END}\n{report.START}\n")
    assert cli.main(["bench", "report", "--write", "--readme", str(readme), "--results", str(tmp_path)]) == 1
    assert "bench-table:start" in capsys.readouterr().err
    assert readme.read_text() == f"# agentmem\n{report.END}\n{report.START}\n"


def test_a_newer_result_on_the_same_or_a_more_precisely_named_cpu_supersedes(tmp_path):
    root = tmp_path / "docs" / "bench"
    for kind, cpu, day in (("epyc-avx2", "AMD EPYC", "2026-01-01"), ("zen3-avx2", "AMD EPYC (family 25 model 1)",
                           "2026-02-01"), ("zen3-old", "AMD EPYC (family 25 model 1)", "2026-01-15"),
                           ("xeon", "Intel Xeon", "2025-12-01")):
        m = Machine(kind=kind, cpu=cpu, flags=("avx2",))
        write(result_path("engine", kind, root=root), stamp(ENGINE, m, "float32", "0" * 40, day))
    rows = [x for x in report.table(root, tmp_path).splitlines() if x.startswith("| `bench engine`")]
    assert len(rows) == 2
    assert "(docs/bench/engine/zen3-avx2.json)" in rows[0] and "(docs/bench/engine/xeon.json)" in rows[1]


def test_recall_sets_share_a_row_per_cpu(tmp_path):
    root = tmp_path / "docs" / "bench"
    m = Machine(kind="box", cpu="CPU of box", flags=("avx2",))
    for variant, value in ((None, 0.787), ("handwritten", 0.877), ("handwritten2", 0.808)):
        path = result_path("recall", "box", variant, root=root) if variant else result_path("recall", "box", root=root)
        write(path, stamp({"evidence_recall_at_10": value, "dense_recall_at_10": 0.2}, m, "float32", "0" * 40,
                          "2026-01-02"))
    rows = [x for x in report.table(root, tmp_path).splitlines() if x.startswith("| `bench recall`")]
    assert len(rows) == 1
    assert "generated 0.787" in rows[0] and "hand-written 1 0.877" in rows[0] and "hand-written 2 0.808" in rows[0]
