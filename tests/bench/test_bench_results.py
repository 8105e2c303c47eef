"""Bench results: where `agentmem bench X --save` puts them, what it stamps on them, and the
files kept in docs/bench/."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from agentmem import cli
from agentmem.bench.results import (
    Machine,
    cpu_machine,
    gpu_kind,
    result_path,
    split_save,
    stamp,
    this_machine,
)

REPO = Path(__file__).resolve().parents[2]
STAMP = ("machine", "commit", "date", "cpu", "flags", "dtype")


def _cpuinfo(vendor: str, name: str, family: int, model: int, flags: str) -> str:
    core = (f"processor\t: {{n}}\nvendor_id\t: {vendor}\ncpu family\t: {family}\nmodel\t\t: {model}\n"
            f"model name\t: {name}\nflags\t\t: fpu sse2 {flags}\n\n")
    return core.format(n=0) + core.format(n=1)


@pytest.mark.parametrize("vendor, name, family, model, flags, kind", [
    ("AuthenticAMD", "AMD EPYC 9R14", 25, 17, "avx2 avx512f avx512_bf16 avx512_vnni", "zen4-avx512"),
    ("AuthenticAMD", "AMD EPYC 9R14", 25, 17, "avx2 fma", "zen4-avx2"),  # AVX-512 hidden by the hypervisor
    ("AuthenticAMD", "AMD EPYC 7R13", 25, 1, "avx2", "zen3-avx2"),
    ("AuthenticAMD", "AMD EPYC", 26, 2, "avx2 avx512f avx512_bf16", "zen5-avx512"),
    ("GenuineIntel", "Intel(R) Xeon(R) Processor", 6, 143, "avx2 avx512f avx512_bf16 amx_tile amx_bf16", "xeon-amx"),
    ("GenuineIntel", "Intel(R) Xeon(R) Processor", 6, 207, "avx2 avx512f avx512_bf16 avx512_vnni", "xeon-bf16"),
    ("GenuineIntel", "Intel(R) Xeon(R) Processor @ 2.50GHz", 6, 85, "avx2 avx512f avx512_vnni", "xeon-clx"),
    ("GenuineIntel", "Intel(R) Xeon(R) Processor @ 2.50GHz", 6, 85, "avx2 avx512f", "skylake"),
])
def test_a_machine_is_named_by_what_changes_its_figures(vendor, name, family, model, flags, kind):
    m = cpu_machine(_cpuinfo(vendor, name, family, model, flags))
    assert m.kind == kind
    assert m.cpu == f"{name} (family {family} model {model})"
    assert set(m.flags) <= {"avx2", "avx512f", "avx512_bf16", "amx"}
    assert ("amx" in m.flags) == ("amx_tile" in flags)
    assert ("avx512f" in m.flags) == ("avx512f" in flags)


def test_a_gpu_run_is_named_by_its_gpu():
    assert gpu_kind("NVIDIA H200") == "h200"
    assert gpu_kind("NVIDIA H100 80GB HBM3") == "h100-80gb-hbm3"


def test_the_stamp_goes_in_front_and_keeps_the_bench_keys():
    m = Machine(kind="zen4-avx512", cpu="AMD EPYC (family 25 model 17)", flags=("avx2", "avx512f"))
    out = stamp({"speedup": 4.4, "dtype": "float32", "bench": "blend"}, m, "bfloat16", "abc123", "2026-12-01")
    assert list(out)[:6] == list(STAMP)
    assert out["dtype"] == "float32"  # what the bench says it ran in wins over the fallback
    assert out["speedup"] == 4.4 and out["bench"] == "blend"
    assert out["flags"] == ["avx2", "avx512f"] and "gpu" not in out
    gpu = Machine(kind="h200", cpu="Intel Xeon", flags=("amx",), gpu="NVIDIA H200")
    assert stamp({}, gpu, "bfloat16", None, "2026-12-01")["gpu"] == "NVIDIA H200"


def test_save_options_are_split_from_the_bench_options():
    assert split_save(["--json", "--prompts", "10"]) == (["--json", "--prompts", "10"], False, None)
    assert split_save(["--json", "--save"]) == (["--json"], True, None)
    assert split_save(["--save=handwritten", "--json", "--dataset", "x.json"]) == (
        ["--json", "--dataset", "x.json"], True, "handwritten")


@pytest.fixture
def fake_bench(tmp_path, monkeypatch):
    """A bench module that prints progress, then its JSON, as every bench does."""
    (tmp_path / "fake_bench_mod.py").write_text(
        "import json, sys\n"
        "def main(argv):\n"
        "    print('warming up')\n"
        "    if '--fail' in argv:\n"
        "        return 1\n"
        "    print('no json' if '--plain' in argv else json.dumps({'speedup': 2.5, 'args': argv}))\n"
        "    return 0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(cli.BENCHES, "fake", ("fake_bench_mod", "a bench for the tests"))
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    return work


def test_bench_save_keeps_the_last_json_stamped_at_its_machine_path(fake_bench, capsys):
    assert cli.main(["bench", "fake", "--json", "--dtype", "float32", "--save"]) == 0
    out = capsys.readouterr()
    assert out.out.splitlines()[0] == "warming up"  # the bench still prints as always
    assert json.loads(out.out.splitlines()[-1])["args"] == ["--json", "--dtype", "float32"]
    path = fake_bench / result_path("fake", this_machine().kind)
    assert str(path.relative_to(fake_bench)) in out.err
    saved = json.loads(path.read_text())
    assert saved["speedup"] == 2.5 and saved["args"] == ["--json", "--dtype", "float32"]
    assert saved["dtype"] == "float32"  # not in the result: the bench's --dtype
    assert saved["machine"] == this_machine().kind and saved["cpu"] == this_machine().cpu
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", saved["date"])
    assert saved["commit"] is None or re.fullmatch(r"[0-9a-f]{40}(-dirty)?", saved["commit"])

    assert cli.main(["bench", "fake", "--json", "--save=quick"]) == 0
    assert (fake_bench / result_path("fake", this_machine().kind, "quick")).exists()


def test_a_saved_result_names_the_commit_its_run_started_from(fake_bench, monkeypatch, capsys):
    from agentmem.bench import results

    seen = iter(["a" * 40, "a" * 40 + "-dirty"])  # the code is edited while the bench runs
    monkeypatch.setattr(results, "commit", lambda: next(seen))
    assert cli.main(["bench", "fake", "--json", "--save"]) == 0
    saved = json.loads((fake_bench / result_path("fake", this_machine().kind)).read_text())
    assert saved["commit"] == "a" * 40


def test_bench_save_writes_nothing_for_a_failed_run_or_one_without_json(fake_bench, capsys):
    assert cli.main(["bench", "fake", "--fail", "--save"]) == 1
    assert cli.main(["bench", "fake", "--plain", "--save"]) == 2
    assert "--json" in capsys.readouterr().err
    assert not (fake_bench / "docs").exists()


# --- the files kept in docs/bench ------------------------------------------------------------
def _kept() -> list[Path]:
    return sorted((REPO / "docs" / "bench").rglob("*.json"))


def test_every_kept_result_names_its_machine_commit_and_date():
    assert _kept(), "docs/bench holds no results"
    for path in _kept():
        r = json.loads(path.read_text())
        assert all(key in r for key in STAMP), path
        assert path.stem == r["machine"], path
        assert re.fullmatch(r"[0-9a-f]{40}(-dirty)?", r["commit"]), path
        assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", r["date"]), path
        assert r["cpu"] and set(r["flags"]) <= {"avx2", "avx512f", "avx512_bf16", "amx"}, path
        depth = len(path.relative_to(REPO / "docs" / "bench").parts)
        assert depth in (2, 3), path  # <bench>/<machine>.json or <bench>/<variant>/<machine>.json
