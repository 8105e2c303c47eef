"""Where a benchmark's result is kept, and what it says about the run that made it.

A result is the JSON object a bench prints last. `agentmem bench X --json --save` keeps it at
`docs/bench/X/<machine>.json`, and a named configuration of a bench (`--save=VARIANT`: recall on
a hand-written set, serve with replicas) at `docs/bench/X/VARIANT/<machine>.json`: one file per
bench and kind of machine, always the latest run. The bench's own keys say what it measured;
the stamp says where and at what code, which a reader needs before comparing two files:
`machine` (the kind, also the file's name), `commit`, `date`, `cpu` (model), `flags` (the
SIMD features that choose the engine's paths) and `dtype` (and `gpu` for a CUDA run).

The kind of machine is named by what changes the figures: the CPU's generation and vector
width on AMD (`zen4-avx512`, `zen3-avx2`; a Zen 4 whose hypervisor hides AVX-512 is
`zen4-avx2`), the widest bf16/int8 feature on Intel (`xeon-amx`, `xeon-bf16`, `xeon-clx`,
`skylake`), the GPU's name on CUDA (`h200`).
"""

from __future__ import annotations

import contextlib
import io
import json
import platform
import re
import subprocess
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import date
from pathlib import Path

RESULTS = Path("docs/bench")
FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx")
_GPU_VENDOR_WORDS = {"nvidia", "tesla", "geforce", "amd", "radeon"}


@dataclass(frozen=True)
class Machine:
    kind: str
    cpu: str
    flags: tuple[str, ...]
    gpu: str | None = None


def _cpuinfo_fields(text: str) -> dict[str, str]:
    """The first processor's `key: value` lines of /proc/cpuinfo (every core repeats them)."""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            if fields:
                break
            continue
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    return fields


def _zen(family: int | None, model: int | None) -> str | None:
    if family == 26:
        return "zen5"
    if family == 25 and model is not None:
        return "zen4" if 0x10 <= model <= 0x1F or 0x60 <= model <= 0xAF else "zen3"
    if family == 23 and model is not None:
        return "zen2" if model >= 0x30 else "zen"
    return None


def relevant_flags(flags: Iterable[str]) -> tuple[str, ...]:
    """The features of FLAGS this CPU has; `amx` stands for AMX tiles with bf16."""
    have = set(flags)
    if {"amx_tile", "amx_bf16"} <= have:
        have.add("amx")
    return tuple(f for f in FLAGS if f in have)


def cpu_machine(cpuinfo: str, arch: str = "") -> Machine:
    """The machine a /proc/cpuinfo text describes (no GPU)."""
    fields = _cpuinfo_fields(cpuinfo)
    flags = frozenset(fields.get("flags", "").split())
    name = fields.get("model name") or arch or "unknown CPU"
    family = int(fields["cpu family"]) if fields.get("cpu family", "").isdigit() else None
    model = int(fields["model"]) if fields.get("model", "").isdigit() else None
    cpu = f"{name} (family {family} model {model})" if family is not None and model is not None else name
    vendor = fields.get("vendor_id", "")
    isa = "avx512" if "avx512f" in flags else "avx2" if "avx2" in flags else ""
    if vendor == "AuthenticAMD":
        base = _zen(family, model) or ("epyc" if "EPYC" in name else "amd")
        kind = f"{base}-{isa}" if isa else base
    elif vendor == "GenuineIntel":
        if {"amx_tile", "amx_bf16"} <= flags:
            kind = "xeon-amx"
        elif "avx512_bf16" in flags:
            kind = "xeon-bf16"
        elif "avx512_vnni" in flags:
            kind = "xeon-clx"
        elif "avx512f" in flags:
            kind = "skylake"
        else:
            kind = f"intel-{isa}" if isa else "intel"
    else:
        kind = (arch or "cpu").lower()
    return Machine(kind=kind, cpu=cpu, flags=relevant_flags(flags))


def gpu_kind(name: str) -> str:
    """'NVIDIA H200' -> 'h200': the GPU's name without its vendor's words."""
    words = [re.sub(r"[^a-z0-9]", "", w) for w in name.lower().split() if w not in _GPU_VENDOR_WORDS]
    return "-".join(w for w in words if w) or "gpu"


def this_machine(gpu: str | None = None) -> Machine:
    """This machine; `gpu` is the CUDA device's name when the run used one."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        text = ""
    cpu = cpu_machine(text, platform.machine())
    if gpu is None:
        return cpu
    return Machine(kind=gpu_kind(gpu), cpu=cpu.cpu, flags=cpu.flags, gpu=gpu)


def commit() -> str | None:
    """HEAD of the checkout agentmem runs from, `-dirty` when its code has changes that are
    not committed; None for an installed package."""
    root = Path(__file__).resolve().parents[2]

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, check=True).stdout.strip()

    try:
        if Path(git("rev-parse", "--show-toplevel")).resolve() != root:
            return None  # a site-packages copy inside some other repository
        head = git("rev-parse", "HEAD")
        dirty = git("status", "--porcelain", "--", "agentmem")
    except (OSError, subprocess.CalledProcessError):
        return None
    return f"{head}-dirty" if dirty else head


def stamp(result: dict, machine: Machine, dtype: str | None, commit: str | None, day: str) -> dict:
    """The result with the run's stamp in front; the bench's own keys are kept as they are (its
    `dtype`, where it reports one, is the one recorded)."""
    head = {"machine": machine.kind, "commit": commit, "date": day, "cpu": machine.cpu,
            "flags": list(machine.flags), "dtype": dtype}
    if machine.gpu is not None:
        head["gpu"] = machine.gpu
    return {**head, **result}


def result_path(bench: str, kind: str, variant: str | None = None, root: Path = RESULTS) -> Path:
    return (root / bench / variant if variant else root / bench) / f"{kind}.json"


def write(path: Path, result: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")


def _option(argv: Sequence[str], name: str) -> str | None:
    """The value of `--name X` or `--name=X` in a bench's arguments, the last one given."""
    value = None
    for i, arg in enumerate(argv):
        if arg == name and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith(name + "="):
            value = arg.split("=", 1)[1]
    return value


def _run_device(result: dict, argv: Sequence[str]):
    """The torch device the bench ran on: its result's `device` (a device type, or on the
    engine bench the device's name), else its `--device`, else the configured one."""
    import torch

    from ..config import Config
    from ..engine.engine import pick_device

    named = str(result.get("device") or _option(argv, "--device") or Config().device)
    if named == "auto" or named.split(":")[0] in ("cpu", "cuda"):
        return pick_device(named)
    return torch.device("cuda" if torch.cuda.is_available() and named == torch.cuda.get_device_name() else "cpu")


def save(bench: str, result: dict, argv: Sequence[str], variant: str | None, root: Path, *,
         code: str | None) -> Path:
    """Stamp `result` (made by `agentmem bench <bench> <argv>` in this process, from the commit
    `code` as `commit()` read it when the run started) and write it where its bench and this
    machine's kind say; returns the path."""
    import torch

    from ..config import Config
    from ..engine.engine import pick_dtype

    device = _run_device(result, argv)
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    dtype = result.get("dtype")
    if dtype is None:
        dtype = str(pick_dtype(_option(argv, "--dtype") or Config().dtype, device)).removeprefix("torch.")
    machine = this_machine(gpu)
    path = result_path(bench, machine.kind, variant, root)
    write(path, stamp(result, machine, dtype, code, date.today().isoformat()))
    return path


def split_save(argv: Sequence[str]) -> tuple[list[str], bool, str | None]:
    """(the bench's own arguments, whether `--save` was given, the VARIANT of `--save=VARIANT`)."""
    rest, saving, variant = [], False, None
    for arg in argv:
        if arg == "--save":
            saving = True
        elif arg.startswith("--save="):
            saving, variant = True, arg.split("=", 1)[1] or None
        else:
            rest.append(arg)
    return rest, saving, variant


class _Tee(io.TextIOBase):
    """Standard output that also keeps what was written, so the bench prints as always."""

    def __init__(self, out):
        self.out, self.seen = out, io.StringIO()

    def write(self, s: str) -> int:
        self.seen.write(s)
        return self.out.write(s)

    def flush(self) -> None:
        self.out.flush()

    def fileno(self) -> int:
        return self.out.fileno()


def last_json(output: str) -> dict:
    lines = output.strip().splitlines()
    try:
        result = json.loads(lines[-1]) if lines else None
    except json.JSONDecodeError:
        result = None
    if not isinstance(result, dict):
        raise ValueError("its output did not end with one JSON object on a line (run it with --json)")
    return result


def run_saved(bench: str, main: Callable[[list[str]], int | None], argv: list[str], variant: str | None = None,
              root: Path = RESULTS) -> int:
    """Run a bench's `main(argv)` and save the JSON it printed last, stamped with the commit
    the run started from (code edited while a long bench runs is not the code it timed)."""
    code = commit()
    tee = _Tee(sys.stdout)
    with contextlib.redirect_stdout(tee):
        rc = int(main(argv) or 0)
    if rc != 0:
        return rc
    try:
        result = last_json(tee.seen.getvalue())
    except ValueError as exc:
        print(f"agentmem bench {bench} --save: {exc}", file=sys.stderr)
        return 2
    print(f"saved {save(bench, result, argv, variant, root, code=code)}", file=sys.stderr)
    return 0
